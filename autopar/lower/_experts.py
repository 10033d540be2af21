"""Run a grouped GEMM planned expert-parallel: dispatch and combine by all-to-all.

(And `top_k` split by rows, per shard: `PER_SHARD`.)

In: a graph, its plan (a `ShardingPlan` or a scan's `BodyPlan`) and the jax mesh. Out: the
graph with every `ragged_dot_general` node that the plan runs expert-parallel
(`autopar.intra._strategies_moe`: the routed rows and the experts split over the same mesh
axes) bound to `ExpertParallelRaggedDot`, which runs it under `jax.shard_map`:

1. each device holds a block of ``M / ep`` rows of the tokens sorted by expert; the global
   group sizes say which device owns each row's expert;
2. dispatch: one `jax.lax.all_to_all` sends every row to its expert's device. XLA:CPU has
   no ``ragged-all-to-all``, so each device sends a fixed ``[ep, M / ep, K]`` buffer (a
   block per destination, as many rows as it could send there: dropless, and ``ep`` times
   the bytes the routed rows need; the cost model prices the routed rows);
3. the device runs its experts' grouped GEMM on the rows it received, in expert order
   (a buffer of ``M`` rows, the worst case of every token routed to it; rows past its
   experts' count are zero and skipped by the grouped GEMM's group sizes);
4. combine (form 1): a second all-to-all returns each result row to the device that
   held it. The weight gradient (form 2) dispatches both operands and keeps its experts'
   block of the result: no combine.

A grouped GEMM whose strategy is overlapped (`autopar.intra._strategies_moe.OVERLAPPED`)
runs steps 1–4 once per chunk of `autopar.cost.OVERLAP_CHUNKS` equal chunks of each
device's rows: chunk ``c`` is rows ``[c·R/n, (c+1)·R/n)`` of every device's block of R
rows, itself sorted by expert, so it routes like a whole exchange of R/n rows per device
with its own group sizes (`chunk_group_sizes`). Nothing orders one chunk's all-to-alls
after another chunk's grouped GEMM, so a scheduler that runs collectives asynchronously
(XLA:GPU's) can send chunk 2 while chunk 1 computes; the results are concatenated (form
1) or summed (form 2).

An expert MLP region (`autopar.intra._moe_regions`: the grouped GEMMs sharing one
routing and the row-wise ops between them) whose every GEMM the plan puts in this layout
over the same axes, whole and priced by region (not ``moe_dispatch="gemm"``, whose
strategy names end in `autopar.intra._strategies_moe.PER_GEMM`), runs dispatched
instead (`fused_regions`): its entering rows
are dispatched once (step 2), its GEMMs (`RegionGemm`: steps 3 only) and row-wise ops
(`RegionRowOp`) run on each device's received rows, and only the rows read outside it
are combined (step 4). A row variable in dispatched form is ``[ep · M, ...]`` (each
device's receive buffer), so the form shows in its leading size; a scan body's
residuals read only by the backward's region stay dispatched through the scan, so a
layer's MLP has one dispatch and one combine forward and one of each backward.

A grouped GEMM the plan splits otherwise runs as planned by XLA's SPMD partitioner.
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax.sharding import Mesh, PartitionSpec

from autopar.cluster._mesh import replicated, to_partition_spec
from autopar.cost import OVERLAP_CHUNKS
from autopar.graph import OpGraph
from autopar.intra._moe_regions import ExpertRegion, expert_regions
from autopar.intra._rules_moe import ragged_form
from autopar.intra._strategies_moe import OVERLAPPED, PER_GEMM, ep_layout


def with_expert_dispatch(graph: OpGraph, plan, mesh: Mesh) -> OpGraph:
    """`graph` with each node `planned_prim` replaces for `plan` bound to its stand-in,
    and each expert MLP region the plan runs expert-parallel over one set of mesh axes
    (`fused_regions`) run on dispatched rows: one dispatch on entry, one combine on exit."""
    operand_specs = {(n, p): s for n, p, s in plan.operand_specs}
    strategies = (dict(enumerate(plan.node_strategies)) if hasattr(plan, "node_strategies")
                  else dict(plan.strategies))
    nodes = list(graph.nodes)
    changed = False

    def specs(node):
        ins = [operand_specs.get((node.id, p)) or plan.var_specs[v]
               or replicated(len(graph.vars[v].shape)) for p, v in enumerate(node.inputs)]
        outs = [plan.var_specs[v] or replicated(len(graph.vars[v].shape))
                for v in node.outputs]
        return ins, outs

    done: set[int] = set()
    for region, axes in fused_regions(graph, specs, strategies):
        done |= _bind_region(graph, nodes, region, axes, mesh, specs)
        changed = True
    for node in graph.nodes:
        if node.id in done or node.primitive not in ("ragged_dot_general", *PER_SHARD):
            continue
        in_specs, out_specs = specs(node)
        chunks = OVERLAP_CHUNKS if strategies.get(node.id, "").endswith(OVERLAPPED) else 1
        prim = planned_prim(node, graph, mesh, in_specs, out_specs, chunks)
        if prim is not None:
            nodes[node.id] = replace(node, prim=prim)
            changed = True
    return replace(graph, nodes=nodes) if changed else graph


def fused_regions(graph: OpGraph, specs, strategies) -> list[tuple[ExpertRegion, tuple]]:
    """The expert MLP regions of `graph` (`autopar.intra._moe_regions`) whose every
    grouped GEMM the plan runs in the all-to-all layout over the same mesh axes, whole
    (not `OVERLAPPED`) and priced by region (not `PER_GEMM`: planned with
    ``moe_dispatch="gemm"``), with those axes. `specs(node)` gives a node's planned
    operand and result specs."""
    fused = []
    for region in expert_regions(graph):
        found = set()
        for nid in region.gemms:
            node = graph.nodes[nid]
            in_specs, out_specs = specs(node)
            layout = ep_layout(node, graph)
            found.add(None if strategies.get(nid, "").endswith((OVERLAPPED, PER_GEMM))
                      else _ep_axes(in_specs, out_specs[0], layout))
        if len(found) == 1 and None not in found:
            fused.append((region, found.pop()))
    return fused


def _bind_region(graph: OpGraph, nodes: list, region: ExpertRegion, axes, mesh: Mesh,
                 specs) -> set[int]:
    """Bind `region`'s nodes (and the producers of the rows it alone reads) to their
    stand-ins in `nodes`; the ids of the region's grouped GEMMs."""
    run = _RegionRun(region, mesh, axes)
    sizes = region.group_sizes
    producer = {v: n.id for n in graph.nodes for v in n.outputs}
    for nid in region.gemms:
        node = graph.nodes[nid]
        in_specs, out_specs = specs(node)
        nodes[nid] = replace(node, prim=RegionGemm(node, run, in_specs, out_specs[0]))
    for nid in region.row_ops:  # the group sizes as one more operand, to route rows
        node = graph.nodes[nid]
        nodes[nid] = replace(node, prim=RegionRowOp(node, run), inputs=(*node.inputs, sizes))
    consumers = graph.consumers()
    for v in region.inputs:  # rows read only inside: dispatched where they are made
        p = producer.get(v)
        if (p is None or p in region.members or nodes[p].prim is not graph.nodes[p].prim
                or graph.nodes[p].primitive in (*PER_SHARD, "ragged_dot_general")
                or not all(c in region.members for c in consumers[v])
                or (v in graph.outvars and v not in region.kept)
                or not (sizes in graph.invars or producer.get(sizes, p) < p)):
            continue
        node = graph.nodes[p]
        nodes[p] = replace(node, prim=RegionEntry(node, run, node.outputs.index(v)),
                           inputs=(*node.inputs, sizes))
    return set(region.gemms)


class _RegionRun:
    """What the stand-ins of one fused region share: its routing over `axes`, and the
    dispatched form of each row variable the region read or made in block form.

    A row variable in *block* form is ``[M, ...]`` with each device holding ``M / ep`` of
    the sorted rows (the plan's layout); in *dispatched* form it is ``[ep · M, ...]``,
    each device's block of it the rows of its own experts in expert order (`_Routes`'
    receive buffer: dropless, up to every row). The form shows in the leading size."""

    def __init__(self, region: ExpertRegion, mesh: Mesh, axes) -> None:
        self.mesh, self.axes = mesh, tuple(axes)
        self.ep = math.prod(mesh.shape[a] for a in self.axes)
        self.rows = region.rows
        self.combined = set(region.exchanged_outputs())
        self.cache: dict[int, tuple] = {}  # var -> (trace, dispatched form)

    def is_dispatched(self, x) -> bool:
        return x.ndim > 0 and x.shape[0] == self.ep * self.rows

    def dispatched(self, v: int, x, sizes):
        """Variable `v` (value `x`, either form) in dispatched form: as it is, the form
        made earlier in this trace, or one dispatch all-to-all."""
        if self.is_dispatched(x):
            return x
        trace = jax_core.trace_ctx.trace
        made = self.cache.get(v)
        if made is not None and made[0] is trace:
            return made[1]
        out = self._exchange(x, sizes, combine=False)
        self.cache[v] = (trace, out)
        return out

    def emit(self, v: int, x, sizes):
        """What the graph holds for a row variable the region made (dispatched `x`): its
        block form (one combine all-to-all) where it is read outside the region."""
        if v not in self.combined:
            return x
        self.cache[v] = (jax_core.trace_ctx.trace, x)
        return self._exchange(x, sizes, combine=True)

    def row_spec(self, ndim: int) -> PartitionSpec:
        return PartitionSpec(self.axes, *([None] * (ndim - 1)))

    def _exchange(self, x, sizes, combine: bool):
        ep, axes, block = self.ep, self.axes, self.rows // self.ep

        def local(x, sizes):
            routes = _Routes(sizes, ep, jax.lax.axis_index(axes), block)
            return routes.combine(x, axes) if combine else routes.dispatch(x, axes)

        spec = self.row_spec(x.ndim)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(spec, PartitionSpec()),
                             out_specs=spec, check_vma=False)(x, sizes)


class RegionGemm:
    """Stands in for a grouped GEMM of a fused region: runs it on each device's
    dispatched rows against its own experts (no exchange of its own)."""

    multiple_results = False

    def __init__(self, node, run: _RegionRun, in_specs, out_spec) -> None:
        self.prim, self.run = node.prim, run
        self.inputs, (self.out,) = node.inputs, node.outputs
        self.rhs_spec = to_partition_spec(in_specs[1])
        self.out_spec = to_partition_spec(out_spec)

    def bind(self, lhs, rhs, group_sizes, **params):
        run, prim = self.run, self.prim
        form = ragged_form(params)
        per_device = group_sizes.shape[0] // run.ep
        lhs = run.dispatched(self.inputs[0], lhs, group_sizes)

        def local_groups(sizes):
            me = jax.lax.axis_index(run.axes)
            return jax.lax.dynamic_slice_in_dim(sizes, me * per_device, per_device)

        if form == 1:
            out = jax.shard_map(
                lambda x, w, s: prim.bind(x, w, local_groups(s), **params),
                mesh=run.mesh, in_specs=(run.row_spec(2), self.rhs_spec, PartitionSpec()),
                out_specs=run.row_spec(2), check_vma=False,
            )(lhs, rhs, group_sizes)
            return run.emit(self.out, out, group_sizes)
        rhs = run.dispatched(self.inputs[1], rhs, group_sizes)
        return jax.shard_map(
            lambda x, y, s: prim.bind(x, y, local_groups(s), **params),
            mesh=run.mesh, in_specs=(run.row_spec(2), run.row_spec(2), PartitionSpec()),
            out_specs=self.out_spec, check_vma=False,
        )(lhs, rhs, group_sizes)


class RegionRowOp:
    """Stands in for a row-wise op of a fused region: runs it on dispatched rows (its
    last operand, added by `_bind_region`, is the region's group sizes)."""

    multiple_results = False

    def __init__(self, node, run: _RegionRun) -> None:
        self.prim, self.run = node.prim, run
        self.inputs, (self.out,) = node.inputs, node.outputs

    def bind(self, *operands, **params):
        *operands, sizes = operands
        xs = [x if jnp.ndim(x) == 0 else self.run.dispatched(v, x, sizes)
              for v, x in zip(self.inputs, operands)]
        return self.run.emit(self.out, self.prim.bind(*xs, **params), sizes)


class RegionEntry:
    """Stands in for the node making rows that only a fused region reads: its result
    `index` leaves dispatched (the last operand is the region's group sizes)."""

    def __init__(self, node, run: _RegionRun, index: int) -> None:
        self.prim, self.run, self.index = node.prim, run, index
        self.var = node.outputs[index]
        self.multiple_results = node.prim.multiple_results

    def bind(self, *operands, **params):
        *operands, sizes = operands
        out = self.prim.bind(*operands, **params)
        if not self.multiple_results:
            return self.run.dispatched(self.var, out, sizes)
        out = list(out)
        out[self.index] = self.run.dispatched(self.var, out[self.index], sizes)
        return out


# Primitives that work row by row along every dimension their rule splits, but that
# XLA's SPMD partitioner runs whole: XLA:CPU lowers `top_k` to a "TopK" custom call that
# it all-gathers (the compiled HLO of a row-split top_k of f32[16, 8] on 8 CPU devices:
# `all-gather` of the whole operand, then the custom call). Run per shard instead.
PER_SHARD = frozenset({"top_k"})


def planned_prim(node, graph: OpGraph, mesh: Mesh, in_specs, out_specs,
                 num_chunks: int = 1):
    """The stand-in that runs `node` as planned with these operand and result specs:
    `ExpertParallelRaggedDot` for a grouped GEMM in the all-to-all layout (in
    `num_chunks` chunks of rows), `PerShard` for a split `PER_SHARD` primitive; None
    where XLA's partitioner runs it as planned."""
    if node.primitive == "ragged_dot_general":
        layout = ep_layout(node, graph)
        axes = None if layout is None else _ep_axes(in_specs, out_specs[0], layout)
        if axes is None:
            return None
        return ExpertParallelRaggedDot(node.prim, mesh, axes, in_specs, out_specs[0],
                                       num_chunks)
    if node.primitive in PER_SHARD and any(any(s) for s in (*in_specs, *out_specs)):
        return PerShard(node.prim, mesh, in_specs, out_specs)
    return None


class PerShard:
    """Stands in for a primitive that runs on each device's shards alone (`PER_SHARD`)."""

    def __init__(self, prim, mesh: Mesh, in_specs, out_specs) -> None:
        self.prim = prim
        self.multiple_results = prim.multiple_results
        self.mesh = mesh
        self.in_specs = tuple(to_partition_spec(s) for s in in_specs)
        self.out_specs = tuple(to_partition_spec(s) for s in out_specs)

    def bind(self, *operands, **params):
        def local(*xs):
            out = self.prim.bind(*xs, **params)
            return tuple(out) if self.multiple_results else (out,)

        outs = jax.shard_map(local, mesh=self.mesh, in_specs=self.in_specs,
                             out_specs=self.out_specs, check_vma=False)(*operands)
        return list(outs) if self.multiple_results else outs[0]


def _ep_axes(in_specs, out_spec, layout) -> tuple[str, ...] | None:
    """The EP axes if the specs are `ep_layout`'s all-to-all layout, else None."""
    split_dims, out_dim = layout
    axes = tuple(out_spec[out_dim])
    if not axes:
        return None
    for spec, split in zip((*in_specs, out_spec), (*split_dims, out_dim)):
        for d, dim_axes in enumerate(spec):
            if tuple(dim_axes) != (axes if d == split else ()):
                return None
    return axes


class ExpertParallelRaggedDot:
    """Stands in for `ragged_dot_general` in one node: `bind` runs it expert-parallel over
    `axes` (module docstring), in `num_chunks` chunks of each device's rows."""

    multiple_results = False

    def __init__(self, prim, mesh: Mesh, axes, in_specs, out_spec,
                 num_chunks: int = 1) -> None:
        self.prim = prim
        self.num_chunks = num_chunks
        self.mesh = mesh
        self.axes = tuple(axes)
        self.in_specs = tuple(to_partition_spec(s) for s in in_specs)
        self.out_spec = to_partition_spec(out_spec)

    def bind(self, lhs, rhs, group_sizes, **params):
        ep = math.prod(self.mesh.shape[a] for a in self.axes)
        form = ragged_form(params)

        def exchange(lhs, rhs, group_sizes, me):
            routes = _Routes(group_sizes, ep, me, lhs.shape[0])
            local_groups = jax.lax.dynamic_slice_in_dim(
                group_sizes, me * routes.groups_per_device, routes.groups_per_device
            )
            if form == 1:
                received = routes.dispatch(lhs, self.axes)
                result = self.prim.bind(received, rhs, local_groups, **params)
                return routes.combine(result, self.axes)
            return self.prim.bind(routes.dispatch(lhs, self.axes),
                                  routes.dispatch(rhs, self.axes), local_groups, **params)

        def local(lhs, rhs, group_sizes):
            me = jax.lax.axis_index(self.axes)
            n = self.num_chunks
            if n == 1 or lhs.shape[0] % n:
                return exchange(lhs, rhs, group_sizes, me)
            size = lhs.shape[0] // n
            parts = []
            for c in range(n):
                rows = slice(c * size, (c + 1) * size)
                sizes = chunk_group_sizes(group_sizes, lhs.shape[0], n, c)
                parts.append(exchange(lhs[rows], rhs[rows] if form == 2 else rhs, sizes, me))
            return jnp.concatenate(parts) if form == 1 else sum(parts[1:], parts[0])

        return jax.shard_map(
            local, mesh=self.mesh, in_specs=self.in_specs, out_specs=self.out_spec,
            check_vma=False,
        )(lhs, rhs, group_sizes)


def chunk_group_sizes(group_sizes, rows: int, num_chunks: int, chunk: int):
    """Rows of each group in `chunk` of `num_chunks`: the rows ``[chunk·rows/n,
    (chunk+1)·rows/n)`` of every device's block of `rows` sorted rows.

    **Example:** blocks of 4 rows, groups (3, 5): rows 0–2 and 3–7; chunk 0 of 2 is rows
    0, 1, 4, 5, so its group sizes are (2, 2); chunk 1's (1, 3).
    """
    size = rows // num_chunks
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)

    def before(r):  # rows of the chunk in the global order before row r
        return (r // rows) * size + jnp.clip(r % rows - chunk * size, 0, size)

    return (before(ends) - before(starts)).astype(group_sizes.dtype)


class _Routes:
    """Where each of this device's sorted rows goes, and where each row this device
    receives came from. Row ``r`` of the global sorted order is held by device
    ``r // rows`` and belongs to the device owning its expert."""

    def __init__(self, group_sizes, ep: int, me, rows: int) -> None:
        num_groups = group_sizes.shape[0]
        self.groups_per_device = num_groups // ep
        self.ep, self.rows, self.me = ep, rows, me
        ends = jnp.cumsum(group_sizes.astype(jnp.int32))
        dev_end = ends[self.groups_per_device - 1 :: self.groups_per_device]  # [ep]
        dev_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), dev_end[:-1]])
        self.dev_start, self.dev_end = dev_start, dev_end
        # sending: my rows, their destination and place in the block sent there
        mine = me * rows + jnp.arange(rows, dtype=jnp.int32)
        self.send_valid = mine < dev_end[-1]
        dest = jnp.minimum(jnp.searchsorted(dev_end, mine, side="right"), ep - 1)
        self.dest = dest.astype(jnp.int32)
        self.send_pos = mine - jnp.maximum(dev_start[self.dest], me * rows)
        # receiving: my experts' rows in expert order, from the blocks of their holders
        total = ep * rows
        wanted = dev_start[me] + jnp.arange(total, dtype=jnp.int32)
        self.recv_valid = wanted < dev_end[me]
        source = jnp.minimum(wanted // rows, ep - 1)
        self.source = source
        self.recv_pos = jnp.clip(wanted - jnp.maximum(dev_start[me], source * rows), 0, rows - 1)

    def dispatch(self, x, axes):
        """``x[rows, ...]`` (my block) -> ``[ep · rows, ...]``: my experts' rows, in order."""
        send = jnp.zeros((self.ep, self.rows, *x.shape[1:]), x.dtype)
        dest = jnp.where(self.send_valid, self.dest, self.ep)  # out of range: dropped
        send = send.at[dest, self.send_pos].set(x, mode="drop")
        recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=False)
        got = recv[self.source, self.recv_pos]
        mask = self.recv_valid.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(mask, got, jnp.zeros((), x.dtype))

    def combine(self, y, axes):
        """``y[ep · rows, ...]`` (results of my experts' rows) -> ``[rows, ...]``, my block."""
        send = jnp.zeros((self.ep, self.rows, *y.shape[1:]), y.dtype)
        source = jnp.where(self.recv_valid, self.source, self.ep)
        send = send.at[source, self.recv_pos].set(y, mode="drop")
        recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=False)
        got = recv[self.dest, jnp.clip(self.send_pos, 0, self.rows - 1)]
        mask = self.send_valid.reshape((-1,) + (1,) * (y.ndim - 1))
        return jnp.where(mask, got, jnp.zeros((), y.dtype))
