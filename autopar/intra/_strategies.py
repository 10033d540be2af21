"""Strategies: the concrete ways to run one node on a logical mesh, with their costs.

A strategy fixes the spec of every operand and result, the compute time per device, and
the collectives the node itself must issue (reducing partial sums). All times come from
`autopar.cost`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar._memo import declare, memo
from autopar.cluster import LogicalMesh, Spec, spec_axes
from autopar.cost import (
    MATMUL_PRIMITIVES,
    batch_feed_seconds,
    bytes_per_device,
    fused_attention_bytes,
    fusion_boundary_bytes,
    kernel_launch_time,
    kernel_seconds,
    layout_copy_seconds,
    node_compute_seconds,
    rate_dtype,
    reductions_seconds,
    shard_shape,
    unfused_bytes,
)
from autopar.cost.backends import backend_for
from autopar.graph import (
    Node,
    OpGraph,
    Role,
    attention_core,
    fusion_kind,
    fusion_traffic,
    kernel_roots,
)
from autopar.intra._control_flow import STACK
from autopar.intra._registry import signature_of
from autopar.intra._rules import OpInfo
from autopar.intra._signature import (
    Signature,
    enumerate_assignments,
    reduced_axes,
    spec_for,
)


@dataclass(frozen=True)
class Collective:
    """A predicted collective: kind, mesh axes, and bytes as `collective_time` takes them."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    # Times per planned unit of work: 1/microbatches for what runs once per step in a
    # pipeline stage planned per microbatch (see `autopar.inter.passes._deferred.step_weights`).
    weight: float = 1.0
    # Merged by XLA's combiner with the step's other independent collectives of its kind
    # and group, its latency charged per bucket (`autopar.cost.combined_collective_time`).
    combined: bool = False


@dataclass(frozen=True)
class Strategy:
    """One way to run a node. `in_specs[i]` is None for constant operands."""

    name: str
    in_specs: tuple[Spec | None, ...]
    out_specs: tuple[Spec, ...]
    compute_cost: float
    comm_cost: float
    out_bytes: float  # bytes per device of all results
    collectives: tuple[Collective, ...] = ()

    @property
    def cost(self) -> float:
        return self.compute_cost + self.comm_cost


@dataclass(frozen=True)
class CostContext:
    """What node costs depend on besides the node: the cluster, the mesh, and two sets of
    graph node ids (`step_effects`): `combinable`, nodes whose reductions XLA merges with
    their kind's other independent ones; `in_place`, elementwise nodes that write the
    step's donated state in place. Empty sets: every node is charged on its own.
    `moe_overlap`: which expert-parallel grouped GEMM forms to list; `moe_dispatch`:
    whether they are priced per expert MLP region or per GEMM (`ShardOptions`)."""

    cluster: object
    mesh: LogicalMesh
    combinable: frozenset = frozenset()
    in_place: frozenset = frozenset()
    moe_overlap: str = "auto"
    moe_dispatch: str = "mlp"
    # A memo for this mesh and cluster (`autopar.intra._reshard.shared_reshard_cache`'s),
    # where `_reductions_seconds` keeps the seconds of each tuple of reductions; None: none.
    memo: dict | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class StepEffects:
    combinable: frozenset
    in_place: frozenset


def step_effects(graph: OpGraph, tied: Sequence[tuple[int, int]] = ()) -> StepEffects:
    """Which nodes' costs the rest of the step changes (for `CostContext`).

    - `combinable`: nodes from whose results no matmul, non-sum reduction or kernel
      (anything but elementwise work and `reduce_sum`: `autopar.graph.fusion_kind`)
      follows, e.g. weight gradients feeding only the optimizer update. Nothing in the
      step waits on their reductions but that tail, so they are independent of each other
      and XLA's combiner merges them (`autopar.cost.combined_collective_time`). A later
      sum does not stop it: a sum of partial sums is a partial sum, and XLA reduces it
      once, after (a bias gradient summed over the batch, reshaped and summed again: the
      optimized HLO of a data-parallel GPT step on 8 CPU devices has one all-reduce and
      no reduce-scatter for it). A reduction that a matmul or kernel later reads (a
      tensor-parallel all-reduce of an activation) stays on its own.
    - `in_place`: elementwise nodes whose every result is a donated state output
      (`tied`: (output var, input var) pairs) or is read only by such nodes: the
      optimizer update, whose fusion writes the parameters and optimizer state over
      their donated buffers (`autopar.cost.compute_time`'s `in_place`).
    """
    key = tuple(tied)
    cached = _EFFECTS.get(graph)
    if cached is not None and cached[0] == key:
        return cached[1]
    nodes = graph.nodes
    consumers = graph.consumers()
    # A sum of partial sums is still a partial sum: XLA's partitioner reduces after it, so
    # a later reduce_sum does not keep a reduction from merging with the step's others.
    # A scanned body's per-iteration result leaving through ``scan_stack`` is read by
    # nothing later in that iteration: the body's weight gradients are independent of the
    # rest of the iteration, and XLA combines them into one all-reduce per iteration (the
    # while body of a data-parallel scanned GPT on 8 CPU devices reduces its five weight
    # and bias gradients in one tuple all-reduce). A carry (``scan_exit``) feeds the next
    # iteration, which the planning graph does not show: it blocks.
    blocking = [fusion_kind(n.primitive) != "elementwise"
                and n.primitive not in ("reduce_sum", STACK) for n in nodes]
    feeds_block = [False] * len(nodes)  # a blocking node lies downstream of its results
    tied_out = {o for o, _ in tied}
    outvars = set(graph.outvars)
    in_place = [False] * len(nodes)
    for node in reversed(nodes):
        users = [c for v in node.outputs for c in consumers[v]]
        feeds_block[node.id] = any(blocking[c] or feeds_block[c] for c in users)
        in_place[node.id] = bool(tied_out) and not blocking[node.id] and all(
            v in tied_out or (v not in outvars and consumers[v]
                              and all(in_place[c] for c in consumers[v]))
            for v in node.outputs
        )
    effects = StepEffects(
        frozenset(n.id for n in nodes if not feeds_block[n.id]),
        frozenset(n.id for n in nodes if in_place[n.id]),
    )
    _EFFECTS[graph] = (key, effects)
    return effects


_EFFECTS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.step_effects",
    "graph -> {tied pairs: StepEffects}")


def _assignment_name(assignment: dict[str, tuple[str, ...]]) -> str:
    if not assignment:
        return "replicated"
    return " ".join(f"{label}:{''.join(axes)}" for label, axes in sorted(assignment.items()))


def op_info(node: Node, graph: OpGraph) -> OpInfo:
    return OpInfo(
        primitive=node.primitive,
        params=node.params,
        in_shapes=tuple(graph.vars[v].shape for v in node.inputs),
        out_shapes=tuple(graph.vars[v].shape for v in node.outputs),
        in_const=tuple(graph.vars[v].role is Role.CONST for v in node.inputs),
    )


def node_signature(node: Node, graph: OpGraph) -> Signature | None:
    """The node's signature; None when no rule covers its primitive."""
    return signature_of(op_info(node, graph))


def replicated_signature(node: Node, graph: OpGraph) -> Signature:
    return Signature(
        tuple(None for _ in node.inputs),
        tuple((None,) * len(graph.vars[v].shape) for v in node.outputs),
    )


def node_strategies(
    node: Node, graph: OpGraph, sig: Signature, ctx: CostContext
) -> list[Strategy]:
    """Every strategy of `node` under `sig` on `ctx.mesh`, replicated first."""
    in_vars = [graph.vars[v] for v in node.inputs]
    out_vars = [graph.vars[v] for v in node.outputs]
    mesh = ctx.mesh
    # Constants are used whole on every device (their spec is None), so a mesh axis given
    # to a label that only constants carry would split nothing: the strategy would claim
    # divided work and a reduction of partial results that no device computes (and over
    # axes that no spec names, so its reduce-scatter variant would count them twice, as
    # spare axes too). Such labels stay unsplit, e.g. the position index of a rotary
    # sin/cos table gathered by position ids.
    carried = _carried_labels(sig, in_vars)
    assignments = [
        assignment
        for assignment in enumerate_assignments(
            sig, [v.shape for v in in_vars], [v.shape for v in out_vars], mesh
        )
        if carried.issuperset(assignment)
    ]
    strategies = []
    dtype = _rate_dtype(node, in_vars, out_vars)
    for assignment in assignments:
        strategies.extend(_assignment_strategies(node, graph, sig, ctx, assignment, in_vars,
                                                 out_vars, dtype))
    extra_rule = EXTRA_STRATEGIES.get(node.primitive)
    if extra_rule is not None:
        strategies.extend(extra_rule(node, graph, ctx))
    return _dedupe(strategies)


def _specs_under(sig: Signature, assignment, in_vars, out_vars) -> tuple[tuple, tuple]:
    """(input specs, output specs) of `sig`'s operands under `assignment` (label -> mesh
    axes); a constant input's spec is None."""
    in_specs = tuple(
        None if var.role is Role.CONST else spec_for(labels, len(var.shape), assignment)
        for labels, var in zip(sig.inputs, in_vars)
    )
    out_specs = tuple(
        spec_for(labels, len(var.shape), assignment)
        for labels, var in zip(sig.outputs, out_vars)
    )
    return in_specs, out_specs


def _assignment_strategies(node: Node, graph: OpGraph, sig: Signature, ctx: CostContext,
                           assignment, in_vars, out_vars, dtype) -> list[Strategy]:
    """The strategies of one assignment of mesh axes to `sig`'s labels: the node's specs
    and compute under it and, where it leaves partial results, their all-reduce (and,
    for one summed result, the reduce-scatter variants)."""
    mesh = ctx.mesh
    in_specs, out_specs = _specs_under(sig, assignment, in_vars, out_vars)
    used_axes = {a for axes in assignment.values() for a in axes}
    parallelism = math.prod(mesh.axis_size(a) for a in used_axes) if used_axes else 1
    out_bytes = sum(
        bytes_per_device(v.shape, v.dtype, s, mesh) for v, s in zip(out_vars, out_specs)
    )
    fused = getattr(ctx.cluster, "fused_attention", False)
    held = held_bytes(graph, out_vars, out_specs, mesh, fused)
    accessed = _hbm_bytes(node, graph, in_specs, out_specs, mesh,
                          getattr(ctx.cluster, "fused_attention", False))
    matmul = node.primitive in MATMUL_PRIMITIVES
    in_place = node.id in ctx.in_place and graph.nodes[node.id] is node
    extra = _extra_seconds(node, graph, in_specs, ctx)
    shape = _gemm_shape(node, in_vars, in_specs, mesh)
    work = (node.flops / parallelism, accessed, dtype, matmul, in_place, extra, shape)
    compute = node_compute_seconds(work[0], work[1], ctx.cluster, dtype, matmul=matmul,
                                   in_place=in_place, gemm_shape=shape,
                                   extra_seconds=extra)
    name = _assignment_name(assignment)
    partial = reduced_axes(sig, assignment)
    if not partial:
        return [Strategy(name, in_specs, out_specs, compute, 0.0, held)]
    # Partial results: reduce them with an all-reduce, or (one summed result) with a
    # reduce-scatter that leaves the result split along a free dimension.
    combined = _combined(node, graph, ctx)
    reduce = tuple(
        Collective("all_reduce", axes, out_bytes, combined=combined)
        for axes in partial.values()
    )
    comm = _reductions_seconds(reduce, ctx)
    found = [Strategy(name, in_specs, out_specs, compute, comm, held, reduce)]
    if len(out_vars) == 1 and set(partial) == {"sum"}:
        found.extend(
            _reduce_scatter_variants(
                name, in_specs, out_specs[0], out_vars[0], partial["sum"], work, ctx,
                combined, fused and out_vars[0].id in attention_core(graph),
            )
        )
    return found


# Strategies a primitive has beyond its signature's label assignments, keyed by primitive
# (`autopar.intra._strategies_moe`: a grouped GEMM's expert parallelism splits the tokens
# and the experts over one mesh axis, two labels that a signature keeps apart).
EXTRA_STRATEGIES: dict = {}
# What those strategies depend on beyond the node itself, keyed by primitive: fn(node,
# graph, ctx) -> a hashable the planner's strategy memo keys on (`extra_strategy_key`; a
# grouped GEMM's expert MLP region, `autopar.intra._strategies_moe.region_key`).
EXTRA_KEYS: dict = {}


def extra_strategy_key(node: Node, graph: OpGraph, ctx: CostContext):
    """What `node`'s `EXTRA_STRATEGIES` depend on in `graph` beyond the node (None: nothing)."""
    fn = EXTRA_KEYS.get(node.primitive)
    return None if fn is None else fn(node, graph, ctx)


def _combined(node: Node, graph: OpGraph, ctx: CostContext) -> bool:
    return node.id in ctx.combinable and graph.nodes[node.id] is node


def _reductions_seconds(reduce: Sequence[Collective], ctx: CostContext) -> float:
    """`reductions_seconds` of `reduce`, memoised in `ctx.memo` (the seconds depend on the
    collectives, the mesh and the cluster alone; issue 45: strategies of many nodes and
    shapes reduce the same bytes)."""
    key = ("reductions", *((c.kind, c.nbytes, c.axes, c.combined) for c in reduce))
    found = None if ctx.memo is None else ctx.memo.get(key)
    if found is None:
        found = reductions_seconds(key[1:], ctx.cluster, ctx.mesh)
        if ctx.memo is not None:
            ctx.memo[key] = found
    return found


def _carried_labels(sig: Signature, in_vars) -> set[str]:
    """Labels of some non-constant operand or some result: those a split can act on."""
    carried = {
        label
        for labels, var in zip(sig.inputs, in_vars)
        if var.role is not Role.CONST
        for label in labels or ()
    }
    carried.update(label for labels in sig.outputs for label in labels)
    carried.discard(None)
    return carried


def _dedupe(strategies: list[Strategy]) -> list[Strategy]:
    """Keep the cheapest strategy for each combination of operand and result specs."""
    best: dict[tuple, Strategy] = {}
    for s in strategies:
        key = (s.in_specs, s.out_specs)
        if key not in best or s.cost < best[key].cost:
            best[key] = s
    return list(best.values())


def _reduce_scatter_variants(name, in_specs, out_spec, out_var, axes, work, ctx,
                             combined=False, on_chip=False):
    """The strategy that leaves the summed result split over the reduced `axes`.

    `work` is (FLOPs per device, bytes accessed per device, dtype, is a matmul, writes in
    place, `_extra_seconds`, GEMM shape or None) of the node when it computes the whole
    partial result; `combined`: its reduction merges with the step's other independent
    ones (`step_effects`); `on_chip`: the result is inside a fused attention kernel
    (`held_bytes`), held as its per-row statistics.
    """
    mesh = ctx.mesh
    split = mesh.axis_size(axes)
    full_bytes = bytes_per_device(out_var.shape, out_var.dtype, out_spec, mesh)
    spare = _unused_axes(mesh, (*in_specs, out_spec))
    # XLA's dot (and convolution) partitioner reduce-scatters only when the mesh axes the
    # operands leave unused cannot hold the split. When they can (their size is a multiple
    # of it), it slices the result dimension over a subgroup of those replicated devices,
    # computes 1/split of the result, all-reduces that over `axes` and moves each tile to
    # its device with a collective-permute. Seen in the compiled HLO of the conv net's
    # first weight gradient on mesh (2, 4) (reduction over x of size 2, y of size 4
    # unused: `convolution f32[3,3,3,8]`, `all-reduce` over x, `collective-permute`
    # {4->2, 5->3, 2->4, 3->5}) and of the MoE einsums on (4, 2). A reduction over y of
    # size 4 on (2, 4), with only x of size 2 unused, reduce-scatters (on XLA:CPU an
    # all-reduce and a local slice).
    on_spare = bool(spare) and mesh.axis_size(spare) % split == 0
    flops, accessed, dtype, matmul, in_place, extra, shape = work
    if on_spare:
        reduce = (
            Collective("all_reduce", tuple(axes), full_bytes / split, combined=combined),
            Collective("send_recv", (*axes, *spare), full_bytes / split),
        )
        # each device computes 1/split of the result's rows (or columns)
        shape = None if shape is None else (max(1.0, shape[0] / split), *shape[1:])
        compute = node_compute_seconds(flops / split, accessed, ctx.cluster, dtype,
                                       matmul=matmul, in_place=in_place, gemm_shape=shape,
                                       extra_seconds=extra)
    else:
        reduce = (Collective("reduce_scatter", tuple(axes), full_bytes, combined=combined),)
        compute = node_compute_seconds(flops, accessed, ctx.cluster, dtype, matmul=matmul,
                                       in_place=in_place, gemm_shape=shape,
                                       extra_seconds=extra)
    comm = _reductions_seconds(reduce, ctx)
    # One variant: scatter onto the first free dimension that divides evenly (for a
    # weight gradient, its leading dimension: the ZeRO-style sharded gradient).
    for dim, (size, dim_axes) in enumerate(zip(out_var.shape, out_spec)):
        if dim_axes or size % split:
            continue
        new_spec = tuple(tuple(axes) if d == dim else s for d, s in enumerate(out_spec))
        held = (fused_attention_bytes(out_var.shape, new_spec, mesh) if on_chip
                else full_bytes / split)
        yield Strategy(f"{name} rs:{dim}", in_specs, (new_spec,), compute, comm, held, reduce)
        return


def _unused_axes(mesh: LogicalMesh, specs) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that split none of `specs` (None entries are skipped)."""
    used = {a for spec in specs if spec is not None for a in spec_axes(spec)}
    return tuple(a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1 and a not in used)


def input_strategies(var, ctx: CostContext) -> list[Strategy]:
    """Strategies of a graph input: every legal spec, free, memory = its bytes per device."""
    labels = tuple(f"d{d}" for d in range(len(var.shape)))
    sig = Signature((), (labels,))
    strategies = []
    for assignment in enumerate_assignments(sig, (), (var.shape,), ctx.mesh):
        spec = spec_for(labels, len(var.shape), assignment)
        nbytes = bytes_per_device(var.shape, var.dtype, spec, ctx.mesh)
        # The batch arrives from the host every step: each device pays for writing the
        # bytes it holds (a replicated batch is copied to every device).
        feed = batch_feed_seconds(nbytes, ctx.cluster, var.dtype) \
            if var.role is Role.BATCH else 0.0
        strategies.append(
            Strategy(_assignment_name(assignment), (), (spec,), feed, 0.0, nbytes)
        )
    return strategies


def follow_strategies(
    node: Node,
    graph: OpGraph,
    sig: Signature,
    main: int,
    leader_specs: Sequence[Spec],
    ctx: CostContext,
    cache: dict | None = None,
) -> list[Strategy] | None:
    """Strategies of a node that follows its operand `main`.

    For each spec the operand may arrive with (one per leader strategy), the node keeps
    that split; other operands are asked for the matching split (the ILP charges their
    resharding on their edges). Returns None when some spec cannot be carried through
    (then the node is planned on its own).

    `cache`, if given, is a dict spec -> that spec's strategy (None: it cannot be carried
    through) for this node's key on this mesh (`autopar.intra._problem`'s follower memo:
    leaders' spec lists differ between graphs while their specs recur).
    """
    labels = sig.inputs[main]
    out_vars = [graph.vars[v] for v in node.outputs]
    in_vars = [graph.vars[v] for v in node.inputs]
    result = []
    cache = {} if cache is None else cache
    dtype = None
    for spec in leader_specs:
        strategy = cache.get(spec, _UNSEEN)
        if strategy is _UNSEEN:
            if dtype is None:
                dtype = _rate_dtype(node, in_vars, out_vars)
            strategy = cache[spec] = _follow_one(node, graph, sig, labels, spec, in_vars,
                                                 out_vars, dtype, ctx)
        if strategy is None:
            return None
        result.append(strategy)
    return result


_UNSEEN = object()


def _follow_one(node, graph, sig, labels, spec, in_vars, out_vars, dtype,
                ctx: CostContext) -> Strategy | None:
    """`follow_strategies`' strategy for one leader spec; None if it cannot be followed."""
    assignment: dict[str, tuple[str, ...]] = {}
    for label, axes in zip(labels, spec):
        if axes and label is None:
            return None
        if axes:
            assignment[label] = axes
    in_specs, out_specs = _specs_under(sig, assignment, in_vars, out_vars)
    tensors = [*zip(in_vars, in_specs), *zip(out_vars, out_specs)]
    if not all(s is None or _divisible(v.shape, s, ctx.mesh) for v, s in tensors):
        return None
    used = set(spec_axes(spec))
    parallelism = math.prod(ctx.mesh.axis_size(a) for a in used) if used else 1
    held = held_bytes(graph, out_vars, out_specs, ctx.mesh,
                      getattr(ctx.cluster, "fused_attention", False))
    accessed = _hbm_bytes(node, graph, in_specs, out_specs, ctx.mesh,
                          getattr(ctx.cluster, "fused_attention", False))
    compute = node_compute_seconds(
        node.flops / parallelism, accessed, ctx.cluster, dtype,
        matmul=node.primitive in MATMUL_PRIMITIVES,
        in_place=node.id in ctx.in_place and graph.nodes[node.id] is node,
        extra_seconds=_extra_seconds(node, graph, in_specs, ctx),
    )
    return Strategy(_assignment_name(assignment), in_specs, out_specs, compute, 0.0, held)


def held_bytes(graph: OpGraph, out_vars, out_specs, mesh, fused_attention: bool) -> float:
    """Bytes per device the results `out_vars` (graph variables) at `out_specs` hold in
    device memory; with `fused_attention`, a value inside the fused attention kernel
    (`attention_core`) holds only its per-row softmax statistics
    (`autopar.cost.fused_attention_bytes`)."""
    core = attention_core(graph) if fused_attention else frozenset()
    return sum(
        fused_attention_bytes(v.shape, s, mesh) if v.id in core
        else bytes_per_device(v.shape, v.dtype, s, mesh)
        for v, s in zip(out_vars, out_specs)
    )


def _hbm_bytes(node: Node, graph: OpGraph, in_specs, out_specs, mesh: LogicalMesh,
               fused_attention: bool = False) -> float:
    """Bytes per device the node moves to and from device memory: its operands and results
    that cross its fusion's boundary (`autopar.graph.fusion_traffic`, under the cluster's
    `fused_attention`; constants count 0)."""
    def nbytes(var_id, spec):
        var = graph.vars[var_id]
        return None if spec is None else bytes_per_device(var.shape, var.dtype, spec, mesh)

    in_bytes = [nbytes(v, s) for v, s in zip(node.inputs, in_specs)]
    out_bytes = [nbytes(v, s) for v, s in zip(node.outputs, out_specs)]
    traffic = fusion_traffic(graph, fused_attention)
    if traffic.reads.get(node.id) is None or len(graph.nodes) <= node.id \
            or graph.nodes[node.id] is not node:
        return unfused_bytes(in_bytes, out_bytes)  # not in this graph
    return fusion_boundary_bytes(in_bytes, out_bytes, traffic.reads[node.id],
                                 traffic.writes[node.id])


def _gemm_shape(node: Node, in_vars, in_specs, mesh: LogicalMesh
                ) -> tuple[float, float, float] | None:
    """A dot's (M, N, K) per device under `in_specs` (batch dimensions counted in M; a
    constant operand whole), for `autopar.cost.gemm_efficiency`; None for other nodes."""
    if node.primitive != "dot_general" or len(in_vars) < 2:
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = node.params["dimension_numbers"]

    def local(var, spec):
        return tuple(var.shape) if spec is None else shard_shape(var.shape, spec, mesh)

    lhs, rhs = local(in_vars[0], in_specs[0]), local(in_vars[1], in_specs[1])
    k = math.prod(lhs[d] for d in lhs_contract)
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lhs_contract)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rhs_contract + rhs_batch)
    return float(m), float(n), float(k)


def _extra_seconds(node: Node, graph: OpGraph, in_specs, ctx: CostContext) -> float:
    """What a node costs besides its roofline: its layout copies (`_layout_seconds`) and,
    for the node that stands for a kernel (`autopar.graph.kernel_roots`), the profile's
    `kernel_overhead` (`autopar.cost.kernel_launch_time`)."""
    return _layout_seconds(node, graph, in_specs, ctx) + _kernel_seconds(node, graph, ctx)


def _kernel_seconds(node: Node, graph: OpGraph, ctx: CostContext) -> float:
    """`kernel_launch_time` of one kernel if `node` is a kernel root of `graph`, else 0
    (and 0 for a node of another graph, or on a profile without `kernel_overhead`)."""
    if not getattr(ctx.cluster, "kernel_overhead", 0.0) or len(graph.nodes) <= node.id \
            or graph.nodes[node.id] is not node:
        return 0.0
    if node.primitive in _LOOP_SLICES:
        # Each iteration of the scan's loop slices a stacked operand (``dynamic-slice``)
        # or writes a stacked result (``dynamic-update-slice``) in a kernel of its own:
        # one per iteration, the leading dimension of the stacked side. (The scanned twin
        # of test_same_math's GPT runs 64 + 83 kernels per iteration of its two loops,
        # where an unrolled layer runs about 100: the difference is these.)
        stacked = node.inputs[0] if node.primitive == "scan_slice" else node.outputs[0]
        return kernel_launch_time(ctx.cluster, graph.vars[stacked].shape[0])
    roots = kernel_roots(graph, getattr(ctx.cluster, "fused_attention", False))
    return kernel_seconds(ctx.cluster, node.id in roots)


_LOOP_SLICES = ("scan_slice", "scan_stack")  # `autopar.intra._scan`'s markers


def _layout_seconds(node: Node, graph: OpGraph, in_specs, ctx: CostContext) -> float:
    """Seconds the node's layout copies add on `ctx.cluster`: its backend's
    `layout_copies` of the node, each priced by `layout_copy_seconds` at its operand's
    bytes per device (`autopar.cost.backends`; 0 where the backend prices none, as on
    XLA:GPU, and for a node of another graph)."""
    backend = backend_for(ctx.cluster)
    if not backend.prices_layout_copies(ctx.cluster) or \
            len(graph.nodes) <= node.id or graph.nodes[node.id] is not node:
        return 0.0
    copies = []
    for copy in backend.layout_copies(graph, node):
        spec = in_specs[copy.operand]
        if spec is None:  # a constant
            continue
        var = graph.vars[node.inputs[copy.operand]]
        nbytes = bytes_per_device(var.shape, var.dtype, spec, ctx.mesh)
        copies.append((nbytes, copy.fan_in, copy.fused, copy.strided))
    return layout_copy_seconds(ctx.cluster, copies)


def _rate_dtype(node: Node, in_vars, out_vars) -> str:
    """The dtype whose FLOP rate the node runs at (`autopar.cost.rate_dtype`)."""
    result = out_vars[0].dtype if out_vars else "float32"
    return _rate_of(node.primitive, tuple(v.dtype for v in in_vars), result)


@memo("intra.rate_dtype", "(primitive, operand dtypes, result dtype)", maxsize=4096)
def _rate_of(primitive: str, operand_dtypes: tuple, result_dtype) -> str:
    """`rate_dtype`, memoised: a function of dtype names alone, asked once per node
    strategy list and follower spec list on every mesh (2,036 calls, 0.3 of the demo's
    17 profiled build seconds: `np.dtype` per operand; cProfile of
    `benchmarks.investigations.build_replay --row demo`)."""
    return rate_dtype(primitive, list(operand_dtypes), result_dtype)


def _divisible(shape, spec: Spec, mesh: LogicalMesh) -> bool:
    return all(size % mesh.axis_size(axes) == 0 for size, axes in zip(shape, spec) if axes)


def follower_candidates(node: Node, graph: OpGraph, sig: Signature) -> list[int]:
    """Operand indices a node could follow (empty if it must be planned on its own).

    A follower has no reductions and one result, and some array operand carries exactly
    the result's labelled dimensions (elementwise ops, converts, transposes, legal
    reshapes). Its split then fixes the whole node.
    """
    if sig.reductions or len(node.outputs) != 1:
        return []
    out_labels = {lab for lab in sig.outputs[0] if lab is not None}
    candidates = []
    for i, v in enumerate(node.inputs):
        var = graph.vars[v]
        labels = sig.inputs[i]
        if var.role is Role.CONST or len(var.shape) == 0 or labels is None:
            continue
        if {lab for lab in labels if lab is not None} == out_labels:
            candidates.append(i)
    return candidates


def strategy_costs(strategies: Sequence[Strategy]) -> np.ndarray:
    return np.array([s.cost for s in strategies], dtype=np.float64)
