"""Expert parallelism of a grouped GEMM: the all-to-all token dispatcher as strategies.

`_rules_moe.py` labels `ragged_dot_general`'s dimensions; its expert split there (label
``g``) keeps the sorted tokens whole on every device and sums partial results: the
all-gather dispatcher. The dispatcher trained MoEs use (GShard, DeepSeek-V3,
Megatron-Core's ``alltoall``) splits the sorted tokens *and* the experts over the same
mesh axes: each device holds a block of the routed tokens, sends each row to the device
owning its expert (dispatch all-to-all), runs its own experts' grouped GEMM and sends the
results back (combine all-to-all). Two labels on one axis is outside what a `Signature`
lists, so these strategies are added beside it (`EXTRA_STRATEGIES`), one per choice of EP
axes (each mesh axis of size > 1, and all of them together):

- form 1 (``lhs[M, K] · rhs[G, K, N] -> out[M, N]``, forward and token gradient): lhs rows
  and rhs groups split over the EP axes, out rows too; a dispatch of the local lhs rows and
  a combine of the local result rows.
- form 2 (``lhs[M, K] · rhs[M, N] -> out[G, K, N]``, the weight gradient): both operands'
  rows split, the result's groups split; two dispatches (lhs and rhs rows), no combine.

Each all-to-all moves the rows a device holds times the token imbalance (the busiest
device's routed rows over the mean: `autopar.cost.DEFAULT_TOKEN_IMBALANCE`, or a
``token_imbalance`` attribute of the cluster object, which no profile sets yet), priced
by `autopar.cost.all_to_all_time` on the topology; the grouped GEMM's FLOPs divide by
the EP degree and scale by the imbalance.
`autopar.lower._experts` runs them.
"""

from __future__ import annotations

import math

from autopar.cost import (
    DEFAULT_TOKEN_IMBALANCE,
    all_to_all_time,
    bytes_per_device,
    compute_time,
)
from autopar.graph import Node, OpGraph
from autopar.intra._rules_moe import ragged_form
from autopar.intra._strategies import EXTRA_STRATEGIES, Collective, CostContext, Strategy


def token_imbalance(cluster) -> float:
    """The cluster's routed-token imbalance (>= 1), or the default."""
    return float(getattr(cluster, "token_imbalance", None) or DEFAULT_TOKEN_IMBALANCE)


def ep_layout(node: Node, graph: OpGraph) -> tuple[tuple[int, ...], int] | None:
    """(per operand, the dimension the EP axes split, or -1 for none; the result's split
    dimension) of a grouped GEMM, or None for a form without expert parallelism."""
    params = node.params
    form = ragged_form(params)
    rdn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    (ragged,) = rdn.lhs_ragged_dimensions
    if ragged != 0 or len(graph.vars[node.inputs[0]].shape) != 2:
        return None  # the lowering routes the rows of a [M, K] lhs (`jax.lax.ragged_dot`)
    if form == 1 and len(rdn.rhs_group_dimensions) == 1:
        (group,) = rdn.rhs_group_dimensions
        lhs_free = [d for d in range(len(graph.vars[node.inputs[0]].shape))
                    if d not in lb and d not in lc]
        return (ragged, group, -1), len(lb) + lhs_free.index(ragged)
    if form == 2 and not lb and not rdn.rhs_group_dimensions \
            and tuple(rc) == (0,) and len(graph.vars[node.inputs[1]].shape) == 2:
        return (ragged, 0, -1), 0
    return None


def expert_parallel_strategies(node: Node, graph: OpGraph, ctx: CostContext) -> list[Strategy]:
    """The all-to-all EP strategies of one `ragged_dot_general` node (module docstring)."""
    layout = ep_layout(node, graph)
    if layout is None:
        return []
    split_dims, out_dim = layout
    mesh = ctx.mesh
    in_vars = [graph.vars[v] for v in node.inputs]
    (out_var,) = [graph.vars[v] for v in node.outputs]
    big = [a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1]
    choices = [(a,) for a in big] + ([tuple(big)] if len(big) > 1 else [])
    imbalance = token_imbalance(ctx.cluster)
    form = ragged_form(node.params)
    strategies = []
    for axes in choices:
        ep = math.prod(mesh.axis_size(a) for a in axes)
        sizes = [v.shape[d] for v, d in zip(in_vars, split_dims) if d >= 0]
        if any(s % ep for s in sizes) or out_var.shape[out_dim] % ep:
            continue
        in_specs = tuple(
            tuple(axes if d == split else () for d in range(len(v.shape)))
            for v, split in zip(in_vars, split_dims)
        )
        out_spec = tuple(axes if d == out_dim else () for d in range(len(out_var.shape)))
        local = [bytes_per_device(v.shape, v.dtype, s, mesh) for v, s in zip(in_vars, in_specs)]
        out_bytes = bytes_per_device(out_var.shape, out_var.dtype, out_spec, mesh)
        # dispatch the routed rows: lhs (form 1), lhs and rhs (form 2); combine: the result
        moved = [local[0] * imbalance]
        moved.append(out_bytes * imbalance if form == 1 else local[1] * imbalance)
        collectives = tuple(Collective("all_to_all", axes, b) for b in moved)
        comm = sum(all_to_all_time(c.nbytes, ctx.cluster, mesh, axes) for c in collectives)
        dtype = out_var.dtype
        compute = compute_time(node.flops / ep * imbalance,
                               (sum(local) + out_bytes) * imbalance, ctx.cluster, dtype,
                               matmul=True)
        strategies.append(Strategy(f"ep:{''.join(axes)}", in_specs, (out_spec,), compute,
                                   comm, out_bytes, collectives))
    return strategies


EXTRA_STRATEGIES["ragged_dot_general"] = expert_parallel_strategies
