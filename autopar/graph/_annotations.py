"""The user's sharding annotations in a step, and the step without them.

`ANNOTATION_PRIMITIVES` are the primitives that only say how a value should be sharded
(``jax.lax.with_sharding_constraint`` and flax's ``nn.with_logical_constraint``, which
lowers to it; ``jax.sharding.reshard``; ``jax.sharding.mesh_cast``). The planner's rules for
them are in `autopar.intra._rules_annotations`. `without_annotations(fn)` is `fn` with every
such equation replaced by its operand: what `annotations="ignore"` plans and runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax._src import source_info_util
from jax.extend import core

from autopar.graph import _flops

ANNOTATION_PRIMITIVES = frozenset({"sharding_constraint", "reshard", "mesh_cast"})


def without_annotations(fn: Callable) -> Callable:
    """`fn` with its sharding annotations dropped (each returns its operand unchanged).

    The step is traced once more into a jaxpr and re-run equation by equation; nested
    calls (`jit`, `closed_call`, remat, ...) are run inline, as the tracer inlines them,
    so the graph autopar traces from it is the graph of the step written without the
    annotations. Annotations inside custom_jvp/custom_vjp and remat'd functions stay.
    """

    @functools.wraps(fn)
    def stripped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree.leaves(args)
        outs = _run(closed.jaxpr, closed.consts, flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return stripped


def _run(jaxpr: core.Jaxpr, consts, args) -> list:
    env: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, core.Literal) else env[atom]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        if name in ANNOTATION_PRIMITIVES:
            outs = ins
        elif name in _flops.CALL_JAXPR_PARAM and name not in ("remat2", "checkpoint"):
            sub = eqn.params[_flops.CALL_JAXPR_PARAM[name]]
            sub_consts = sub.consts if hasattr(sub, "consts") else ()
            outs = _run(getattr(sub, "jaxpr", sub), sub_consts, ins)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            # As `jax.core.eval_jaxpr` runs an equation: its source and context kept.
            with source_info_util.user_context(eqn.source_info.traceback,
                                               name_stack=eqn.source_info.name_stack), \
                    eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(a) for a in jaxpr.outvars]
