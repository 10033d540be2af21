"""The intra-operator sharding ILP: one strategy per node, least total cost (numbers only).

In: a `ShardingProblem` (node cost vectors, edge resharding matrices, memory, followers).
Out: a `Solution` (a strategy index per node and its exact cost). The solver knows nothing
of JAX. It follows Alpa's formulation (Zheng et al. 2022, REFERENCES.md): minimise
sum_v c_v[s_v] + sum_(u,v) R_uv[s_u, s_v] with one strategy per node, the bytes of every
memory group under the budget, and followers sharing their leader's choice.

Before the ILP is built the problem is reduced, exactly (`_merge`, `_reduce`):
1. followers are merged into their leaders and parallel edges summed;
2. dominated strategies are dropped: b goes when some a is never worse whatever the
   neighbours pick and needs no more memory (`_undominated`);
3. single-strategy nodes become constants;
4. nodes with at most two neighbours and no memory term are eliminated by min-plus
   products and recovered after the solve (bucket elimination);
5. each edge matrix is shifted by its row and column minima (so it is >= 0 with a zero in
   every row and column), and all costs are scaled so the largest coefficient is 1.
Edges are linearised with Alpa's marginal constraints (`_add_marginal_edge`); ties are
broken towards lower strategy indices (`_prefer_lower_indices`).

The slow reference used by the tests is `autopar.intra._ilp_reference.solve_brute_force`.
"""

from __future__ import annotations

import heapq
import math
import time
import types
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pulp

Formulation = Literal["marginal", "product"]
SolverName = Literal["auto", "highs", "cbc"]

# HiGHS stops once (upper - lower) / upper <= mip_rel_gap; its default of 1e-4 would accept a
# plan 0.01 % worse than the best. The plan must be exact (the tests compare it with brute
# force to 1e-9), so both gaps are closed down to floating-point noise. The absolute gap is
# in scaled-objective units, where the largest single cost coefficient is 1.
MIP_RELATIVE_GAP = 1e-9
MIP_ABSOLUTE_GAP = 1e-10
# Fixed seed and one thread: the same problem always gives the same search and choices.
SOLVER_RANDOM_SEED = 0
SOLVER_THREADS = 1
# Solution values above this count as "strategy chosen" (HiGHS's integrality tolerance is
# 1e-6, so a chosen binary reads at least 1 - 1e-6).
CHOSEN_THRESHOLD = 0.5


# --------------------------------------------------------------------------------------
# Problem and solution data
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShardingProblem:
    """The numbers the sharding ILP sees.

    **Arguments:**
    - `node_costs`: node i's cost per strategy, float64[S_i] (seconds; compute plus
      communication, already summed). Every S_i >= 1.
    - `edges`: pairs (u, v) with u != v; duplicates are allowed and summed.
    - `edge_costs`: resharding cost of each edge, float64[S_u, S_v].
    - `node_memory`: bytes per device of node i per strategy, float64[S_i]; or empty.
    - `memory_groups`: each group lists nodes live together at one program point.
    - `memory_budget`: bytes per device every group's sum must fit in; None: no limit.
    - `followers`: v -> (u, map): v must pick strategy map[s_u] (int[S_u]); chains allowed.
    - `names`: optional node names, used in messages.

    All costs and memory must be finite. Arrays are converted to float64 / int64 copies.
    """

    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...] = ()
    edge_costs: tuple[np.ndarray, ...] = ()
    node_memory: tuple[np.ndarray, ...] = ()
    memory_groups: tuple[tuple[int, ...], ...] = ()
    memory_budget: float | None = None
    followers: Mapping[int, tuple[int, np.ndarray]] = field(default_factory=dict)
    names: tuple[str, ...] = ()

    def __post_init__(self):
        _check_problem(self)

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_strategies(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.node_costs)


@dataclass(frozen=True)
class SolveStats:
    """Sizes and timings of one solve.

    `num_variables_before_merge` counts the plain Alpa formulation of the original problem
    (one binary per node strategy, one variable per strategy pair of every edge);
    `num_variables` and `num_constraints` are those of the ILP actually solved, after
    merging, pruning and elimination. `num_ilp_nodes` is the nodes left in that ILP.
    """

    num_nodes: int
    num_nodes_after_merge: int
    num_ilp_nodes: int
    num_variables_before_merge: int
    num_variables: int
    num_constraints: int
    build_time: float
    solve_time: float
    solver: str
    formulation: str


@dataclass(frozen=True)
class Solution:
    """The chosen strategy of every original node.

    `objective` is recomputed exactly from `choices` with `evaluate`. `status` is
    "optimal", or "time_limit" when the time limit stopped the solver with a feasible but
    not proven optimal plan.
    """

    choices: tuple[int, ...]
    objective: float
    status: Literal["optimal", "time_limit"]
    stats: SolveStats


class MemoryBudgetError(ValueError):
    """No choice of strategies fits the memory budget.

    `budget` is the budget asked for and `least_memory` the least per-device memory any
    choice reaches (see `least_memory`), both in bytes.
    """

    def __init__(self, budget: float, least: float):
        self.budget = budget
        self.least_memory = least
        super().__init__(
            f"memory budget of {budget:.6g} bytes ({budget / 2**30:.3f} GiB) per device is "
            f"infeasible: the least memory per device any choice of strategies reaches is "
            f"{least:.6g} bytes ({least / 2**30:.3f} GiB). Raise memory_budget to at least "
            f"{least:.6g}, or lower the memory needed (more devices, more pipeline stages, "
            f"smaller micro-batches, rematerialisation)."
        )


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def node_name(problem: ShardingProblem, v: int) -> str:
    """`names[v]` if names were given, else "node v"."""
    return f"node {v} ({problem.names[v]!r})" if problem.names else f"node {v}"


def _float_vector(values, what: str, length: int | None = None) -> np.ndarray:
    array = np.array(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array, got shape {array.shape}.")
    if length is not None and array.size != length:
        raise ValueError(f"{what} has {array.size} entries but the node has {length} strategies.")
    if not np.all(np.isfinite(array)):
        raise ValueError(
            f"{what} has a NaN or infinite entry; drop impossible strategies instead of giving "
            "them infinite cost, or use a large finite cost."
        )
    return array


def _check_problem(p: ShardingProblem) -> None:
    """Validate `p` and freeze its fields as float64/int64 arrays and tuples."""
    put = lambda name, value: object.__setattr__(p, name, value)
    if len(p.node_costs) == 0:
        raise ValueError("ShardingProblem needs at least one node in node_costs.")
    costs = (_float_vector(c, f"node_costs[{i}]") for i, c in enumerate(p.node_costs))
    put("node_costs", tuple(costs))
    sizes = p.num_strategies
    n = len(sizes)
    put("names", tuple(str(s) for s in p.names))
    if p.names and len(p.names) != n:
        raise ValueError(f"names has {len(p.names)} entries but there are {n} nodes.")
    put("edges", tuple((int(u), int(v)) for u, v in p.edges))
    if len(p.edge_costs) != len(p.edges):
        raise ValueError(
            f"edge_costs has {len(p.edge_costs)} matrices but there are {len(p.edges)} edges."
        )
    matrices = []
    for k, ((u, v), cost) in enumerate(zip(p.edges, p.edge_costs)):
        if not (0 <= u < n and 0 <= v < n) or u == v:
            raise ValueError(f"edges[{k}] = {(u, v)} must join two different nodes in [0, {n}).")
        matrix = np.array(cost, dtype=np.float64)
        if matrix.shape != (sizes[u], sizes[v]) or not np.all(np.isfinite(matrix)):
            raise ValueError(
                f"edge_costs[{k}] for edge {(u, v)} must be a finite array of shape "
                f"{(sizes[u], sizes[v])} (strategies of both ends), got shape {matrix.shape}."
            )
        matrices.append(matrix)
    put("edge_costs", tuple(matrices))
    _check_memory(p, put)
    _check_followers(p, put)


def _check_memory(p: ShardingProblem, put) -> None:
    n, sizes = p.num_nodes, p.num_strategies
    if p.node_memory:
        if len(p.node_memory) != n:
            raise ValueError(f"node_memory has {len(p.node_memory)} entries but {n} nodes.")
        memory = tuple(
            _float_vector(m, f"node_memory[{i}]", sizes[i]) for i, m in enumerate(p.node_memory)
        )
        if any(np.any(m < 0) for m in memory):
            raise ValueError("node_memory has a negative entry; memory is bytes per device.")
        put("node_memory", memory)
    groups = tuple(tuple(int(v) for v in group) for group in p.memory_groups)
    for k, group in enumerate(groups):
        if any(not 0 <= v < n for v in group) or len(set(group)) != len(group):
            raise ValueError(
                f"memory_groups[{k}] = {group} must list distinct nodes in [0, {n})."
            )
    put("memory_groups", groups)
    if groups and not p.node_memory:
        raise ValueError("memory_groups were given without node_memory; give both or neither.")
    if p.memory_budget is not None:
        budget = float(p.memory_budget)
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {budget}.")
        put("memory_budget", budget)


def _check_followers(p: ShardingProblem, put) -> None:
    n, sizes = p.num_nodes, p.num_strategies
    followers = {}
    for v, (u, strategy_map) in sorted(p.followers.items()):
        v, u = int(v), int(u)
        if not (0 <= v < n and 0 <= u < n) or u == v:
            raise ValueError(f"follower {v} of leader {u} must be two different nodes in [0, {n}).")
        mapping = np.array(strategy_map, dtype=np.int64)
        if mapping.shape != (sizes[u],) or np.any(mapping < 0) or np.any(mapping >= sizes[v]):
            raise ValueError(
                f"the follower map of {node_name(p, v)} must give, for each of the {sizes[u]} "
                f"strategies of its leader {node_name(p, u)}, a strategy index in "
                f"[0, {sizes[v]}); got {mapping.tolist()}."
            )
        followers[v] = (u, mapping)
    put("followers", types.MappingProxyType(followers))
    resolve_followers(p)  # raises on cycles


def resolve_followers(p: ShardingProblem) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Resolve follower chains to their root leaders.

    **Arguments:**
    - `p`: the problem.

    **Returns:** `(root, strategy_of)`: `root[v]` is the node whose choice decides v (v
    itself for a non-follower) and `strategy_of[v][k]` is v's strategy when the root picks k.
    """
    n = p.num_nodes
    root = np.full(n, -1, dtype=np.int64)
    strategy_of: list[np.ndarray | None] = [None] * n
    for start in range(n):
        chain = []
        v = start
        while root[v] < 0 and v in p.followers:
            if v in chain:
                cycle = " -> ".join(node_name(p, w) for w in chain[chain.index(v) :] + [v])
                raise ValueError(f"followers form a cycle ({cycle}); one node must lead.")
            chain.append(v)
            v = p.followers[v][0]
        if root[v] < 0:
            root[v], strategy_of[v] = v, np.arange(p.num_strategies[v])
        for w in reversed(chain):
            leader, mapping = p.followers[w]
            root[w], strategy_of[w] = root[leader], mapping[strategy_of[leader]]
    return root, tuple(strategy_of)


def _check_choices(p: ShardingProblem, choices: Sequence[int]) -> tuple[int, ...]:
    choices = tuple(int(k) for k in choices)
    if len(choices) != p.num_nodes:
        raise ValueError(f"got {len(choices)} choices for {p.num_nodes} nodes.")
    for v, k in enumerate(choices):
        if not 0 <= k < p.num_strategies[v]:
            raise ValueError(
                f"choice {k} of {node_name(p, v)} is not in [0, {p.num_strategies[v]})."
            )
    for v, (u, mapping) in p.followers.items():
        if choices[v] != mapping[choices[u]]:
            raise ValueError(
                f"{node_name(p, v)} follows {node_name(p, u)} and must pick strategy "
                f"{mapping[choices[u]]} when its leader picks {choices[u]}, not {choices[v]}."
            )
    return choices


# --------------------------------------------------------------------------------------
# Objective and memory of a given choice
# --------------------------------------------------------------------------------------


def evaluate(problem: ShardingProblem, choices: Sequence[int]) -> float:
    """Total cost of a choice of strategies, summed exactly (`math.fsum`).

    **Arguments:**
    - `problem`: the problem.
    - `choices`: a strategy index per node; followers must match their leaders.

    **Returns:** sum_v c_v[s_v] + sum_(u,v) R_uv[s_u, s_v], in the problem's cost units.
    """
    s = _check_choices(problem, choices)
    terms = [cost[s[v]] for v, cost in enumerate(problem.node_costs)]
    terms += [r[s[u], s[v]] for (u, v), r in zip(problem.edges, problem.edge_costs)]
    return math.fsum(terms)


def peak_memory(problem: ShardingProblem, choices: Sequence[int]) -> float:
    """Largest memory group total of a choice (bytes per device); 0.0 without groups.

    **Arguments:**
    - `problem`: the problem.
    - `choices`: a strategy index per node.

    **Returns:** max over memory groups of sum_(v in group) node_memory[v][s_v].
    """
    s = _check_choices(problem, choices)
    totals = [math.fsum(problem.node_memory[v][s[v]] for v in g) for g in problem.memory_groups]
    return max(totals, default=0.0)


# --------------------------------------------------------------------------------------
# Reduction: merge followers, drop dominated strategies, fix and eliminate nodes
# --------------------------------------------------------------------------------------


class _CostGraph:
    """Node cost vectors and edge cost matrices of the merged problem, mutable.

    `adjacent[v][w]` is the matrix of edge {v, w} with v's strategies as rows (the entry for
    w -> v is its transpose). Arrays are never modified in place, so copies may share them.
    """

    def __init__(self, node_cost: dict[int, np.ndarray]):
        self.node_cost = dict(node_cost)
        self.adjacent: dict[int, dict[int, np.ndarray]] = {v: {} for v in node_cost}

    def copy(self) -> _CostGraph:
        other = _CostGraph(self.node_cost)
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
class _MemoryGroup:
    """A memory group on merged nodes: constant + sum_v terms[v][s_v] bytes, terms >= 0."""

    constant: float
    terms: tuple[tuple[int, np.ndarray], ...]

    def upper(self) -> float:
        return self.constant + math.fsum(float(t.max()) for _, t in self.terms)


def _merge(p: ShardingProblem, root: np.ndarray, strategy_of) -> _CostGraph:
    """Fold followers into their roots and sum parallel edges (Alpa's follower merging)."""
    roots = sorted({int(r) for r in root})
    graph = _CostGraph({r: np.zeros(p.num_strategies[r]) for r in roots})
    for v, cost in enumerate(p.node_costs):
        graph.add_node_cost(int(root[v]), cost[strategy_of[v]])
    for (u, v), matrix in zip(p.edges, p.edge_costs):
        ru, rv = int(root[u]), int(root[v])
        if ru == rv:  # an edge inside one follower group is a cost of that group's choice
            graph.add_node_cost(ru, matrix[strategy_of[u], strategy_of[v]])
        else:
            graph.add_edge(ru, rv, matrix[np.ix_(strategy_of[u], strategy_of[v])])
    return graph


def _memory_group(terms: Mapping[int, np.ndarray], constant: float = 0.0) -> _MemoryGroup:
    """A group from per-node byte vectors: minima go to the constant, all-zero terms away."""
    constant += math.fsum(float(t.min()) for t in terms.values())
    shifted = ((v, t - t.min()) for v, t in sorted(terms.items()))
    return _MemoryGroup(constant, tuple((v, t) for v, t in shifted if t.any()))


def _memory_groups(p: ShardingProblem, root, strategy_of) -> list[_MemoryGroup]:
    """Each memory group on merged nodes."""
    groups = []
    for members in p.memory_groups:
        terms: dict[int, np.ndarray] = {}
        for v in members:
            r = int(root[v])
            term = p.node_memory[v][strategy_of[v]]
            terms[r] = term if r not in terms else terms[r] + term
        groups.append(_memory_group(terms))
    return groups


def _binding_groups(groups: list[_MemoryGroup], budget: float) -> list[_MemoryGroup]:
    """The groups that some choice could push over `budget`, without duplicates."""
    binding, seen = [], set()
    for group in groups:
        key = (group.constant, tuple((r, t.tobytes()) for r, t in group.terms))
        if group.upper() > budget and key not in seen:
            seen.add(key)
            binding.append(group)
    return binding


def _fix_single_strategy_nodes(graph: _CostGraph) -> list[int]:
    """Remove nodes with one strategy, moving their edges into neighbour costs.
    **Returns:** the removed nodes."""
    fixed = [v for v, cost in sorted(graph.node_cost.items()) if len(cost) == 1]
    for v in fixed:
        for w, matrix in sorted(graph.adjacent[v].items()):
            graph.add_node_cost(w, matrix[0, :])
        graph.remove_node(v)
    return fixed


def _undominated(graph: _CostGraph, v: int, memory: list[np.ndarray]) -> np.ndarray:
    """Strategies of v to keep: b goes if a kept a is never worse, whatever v's neighbours
    pick, and needs no more memory in any group (`memory`: v's byte vectors).

    extra[a, b] = c_v[a] - c_v[b] + sum_w max_j (R_vw[a, j] - R_vw[b, j]) bounds how much
    switching v from b to a can cost; extra <= 0 means a dominates b. Candidates are
    dropped from the highest index down, so ties keep the lower index. Dominance is
    transitive (max of a sum <= sum of maxima), so every removed strategy stays dominated by
    a kept one and the optimum is unchanged.

    **Returns:** int array of kept strategy indices, ascending.
    """
    cost = graph.node_cost[v]
    extra = cost[:, None] - cost[None, :]
    for _, matrix in sorted(graph.adjacent[v].items()):
        extra = extra + (matrix[:, None, :] - matrix[None, :, :]).max(axis=2)
    dominates = extra <= 0
    for bytes_ in memory:
        dominates &= bytes_[:, None] <= bytes_[None, :]
    np.fill_diagonal(dominates, False)
    alive = np.ones(len(cost), dtype=bool)
    for b in reversed(range(len(cost))):
        if np.any(dominates[alive, b]):
            alive[b] = False
    return np.flatnonzero(alive)


def _prune_dominated(
    graph: _CostGraph, groups: list[_MemoryGroup], kept: dict[int, np.ndarray]
) -> None:
    """Drop dominated strategies (see `_undominated`) until none is left, updating `graph`
    and `kept[v]` (the original index of each remaining strategy of v)."""
    memory_of: dict[int, list[np.ndarray]] = {}
    for group in groups:
        for v, bytes_ in group.terms:
            memory_of.setdefault(v, []).append(bytes_)
    queue = sorted(graph.node_cost)
    queued = set(queue)
    while queue:
        v = heapq.heappop(queue)
        queued.discard(v)
        keep = _undominated(graph, v, [t[kept[v]] for t in memory_of.get(v, ())])
        if len(keep) == len(graph.node_cost[v]):
            continue
        graph.restrict(v, keep)
        kept[v] = kept[v][keep]
        for w in graph.adjacent[v]:
            if w not in queued:
                queued.add(w)
                heapq.heappush(queue, w)


def _restrict_groups(
    groups: list[_MemoryGroup], kept: dict[int, np.ndarray], budget: float
) -> list[_MemoryGroup]:
    """The binding memory groups over the strategies left in `kept`."""
    restricted = []
    for group in groups:
        terms = {v: bytes_[kept[v]] for v, bytes_ in group.terms}
        restricted.append(_memory_group(terms, group.constant))
    return _binding_groups(restricted, budget)


@dataclass(frozen=True, eq=False)
class _Eliminated:
    """A node removed by elimination: its cost and its edges to the neighbours it had."""

    node: int
    cost: np.ndarray
    neighbours: tuple[int, ...]
    matrices: tuple[np.ndarray, ...]  # rows: the node's strategies


def _eliminate_low_degree(graph: _CostGraph, pinned: set[int]) -> list[_Eliminated]:
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


def _eliminable(graph: _CostGraph, v: int) -> bool:
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
class _Reduction:
    """What `_reduce` did, to map ILP choices back: `kept[v]` original strategy indices
    left at v; `fixed` nodes left with one strategy; `eliminated` in elimination order."""

    graph: _CostGraph
    groups: list[_MemoryGroup]
    kept: dict[int, np.ndarray]
    fixed: tuple[int, ...]
    eliminated: list[_Eliminated]

    def recover(self, ilp_choice: Mapping[int, int]) -> dict[int, int]:
        """Original strategy index of every merged node, given the ILP nodes' choices."""
        choice = {**ilp_choice, **{v: 0 for v in self.fixed}}
        _back_substitute(self.eliminated, choice)
        return {v: int(self.kept[v][k]) for v, k in choice.items()}


def _reduce(graph: _CostGraph, groups: list[_MemoryGroup], budget: float | None) -> _Reduction:
    """Shrink the merged problem exactly: dominated strategies, single-strategy nodes, then
    low-degree nodes free of memory terms. `graph` is left unchanged."""
    reduced = graph.copy()
    kept = {v: np.arange(len(cost)) for v, cost in reduced.node_cost.items()}
    _prune_dominated(reduced, groups, kept)
    if groups:
        groups = _restrict_groups(groups, kept, budget)
    fixed = tuple(_fix_single_strategy_nodes(reduced))
    eliminated = _eliminate_low_degree(reduced, {v for g in groups for v, _ in g.terms})
    return _Reduction(reduced, groups, kept, fixed, eliminated)


# --------------------------------------------------------------------------------------
# The ILP, as plain arrays
# --------------------------------------------------------------------------------------

_LE, _EQ, _GE = pulp.LpConstraintLE, pulp.LpConstraintEQ, pulp.LpConstraintGE


@dataclass
class _Model:
    """A mixed-integer program: minimise cost . x over x >= 0 subject to `rows`.

    Binary columns are in [0, 1]; continuous columns are unbounded above. Each row is
    (columns, coefficients, sense, right-hand side). `node_columns[v]` are the one-hot
    strategy columns of node v.
    """

    cost: list[float] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    rows: list[tuple[np.ndarray, np.ndarray, int, float]] = field(default_factory=list)
    node_columns: dict[int, np.ndarray] = field(default_factory=dict)

    def add_columns(self, costs: np.ndarray, binary: bool) -> np.ndarray:
        start = len(self.cost)
        self.cost.extend(float(c) for c in costs)
        self.binary.extend([binary] * len(costs))
        return np.arange(start, len(self.cost))

    def add_row(self, columns, coefficients, sense: int, rhs: float) -> None:
        self.rows.append((np.asarray(columns), np.asarray(coefficients, float), sense, rhs))

    def add_one_hot_node(self, v: int, costs: np.ndarray) -> np.ndarray:
        columns = self.add_columns(costs, binary=True)
        self.add_row(columns, np.ones(len(columns)), _EQ, 1.0)
        self.node_columns[v] = columns
        return columns


def _normalised_costs(graph: _CostGraph):
    """Shift every edge by its row then column minima into the node costs, and every node
    cost by its minimum; drop all-zero edges. Exact: the shifts only add constants to the
    objective for every choice. **Returns:** (node_cost, [(v, w, matrix >= 0)], scale)."""
    node_cost = dict(graph.node_cost)
    edges = []
    for v, w, matrix in graph.edges():
        row_min = matrix.min(axis=1)
        matrix = matrix - row_min[:, None]
        col_min = matrix.min(axis=0)
        matrix = matrix - col_min[None, :]
        node_cost[v], node_cost[w] = node_cost[v] + row_min, node_cost[w] + col_min
        if matrix.any():
            edges.append((v, w, matrix))
    node_cost = {v: c - c.min() for v, c in node_cost.items()}
    largest = [float(c.max()) for c in node_cost.values()] + [float(m.max()) for *_, m in edges]
    scale = max(largest, default=0.0) or 1.0
    return node_cost, edges, scale


def _add_marginal_edge(model: _Model, v: int, w: int, matrix: np.ndarray) -> None:
    """Alpa's linearisation: e[i, j] >= 0 for every pair, sum_j e[i, j] = s_v[i] and
    sum_i e[i, j] = s_w[j] (the last column's equation is implied and left out). With
    one-hot s the only such e is the outer product s_v s_w^T, so continuous e is exact."""
    s_v, s_w = model.node_columns[v], model.node_columns[w]
    e = model.add_columns(matrix.ravel(), binary=False).reshape(matrix.shape)
    for i in range(matrix.shape[0]):
        model.add_row(np.append(e[i, :], s_v[i]), [1.0] * matrix.shape[1] + [-1.0], _EQ, 0.0)
    for j in range(matrix.shape[1] - 1):
        model.add_row(np.append(e[:, j], s_w[j]), [1.0] * matrix.shape[0] + [-1.0], _EQ, 0.0)


def _add_product_edge(model: _Model, v: int, w: int, matrix: np.ndarray) -> None:
    """Product bound: e[i, j] >= s_v[i] + s_w[j] - 1, e >= 0, only where matrix > 0. The
    matrix is >= 0 so the minimum puts e at max(0, s_v[i] + s_w[j] - 1) = s_v[i] s_w[j]
    for one-hot s; exact, smaller than the marginal form, but a weaker LP relaxation."""
    s_v, s_w = model.node_columns[v], model.node_columns[w]
    pairs = np.argwhere(matrix > 0)
    e = model.add_columns(matrix[pairs[:, 0], pairs[:, 1]], binary=False)
    for column, (i, j) in zip(e, pairs):
        model.add_row([column, s_v[i], s_w[j]], [1.0, -1.0, -1.0], _GE, -1.0)


def _sharding_model(
    graph: _CostGraph, groups: list[_MemoryGroup], budget: float | None, form: Formulation
) -> _Model:
    """The ILP of the reduced problem: costs scaled to <= 1, memory scaled by the budget."""
    node_cost, edges, scale = _normalised_costs(graph)
    model = _Model()
    for v in sorted(node_cost):
        model.add_one_hot_node(v, node_cost[v] / scale)
    add_edge = _add_marginal_edge if form == "marginal" else _add_product_edge
    for v, w, matrix in edges:
        add_edge(model, v, w, matrix / scale)
    for group in groups:
        columns = np.concatenate([model.node_columns[v] for v, _ in group.terms])
        bytes_ = np.concatenate([t for _, t in group.terms])
        model.add_row(columns, bytes_ / budget, _LE, (budget - group.constant) / budget)
    return model


def _least_memory_model(groups: list[_MemoryGroup]) -> tuple[_Model, int]:
    """Minimise z subject to z >= every group's bytes (scaled by the largest upper bound).
    **Returns:** the model and the column of z."""
    scale = max(g.upper() for g in groups) or 1.0
    model = _Model()
    for v, t in sorted({v: t for g in groups for v, t in g.terms}.items()):
        model.add_one_hot_node(v, np.zeros(len(t)))
    (peak,) = model.add_columns([1.0], binary=False)
    for group in groups:
        columns = np.concatenate([model.node_columns[v] for v, _ in group.terms] + [[peak]])
        coefficients = np.concatenate([t / scale for _, t in group.terms] + [[-1.0]])
        model.add_row(columns, coefficients, _LE, -group.constant / scale)
    return model, int(peak)


# --------------------------------------------------------------------------------------
# Running pulp
# --------------------------------------------------------------------------------------


def _solver_name(solver: SolverName) -> Literal["highs", "cbc"]:
    if solver not in ("auto", "highs", "cbc"):
        raise ValueError(f'solver must be "auto", "highs" or "cbc", got {solver!r}.')
    highs_available = pulp.HiGHS(msg=False).available()
    if solver == "highs" and not highs_available:
        raise ValueError('solver="highs" needs the highspy package: pip install highspy, '
                         'or pass solver="cbc".')
    if solver == "auto":
        return "highs" if highs_available else "cbc"
    return solver


def _pulp_solver(name: Literal["highs", "cbc"], time_limit: float, msg: bool):
    common = dict(msg=msg, timeLimit=time_limit, gapRel=MIP_RELATIVE_GAP,
                  gapAbs=MIP_ABSOLUTE_GAP, threads=SOLVER_THREADS)
    if name == "highs":
        return pulp.HiGHS(random_seed=SOLVER_RANDOM_SEED, **common)
    options = [f"randomCbcSeed {SOLVER_RANDOM_SEED + 1}"]  # CBC reads 0 as "seed from clock"
    if pulp.COIN_CMD(msg=False).available():  # a CBC binary on PATH
        return pulp.COIN_CMD(options=options, **common)
    with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC, still shipped
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(options=options, **common)


def _to_pulp(model: _Model) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    """The model as a pulp problem; zero-padded names keep pulp's name-sorted column order
    equal to ours."""
    problem = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
    width = len(str(len(model.cost)))
    variables = [
        problem.add_variable(f"x{i:0{width}d}", 0, 1 if b else None,
                             pulp.LpBinary if b else pulp.LpContinuous)
        for i, b in enumerate(model.binary)
    ]
    problem.setObjective(pulp.LpAffineExpression(
        [(variables[i], c) for i, c in enumerate(model.cost) if c != 0]))
    width = len(str(len(model.rows)))
    for r, (columns, coefficients, sense, rhs) in enumerate(model.rows):
        terms = pulp.LpAffineExpression([(variables[c], a) for c, a in zip(columns, coefficients)])
        problem.addConstraint(pulp.LpConstraint(terms, sense, f"c{r:0{width}d}", rhs))
    return problem, variables


def _run(built, solver: Literal["highs", "cbc"], time_limit: float, msg: bool):
    """Solve a model built by `_to_pulp` (None: a model without columns).

    **Returns:** (column values or None, status), status one of "optimal", "time_limit",
    "infeasible", "no_solution".
    """
    if built is None:
        return np.zeros(0), "optimal"
    problem, variables = built
    problem.solve(_pulp_solver(solver, time_limit, msg))
    if problem.status == pulp.LpStatusInfeasible:
        return None, "infeasible"
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, "no_solution"
    values = np.array([v.varValue if v.varValue is not None else 0.0 for v in variables])
    return values, "optimal" if problem.sol_status == pulp.LpSolutionOptimal else "time_limit"


def _node_choices(model: _Model, values: np.ndarray) -> dict[int, int]:
    choice = {}
    for v, columns in model.node_columns.items():
        k = int(np.argmax(values[columns]))
        assert values[columns[k]] > CHOSEN_THRESHOLD, f"no strategy chosen for merged node {v}"
        choice[v] = k
    return choice


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


def _prefer_lower_indices(
    graph: _CostGraph, groups: list[_MemoryGroup], budget: float | None, choice: dict[int, int]
) -> None:
    """Deterministic tie-break: in node order, move each node to the lowest strategy that
    costs no more with its neighbours fixed and keeps every memory group within budget."""
    groups_of: dict[int, list[_MemoryGroup]] = {}
    for group in groups:
        for v, _ in group.terms:
            groups_of.setdefault(v, []).append(group)

    def fits(v: int) -> bool:
        return all(
            group.constant + math.fsum(float(t[choice[w]]) for w, t in group.terms) <= budget
            for group in groups_of.get(v, ())
        )

    for v in sorted(graph.node_cost):
        local, current = graph.local_cost(v, choice), choice[v]
        for k in range(current):
            if local[k] <= local[current]:
                choice[v] = k
                if fits(v):
                    break
                choice[v] = current


def _budget_groups(problem: ShardingProblem, root, strategy_of, solver) -> list[_MemoryGroup]:
    """The memory groups the budget constrains; raises if one can never fit."""
    budget = problem.memory_budget
    if budget is None:
        return []
    groups = _binding_groups(_memory_groups(problem, root, strategy_of), budget)
    if any(group.constant > budget for group in groups):
        raise MemoryBudgetError(budget, least_memory(problem, solver=solver))
    return groups


def _check_options(time_limit: float, formulation: str) -> None:
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}.")
    if formulation not in ("marginal", "product"):
        raise ValueError(f'formulation must be "marginal" or "product", got {formulation!r}.')


def solve(
    problem: ShardingProblem,
    *,
    time_limit: float = 60.0,
    solver: SolverName = "auto",
    msg: bool = False,
    formulation: Formulation = "marginal",
) -> Solution:
    """Choose one strategy per node minimising total cost under the memory budget.

    **Arguments:**
    - `problem`: the numbers (see `ShardingProblem`).
    - `time_limit`: seconds the MILP solver may run; past it the best plan found so far is
      returned with status "time_limit".
    - `solver`: "highs" (pulp + highspy), "cbc" (pulp's bundled CBC) or "auto" (HiGHS when
      highspy is installed, else CBC).
    - `msg`: print the solver's log.
    - `formulation`: edge linearisation, "marginal" (Alpa's, the default: fastest in
      benchmarks/ilp_scaling.py) or "product".

    **Returns:** a `Solution` whose choices honour followers and the budget.

    **Raises:** `MemoryBudgetError` if no choice fits the budget; `RuntimeError` if the
    solver found no plan within the time limit.

    Example: two nodes, one edge; node 1 prefers strategy 1 but resharding costs 5:
    ``solve(ShardingProblem(([0., 1.], [2., 0.]), [(0, 1)], [[[0., 5.], [5., 0.]]]))``
    picks (1, 1) with objective 1: node 0 takes its dearer strategy to avoid resharding.
    """
    _check_options(time_limit, formulation)
    solver_name = _solver_name(solver)
    start = time.perf_counter()
    root, strategy_of = resolve_followers(problem)
    graph = _merge(problem, root, strategy_of)
    num_merged = len(graph.node_cost)
    budget = problem.memory_budget
    groups = _budget_groups(problem, root, strategy_of, solver)
    reduction = _reduce(graph, groups, budget)
    model = _sharding_model(reduction.graph, reduction.groups, budget, formulation)
    built = _to_pulp(model) if model.cost else None
    build_time = time.perf_counter() - start
    start = time.perf_counter()
    values, status = _run(built, solver_name, time_limit, msg)
    solve_time = time.perf_counter() - start
    if status == "infeasible":
        assert groups, "a sharding ILP without memory constraints is always feasible"
        raise MemoryBudgetError(budget, least_memory(problem, solver=solver))
    if status == "no_solution":
        raise RuntimeError(
            f"the {solver_name} solver found no plan within time_limit={time_limit} s "
            f"({len(model.cost)} variables); pass a larger time_limit to solve()."
        )
    choice = reduction.recover(_node_choices(model, values))
    _prefer_lower_indices(graph, groups, budget, choice)
    choices = tuple(int(strategy_of[v][choice[int(root[v])]]) for v in range(problem.num_nodes))
    stats = SolveStats(
        num_nodes=problem.num_nodes,
        num_nodes_after_merge=num_merged,
        num_ilp_nodes=len(model.node_columns),
        num_variables_before_merge=_alpa_variable_count(problem),
        num_variables=len(model.cost),
        num_constraints=len(model.rows),
        build_time=build_time,
        solve_time=solve_time,
        solver=solver_name if model.cost else "none",
        formulation=formulation,
    )
    return Solution(choices, evaluate(problem, choices), status, stats)


def _alpa_variable_count(problem: ShardingProblem) -> int:
    """Variables of the plain formulation: node strategies plus edge strategy pairs."""
    sizes = problem.num_strategies
    return sum(sizes) + sum(sizes[u] * sizes[v] for u, v in problem.edges)


def least_memory(
    problem: ShardingProblem, *, time_limit: float = 60.0, solver: SolverName = "auto"
) -> float:
    """The least, over choices that honour followers, of the largest memory group total.

    Costs are ignored: this is the smallest `memory_budget` for which `solve` can succeed.

    **Arguments:**
    - `problem`: the problem (its own `memory_budget` is ignored).
    - `time_limit`, `solver`: as for `solve`.

    **Returns:** bytes per device; 0.0 when the problem has no memory groups.
    """
    _check_options(time_limit, "marginal")
    root, strategy_of = resolve_followers(problem)
    groups = _memory_groups(problem, root, strategy_of)
    if not any(group.terms for group in groups):
        return max((group.constant for group in groups), default=0.0)
    model, _ = _least_memory_model(groups)
    values, status = _run(_to_pulp(model), _solver_name(solver), time_limit, msg=False)
    if values is None:
        raise RuntimeError(
            f"the solver found no strategy choice within time_limit={time_limit} s while "
            "computing the least memory; pass a larger time_limit."
        )
    choice = _node_choices(model, values)
    choices = [int(strategy_of[v][choice.get(int(root[v]), 0)]) for v in range(problem.num_nodes)]
    return peak_memory(problem, choices)
