"""Identity primitives that mark structure in a traced train step.

* ``layer_boundary`` marks the edge between two layers (forward, and by its transpose rule
  the matching edge in the backward pass).
* ``grad_boundary`` wraps the outputs of ``autopar.value_and_grad``: everything it depends on
  is the per-microbatch gradient computation, everything after it is the optimizer update.

Both are identities when run; they only survive in the jaxpr so that the planner can see them.

``value_and_grad``/``grad`` also apply the layer marker a planner installs with
`marking_layers` (the pipeline search cuts models without marks into layers this way,
`autopar.inter.auto_layers`); this module knows nothing of how the marker cuts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def _identity_primitive(name: str) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(lambda *xs, **_: xs)
    prim.def_abstract_eval(lambda *avals, **_: avals)

    def jvp(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return prim.bind(*primals, **params), prim.bind(*tangents, **params)

    def transpose(cts, *args, **params):
        cts = [ad.instantiate_zeros(c) for c in cts]
        return prim.bind(*cts, **params)

    def batch(args, dims, **params):
        return prim.bind(*args, **params), dims

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = batch
    mlir.register_lowering(prim, lambda ctx, *xs, **_: xs)
    return prim


layer_boundary_p = _identity_primitive("layer_boundary")
grad_boundary_p = _identity_primitive("grad_boundary")


def layer_boundary(x: Any) -> Any:
    """Mark ``x`` (any pytree of arrays) as the output of one layer and input of the next.

    An identity: ``autopar.layer_boundary(x)`` returns ``x``. The pipeline planner cuts
    stages only at these marks when any are present.

    **Example:**

    ```python
    for layer in params["layers"]:
        h = autopar.layer_boundary(block(layer, h))
    ```
    """
    leaves, tree = jax.tree.flatten(x)
    if not leaves:
        return x
    return jax.tree.unflatten(tree, layer_boundary_p.bind(*leaves))


def _mark_grad_boundary(out: Any) -> Any:
    leaves, tree = jax.tree.flatten(out)
    if not leaves:
        return out
    return jax.tree.unflatten(tree, grad_boundary_p.bind(*leaves))


def value_and_grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any
) -> Callable:
    """Like `jax.value_and_grad`, and marks the gradient boundary for autopar.

    On one device it is exactly `jax.value_and_grad`. Under `autopar.autoparallel` the
    computation up to this point runs once per microbatch with gradients accumulated, and
    what follows (the optimizer update) runs once per step.
    """
    def wrapped(*args: Any, **kw: Any) -> Any:
        marker = _LAYER_MARKER.get()
        f = fun if marker is None else marker(fun)
        inner = jax.value_and_grad(f, argnums=argnums, has_aux=has_aux, **kwargs)
        return _mark_grad_boundary(inner(*args, **kw))

    return wrapped


def grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any
) -> Callable:
    """Like `jax.grad`, and marks the gradient boundary for autopar (see `value_and_grad`)."""
    def wrapped(*args: Any, **kw: Any) -> Any:
        marker = _LAYER_MARKER.get()
        f = fun if marker is None else marker(fun)
        inner = jax.grad(f, argnums=argnums, has_aux=has_aux, **kwargs)
        return _mark_grad_boundary(inner(*args, **kw))

    return wrapped


# ---- layer markers installed by a planner ----------------------------------------------------

LayerMarker = Callable[[Callable], Callable]
"""Takes the loss function and returns one that marks layer edges with `layer_boundary`."""

_LAYER_MARKER: contextvars.ContextVar[LayerMarker | None] = contextvars.ContextVar(
    "autopar_layer_marker", default=None
)


@contextlib.contextmanager
def marking_layers(marker: LayerMarker | None):
    """Within this block, `value_and_grad` and `grad` apply `marker` to the loss function
    before differentiating it (None: no marking)."""
    token = _LAYER_MARKER.set(marker)
    try:
        yield
    finally:
        _LAYER_MARKER.reset(token)
