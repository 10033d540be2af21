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
device's routed rows over the mean: the cluster's ``token_imbalance``, a profile field
defaulting to `autopar.cost.DEFAULT_TOKEN_IMBALANCE`), priced
by `autopar.cost.all_to_all_time` on the topology; the grouped GEMM's FLOPs divide by
the EP degree and scale by the imbalance.

Each also comes overlapped (name suffix `OVERLAPPED`) where a device's routed rows split
into `autopar.cost.OVERLAP_CHUNKS` equal chunks: the chunks are dispatched, computed and
combined one after the other, so one chunk's all-to-all can run beside another's grouped
GEMM, priced by `autopar.cost.chunked_exchange_time` with the share of a collective the
backend runs beside compute (`Backend.collective_concurrency`: the profile's `overlap`
on XLA:GPU, none on XLA:CPU). The same specs, so "auto" (`CostContext.moe_overlap`)
keeps the faster of the two; "off" lists only the whole exchange, "on" only the chunked
one (the whole where the rows do not split).
`autopar.lower._experts` runs them.

A grouped GEMM of an expert MLP region (`autopar.intra._moe_regions`: the GEMMs sharing a
routing and the row-wise ops between them) is priced, whole, its share of the region's
exchanges instead (`autopar.cost.ep_region_exchange_bytes`): one dispatch per row
variable entering the region and one combine per row variable leaving it, the residuals a
layer's backward reads inside its region staying on their expert's device. That assumes
the plan runs every GEMM of the region expert-parallel over the same axes, which the
lowering then fuses; a plan that mixes forms is lowered per GEMM and costs more than
predicted. With ``moe_dispatch="gemm"`` (`CostContext.moe_dispatch`) no GEMM is priced
by region: each whole EP strategy carries its own exchange and its name the suffix
`PER_GEMM`, which tells the lowering to run each GEMM with its own dispatch and combine.
"""

from __future__ import annotations

import math

from autopar.cost import (
    DEFAULT_TOKEN_IMBALANCE,
    OVERLAP_CHUNKS,
    all_to_all_time,
    bytes_per_device,
    chunked_exchange_time,
    ep_buffer_bytes,
    ep_exchange_bytes,
    ep_grouped_gemm_time,
    ep_region_exchange_bytes,
)
from autopar.cost.backends import backend_for
from autopar.graph import Node, OpGraph, dtype_itemsize
from autopar.intra._moe_regions import ExpertRegion, regions_by_gemm
from autopar.intra._rules_moe import ragged_form
from autopar.intra._strategies import (
    EXTRA_KEYS,
    EXTRA_STRATEGIES,
    Collective,
    CostContext,
    Strategy,
)


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
        exchange = _Exchange(node, form, axes, ep, local, out_bytes, out_var.dtype,
                             imbalance, ctx, _region_of(node, graph, ctx), graph)
        name = f"ep:{''.join(axes)}"
        whole = name + (PER_GEMM if ctx.moe_dispatch == "gemm" else "")
        if ctx.moe_overlap != "on" or not exchange.chunkable(in_vars[0].shape[0]):
            strategies.append(exchange.strategy(whole, in_specs, out_spec, 1))
        if ctx.moe_overlap != "off" and exchange.chunkable(in_vars[0].shape[0]):
            strategies.append(exchange.strategy(name + OVERLAPPED, in_specs, out_spec,
                                                OVERLAP_CHUNKS))
    return strategies


# The suffix of an EP strategy run in `OVERLAP_CHUNKS` token chunks (`autopar.lower.
# _experts` reads it from the plan's strategy names).
OVERLAPPED = "+overlap"
# The suffix of a whole EP strategy priced with its own dispatch and combine
# (`moe_dispatch="gemm"`): `autopar.lower._experts` does not fuse a region holding one.
PER_GEMM = "+per-gemm"


class _Exchange:
    """The costs of one grouped GEMM's EP strategy over `axes`, whole or in chunks of
    the routed rows (`autopar.cost.chunked_exchange_time`)."""

    def __init__(self, node, form, axes, ep, local, out_bytes, dtype, imbalance,
                 ctx, region: ExpertRegion | None, graph: OpGraph) -> None:
        self.node, self.form, self.axes, self.ep, self.dtype = node, form, axes, ep, dtype
        self.local, self.out_bytes, self.imbalance, self.ctx = (local, out_bytes,
                                                                imbalance, ctx)
        self.region, self.graph = region, graph

    def region_exchange(self) -> tuple[float, tuple[Collective, ...]]:
        """This GEMM's share of its region's entry dispatches and exit combines (whole,
        not chunked): seconds and collectives."""
        ctx, graph, region = self.ctx, self.graph, self.region

        def block(v):
            var = graph.vars[v]
            spec = tuple(self.axes if d == 0 else () for d in range(len(var.shape)))
            return bytes_per_device(var.shape, var.dtype, spec, ctx.mesh)

        dispatched, combined, share = ep_region_exchange_bytes(
            [block(v) for v in region.exchanged_inputs()],
            [block(v) for v in region.exchanged_outputs()], self.imbalance,
            len(region.gemms))
        moved = (*dispatched, *combined)
        seconds = sum(all_to_all_time(b, ctx.cluster, ctx.mesh, self.axes) for b in moved)
        return share * seconds, tuple(Collective("all_to_all", self.axes, b, weight=share)
                                      for b in moved)

    def region_bytes(self) -> float:
        """Bytes per device this GEMM's result and its share of its region's receive
        buffers hold (`autopar.cost.ep_buffer_bytes`): a form-1 result in dispatched form
        (the busiest device's routed rows), and a buffer per entering and leaving row
        variable; a form-2 result (expert weight gradients) as it is."""
        graph, region = self.graph, self.region

        def buffer(v):
            var = graph.vars[v]
            width = math.prod(var.shape[1:])
            return ep_buffer_bytes(var.shape[0] / self.ep, width, dtype_itemsize(var.dtype),
                                   self.imbalance)

        boundary = region.exchanged_inputs() + region.exchanged_outputs()
        own = (buffer(self.node.outputs[0]) if self.form == 1 else self.out_bytes)
        return own + sum(buffer(v) for v in boundary) / len(region.gemms)

    def chunkable(self, rows: int) -> bool:
        """Whether each device's routed rows split into `OVERLAP_CHUNKS` equal chunks."""
        return (rows // self.ep) % OVERLAP_CHUNKS == 0

    def strategy(self, name, in_specs, out_spec, num_chunks: int) -> Strategy:
        ctx, n = self.ctx, num_chunks
        dispatched, combined, rows_bytes = ep_exchange_bytes(
            self.form, self.local[0], self.local[1], self.out_bytes, self.imbalance, n)
        collectives = tuple(Collective("all_to_all", self.axes, b)
                            for _ in range(n) for b in (*dispatched, *combined))

        def seconds(moved):
            return sum(all_to_all_time(b, ctx.cluster, ctx.mesh, self.axes) for b in moved)

        gemm = ep_grouped_gemm_time(self.node.flops, self.ep, self.imbalance, n,
                                    sum(self.local[2:]), rows_bytes, ctx.cluster, self.dtype)
        if n == 1 and self.region is not None:
            comm, collectives = self.region_exchange()
            return Strategy(name, in_specs, (out_spec,), gemm, comm, self.region_bytes(),
                            collectives)
        if n == 1:
            return Strategy(name, in_specs, (out_spec,), gemm,
                            seconds(dispatched) + seconds(combined), self.out_bytes,
                            collectives)
        concurrency = backend_for(ctx.cluster).collective_concurrency(ctx.cluster)
        total = chunked_exchange_time(seconds(dispatched), gemm, seconds(combined), n,
                                      concurrency)
        return Strategy(name, in_specs, (out_spec,), n * gemm, total - n * gemm,
                        self.out_bytes, collectives)


def _region_of(node: Node, graph: OpGraph, ctx: CostContext) -> ExpertRegion | None:
    """The expert MLP region (`autopar.intra._moe_regions`) holding grouped GEMM `node`
    when `ctx.moe_dispatch` prices regions ("mlp"), else None."""
    if ctx.moe_dispatch != "mlp":
        return None
    return regions_by_gemm(graph).get(node.id)


def region_key(node: Node, graph: OpGraph, ctx: CostContext) -> tuple | None:
    """What `node`'s EP strategies take from its expert MLP region (`_region_of`): its
    GEMM count and the shapes and dtypes of the rows it exchanges. Nodes of equal shapes
    in regions that differ (a layer's forward, and its forward recomputed inside the
    backward's region) must not share their strategies."""
    region = _region_of(node, graph, ctx)
    if region is None:
        return None

    def rows(vs):
        return tuple((tuple(graph.vars[v].shape), graph.vars[v].dtype) for v in vs)

    return (len(region.gemms), rows(region.exchanged_inputs()),
            rows(region.exchanged_outputs()))


EXTRA_STRATEGIES["ragged_dot_general"] = expert_parallel_strategies
EXTRA_KEYS["ragged_dot_general"] = region_key
