"""From an `OpGraph` on one logical mesh to the numbers the ILP solver sees.

Every non-constant graph input is an ILP node whose strategies are its possible specs;
every graph node is an ILP node whose strategies come from its sharding rule. Edges carry
resharding costs from the producer's result spec to the consumer's operand spec. Nodes that
only follow their operand become solver followers. Donated state outputs are tied back to
their inputs by an edge, so that the state keeps one layout across steps.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autopar._memo import declare
from autopar.cluster import LogicalMesh, Spec, replicated, spec_axes
from autopar.cost import fused_attention_bytes, memory_budget
from autopar.cost.backends import backend_for
from autopar.graph import (
    OpGraph,
    Role,
    attention_core,
    dtype_itemsize,
    fusion_traffic,
    kernel_roots,
)
from autopar.intra._context import constrains, keep_strategies, score_vars, sequence_length
from autopar.intra._edges import build_edges, shared_specs
from autopar.intra._ilp import ShardingProblem
from autopar.intra._options import ShardOptions
from autopar.intra._registry import SHARDING_RULES
from autopar.intra._reshard import reshard_time, shared_reshard_cache
from autopar.intra._ring_strategies import (
    ring_core_nodes,
    ring_core_strategies,
    ring_dots,
    ring_strategies,
)
from autopar.intra._rules_annotations import ANNOTATION_PRIMITIVES, annotated_strategies
from autopar.intra._scan import SCAN_MARKERS, Expansion, expand_scans
from autopar.intra._strategies import (
    CostContext,
    Strategy,
    extra_strategy_key,
    follow_strategies,
    follower_candidates,
    input_strategies,
    node_signature,
    node_strategies,
    replicated_signature,
    step_effects,
)

# Identity primitives that take no decision of their own: results alias operands.
TRANSPARENT = frozenset({"layer_boundary", "grad_boundary"})


@dataclass
class IlpNode:
    """One decision of the ILP: a graph input (`var`) or a graph node (`node`)."""

    name: str
    strategies: list[Strategy]
    var: int | None = None
    node: int | None = None
    # The mesh memo's tuple `strategies` is a copy of, where it is one (`_add_operator_nodes`;
    # None otherwise): `autopar.intra._edges.shared_specs` memoises the spec lists read off
    # the strategies by it. (Not an argument: `dataclasses.replace` leaves it None.)
    origin: tuple | None = field(default=None, init=False, repr=False, compare=False)


@dataclass(frozen=True)
class Footprint:
    """Memory a graph's plan holds for the whole run, as the ILP's second memory limit
    (`ShardingProblem.footprint`), in bytes per device.

    - `held`: var id -> weight; the var counts at the layout its producer (or, for a graph
      input, its own decision) gives it, times the weight.
    - `unreduced`: var id -> weight, for results of summing operations kept as partial
      sums (deferred gradient reductions): the var counts at its producer's result layout
      without the mesh axes the producer sums over, times the weight.
    - `budget`: the limit; None computes the footprint without limiting it.
    - `peak_budget`: a lower limit on the peak memory than the options' budget, or None.
      A leaner memory level gives it the peak of the layer's fastest plan: a plan that
      holds less for the whole run by running replicated (activations whole on every
      device, so that gradients need no partial sums) is no leaner where it runs.
    - `price`: seconds per byte the objective pays for the footprint (a Lagrangian
      memory price, instead of or besides `budget`); 0: none. The plan's costs leave it
      out: it steers the choice only.
    """

    held: Mapping[int, float] = field(default_factory=dict)
    unreduced: Mapping[int, float] = field(default_factory=dict)
    budget: float | None = None
    peak_budget: float | None = None
    price: float = 0.0


@dataclass
class BuiltProblem:
    problem: ShardingProblem
    ilp_nodes: list[IlpNode]
    source_of: dict[int, tuple[int, int]]  # var id -> (ilp node index, result index)
    warnings: list[str] = field(default_factory=list)
    weights: dict[int, tuple[float, float]] = field(default_factory=dict)  # see build_problem
    # With scans opened (`_scan.py`): the planning graph the ILP is about, with the ties
    # of its carries; `graph` is None otherwise (the ILP is about the given graph).
    expansion: Expansion | None = None

    def weight(self, node_id: int | None) -> float:
        """The weight of a graph node's cost and of resharding its operands."""
        return self.weights[node_id][0] if node_id in self.weights else 1.0


def build_problem(
    graph: OpGraph,
    mesh: LogicalMesh,
    cluster,
    options: ShardOptions,
    tied: Sequence[tuple[int, int]] = (),
    fixed: Mapping[int, Spec] | None = None,
    weights: Mapping[int, tuple[float, float]] | None = None,
    footprint: Footprint | None = None,
    layout: Sequence[tuple] | None = None,
    operator_nodes=None,
) -> BuiltProblem:
    """Build the ILP for `graph` on `mesh`.

    **Arguments:**
    - `tied`: (output var, input var) pairs of state that must keep its layout across steps.
    - `fixed`: input var -> the only spec it may take (hand-written plans pin parameters
      and the batch this way; the ILP fills in the rest).
    - `weights`: node id -> (weight of its cost and its operands' resharding, extra weight
      of its own reduction collectives); absent nodes weigh (1, 1). A pipeline stage's
      layers are planned per microbatch, and the parts that run once per step (the
      optimizer update, deferred gradient reductions) weigh 1/microbatches
      (`autopar.inter.passes._deferred.step_weights`).
    - `footprint`: memory held for the whole run, limited besides the peak (a pipeline
      stage's view of one layer, `Footprint`).
    - `layout`: a `chosen_layout` of another graph of the same structure (the same layer
      traced at another microbatch size): every ILP node keeps only the strategy of those
      specs, so the problem has one choice and prices that layout on this graph's shapes
      (no edge matrix larger than 1 x 1). Raises `LayoutMismatch` when the nodes differ
      or this graph's shapes rule one of those strategies out.
    - `operator_nodes`: what adds the graph nodes' ILP nodes instead of
      `_add_operator_nodes` (same arguments and result; `autopar.intra._price_layout`
      gives each only its layout's strategy).
    """
    expansion = _expanded(graph, weights, tied) if options.open_scans else None
    if expansion is not None:  # the ILP is about the planning graph from here on
        graph, weights, tied = expansion.graph, expansion.weights, expansion.tied
    weights = dict(weights or {})
    effects = step_effects(graph, tied)
    ctx = CostContext(cluster, mesh, effects.combinable, effects.in_place,
                      options.moe_overlap, options.moe_dispatch,
                      shared_reshard_cache(mesh, cluster))
    ilp_nodes: list[IlpNode] = []
    source_of: dict[int, tuple[int, int]] = {}  # var -> (ILP node, output index)
    followers: dict[int, tuple[int, np.ndarray]] = {}
    _add_input_nodes(graph, ctx, options, dict(fixed or {}), ilp_nodes, source_of)
    add_nodes = _add_operator_nodes if operator_nodes is None else operator_nodes
    missing = add_nodes(graph, ctx, options, weights, ilp_nodes, source_of, followers)
    if layout is not None:
        _keep_layout(ilp_nodes, layout)
        followers = {}  # one strategy per node: nothing left to follow
    warnings = [
        f"no sharding rule for primitive '{prim}' ({count} node(s)): planned as replicated"
        for prim, count in sorted(missing.items())
    ]

    edges, edge_costs = build_edges(graph, ilp_nodes, source_of, tied, mesh, cluster, weights)
    node_costs = tuple(np.array([s.cost for s in n.strategies]) for n in ilp_nodes)
    node_memory = tuple(np.array([s.out_bytes for s in n.strategies]) for n in ilp_nodes)
    groups = _memory_groups(graph, ilp_nodes, source_of, options.num_memory_points,
                            getattr(cluster, "fused_attention", False))
    budget = memory_budget(cluster, options.memory_budget)
    problem = ShardingProblem(
        node_costs=node_costs,
        edges=tuple(edges),
        edge_costs=tuple(edge_costs),
        node_memory=node_memory,
        memory_groups=groups,
        memory_budget=budget,
        followers=followers,
        names=tuple(n.name for n in ilp_nodes),
        **_footprint(graph, mesh, ilp_nodes, source_of, footprint),
    )
    return BuiltProblem(problem, ilp_nodes, source_of, warnings, weights, expansion)


def _expanded(graph: OpGraph, weights, tied) -> Expansion | None:
    """`expand_scans` of `graph`, memoised per graph, weights and ties: the stage DP builds
    a layer's problem on many meshes, and one planning graph keeps its per-graph memos
    (`_node_facts`, fusion traffic, step effects, memory groups) warm across them (issue
    45: each build opened its scans into a new graph, and those memos missed)."""
    key = (tuple(sorted((weights or {}).items())), tuple(tied))
    by_key = _EXPANSIONS.setdefault(graph, {})
    if key not in by_key:
        by_key[key] = expand_scans(graph, weights, tied)
    return by_key[key]


# graph -> {(weights, ties): its Expansion or None}; dropped when the search ends.
_EXPANSIONS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.expansions",
    "graph -> {(weights, ties): expand_scans' Expansion}")


class LayoutMismatch(ValueError):
    """A `chosen_layout` that does not apply to the graph `build_problem` was given."""


def chosen_layout(built: BuiltProblem, choices: Sequence[int]) -> tuple:
    """What a solution of `built` chose, independent of shapes: per ILP node its kind
    (`_kind`) and the chosen strategy's operand and result specs (a node's strategies
    differ in these: `_dedupe`). `build_problem(..., layout=...)` applies it to a graph of
    the same structure."""
    return tuple(
        (_kind(node), (node.strategies[c].in_specs, node.strategies[c].out_specs))
        for node, c in zip(built.ilp_nodes, choices)
    )


def _kind(node: IlpNode) -> str:
    """What the node is, without the ids and paths it carries: another trace of the same
    graph numbers its variables and equations from elsewhere, and a layer of the same
    structure reads other parameters (``layers/1/...`` against ``layers/24/...``)."""
    return "input" if node.node is None else node.name.rsplit(" #", 1)[0]


def _keep_layout(ilp_nodes: list[IlpNode], layout: Sequence[tuple]) -> None:
    """Each node's strategies cut to the one `layout` names (`chosen_layout`)."""
    if len(layout) != len(ilp_nodes):
        raise LayoutMismatch(
            f"the layout has {len(layout)} ILP nodes and this graph {len(ilp_nodes)}"
        )
    for node, (kind, specs) in zip(ilp_nodes, layout):
        if _kind(node) != kind:
            raise LayoutMismatch(f"the layout's {kind!r} node is {node.name!r} here")
        kept = [s for s in node.strategies if (s.in_specs, s.out_specs) == specs]
        if not kept:
            raise LayoutMismatch(f"{node.name}: this graph's shapes rule out {specs}")
        node.strategies, node.origin = kept[:1], None


def layout_choices(built: BuiltProblem, layout: Sequence[tuple]) -> tuple[int, ...]:
    """The strategy index per ILP node of `built` (a problem built without a layout) that
    `build_problem(..., layout=layout)` keeps (`_keep_layout`: each node's first strategy
    of the layout's specs), so that a layout is priced on a problem built once for every
    layout (and for the ILP) of the graph on that mesh. Raises `LayoutMismatch` as
    `build_problem` does."""
    if len(layout) != len(built.ilp_nodes):
        raise LayoutMismatch(
            f"the layout has {len(layout)} ILP nodes and this graph {len(built.ilp_nodes)}"
        )
    choices = []
    for node, (kind, specs) in zip(built.ilp_nodes, layout):
        if _kind(node) != kind:
            raise LayoutMismatch(f"the layout's {kind!r} node is {node.name!r} here")
        index = next((i for i, s in enumerate(node.strategies)
                      if (s.in_specs, s.out_specs) == specs), None)
        if index is None:
            raise LayoutMismatch(f"{node.name}: this graph's shapes rule out {specs}")
        choices.append(index)
    return tuple(choices)


def ilp_inputs(graph: OpGraph) -> list[int]:
    """The graph inputs that get an ILP node, in the ILP's order (`_add_input_nodes`):
    each non-constant input once."""
    return list(dict.fromkeys(v for v in graph.invars if graph.vars[v].role is not Role.CONST))


def passed_on(node, source_of) -> bool:
    """Whether `node` is an identity marker (`TRANSPARENT`) that gets no ILP node: each of
    its results takes its operand's source where that has one (`source_of`, var -> source,
    updated here), and every result then has one. False for any other node.
    `OperatorWalk` and `autopar.inter._one_row` walk the ILP's operators by this rule."""
    if node.primitive not in TRANSPARENT:
        return False
    for v_in, v_out in zip(node.inputs, node.outputs):
        if v_in in source_of:
            source_of[v_out] = source_of[v_in]
    return all(v in source_of for v in node.outputs)


def _add_input_nodes(graph, ctx, options, fixed, ilp_nodes, source_of) -> None:
    """One ILP node per non-constant input (`ilp_inputs`): its layouts (pinned ones only
    when `fixed`)."""
    for v in ilp_inputs(graph):
        var = graph.vars[v]
        strategies = input_strategies(var, ctx)
        if v in fixed:
            strategies = _pin(var, strategies, fixed[v], ctx.mesh)
        else:
            strategies = _restrict_input(var, strategies, ctx.mesh, options)
        source_of[v] = (len(ilp_nodes), 0)
        ilp_nodes.append(IlpNode(var.path or f"input {v}", strategies, var=v))


def _add_operator_nodes(graph, ctx, options, weights, ilp_nodes, source_of, followers):
    """One ILP node per equation (identity markers pass their operand's node on), with
    its strategies from the rule registry, weighted per `weights`, cut to those
    `options.context_parallel` allows (`autopar.intra._context`; a cut that leaves none
    raises its `ContextParallelError`).
    **Returns:** primitive -> count of equations without a rule (planned replicated)."""
    walk = OperatorWalk(graph, ctx, options, weights, source_of)
    memo = shared_reshard_cache(ctx.mesh, ctx.cluster)
    specs_of: dict[tuple[int, int], tuple[Spec, ...]] = {}

    def out_specs(u: int, k: int) -> tuple[Spec, ...]:
        found = specs_of.get((u, k))
        if found is None:
            found = specs_of[u, k] = shared_specs(memo, ilp_nodes[u], "out", k)
        return found

    for node, sig, key, candidates, extra, annotated, cut in walk:
        index = len(ilp_nodes)
        strategies = None
        if options.merge_followers and not annotated and not cut:
            strategies = _as_follower(node, graph, sig, key, candidates, extra, ctx, memo,
                                      ilp_nodes, source_of, out_specs, followers)
        if strategies is None:
            okey = own_key(node, graph, key, extra, ctx)
            strategies = memo.get(okey)
            if strategies is None:
                # the same node under other weights has the same strategies unweighted
                rkey = ("own raw", key, *okey[3:])
                found = memo.get(rkey)
                if found is None:
                    found = memo[rkey] = tuple(node_strategies(node, graph, sig, ctx))
                strategies = memo[okey] = _finished(found, extra)
        strategies = walk.cut_strategies(node, strategies, annotated, cut)
        for k, v in enumerate(node.outputs):
            source_of[v] = (index, k)
        ilp_node = IlpNode(f"{node.primitive} #{node.id}", list(strategies), node=node.id)
        if type(strategies) is tuple:  # the memo's (a cut makes a list of its own)
            ilp_node.origin = strategies
        ilp_nodes.append(ilp_node)
    return walk.missing


class OperatorWalk:
    """The graph's operator nodes in order, as `_add_operator_nodes` (and a layout priced
    node by node, `autopar.intra._price_layout`) takes them: identity markers pass their
    operand's ILP node on in `source_of` and are skipped where every result has one;
    each other node is yielded as (node, signature, key, follower candidates, extra,
    annotated, cut) from `_node_facts`, with its primitive counted in `missing` when no
    rule has it. `extra` is what its strategies depend on besides `key` (the node up to
    its ids): its weights, and whether it is a scan marker. `annotated`: a sharding
    annotation `options.annotations` does not ignore; `cut`: its strategies are cut by
    the forced context parallelism or the ring (`cut_strategies`)."""

    def __init__(self, graph: OpGraph, ctx: CostContext, options: ShardOptions, weights,
                 source_of: dict):
        self.graph, self.ctx, self.options = graph, ctx, options
        self.weights, self.source_of = weights, source_of
        self.missing: dict[str, int] = {}
        cp_mode = options.context_parallel
        self.seq_len = None if cp_mode == "auto" else sequence_length(graph)
        self.score_ids = (frozenset(score_vars(graph)) if self.seq_len is not None
                          else frozenset())
        # the ring's dots (`_ring_strategies`): their strategies get ring twins
        self.ring = ring_dots_of(graph) if cp_mode in ("auto", "ring") else {}
        # and under "ring" the rest of each attention it runs skips the masked blocks too
        self.ring_core = ring_core_nodes(self.ring) if cp_mode == "ring" else {}
        self.facts = _node_facts(graph, getattr(ctx.cluster, "fused_attention", False))

    def __iter__(self):
        graph, options, source_of = self.graph, self.options, self.source_of
        cp_mode = options.context_parallel
        for node in graph.nodes:
            if passed_on(node, source_of):
                continue  # an identity marker: each result is its operand, same layout
            sig, key, has_rule, candidates = self.facts[node.id]
            if not has_rule:
                self.missing[node.primitive] = self.missing.get(node.primitive, 0) + 1
            extra = (self.weights.get(node.id), node.primitive in SCAN_MARKERS)
            annotated = (node.primitive in ANNOTATION_PRIMITIVES
                         and options.annotations != "ignore")
            # (a scan's slice and stack markers move a layer's values in and out whole)
            cut = node.primitive not in SCAN_MARKERS and (
                constrains(node, graph, cp_mode, self.seq_len, self.score_ids)
                or node.id in self.ring or node.id in self.ring_core)
            yield node, sig, key, candidates, extra, annotated, cut

    def cut_strategies(self, node, strategies, annotated: bool, cut: bool):
        """`cut_strategies` of `node` with this walk's context parallelism and ring."""
        return cut_strategies(node, self.graph, strategies, annotated, cut, self.ring,
                              self.ring_core, self.ctx, self.options, self.seq_len,
                              self.score_ids)


def ring_dots_of(graph: OpGraph) -> dict:
    """`ring_dots(graph, sequence_length(graph))`, memoised per graph (read only)."""
    found = _RING_DOTS.get(graph)
    if found is None:
        found = _RING_DOTS[graph] = ring_dots(graph, sequence_length(graph))
    return found


# graph -> its `ring_dots`; forgets graphs nothing else holds.
_RING_DOTS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.ring_dots", "graph -> ring_dots")


def cut_strategies(node, graph, strategies, annotated: bool, cut: bool, ring, ring_core, ctx,
                   options: ShardOptions, seq_len, score_ids):
    """A node's listed strategies as the sharding annotation (`_annotated`), the forced
    context parallelism (`keep_strategies`) and the ring (`ring_strategies`,
    `ring_core_strategies`) leave them, where they apply to it."""
    if annotated:
        strategies = _annotated(node, graph, strategies, ctx, options)
    if cut:
        strategies = keep_strategies(node, graph, list(strategies), options.context_parallel,
                                     seq_len, score_ids, ctx.mesh)
    if node.id in ring:
        role, roles = ring[node.id]
        strategies = ring_strategies(node, graph, role, roles, list(strategies), ctx,
                                     forced=options.context_parallel == "ring")
    elif node.id in ring_core:
        strategies = ring_core_strategies(node, ring_core[node.id], list(strategies),
                                          ctx.mesh)
    return strategies


def _as_follower(node, graph, sig, key, candidates, extra, ctx, memo, ilp_nodes, source_of,
                 out_specs, followers):
    """The strategies of `node` as a follower of its leader's result (`_leader`,
    `follow_strategies`, memoised in `memo`), its entry added to `followers`; None when
    it has no leader or cannot follow it."""
    leader = _leader(node, graph, candidates, ilp_nodes, source_of)
    if leader is None:
        return None
    main, u, k = leader
    specs = out_specs(u, k)
    context = _context_key(node, graph, ctx)
    fkey = follow_key(key, main, specs, extra, ctx, context)
    strategies = memo.get(fkey)
    if strategies is None:
        # per leader spec, shared by leaders' other spec lists and by other weights
        per_spec = memo.setdefault(
            ("follow spec", key, main, ctx.moe_overlap, ctx.moe_dispatch, context), {})
        found = follow_strategies(node, graph, sig, main, specs, ctx, per_spec)
        strategies = memo[fkey] = (
            _CANNOT_FOLLOW if found is None else _finished(found, extra)
        )
    if strategies is _CANNOT_FOLLOW:
        return None
    followers[len(ilp_nodes)] = (u, np.arange(len(specs)))
    return strategies


def _annotated(node, graph, strategies, ctx, options):
    """A sharding annotation's strategies under `options.annotations` ("keep" or "hint";
    `annotated_strategies`), a resharding of its result priced by `reshard_time`."""
    var = graph.vars[node.outputs[0]]

    def reshard_seconds(src, dst, var=var):
        return reshard_time(var.shape, var.dtype, src, dst, ctx.mesh, ctx.cluster)

    return annotated_strategies(node, var, list(strategies), ctx.mesh, options.annotations,
                                reshard_seconds)


def own_key(node, graph: OpGraph, key, extra, ctx: CostContext) -> tuple:
    """The mesh memo's key of a node's own strategies (`_add_operator_nodes`): its
    `_node_facts` key, weights (`extra`), the MoE options, what its primitive's extra
    strategies read (`extra_strategy_key`) and its context in the step (`_context_key`)."""
    return ("own", key, extra, ctx.moe_overlap, ctx.moe_dispatch,
            extra_strategy_key(node, graph, ctx), _context_key(node, graph, ctx))


def follow_key(key, main: int, specs, extra, ctx: CostContext, context: tuple) -> tuple:
    """The mesh memo's key of a follower's strategies (`_as_follower`) for its leader's
    spec list `specs` (operand `main`), given its `_context_key` `context`."""
    return ("follow", key, main, specs, extra, ctx.moe_overlap, ctx.moe_dispatch, context)


def _context_key(node, graph: OpGraph, ctx: CostContext) -> tuple:
    """What a node's strategies read of its graph and step beyond `_node_facts`' key, for
    the memos that share them between nodes of other weights and leaders' other spec
    lists: whether it writes donated state in place or its reductions combine
    (`step_effects`), whether it is a kernel root and which of its results lie inside a
    fused attention kernel (read only where the cluster prices kernels or fuses
    attention), and the layout copies its backend prices."""
    cluster = ctx.cluster
    fused = getattr(cluster, "fused_attention", False)
    core = attention_core(graph) if fused else frozenset()
    roots = (kernel_roots(graph, fused) if getattr(cluster, "kernel_overhead", 0.0)
             else frozenset())
    backend = backend_for(cluster)
    copies = (tuple(backend.layout_copies(graph, node))
              if backend.prices_layout_copies(cluster) else ())
    return (node.id in ctx.in_place, node.id in ctx.combinable, node.id in roots,
            tuple(v in core for v in node.outputs), copies)


# Memoised for a node that cannot follow its leader (`follow_strategies` gave None).
_CANNOT_FOLLOW = object()


def _finished(strategies: list[Strategy], extra) -> tuple[Strategy, ...]:
    """`strategies` with the node's weights applied.

    A scan marker moves no bytes of its own (`autopar.graph.fusion_traffic` puts it on
    the loop's boundary) and launches no kernel (`kernel_roots`): its compute is only
    what its backend charges for the loop's slices (XLA:CPU copies every iteration's
    slice of a stacked operand, `autopar.cost.backends._xla_cpu.scan_slice_copies`;
    XLA:GPU reads them in place: 0)."""
    weight, _ = extra
    if weight is not None:
        strategies = [_weighted(s, *weight) for s in strategies]
    return tuple(strategies)


def _node_facts(graph: OpGraph, fused_attention: bool):
    """Per node id: (signature, key, has a rule, (operand, its bytes) of each operand it
    could follow).

    The key holds everything the node's strategies depend on besides the mesh and the
    cluster (`node_strategies`, `follow_strategies`): primitive, signature, operand and
    result shapes and dtypes, which operands are constants, FLOPs and which bytes cross
    its fusion's boundary. Nodes of equal keys (the same operation in every layer, the
    forward and backward elementwise ops of one shape) share their strategies through the
    mesh's memo (issue 18: enumerating strategies was a third of the demo's planning).
    The same on every mesh, so computed once per graph. The key is given as its token
    (`_key_token`): the memos' keys hold it and hash an int, not the key's nested tuples,
    on every lookup of every build."""
    # The rules looked up (a rule registered later makes other signatures).
    rules = tuple(
        (p, SHARDING_RULES.get(p)) for p in sorted({n.primitive for n in graph.nodes})
    )
    cache_key = (fused_attention, len(graph.nodes), rules)
    by_key = _NODE_FACTS.setdefault(graph, {})
    if cache_key not in by_key:
        traffic = fusion_traffic(graph, fused_attention)
        facts = []
        for node in graph.nodes:
            sig = node_signature(node, graph)
            has_rule = sig is not None
            if sig is None:
                sig = replicated_signature(node, graph)
            in_vars = [graph.vars[v] for v in node.inputs]
            key = (
                node.primitive,
                sig.inputs, sig.outputs, tuple(sorted(sig.reductions.items())),
                tuple((tuple(v.shape), v.dtype, v.role is Role.CONST) for v in in_vars),
                tuple((tuple(graph.vars[v].shape), graph.vars[v].dtype) for v in node.outputs),
                node.flops,
                traffic.reads.get(node.id), traffic.writes.get(node.id),
            )
            key = _key_token(key)
            candidates = tuple((i, _nbytes(graph.vars[node.inputs[i]]))
                               for i in follower_candidates(node, graph, sig))
            facts.append((sig, key, has_rule, candidates))
        by_key[cache_key] = facts
    return by_key[cache_key]


# graph -> {(fused attention, node count, rules): per-node facts}; forgets graphs nothing
# else holds.
_NODE_FACTS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.node_facts",
    "graph -> {(fused attention, node count, rules): per-node facts}")


def _key_token(key: tuple) -> int:
    """An int that stands for a node's `_node_facts` key: equal keys get one token, and a
    token is never given to another key (a counter, never reset: a key seen again after
    the table was dropped gets a new token, which the memos only miss). Hashing a key's
    nested tuples took 5.5 us (tiny GPT's nodes, `timeit`), and the memos of a node's
    strategies (`own_key`, `follow_key`) hashed it on every lookup of every build."""
    token = _KEY_TOKENS.get(key)
    if token is None:
        token = _KEY_TOKENS[key] = next(_KEY_COUNTER)
    return token


# Node keys -> their tokens; dropped when the search ends, as the node facts are.
_KEY_COUNTER = itertools.count()
_KEY_TOKENS: dict[tuple, int] = declare(
    {}, "intra.node_key_tokens", "a node's _node_facts key -> its token")


def _nbytes(var) -> int:
    """`var.nbytes` (a graph variable's bytes), without numpy's per-call overhead."""
    return math.prod(var.shape) * dtype_itemsize(var.dtype)


def _leader(node, graph, candidates, ilp_nodes, source_of):
    """(operand, ILP node, result index) that `node` follows, or None.

    Among the operands that fix the whole node, follow the largest one computed by
    another node (graph inputs keep their own decision)."""
    best = None
    for i, nbytes in candidates:
        leader = source_of.get(node.inputs[i])
        if leader is None or ilp_nodes[leader[0]].node is None:
            continue
        if best is None or nbytes > best[0]:
            best = (nbytes, i, leader)
    if best is None:
        return None
    _, main, (u, k) = best
    return main, u, k


def _weighted(
    strategy: Strategy, weight: float, reduction_weight: float, exposed: float = 1.0
) -> Strategy:
    """`exposed`: the share of the reduction collectives' time not hidden under compute
    (`autopar.cost.hideable_weight`); their counts stay whole."""
    return Strategy(  # (not `dataclasses.replace`: a tenth of the cost, issue 45)
        strategy.name, strategy.in_specs, strategy.out_specs,
        weight * strategy.compute_cost,
        weight * reduction_weight * exposed * strategy.comm_cost,
        strategy.out_bytes,
        tuple(replace(c, weight=c.weight * weight * reduction_weight)
              for c in strategy.collectives),
    )


def _pin(var, strategies: list[Strategy], spec: Spec, mesh: LogicalMesh) -> list[Strategy]:
    spec = tuple(tuple(axes) for axes in spec)
    chosen = [s for s in strategies if s.out_specs[0] == spec]
    if not chosen:
        raise ValueError(
            f"cannot give {var.path or 'input'} of shape {var.shape} the spec {spec} on mesh "
            f"{dict(zip(mesh.axis_names, mesh.shape))}: every split dimension must be "
            "divisible by the product of its mesh axis sizes, and each axis used once. "
            "Choose a spec that divides the shape, or another mesh shape."
        )
    return chosen


def _restrict_input(var, strategies: list[Strategy], mesh: LogicalMesh, options: ShardOptions):
    """Apply the method's constraints to the specs a graph input may take."""
    method = options.method
    if method == "shard":
        return strategies
    all_axes = {a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1}

    def full(s: Strategy) -> bool:
        return set(spec_axes(s.out_specs[0])) == all_axes

    if var.role is Role.BATCH:
        data = [
            s for s in strategies
            if full(s) and all(not axes for axes in s.out_specs[0][1:])
            and s.out_specs[0] and list(s.out_specs[0][0]) == [a for a in mesh.axis_names
                                                                 if a in all_axes]
        ]
        return data or strategies[:1]
    sharded_roles = {"data": (), "zero2": (Role.OPT_STATE,), "zero3": (Role.OPT_STATE, Role.PARAM)}
    if var.role in sharded_roles[method]:
        fully = [s for s in strategies if full(s)]
        return fully or strategies
    return strategies[:1]  # replicated


def _memory_groups(graph: OpGraph, ilp_nodes, source_of, num_points: int,
                   fused_attention: bool = False):
    """Groups of ILP nodes live together at the program points with the most live bytes.

    Graph inputs are live throughout; an activation is live from its producer to its last
    consumer (a liveness estimate in program order); with `fused_attention`, a value
    inside the fused attention kernel (`attention_core`) weighs its per-row statistics
    (`fused_attention_bytes`) in choosing the points. The same on every mesh (it reads
    sizes of whole tensors and which ILP node makes each), so computed once per graph and
    numbering of the ILP nodes (the stage DP builds a layer's problem on many meshes).
    """
    if num_points <= 0:
        return ()
    key = (num_points, tuple(sorted(source_of.items())), fused_attention)
    by_key = _MEMORY_GROUPS.setdefault(graph, {})
    if key not in by_key:
        by_key[key] = _live_groups(graph, source_of, num_points, fused_attention)
    return by_key[key]


# graph -> {(points, ILP node of each var): groups}; forgets graphs nothing else holds.
_MEMORY_GROUPS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.memory_groups",
    "graph -> {(points, ILP node of each var): groups}")


def _live_groups(graph: OpGraph, source_of, num_points: int, fused_attention: bool = False):
    core = attention_core(graph) if fused_attention else frozenset()

    def nbytes(v: int) -> float:
        var = graph.vars[v]
        return fused_attention_bytes(var.shape, None, None) if v in core else _nbytes(var)

    last_use = {}
    for node in graph.nodes:
        for v in node.inputs:
            last_use[v] = node.id
    for v in graph.outvars:
        last_use[v] = len(graph.nodes)
    inputs = tuple(sorted({source_of[v][0] for v in graph.invars if v in source_of}))
    live: dict[int, int] = {}  # var -> ilp node
    live_bytes = 0
    points: list[tuple[float, int, tuple[int, ...]]] = []
    for node in graph.nodes:
        for v in node.outputs:
            if v in last_use:
                live[v] = source_of[v][0]
                live_bytes += nbytes(v)
        points.append((live_bytes, node.id, tuple(sorted(set(live.values())))))
        for v in set(node.inputs) | set(node.outputs):
            if v in live and last_use.get(v, -1) <= node.id:
                del live[v]
                live_bytes -= nbytes(v)
    points.sort(key=lambda p: (-p[0], p[1]))
    groups = []
    for _, _, members in points[:num_points]:
        groups.append(tuple(sorted(set(inputs) | set(members))))
    return tuple(dict.fromkeys(groups)) or (inputs,)


def _footprint(graph: OpGraph, mesh, ilp_nodes, source_of, footprint: Footprint | None) -> dict:
    """`ShardingProblem` arguments of a `Footprint`: bytes per node per strategy."""
    if footprint is None:
        return {}
    from autopar.cost import bytes_per_device

    vectors = [np.zeros(len(n.strategies)) for n in ilp_nodes]
    for unreduced, counted in ((False, footprint.held), (True, footprint.unreduced)):
        for v, weight in counted.items():
            if v not in source_of or not graph.vars[v].shape:
                continue
            var = graph.vars[v]
            index, k = source_of[v]
            ilp_node = ilp_nodes[index]
            node = graph.nodes[ilp_node.node] if unreduced and ilp_node.node is not None else None
            for j, strategy in enumerate(ilp_node.strategies):
                spec = strategy.out_specs[k]
                if node is not None:
                    axes = summed_axes(
                        node,
                        lambda n, p, s=strategy: s.in_specs[p]
                        or replicated(len(graph.vars[n.inputs[p]].shape)),
                    )
                    spec = unstacked_spec(spec, tuple(axes))
                vectors[index][j] += weight * bytes_per_device(var.shape, var.dtype, spec, mesh)
    return {"footprint": tuple(vectors), "footprint_budget": footprint.budget}


def summed_axes(node, spec_of) -> set[str]:
    """Mesh axes split over the dimensions `node` sums (empty: no partial sums)."""
    if node.primitive == "dot_general":
        (lhs_contract, rhs_contract), _ = node.params["dimension_numbers"]
        lhs = {a for d in lhs_contract for a in spec_of(node, 0)[d]}
        rhs = {a for d in rhs_contract for a in spec_of(node, 1)[d]}
        return lhs if lhs == rhs else set()
    if node.primitive == "reduce_sum":
        return {a for d in node.params["axes"] for a in spec_of(node, 0)[d]}
    return set()


def unstacked_spec(spec: Spec, axes: tuple[str, ...]) -> Spec:
    """The spec of one partial sum in a stack over `axes`: `spec` without those axes."""
    return tuple(tuple(a for a in dim if a not in axes) for dim in spec)
