"""Exact reductions of a sharding problem before its ILP is built (numbers only).

In: a `ShardingProblem` and its resolved followers (`resolve_followers`).
Out: a `CostGraph` with followers folded into their leaders (`merge_followers`), the memory
groups on the merged nodes (`merged_memory_groups`, `binding_groups`), and a `Reduction`
(`reduce_graph`): the smaller graph and memory groups the ILP is built from, plus what is
needed to map the ILP's choices back to every merged node (`Reduction.recover`).

The reductions, each keeping the optimum unchanged:
1. followers are merged into their leaders and parallel edges summed (`merge_followers`);
2. dominated strategies are dropped: b goes when some a is never worse whatever the
   neighbours pick and needs no more memory (`_undominated`);
3. single-strategy nodes become constants (`_fix_single_strategy_nodes`);
4. nodes with at most two neighbours and no memory term are eliminated by min-plus
   products (`_eliminate_low_degree`) and recovered after the solve (`_back_substitute`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from autopar._memo import memo
from autopar.intra._ilp_problem import ShardingProblem

# --------------------------------------------------------------------------------------
# Reduction: merge followers, drop dominated strategies, fix and eliminate nodes
# --------------------------------------------------------------------------------------


class CostGraph:
    """Node cost vectors and edge cost matrices of the merged problem, mutable.

    `adjacent[v][w]` is the matrix of edge {v, w} with v's strategies as rows (the entry for
    w -> v is its transpose). Arrays are never modified in place, so copies may share them.
    """

    def __init__(self, node_cost: dict[int, np.ndarray]):
        self.node_cost = dict(node_cost)
        self.adjacent: dict[int, dict[int, np.ndarray]] = {v: {} for v in node_cost}

    def copy(self) -> CostGraph:
        other = CostGraph(self.node_cost)
        other.adjacent = {v: dict(row) for v, row in self.adjacent.items()}
        return other

    def add_node_cost(self, v: int, cost: np.ndarray) -> None:
        self.node_cost[v] = self.node_cost[v] + cost

    def add_edge(self, v: int, w: int, matrix: np.ndarray) -> None:
        assert v != w, f"self-edge on node {v} must be folded into its node cost"
        old = self.adjacent[v].get(w)
        new = matrix if old is None else old + matrix
        self.adjacent[v][w], self.adjacent[w][v] = new, new.T

    def restrict(self, v: int, keep: np.ndarray) -> None:
        """Keep only the strategies `keep` (indices) of node v."""
        self.node_cost[v] = self.node_cost[v][keep]
        for w, matrix in self.adjacent[v].items():
            self.adjacent[v][w] = matrix[keep, :]
            self.adjacent[w][v] = self.adjacent[v][w].T

    def remove_node(self, v: int) -> None:
        for w in self.adjacent.pop(v):
            del self.adjacent[w][v]
        del self.node_cost[v]

    def edges(self) -> list[tuple[int, int, np.ndarray]]:
        """Every edge once, as (v, w, matrix) with v < w, sorted."""
        return [
            (v, w, m) for v in sorted(self.adjacent) for w, m in sorted(self.adjacent[v].items())
            if v < w
        ]


    def local_cost(self, v: int, choice: Mapping[int, int]) -> np.ndarray:
        """Cost per strategy of v with all its neighbours fixed to `choice`."""
        cost = self.node_cost[v]
        for w, matrix in sorted(self.adjacent[v].items()):
            cost = cost + matrix[:, choice[w]]
        return cost


@dataclass(frozen=True, eq=False)
class MemoryGroup:
    """A memory group on merged nodes: constant + sum_v terms[v][s_v] bytes, terms >= 0."""

    constant: float
    terms: tuple[tuple[int, np.ndarray], ...]

    def upper(self) -> float:
        return self.constant + math.fsum(float(t.max()) for _, t in self.terms)


def merge_followers(p: ShardingProblem, root: np.ndarray, strategy_of) -> CostGraph:
    """Fold followers into their roots and sum parallel edges (Alpa's follower merging).

    A root's own strategies map to themselves (`resolve_followers`), so its costs and the
    (C-ordered) matrices of edges between two roots are taken as they are, not gathered
    through the identity: the same numbers in the same layout, and the graph never changes
    an array in place. Issue 45: most of the CLI line's 1,700-2,400 nodes and edges are
    roots' (`python -m benchmarks.investigations.ilp_replay dump llama-8B@8-cli`)."""
    roots = sorted({int(r) for r in root})
    graph = CostGraph({r: np.zeros(p.num_strategies[r]) for r in roots})
    for v, cost in enumerate(p.node_costs):
        r = int(root[v])
        graph.add_node_cost(r, cost if r == v else cost[strategy_of[v]])
    for (u, v), matrix in zip(p.edges, p.edge_costs):
        ru, rv = int(root[u]), int(root[v])
        if ru == rv:  # an edge inside one follower group is a cost of that group's choice
            graph.add_node_cost(ru, matrix[strategy_of[u], strategy_of[v]])
        elif ru == u and rv == v and matrix.flags.c_contiguous:
            graph.add_edge(ru, rv, matrix)
        else:
            graph.add_edge(ru, rv, matrix[np.ix_(strategy_of[u], strategy_of[v])])
    return graph


def _memory_group(terms: Mapping[int, np.ndarray], constant: float = 0.0) -> MemoryGroup:
    """A group from per-node byte vectors: minima go to the constant, all-zero terms away."""
    constant += math.fsum(float(t.min()) for t in terms.values())
    shifted = ((v, t - t.min()) for v, t in sorted(terms.items()))
    return MemoryGroup(constant, tuple((v, t) for v, t in shifted if t.any()))


def _merged_group(members, memory, root, strategy_of, scale: float = 1.0) -> MemoryGroup:
    terms: dict[int, np.ndarray] = {}
    for v in members:
        r = int(root[v])
        term = memory[v][strategy_of[v]] * scale
        terms[r] = term if r not in terms else terms[r] + term
    return _memory_group(terms)


def merged_memory_groups(p: ShardingProblem, root, strategy_of) -> list[MemoryGroup]:
    """Each memory group on merged nodes."""
    return [_merged_group(g, p.node_memory, root, strategy_of) for g in p.memory_groups]


def merged_footprint_group(p: ShardingProblem, root, strategy_of, scale: float) -> MemoryGroup:
    """The footprint on merged nodes as one more memory group, its bytes times `scale` (so
    that it shares the memory groups' budget)."""
    return _merged_group(range(p.num_nodes), p.footprint, root, strategy_of, scale)


def binding_groups(groups: list[MemoryGroup], budget: float) -> list[MemoryGroup]:
    """The groups that some choice could push over `budget`, without duplicates."""
    binding, seen = [], set()
    for group in groups:
        key = (group.constant, tuple((r, t.tobytes()) for r, t in group.terms))
        if group.upper() > budget and key not in seen:
            seen.add(key)
            binding.append(group)
    return binding


def _fix_single_strategy_nodes(graph: CostGraph) -> list[int]:
    """Remove nodes with one strategy, moving their edges into neighbour costs.
    **Returns:** the removed nodes."""
    fixed = [v for v, cost in sorted(graph.node_cost.items()) if len(cost) == 1]
    for v in fixed:
        for w, matrix in sorted(graph.adjacent[v].items()):
            graph.add_node_cost(w, matrix[0, :])
        graph.remove_node(v)
    return fixed


def _undominated(graph: CostGraph, v: int, memory: list[np.ndarray],
                 checked: dict[int, _Checked] | None = None) -> np.ndarray:
    """Strategies of v to keep: b goes if a kept a is never worse, whatever v's neighbours
    pick, and needs no more memory in any group (`memory`: v's byte vectors).
    `checked`: what earlier calls on this graph computed, by node (`_Checked`), updated
    here; the answer is the same with or without it.

    extra[a, b] = c_v[a] - c_v[b] + sum_w max_j (R_vw[a, j] - R_vw[b, j]) bounds how much
    switching v from b to a can cost; extra <= 0 means a dominates b. Candidates are
    dropped from the highest index down, so ties keep the lower index. Dominance is
    transitive (max of a sum <= sum of maxima), so every removed strategy stays dominated by
    a kept one and the optimum is unchanged.

    **Returns:** int array of kept strategy indices, ascending.
    """
    cost = graph.node_cost[v]
    if len(cost) == 1:
        return np.zeros(1, dtype=np.int64)
    neighbours = sorted(graph.adjacent[v])
    matrices = [graph.adjacent[v][w] for w in neighbours]
    if checked is None:
        dominates = _dominates(cost, matrices)
    else:
        dominates, checked[v] = _dominance(cost, matrices, checked.get(v), tuple(neighbours))
    for bytes_ in memory:
        dominates &= bytes_[:, None] <= bytes_[None, :]
    np.fill_diagonal(dominates, False)
    alive = np.ones(len(cost), dtype=bool)
    for b in reversed(np.flatnonzero(dominates.any(axis=0)).tolist()):  # the others stay
        if dominates[alive, b].any():
            alive[b] = False
    return np.flatnonzero(alive)


# A pair whose lower bound on `extra` (see `_dominates`) exceeds this share of the
# node's largest possible cost is not computed exactly: far above float rounding.
_BOUND_MARGIN = 1e-9


def _dominates(cost: np.ndarray, matrices: list[np.ndarray]) -> np.ndarray:
    """dominates[a, b]: extra[a, b] <= 0 (see `_undominated`), a != b, for v's costs
    `cost` and its edge matrices `matrices` (rows: v's strategies) in neighbour order.

    Only pairs that can dominate are computed: max_j (R[a, j] - R[b, j]) is at least both
    max R[a] - max R[b] and min R[a] - min R[b], which bounds extra[a, b] from below with
    per-row numbers; a pair whose bound is clearly positive is not dominated. The rest
    (a third on the demo) get `extra` exactly, each neighbour's term added in neighbour
    order. Issue 18: a third less time than every pair of every neighbour, the same answer.
    """
    return _dominance(cost, matrices)[0]


@dataclass(frozen=True, eq=False)
class _Checked:
    """What `_dominance`'s bound path computed for a node, to reuse at its next check:
    the node's `cost` and its `neighbours`' edge `matrices` it saw (compared by identity:
    `CostGraph` never changes an array in place, so an array that is the same object
    holds the same numbers), per neighbour the rows' maxima `high` and minima `low`
    (columns of (strategies, neighbours) arrays), the columns' largest magnitudes
    `column_abs`, the bound's sum over neighbours per pair `bound_sum` (updated, not
    summed afresh: `drift` bounds its distance from the exact sum), and for the
    candidate pairs (`row_of[a, b]`: their row, -1 for none) their terms
    max_j (R[a, j] - R[b, j]) per neighbour (`terms`, a row per pair): every one computed
    where `exact`, else (a pair `_exact_in_chunks` dropped part way) the row bounds in
    place of the terms it did not compute."""

    cost: np.ndarray
    neighbours: tuple[int, ...]
    matrices: tuple[np.ndarray, ...]
    high: np.ndarray
    low: np.ndarray
    column_abs: tuple[np.ndarray, ...]
    bound_sum: np.ndarray
    drift: float
    row_of: np.ndarray
    terms: np.ndarray
    exact: np.ndarray


def _dominance(cost: np.ndarray, matrices: list[np.ndarray], previous: _Checked | None = None,
               neighbours: tuple[int, ...] = ()) -> tuple[np.ndarray, _Checked | None]:
    """`_dominates`'s answer, and what its bound path computed (None on the other paths),
    reusing `previous` (the node's last check, or None) for the neighbours whose matrix
    is the same object as then, when the node's `cost` is too.

    Why: `_prune_dominated` checks a node again each time a neighbour loses a strategy;
    on the CLI line most checks are such re-checks of a node with the bounds (one
    neighbour changed, an eighth of the columns) and 99% of them drop nothing, yet each
    took every column again (issue 45: 3.65 of reduce_graph's 8.2 s on ten of its
    problems; `python -m benchmarks.investigations.ilp_replay dump llama-8B@8-cli`,
    then `_prune_dominated` on problems 95-104). Now the row bounds and the exact terms
    of an unchanged neighbour are taken from `previous`, the changed neighbours' computed:
    `reduce_graph` on all 123 problems of that dump, fresh checks against reusing ones
    problem by problem in one process, 43.7 -> 35.9 and 39.5 -> 32.6 CPU s (two runs on
    a loaded machine), every reduction the same.

    Exact, the same dominated pairs as a fresh check: the reused row maxima, minima,
    column magnitudes and exact terms are the numbers a fresh computation gets (the same
    arrays; maxima and minima are exact; the magnitudes are concatenated and summed as
    one vector, as before), so the threshold is the same, and a pair's terms are the
    maxima of the same differences, summed in neighbour order (`_dominated_pairs`) to
    the same `extra`. What may differ is only which pairs get `extra` at all, and a pair
    left out is one whose lower bound on `extra` exceeds the threshold, `_BOUND_MARGIN`
    (1e-9) times the node's scale, so its `extra` is > 0 both ways, the argument by
    which the bounds and the chunks drop pairs at all: (1) the bound is updated per
    changed neighbour (old row bound out, new in) rather than summed afresh, each update's
    rounding added to `drift` (float64's epsilon times the magnitudes involved), and
    summed afresh once `drift` exceeds a quarter of the threshold, so a pair it leaves
    out has a real bound above three quarters of the threshold; (2) a pair that
    `_exact_in_chunks` dropped part way keeps its row (exact terms so far, row bounds
    for the rest; a changed neighbour's term becomes its new row bound, a lower bound),
    and stays dropped while that row's sum exceeds the threshold, else gets its terms
    afresh; (3) a pair whose terms are all exact is summed over every neighbour where a
    fresh check's chunks might have dropped it, which only finds its `extra` > 0. The
    rounding of `extra` itself (its (neighbours + 1) terms, under 1e-13 of the scale) is
    far below the threshold.
    """
    size = len(cost)
    difference = cost[:, None] - cost[None, :]
    if not matrices:
        dominates = difference <= 0
        np.fill_diagonal(dominates, False)
        return dominates, None
    columns = sum(m.shape[1] for m in matrices)
    if size * size * columns <= _ALL_PAIRS_EXACT:
        joined = np.concatenate(matrices, axis=1)
        starts = np.cumsum([0] + [m.shape[1] for m in matrices[:-1]])
        a, b = _pairs(size)
        largest = np.maximum.reduceat(joined[a] - joined[b], starts, axis=1)
        return _dominated_pairs(size, difference, a, b, largest), None
    if (previous is not None and previous.cost is cost and previous.neighbours == neighbours
            and len(previous.matrices) == len(matrices)):
        changed = [k for k, (m, old) in enumerate(zip(matrices, previous.matrices))
                   if m is not old]
        joined = starts = None
        high, low = previous.high.copy(), previous.low.copy()
        column_abs = list(previous.column_abs)
        bound_sum, drift = previous.bound_sum, previous.drift
        for k in changed:
            m = matrices[k]
            high[:, k], low[:, k], column_abs[k] = m.max(axis=1), m.min(axis=1), \
                np.abs(m).max(axis=0)
            old, new = (_row_bound(previous.high[:, k], previous.low[:, k]),
                        _row_bound(high[:, k], low[:, k]))
            drift += _EPSILON * (np.abs(bound_sum).max() + np.abs(old).max()
                                 + np.abs(new).max())
            bound_sum = bound_sum - old + new
    else:
        previous, changed = None, []
        joined = np.concatenate(matrices, axis=1)
        starts = np.cumsum([0] + [m.shape[1] for m in matrices[:-1]])
        high = np.maximum.reduceat(joined, starts, axis=1)
        low = np.minimum.reduceat(joined, starts, axis=1)
        column_abs = np.split(np.abs(joined).max(axis=0), starts[1:])
        bound_sum, drift = None, 0.0
    scale = np.abs(cost).max() + np.concatenate(column_abs).sum()
    threshold = _BOUND_MARGIN * scale
    if bound_sum is None or drift > threshold / 4:  # summed afresh, as before
        bound_sum = np.maximum(high[:, None, :] - high[None, :, :],
                               low[:, None, :] - low[None, :, :]).sum(axis=2)
        drift = 0.0
    bound = difference + bound_sum
    np.fill_diagonal(bound, np.inf)
    a, b = np.nonzero(bound <= threshold)
    kept = []  # (pairs' a, b, their terms, whether exact) reused from `previous`
    if previous is not None:
        a, b, kept = _reused_terms(previous, matrices, changed, difference, high, low,
                                   threshold, a, b)
    if len(a):
        if joined is None:
            joined = np.concatenate(matrices, axis=1)
            starts = np.cumsum([0] + [m.shape[1] for m in matrices[:-1]])
        if columns > _EXACT_CHUNK_COLUMNS:
            kept.append(_exact_in_chunks(difference, joined, starts, high, low, a, b,
                                         threshold))
        else:
            kept.append((a, b, np.maximum.reduceat(joined[a] - joined[b], starts, axis=1),
                         np.ones(len(a), dtype=bool)))
    if kept:
        a, b, terms, exact = (np.concatenate(parts) for parts in zip(*kept))
    else:
        a = b = np.zeros(0, dtype=np.int64)
        terms, exact = np.empty((0, len(matrices))), np.zeros(0, dtype=bool)
    row_of = np.full((size, size), -1, dtype=np.int64)
    row_of[a, b] = np.arange(len(a))
    checked = _Checked(cost, neighbours, tuple(matrices), high, low, tuple(column_abs),
                       bound_sum, drift, row_of, terms, exact)
    return _dominated_pairs(size, difference, a[exact], b[exact], terms[exact]), checked


def _reused_terms(previous: _Checked, matrices, changed: list[int], difference, high, low,
                  threshold: float, a: np.ndarray, b: np.ndarray):
    """`_dominance`'s candidate pairs (a, b) split into those whose terms `previous`
    holds, updated for the `changed` neighbours (an exact row: the changed terms computed;
    a row of a pair dropped part way by `_exact_in_chunks`, lower bounds where not exact:
    the changed ones are the new row bounds, and the pair stays dropped while the sum
    still exceeds `threshold`), and those to compute afresh.
    **Returns:** (the pairs to compute, [(the reused pairs' a, b, terms, exactness)])."""
    rows = previous.row_of[a, b]
    hit = rows >= 0
    rows = rows[hit]
    reused_a, reused_b = a[hit], b[hit]
    terms, exact = previous.terms[rows], previous.exact[rows]
    inexact = ~exact
    for k in changed:
        m = matrices[k]
        terms[exact, k] = (m[reused_a[exact]] - m[reused_b[exact]]).max(axis=1)
        terms[inexact, k] = np.maximum(high[reused_a[inexact], k] - high[reused_b[inexact], k],
                                       low[reused_a[inexact], k] - low[reused_b[inexact], k])
    partial = difference[reused_a, reused_b] + terms.sum(axis=1)
    stays = exact | (partial > threshold)
    fresh_a = np.concatenate([a[~hit], reused_a[~stays]])
    fresh_b = np.concatenate([b[~hit], reused_b[~stays]])
    return fresh_a, fresh_b, [(reused_a[stays], reused_b[stays], terms[stays], exact[stays])]


# float64's machine epsilon: `_dominance`'s per-update rounding bound.
_EPSILON = float(np.finfo(np.float64).eps)


def _row_bound(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """One neighbour's term of `_dominates`'s bound for every pair (a, b):
    max(high[a] - high[b], low[a] - low[b]), from its rows' maxima and minima."""
    return np.maximum(high[:, None] - high[None, :], low[:, None] - low[None, :])


def _dominated_pairs(size: int, difference: np.ndarray, a: np.ndarray, b: np.ndarray,
                     largest: np.ndarray) -> np.ndarray:
    """`_dominates`'s answer from the exact terms `largest` (a row per pair (a, b), a
    column per neighbour): extra[a, b], each neighbour's term added in neighbour order."""
    extra = difference[a, b]
    for k in range(largest.shape[1]):
        extra = extra + largest[:, k]
    dominates = np.zeros((size, size), dtype=bool)
    dominates[a, b] = extra <= 0
    return dominates


# A node with at most this many (pairs of strategies) x (neighbour columns) has `extra`
# computed exactly for every pair, without the per-row bounds first: the bounds only
# drop pairs whose `extra` is far above 0 (`_BOUND_MARGIN`), which are not dominated
# either way, so the answer is the same, and on small nodes the bounds cost more numpy
# calls than they save. Issue 45: most of the CLI line's calls are nodes of 2-4
# strategies and 2-4 neighbours (`python -m benchmarks.investigations.ilp_replay dump
# llama-8B@8-cli`, `_prune_dominated` on its problems).
_ALL_PAIRS_EXACT = 4096


@memo("intra.dominance_pairs", "size: a node's strategy count", maxsize=64)
def _pairs(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ordered pair (a, b), a != b, of `size` strategies, row-major."""
    return np.nonzero(~np.eye(size, dtype=bool))


# Above this many neighbour columns the exact terms are computed a chunk of neighbours at
# a time (`_exact_in_chunks`).
_EXACT_CHUNK_COLUMNS = 512


def _exact_in_chunks(difference, joined, starts, high, low, a, b, threshold):
    """The exact terms max_j (R[a, j] - R[b, j]) of `_dominates` for the candidate pairs
    (a, b), a chunk of neighbours (about `_EXACT_CHUNK_COLUMNS` columns) at a time: after
    each chunk, a pair whose bound (exact terms so far plus the per-row bounds of the
    neighbours left) exceeds `threshold` is dropped, not dominated, as `_dominates` drops
    pairs by the per-row bounds alone. Issue 45: a hub of llama's layer (33 strategies,
    145 neighbours, 3,732 columns) is checked again each time a neighbour loses a
    strategy, and its 346 candidate pairs went through every column; they mostly fail
    within the first chunk. The terms of the pairs kept are the same numbers (maxima of
    the same differences), so `extra` is summed as before.

    **Returns:** (a, b, their terms per neighbour: the exact ones where computed, the
    per-row bounds where not, whether every term of the pair is exact: the pairs left)."""
    count = len(starts)
    ends = np.append(starts[1:], joined.shape[1])
    rest = np.maximum(high[a] - high[b], low[a] - low[b])
    largest = rest.copy()
    alive = np.arange(len(a))
    first = 0
    while first < count and len(alive):
        last = int(np.searchsorted(ends, starts[first] + _EXACT_CHUNK_COLUMNS, side="right"))
        last = max(last, first + 1)
        begin, end = int(starts[first]), int(ends[last - 1])
        offsets = starts[first:last] - begin
        largest[alive, first:last] = np.maximum.reduceat(
            joined[a[alive], begin:end] - joined[b[alive], begin:end], offsets, axis=1)
        first = last
        partial = (difference[a[alive], b[alive]] + largest[alive, :first].sum(axis=1)
                   + rest[alive, first:].sum(axis=1))
        alive = alive[partial <= threshold]
    exact = np.zeros(len(a), dtype=bool)
    exact[alive] = True
    return a, b, largest, exact


def _prune_dominated(
    graph: CostGraph, groups: list[MemoryGroup], kept: dict[int, np.ndarray]
) -> None:
    """Drop dominated strategies (see `_undominated`) until none is left, updating `graph`
    and `kept[v]` (the original index of each remaining strategy of v)."""
    memory_of: dict[int, list[np.ndarray]] = {}
    for group in groups:
        for v, bytes_ in group.terms:
            memory_of.setdefault(v, []).append(bytes_)
    queue = sorted(graph.node_cost)
    queued = set(queue)
    checked: dict[int, _Checked] = {}  # each node's last check, for its next (`_dominance`)
    while queue:
        v = heapq.heappop(queue)
        queued.discard(v)
        keep = _undominated(graph, v, [t[kept[v]] for t in memory_of.get(v, ())], checked)
        if len(keep) == len(graph.node_cost[v]):
            continue
        graph.restrict(v, keep)
        kept[v] = kept[v][keep]
        for w in graph.adjacent[v]:
            if w not in queued:
                queued.add(w)
                heapq.heappush(queue, w)


def _restrict_groups(
    groups: list[MemoryGroup], kept: dict[int, np.ndarray], budget: float
) -> list[MemoryGroup]:
    """The binding memory groups over the strategies left in `kept`."""
    restricted = []
    for group in groups:
        terms = {v: bytes_[kept[v]] for v, bytes_ in group.terms}
        restricted.append(_memory_group(terms, group.constant))
    return binding_groups(restricted, budget)


@dataclass(frozen=True, eq=False)
class _Eliminated:
    """A node removed by elimination: its cost and its edges to the neighbours it had."""

    node: int
    cost: np.ndarray
    neighbours: tuple[int, ...]
    matrices: tuple[np.ndarray, ...]  # rows: the node's strategies


def _eliminate_low_degree(graph: CostGraph, pinned: set[int]) -> list[_Eliminated]:
    """Bucket-eliminate nodes with <= 2 neighbours that no memory constraint mentions.

    A leaf v of neighbour u adds min_j(c_v[j] + R_uv[:, j]) to c_u; a node v between u and
    w adds the edge min_j(c_v[j] + R_uv[:, j] + R_vw[j, :]) to {u, w} (only when that edge
    is no larger than the two it replaces). Exact: min over v is taken for every choice of
    the neighbours. `_back_substitute` recovers v's choice after the solve.

    **Returns:** the eliminated nodes, in elimination order.
    """
    eliminated: list[_Eliminated] = []
    heap = [v for v in sorted(graph.node_cost) if v not in pinned]
    while heap:
        v = heapq.heappop(heap)
        if v not in graph.node_cost or not _eliminable(graph, v):
            continue
        neighbours = tuple(sorted(graph.adjacent[v]))
        matrices = tuple(graph.adjacent[v][w] for w in neighbours)
        cost = graph.node_cost[v]
        eliminated.append(_Eliminated(v, cost, neighbours, matrices))
        graph.remove_node(v)
        if len(neighbours) == 1:
            graph.add_node_cost(neighbours[0], (cost[:, None] + matrices[0]).min(axis=0))
        elif len(neighbours) == 2:
            through = cost[:, None, None] + matrices[0][:, :, None] + matrices[1][:, None, :]
            graph.add_edge(neighbours[0], neighbours[1], through.min(axis=0))
        for w in neighbours:
            if w not in pinned:
                heapq.heappush(heap, w)
    return eliminated


def _eliminable(graph: CostGraph, v: int) -> bool:
    neighbours = sorted(graph.adjacent[v])
    if len(neighbours) <= 1:
        return True
    if len(neighbours) > 2:
        return False
    u, w = neighbours
    if w in graph.adjacent[u]:
        return True
    s_u, s_v, s_w = (len(graph.node_cost[x]) for x in (u, v, w))
    return s_u * s_w <= s_v * (s_u + s_w)


def _back_substitute(eliminated: list[_Eliminated], choice: dict[int, int]) -> None:
    """Choose each eliminated node given its neighbours, in reverse elimination order."""
    for record in reversed(eliminated):
        cost = record.cost
        for w, matrix in zip(record.neighbours, record.matrices):
            cost = cost + matrix[:, choice[w]]
        choice[record.node] = int(np.argmin(cost))  # first minimum: lowest index on ties


@dataclass(frozen=True, eq=False)
class Reduction:
    """What `reduce_graph` did, to map ILP choices back: `kept[v]` original strategy indices
    left at v; `fixed` nodes left with one strategy; `eliminated` in elimination order."""

    graph: CostGraph
    groups: list[MemoryGroup]
    kept: dict[int, np.ndarray]
    fixed: tuple[int, ...]
    eliminated: list[_Eliminated]

    def recover(self, ilp_choice: Mapping[int, int]) -> dict[int, int]:
        """Original strategy index of every merged node, given the ILP nodes' choices."""
        choice = {**ilp_choice, **{v: 0 for v in self.fixed}}
        _back_substitute(self.eliminated, choice)
        return {v: int(self.kept[v][k]) for v, k in choice.items()}


def restrict_strategies(
    graph: CostGraph, groups: list[MemoryGroup], budget: float | None,
    keep: Mapping[int, np.ndarray],
) -> tuple[CostGraph, list[MemoryGroup]]:
    """`graph` and its memory `groups` with only the strategies `keep[v]` (ascending
    indices) of every node v, nodes left with one strategy folded into their neighbours
    (their own cost, a constant, dropped). `graph` is left unchanged."""
    restricted = graph.copy()
    for v, k in keep.items():
        if len(k) < len(restricted.node_cost[v]):
            restricted.restrict(v, k)
    if groups:
        groups = _restrict_groups(groups, keep, budget)
    _fix_single_strategy_nodes(restricted)
    return restricted, groups


def reduce_graph(graph: CostGraph, groups: list[MemoryGroup], budget: float | None) -> Reduction:
    """Shrink the merged problem exactly: dominated strategies, single-strategy nodes, then
    low-degree nodes free of memory terms. `graph` is left unchanged."""
    reduced = graph.copy()
    kept = {v: np.arange(len(cost)) for v, cost in reduced.node_cost.items()}
    _prune_dominated(reduced, groups, kept)
    if groups:
        groups = _restrict_groups(groups, kept, budget)
    fixed = tuple(_fix_single_strategy_nodes(reduced))
    eliminated = _eliminate_low_degree(reduced, {v for g in groups for v, _ in g.terms})
    return Reduction(reduced, groups, kept, fixed, eliminated)

