"""Sharding rules of `stack` and `unstack` (``jnp.stack`` / ``jnp.unstack`` are primitives
of their own in JAX >= 0.7; GPT-J's rotary embedding in transformers traces them).

`stack[axis]` puts n operands of one shape side by side along a new dimension `axis`;
`unstack[axis]` takes a dimension `axis` apart into as many results. Every other dimension
is shared by operands and results and may be split; the stacked dimension is never split
(each operand is one whole slice of it).
"""

from __future__ import annotations

from autopar.intra._rules import OpInfo, register
from autopar.intra._signature import Signature


def _without(ndim: int, axis: int) -> tuple[str | None, ...]:
    return tuple(None if d == axis else f"d{d}" for d in range(ndim))


@register("stack")
def _stack(op: OpInfo) -> Signature:
    ndim = len(op.out_shapes[0])
    axis = op.params["axis"] % ndim
    out = _without(ndim, axis)
    operand = tuple(label for d, label in enumerate(out) if d != axis)
    return Signature(tuple(operand for _ in op.in_shapes), (out,))


@register("unstack")
def _unstack(op: OpInfo) -> Signature:
    ndim = len(op.in_shapes[0])
    axis = op.params["axis"] % ndim
    operand = _without(ndim, axis)
    result = tuple(label for d, label in enumerate(operand) if d != axis)
    return Signature((operand,), tuple(result for _ in op.out_shapes))
