"""A layout priced on a graph without building the graph's whole problem (issue 45).

`price_layout` (`autopar.intra._planner`) prices a layout chosen for another graph of the
same structure (`chosen_layout`: the same layer traced at another microbatch count) on
this graph's shapes. The problem it reads that layout from holds one strategy per ILP
node: per operator node the strategy of the whole problem's strategy list (`build_problem`
without a layout) that has the layout's operand and result specs, and per edge the 1 x 1
resharding entry between the chosen specs. This module builds those strategies without
the whole lists:

- a node planned on its own costs only the label assignments whose operand specs are the
  layout's (`enumerate_assignments` filtered by `_specs_under` before any costing); its
  whole list is known by its specs alone, which is what a follower of it needs;
- a follower (`follow_strategies`) costs only the leader spec the layout takes; whether
  it follows at all (every spec its leader may give it carries through) is decided on
  the leader's specs, without costing;
- sharding annotations, context-parallel cuts, the ring's nodes and primitives with extra
  strategies (`EXTRA_STRATEGIES`: the MoE grouped GEMMs) are built whole, as before, and
  the layout's strategy read out of them.

Every strategy kept is the one the whole problem holds (the same functions on the same
arguments, the cheapest of equal specs as `_dedupe` keeps it), so the priced plan's cost,
peak, footprint and choices are those of pricing on the whole problem
(tests/test_price_layout.py compares the two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.cluster import Spec
from autopar.graph import OpGraph
from autopar.intra._options import ShardOptions
from autopar.intra._problem import (
    _CANNOT_FOLLOW,
    BuiltProblem,
    Footprint,
    IlpNode,
    LayoutMismatch,
    OperatorWalk,
    _context_key,
    _finished,
    _leader,
    build_problem,
    follow_key,
    own_key,
)
from autopar.intra._reshard import shared_reshard_cache
from autopar.intra._signature import enumerate_assignments, reduced_axes
from autopar.intra._strategies import (
    EXTRA_STRATEGIES,
    _assignment_strategies,
    _carried_labels,
    _dedupe,
    _divisible,
    _rate_dtype,
    _specs_under,
    follow_strategies,
    node_strategies,
)

Pair = tuple  # (operand specs, result specs) of one strategy


def layout_problem(
    graph: OpGraph,
    mesh,
    cluster,
    options: ShardOptions,
    tied: Sequence[tuple[int, int]],
    weights: Mapping[int, tuple[float, float]] | None,
    footprint: Footprint | None,
    layout: Sequence[tuple],
) -> tuple[BuiltProblem, bool]:
    """(`build_problem(..., layout=layout)`, whether every follower of the whole problem
    takes its leader's strategy under the layout) with each node's strategy found as the
    module docstring says. Raises `LayoutMismatch` where `build_problem` does. The flag
    tells which problem pricing on the whole problem reads the layout from: with it, the
    whole problem (under the footprint's peak limit, `_built_problem`); without it, one
    built for the layout (`price_layout`)."""
    nodes = _LayoutNodes(layout)
    # (`build_problem` opens the graph's scans once per graph, `_expanded`)
    built = build_problem(graph, mesh, cluster, options, tied, None, weights, footprint,
                          layout=layout, operator_nodes=nodes)
    return built, nodes.agree




class _LayoutNodes:
    """`_add_operator_nodes` for `build_problem`'s `operator_nodes` hook, each node given
    only the layout's strategy; `agree` turns False when a follower's first strategy of
    the layout's specs is not at its leader's index in the whole problem."""

    def __init__(self, layout: Sequence[tuple]):
        self.layout = layout
        self.agree = True

    def __call__(self, graph, ctx, options, weights, ilp_nodes, source_of, followers):
        layout = self.layout
        walk = OperatorWalk(graph, ctx, options, weights, source_of)
        memo = shared_reshard_cache(ctx.mesh, ctx.cluster)
        # Per ILP node: the (operand, result) specs of every strategy the whole problem
        # lists, in its order (None for graph inputs: they lead no follower), and the
        # index the layout picks there.
        pairs: list[tuple[Pair, ...] | None] = [None] * len(ilp_nodes)
        picked: list[int] = [0] * len(ilp_nodes)
        for node, sig, key, candidates, extra, annotated, cut in walk:
            index = len(ilp_nodes)
            name = f"{node.primitive} #{node.id}"
            if index >= len(layout):
                raise LayoutMismatch(
                    f"the layout has {len(layout)} ILP nodes and this graph more")
            kind, specs = layout[index]
            if name.rsplit(" #", 1)[0] != kind:
                raise LayoutMismatch(f"the layout's {kind!r} node is {name!r} here")
            found = None
            if options.merge_followers and not annotated and not cut:
                found = self._follower(node, graph, sig, key, candidates, extra, ctx, memo,
                                       ilp_nodes, source_of, pairs, picked, specs)
            if found is None:
                okey = own_key(node, graph, key, extra, ctx)
                whole = memo.get(okey)
                if (whole is None and not annotated and not cut
                        and node.primitive not in EXTRA_STRATEGIES):
                    found = _own(node, graph, sig, key, okey, extra, ctx, memo, specs)
                else:
                    if whole is None:
                        whole = memo[okey] = _finished(node_strategies(node, graph, sig, ctx),
                                                       extra)
                    found = _special(node, walk, whole, annotated, cut, specs)
            node_pairs, i, strategy = found
            for k, v in enumerate(node.outputs):
                source_of[v] = (index, k)
            pairs.append(node_pairs)
            picked.append(i)
            ilp_nodes.append(IlpNode(name, [strategy], node=node.id))
        return walk.missing

    def _follower(self, node, graph, sig, key, candidates, extra, ctx, memo, ilp_nodes,
                  source_of, pairs, picked, specs):
        """(the node's whole problem's pairs, the layout's index there, its strategy) as
        a follower of its leader (`_as_follower`), or None when it is planned on its own
        there."""
        leader = _leader(node, graph, candidates, ilp_nodes, source_of)
        if leader is None:
            return None
        main, u, k = leader
        leader_specs = tuple(p[1][k] for p in pairs[u])
        context = _context_key(node, graph, ctx)
        fkey = follow_key(key, main, leader_specs, extra, ctx, context)
        whole = memo.get(fkey)
        if whole is _CANNOT_FOLLOW:
            return None
        if whole is not None:
            node_pairs = tuple((s.in_specs, s.out_specs) for s in whole)
            i = _first(node_pairs, specs, node)
            strategy = whole[i]
        else:
            node_pairs = _follower_pairs(node, graph, sig, main, leader_specs, ctx.mesh, memo,
                                         key)
            if node_pairs is None:
                return None
            i = _first(node_pairs, specs, node)
            one = ("follow one", *follow_key(key, main, leader_specs[i], extra, ctx,
                                             context)[1:])
            strategy = memo.get(one)
            if strategy is None:
                found = follow_strategies(node, graph, sig, main, (leader_specs[i],), ctx)
                strategy = memo[one] = _finished(found, extra)[0]
        if i != picked[u]:
            self.agree = False
        return node_pairs, i, strategy


def _first(node_pairs: Sequence[Pair], specs: Pair, node) -> int:
    """The index of the first of `node_pairs` equal to `specs` (`_keep_layout`)."""
    for i, pair in enumerate(node_pairs):
        if pair == specs:
            return i
    raise LayoutMismatch(
        f"{node.primitive} #{node.id}: this graph's shapes rule out {specs}")


def _special(node, walk: OperatorWalk, whole, annotated: bool, cut: bool, specs):
    """A node whose strategies `_add_operator_nodes` cuts or extends after listing them
    (annotations, context parallelism, the ring), or whose list is memoised already:
    built whole, the layout's strategy read out."""
    strategies = walk.cut_strategies(node, whole, annotated, cut)
    node_pairs = tuple((s.in_specs, s.out_specs) for s in strategies)
    i = _first(node_pairs, specs, node)
    return node_pairs, i, strategies[i]


def _own(node, graph, sig, key, okey, extra, ctx, memo, specs):
    """A node planned on its own: its whole list's pairs (`_own_pairs`) and the strategy
    `node_strategies` keeps for the layout's pair, costing only the assignments of the
    layout's operand specs."""
    node_pairs, assignments = _own_pairs(node, graph, sig, key, ctx.mesh, memo)
    i = _first(node_pairs, specs, node)
    one = ("own one", okey, specs)
    strategy = memo.get(one)
    if strategy is None:
        in_vars = [graph.vars[v] for v in node.inputs]
        out_vars = [graph.vars[v] for v in node.outputs]
        dtype = _rate_dtype(node, in_vars, out_vars)
        costed = []
        for assignment, in_specs in assignments:
            if in_specs == specs[0]:
                costed.extend(s for s in _assignment_strategies(
                    node, graph, sig, ctx, assignment, in_vars, out_vars, dtype)
                    if (s.in_specs, s.out_specs) == specs)
        kept = _dedupe(costed)  # the cheapest of these specs, the first of equal costs
        strategy = memo[one] = _finished(kept, extra)[0]
    return node_pairs, i, strategy


def _own_pairs(node, graph, sig, key, mesh, memo):
    """The (operand, result) specs of `node_strategies`' list, in its order (its
    assignments' strategies, each followed by its reduce-scatter variant, deduplicated),
    and each assignment with its operand specs; found without costing any."""
    pkey = ("own pairs", key)
    found = memo.get(pkey)
    if found is not None:
        return found
    in_vars = [graph.vars[v] for v in node.inputs]
    out_vars = [graph.vars[v] for v in node.outputs]
    carried = _carried_labels(sig, in_vars)
    listed: list[Pair] = []
    assignments = []
    for assignment in enumerate_assignments(
            sig, [v.shape for v in in_vars], [v.shape for v in out_vars], mesh):
        if not carried.issuperset(assignment):
            continue
        in_specs, out_specs = _specs_under(sig, assignment, in_vars, out_vars)
        assignments.append((assignment, in_specs))
        listed.append((in_specs, out_specs))
        partial = reduced_axes(sig, assignment)
        if partial and len(out_vars) == 1 and set(partial) == {"sum"}:
            scattered = _scattered_spec(out_specs[0], out_vars[0].shape,
                                        mesh.axis_size(partial["sum"]), partial["sum"])
            if scattered is not None:
                listed.append((in_specs, (scattered,)))
    found = memo[pkey] = (tuple(dict.fromkeys(listed)), tuple(assignments))
    return found


def _scattered_spec(out_spec: Spec, shape, split: int, axes) -> Spec | None:
    """The result spec of `_reduce_scatter_variants`' one variant: the summed result
    split over the reduced `axes` along its first free dimension that `split` divides."""
    for dim, (size, dim_axes) in enumerate(zip(shape, out_spec)):
        if dim_axes or size % split:
            continue
        return tuple(tuple(axes) if d == dim else s for d, s in enumerate(out_spec))
    return None


def _follower_pairs(node, graph, sig, main, leader_specs, mesh, memo, key):
    """The (operand, result) specs of `follow_strategies`' list for `leader_specs`, or
    None where it gives None (some spec cannot be carried through); found without
    costing any, each distinct spec once per node key and mesh."""
    fkey = ("follow pairs", key, main, leader_specs)
    found = memo.get(fkey, _UNKNOWN)
    if found is not _UNKNOWN:
        return found
    by_spec = memo.get(("follow pair", key, main))
    if by_spec is None:
        by_spec = memo[("follow pair", key, main)] = {}
    result = []
    for spec in leader_specs:
        pair = by_spec.get(spec, _UNKNOWN)
        if pair is _UNKNOWN:
            pair = by_spec[spec] = _follower_pair(node, graph, sig, main, spec, mesh)
        if pair is None:
            result = None
            break
        result.append(pair)
    found = memo[fkey] = None if result is None else tuple(result)
    return found


def _follower_pair(node, graph, sig, main, spec, mesh) -> Pair | None:
    """`follow_strategies`' (operand, result) specs for one leader spec; None where it
    cannot carry that spec through (a split of a dimension without a label, or one these
    shapes do not divide)."""
    assignment: dict[str, tuple[str, ...]] = {}
    for label, axes in zip(sig.inputs[main], spec):
        if axes and label is None:
            return None
        if axes:
            assignment[label] = axes
    in_vars = [graph.vars[v] for v in node.inputs]
    out_vars = [graph.vars[v] for v in node.outputs]
    pair = _specs_under(sig, assignment, in_vars, out_vars)
    tensors = [*zip(in_vars, pair[0]), *zip(out_vars, pair[1])]
    if not all(s is None or _divisible(v.shape, s, mesh) for v, s in tensors):
        return None
    return pair


_UNKNOWN = object()  # not memoised yet (None is a memoised answer)
