"""Identity primitives that mark structure in a traced train step.

* ``layer_boundary`` marks the edge between two layers (forward, and by its transpose rule
  the matching edge in the backward pass).
* ``grad_boundary`` wraps the outputs of ``autopar.value_and_grad``: everything it depends on
  is the per-microbatch gradient computation, everything after it is the optimizer update.

Both are identities when run; they only survive in the jaxpr so that the planner can see them.
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
        num_layers = _AUTO_LAYERS.get()
        f = fun if num_layers is None else _with_auto_marks(fun, num_layers)
        inner = jax.value_and_grad(f, argnums=argnums, has_aux=has_aux, **kwargs)
        return _mark_grad_boundary(inner(*args, **kw))

    return wrapped


def grad(
    fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any
) -> Callable:
    """Like `jax.grad`, and marks the gradient boundary for autopar (see `value_and_grad`)."""
    def wrapped(*args: Any, **kw: Any) -> Any:
        num_layers = _AUTO_LAYERS.get()
        f = fun if num_layers is None else _with_auto_marks(fun, num_layers)
        inner = jax.grad(f, argnums=argnums, has_aux=has_aux, **kwargs)
        return _mark_grad_boundary(inner(*args, **kw))

    return wrapped


# ---- automatic layers ----------------------------------------------------------------------
#
# When a model has no `layer_boundary` marks, the planner traces the step inside
# `auto_layers(L)`: `value_and_grad` then cuts the loss function's forward equations into L
# layers of balanced FLOPs with the least bytes crossing the cuts (Alpa's layer
# construction) and marks the values crossing each cut before differentiating, so the
# backward pass carries the matching marks.

_AUTO_LAYERS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "autopar_auto_layers", default=None
)


@contextlib.contextmanager
def auto_layers(num_layers: int | None):
    """Within this block, `autopar.value_and_grad` marks `num_layers` layers itself."""
    token = _AUTO_LAYERS.set(num_layers)
    try:
        yield
    finally:
        _AUTO_LAYERS.reset(token)


def _with_auto_marks(fun: Callable, num_layers: int) -> Callable:
    def marked(*args: Any) -> Any:

        from autopar.graph import Role, trace
        from autopar.inter._clustering import cluster_layers

        graph = trace(fun, *args, batch_argnums=())
        if len(graph.nodes) < 2 * num_layers:
            return fun(*args)
        index = {n.id: i for i, n in enumerate(graph.nodes)}
        producer = {v: n.id for n in graph.nodes for v in n.outputs}
        edges = [
            (index[producer[v]], index[n.id], float(graph.vars[v].nbytes))
            for n in graph.nodes
            for v in n.inputs
            if v in producer
        ]
        flops = [max(n.flops, 1.0) for n in graph.nodes]
        cuts = [end for _, end in cluster_layers(flops, edges, num_layers)][:-1]
        last_use = {}
        for n in graph.nodes:
            for v in n.inputs:
                last_use[v] = n.id
        for v in graph.outvars:
            last_use[v] = len(graph.nodes)
        env: dict[int, Any] = dict(zip(graph.invars, jax.tree.leaves(args)))
        start = 0
        for cut in [*cuts, len(graph.nodes)]:
            graph.run_nodes(env, graph.nodes[start:cut])
            if cut < len(graph.nodes):
                crossing = [
                    v for v in env
                    if graph.vars[v].role is Role.ACTIVATION
                    and last_use.get(v, -1) >= cut
                    and jax.numpy.issubdtype(graph.vars[v].dtype, jax.numpy.floating)
                ]
                if crossing:
                    marked_values = layer_boundary_p.bind(*(env[v] for v in crossing))
                    env.update(zip(crossing, marked_values))
            start = cut
        outs = [graph.vars[v].value if graph.vars[v].role is Role.CONST else env[v]
                for v in graph.outvars]
        return jax.tree.unflatten(graph.out_tree, outs)

    return marked
