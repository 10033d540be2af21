"""Sharding rules of dropless mixture-of-experts dispatch: the grouped GEMM.

A dropless MoE layer (`examples/moe_dropless.py`) sorts its routed tokens by expert
(`sort`), gathers them (`gather`), counts them per expert (`scatter-add`, from
`jnp.bincount`), runs them through grouped GEMMs (`ragged_dot_general`) and scatter-adds
them back (`scatter-add`); `top_k` picks the experts. Every primitive but the grouped GEMM
has its rule in `_rules.py`; this module adds `ragged_dot_general`, in its three forms
(`jax.lax.RaggedDotDimensionNumbers`):

1. ``lhs[M, K] (M ragged, grouped by expert) · rhs[G, K, N] -> out[M, N]``: the forward
   GEMM and the backward one of the tokens (``rhs[G, N, K]``, contracted over N). Row m of
   the result is ``lhs[m] @ rhs[group(m)]``, with ``group(m)`` given by the group sizes
   (the expert ids of the sorted tokens, as counts).
2. ``lhs[M, K] · rhs[M, N] -> out[G, K, N]``, the ragged dimension contracted: the weight
   gradient, ``out[g] = lhs[rows of g].T @ rhs[rows of g]``.
3. The ragged dimension a batch dimension: no rule (replicated).

Splits, with the group sizes (``int32[G]``, a few bytes) used whole on every device:

- **expert-tensor parallelism** (ETP): N (or K of form 2's result) split is a plain split
  of the expert weights' non-group dimension: each device multiplies every routed token by
  its slice of every expert. K of form 1 is a contracting dimension: partial sums.
- **token split**: M split in form 1: each device runs its block of the sorted tokens
  against the experts those rows belong to (the global group sizes locate its block). M
  of form 2 is contracted: each device sums its rows' outer products, partial sums.
- **expert parallelism** (EP): G split. In form 1 each device runs only the routed tokens
  of its own experts and leaves the rows of other experts zero, so the result is a sum of
  the devices' partial results (label ``g``, reduction "sum"). With the sorted tokens
  replicated over the expert axis this is Megatron-Core's all-gather token dispatcher
  (``moe_token_dispatcher_type="allgather"``): the tokens arrive by all-gather (the ILP
  prices it as resharding on the edge), the combine is the reduce-scatter or all-reduce of
  the partial result. In form 2 G is a result dimension: each device computes the weight
  gradient of its own experts only, without communication.

The FLOPs of a grouped GEMM are those of the tokens it runs (``2·M·K·N``, not ``G`` times
that): `autopar.graph._flops` counts them, and a split of M, G, K or N divides them by its
degree (G assuming balanced routing).
"""

from __future__ import annotations

from autopar.intra._rules import OpInfo, register
from autopar.intra._signature import Signature


def ragged_form(params) -> int:
    """Which form of `ragged_dot_general` (module docstring) an equation is: 1, 2 or 3."""
    rdn = params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), (lhs_batch, _) = rdn.dot_dimension_numbers
    (ragged,) = rdn.lhs_ragged_dimensions
    if ragged in lhs_contract:
        return 2
    if ragged in lhs_batch:
        return 3
    return 1


@register("ragged_dot_general")
def _ragged_dot_general(op: OpInfo) -> Signature | None:
    """``ragged_dot_general(lhs, rhs, group_sizes)`` (see the module docstring)."""
    rdn = op.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    group_dims = tuple(rdn.rhs_group_dimensions)
    form = ragged_form(op.params)
    if form == 3 or len(rdn.lhs_ragged_dimensions) != 1 or len(group_dims) > 1:
        return None
    if form == 2 and (lb or group_dims):
        return None  # a batched weight gradient: not traced by jax.lax.ragged_dot
    lhs_nd, rhs_nd = len(op.in_shapes[0]), len(op.in_shapes[1])
    lhs: list[str | None] = [None] * lhs_nd
    rhs: list[str | None] = [None] * rhs_nd
    reductions = {}
    for i, (a, b) in enumerate(zip(lb, rb)):
        lhs[a] = rhs[b] = f"b{i}"
    for i, (a, b) in enumerate(zip(lc, rc)):
        lhs[a] = rhs[b] = f"k{i}"
        reductions[f"k{i}"] = "sum"
    lhs_free = [d for d in range(lhs_nd) if d not in lb and d not in lc]
    rhs_free = [d for d in range(rhs_nd) if d not in rb and d not in rc and d not in group_dims]
    for i, d in enumerate(lhs_free):
        lhs[d] = f"m{i}"
    for i, d in enumerate(rhs_free):
        rhs[d] = f"n{i}"
    out = tuple(f"b{i}" for i in range(len(lb))) + tuple(lhs[d] for d in lhs_free)
    out += tuple(rhs[d] for d in rhs_free)
    if form == 1:
        (g,) = group_dims
        rhs[g] = "g"
        reductions["g"] = "sum"
    else:
        out = ("g",) + out
    # group sizes: used whole (replicated), whatever their shape
    return Signature((tuple(lhs), tuple(rhs), None), (out,), reductions)
