"""The numbers of the sharding ILP, its result types and the exact measures of a choice.

In: node cost vectors, edge resharding matrices, memory per strategy, memory groups, a
memory budget and followers, given to `ShardingProblem`, which validates them (every error
says what is wrong and how to fix it) and freezes them as float64 / int64 arrays.
Out: `ShardingProblem`; the result types `Solution` and `SolveStats`; `MemoryBudgetError`;
`resolve_followers` (follower chains to their root leaders); and, for a given choice of
strategies, `evaluate` (its total cost) and `peak_memory` (its largest memory group).

Nothing here solves anything: the solver (`_ilp.py`) and the brute-force reference
(`_ilp_reference.py`) both build on these definitions.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

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
    - `footprint`: a second memory limit, on memory held for the whole run rather than at
      one program point: bytes per device of node i per strategy, float64[S_i] (weights
      already applied), or empty. A pipeline stage holds each layer's state, accumulated
      gradients and the kept activations of every microbatch in flight, which the
      `memory_groups` (one microbatch's liveness) do not see.
    - `footprint_budget`: bytes per device sum_v footprint[v][s_v] must fit in; needs
      `footprint`.

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
    footprint: tuple[np.ndarray, ...] = ()
    footprint_budget: float | None = None

    def __post_init__(self):
        _check_problem(self)

    # Pickled as checked (a solver pool sends problems to its workers): the followers'
    # read-only view does not pickle, a dict does.
    def __getstate__(self):
        state = dict(self.__dict__)
        state["followers"] = dict(state["followers"])
        return state

    def __setstate__(self, state):
        state["followers"] = types.MappingProxyType(state["followers"])
        self.__dict__.update(state)

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @functools.cached_property
    def num_strategies(self) -> tuple[int, ...]:
        # cached: loops over nodes read it per node (quadratic before, issue 18)
        return tuple(len(c) for c in self.node_costs)


@dataclass(frozen=True)
class SolveStats:
    """Sizes and timings of one solve.

    `num_variables_before_merge` counts the plain Alpa formulation of the original problem
    (one binary per node strategy, one variable per strategy pair of every edge);
    `num_variables` and `num_constraints` are those of the ILP actually solved, after
    merging, pruning and elimination. `num_ilp_nodes` is the nodes left in that ILP.
    `solve_time` covers both solves: the least cost, then the tie-break among equal-cost
    plans (`tie_break_time` of it). `tie_break` is "canonical" (the plan is the unique
    canonical one among equal-cost optima, whatever the solver), "skipped" (the first
    solve stopped at its time limit), "incomplete" (the tie-break stopped at the time
    limit; the plan is of optimal cost but another solver might pick another such plan)
    or "cutoff" (no plan costs less than `solve`'s `cutoff`: the tie-break was not run,
    the plan is of optimal cost).
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
    tie_break: str = "canonical"
    tie_break_time: float = 0.0


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
    choice reaches (see `least_memory`), both in bytes. `kind` is "peak" (the memory groups
    against `memory_budget`) or "footprint" (against `footprint_budget`).
    """

    def __init__(self, budget: float, least: float, kind: str = "peak"):
        from autopar.cost._units import format_gib

        self.budget = budget
        self.least_memory = least
        self.kind = kind
        if kind == "footprint":
            super().__init__(
                f"footprint budget of {format_gib(budget)} per device is infeasible: the "
                f"least footprint any choice of strategies reaches is {format_gib(least)}. "
                f"Raise footprint_budget to at least {least:.6g} bytes."
            )
            return
        super().__init__(
            f"memory budget of {format_gib(budget)} per device is infeasible: the least "
            f"memory per device any choice of strategies reaches is {format_gib(least)}. "
            f"Raise memory_budget to at least {least:.6g} bytes, or lower the memory needed "
            "(more devices, more pipeline stages, smaller micro-batches, rematerialisation)."
        )

    def __reduce__(self):  # pickles with its numbers (a solver pool hands it back)
        return type(self), (self.budget, self.least_memory, self.kind)


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def node_name(problem: ShardingProblem, v: int) -> str:
    """`names[v]` if names were given, else "node v"."""
    return f"node {v} ({problem.names[v]!r})" if problem.names else f"node {v}"


def _float_vectors(values, what: str, lengths: Sequence[int] | None = None,
                   nonnegative: str | None = None) -> tuple[np.ndarray, ...]:
    """Each of `values` as a float64 vector (a copy), checked: non-empty, 1-D, of
    `lengths[i]` entries when given, finite, and >= 0 when `nonnegative` (the message then).
    The finiteness and sign checks run once over all vectors (issue 18: per vector they
    were most of a problem's validation)."""
    arrays = tuple(np.array(v, dtype=np.float64) for v in values)
    for i, array in enumerate(arrays):
        if array.ndim != 1 or array.size == 0:
            raise ValueError(
                f"{what}[{i}] must be a non-empty 1-D array, got shape {array.shape}."
            )
        if lengths is not None and array.size != lengths[i]:
            raise ValueError(
                f"{what}[{i}] has {array.size} entries but the node has {lengths[i]} "
                "strategies."
            )
    joined = np.concatenate(arrays) if arrays else np.zeros(0)
    if not np.isfinite(joined).all():
        i = next(i for i, a in enumerate(arrays) if not np.isfinite(a).all())
        raise ValueError(
            f"{what}[{i}] has a NaN or infinite entry; drop impossible strategies instead of "
            "giving them infinite cost, or use a large finite cost."
        )
    if nonnegative is not None and (joined < 0).any():
        raise ValueError(nonnegative)
    return arrays


def _check_problem(p: ShardingProblem) -> None:
    """Validate `p` and freeze its fields as float64/int64 arrays and tuples."""
    put = lambda name, value: object.__setattr__(p, name, value)
    if len(p.node_costs) == 0:
        raise ValueError("ShardingProblem needs at least one node in node_costs.")
    put("node_costs", _float_vectors(p.node_costs, "node_costs"))
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
        if matrix.shape != (sizes[u], sizes[v]):
            raise _edge_error(k, (u, v), (sizes[u], sizes[v]), matrix.shape)
        matrices.append(matrix)
    if matrices and not np.isfinite(np.concatenate([m.ravel() for m in matrices])).all():
        k = next(k for k, m in enumerate(matrices) if not np.isfinite(m).all())
        u, v = p.edges[k]
        raise _edge_error(k, (u, v), (sizes[u], sizes[v]), matrices[k].shape)
    put("edge_costs", tuple(matrices))
    _check_memory(p, put)
    _check_followers(p, put)


def _edge_error(k: int, edge, shape, got) -> ValueError:
    return ValueError(
        f"edge_costs[{k}] for edge {edge} must be a finite array of shape "
        f"{shape} (strategies of both ends), got shape {got}."
    )


def _check_memory(p: ShardingProblem, put) -> None:
    n, sizes = p.num_nodes, p.num_strategies
    if p.node_memory:
        if len(p.node_memory) != n:
            raise ValueError(f"node_memory has {len(p.node_memory)} entries but {n} nodes.")
        memory = _float_vectors(p.node_memory, "node_memory", sizes,
                                "node_memory has a negative entry; memory is bytes per device.")
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
    if p.footprint:
        if len(p.footprint) != n:
            raise ValueError(f"footprint has {len(p.footprint)} entries but {n} nodes.")
        footprint = _float_vectors(p.footprint, "footprint", sizes,
                                   "footprint has a negative entry; memory is bytes per device.")
        put("footprint", footprint)
    if p.footprint_budget is not None:
        budget = float(p.footprint_budget)
        if not p.footprint:
            raise ValueError("footprint_budget was given without footprint; give both.")
        if not math.isfinite(budget) or budget <= 0:
            raise ValueError(
                f"footprint_budget must be a positive number of bytes, got {budget}."
            )
        put("footprint_budget", budget)


def _check_followers(p: ShardingProblem, put) -> None:
    followers = _valid_followers(p)
    if followers is None:  # some follower is wrong: find the first, as below, and say it
        followers = _checked_followers(p)
    put("followers", types.MappingProxyType(followers))
    resolve_followers(p)  # raises on cycles


def _valid_followers(p: ShardingProblem) -> dict | None:
    """`_checked_followers(p)` when every follower is valid, else None; the maps' bounds
    checked at once over all of them (per follower, two `np.any` calls were most of the
    followers' check: 1,900 followers a problem on the demo's 2-D meshes)."""
    n, sizes = p.num_nodes, p.num_strategies
    followers, bounds = {}, []
    for v, (u, strategy_map) in sorted(p.followers.items()):
        v, u = int(v), int(u)
        if not (0 <= v < n and 0 <= u < n) or u == v:
            return None
        mapping = np.array(strategy_map, dtype=np.int64)
        if mapping.shape != (sizes[u],):
            return None
        followers[v] = (u, mapping)
        bounds.append(sizes[v])
    if followers:
        maps = [m for _, m in followers.values()]
        joined = np.concatenate(maps)
        limit = np.repeat(np.array(bounds, dtype=np.int64), [len(m) for m in maps])
        if (joined < 0).any() or (joined >= limit).any():
            return None
    return followers


def _checked_followers(p: ShardingProblem) -> dict:
    """The followers as int64 maps, each checked; raises for the first wrong one."""
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
    return followers


def resolve_followers(p: ShardingProblem) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Resolve follower chains to their root leaders.

    **Arguments:**
    - `p`: the problem.

    **Returns:** `(root, strategy_of)`: `root[v]` is the node whose choice decides v (v
    itself for a non-follower) and `strategy_of[v][k]` is v's strategy when the root picks k.
    """
    n = p.num_nodes
    # (a list while resolving: a numpy scalar read per step was most of its time)
    root = [-1] * n
    strategy_of: list[np.ndarray | None] = [None] * n
    followers = p.followers
    for start in range(n):
        chain = []
        v = start
        while root[v] < 0 and v in followers:
            if v in chain:
                cycle = " -> ".join(node_name(p, w) for w in chain[chain.index(v) :] + [v])
                raise ValueError(f"followers form a cycle ({cycle}); one node must lead.")
            chain.append(v)
            v = followers[v][0]
        if root[v] < 0:
            root[v], strategy_of[v] = v, np.arange(p.num_strategies[v])
        for w in reversed(chain):
            leader, mapping = followers[w]
            root[w], strategy_of[w] = root[leader], mapping[strategy_of[leader]]
    return np.array(root, dtype=np.int64), tuple(strategy_of)


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



def footprint_total(problem: ShardingProblem, choices: Sequence[int]) -> float:
    """The footprint of a choice (bytes per device, see `ShardingProblem`); 0.0 without."""
    s = _check_choices(problem, choices)
    return math.fsum(m[s[v]] for v, m in enumerate(problem.footprint))


def with_footprint_price(problem: ShardingProblem, price: float) -> ShardingProblem:
    """`problem` whose objective also pays `price` (seconds per byte) for each byte of
    footprint: the Lagrangian relaxation of its footprint limit. Without the limit's row
    the problem keeps the shape of an unconstrained one (its LP relaxation is often
    integral), and for growing prices its optima trace the lower convex hull of the
    latency/footprint trade-off (Everett 1963: a minimiser of cost + price x footprint is
    a cheapest plan among those of at most its footprint)."""
    if not problem.footprint:
        raise ValueError("with_footprint_price: the problem has no footprint to price")
    if not price >= 0 or not math.isfinite(price):
        raise ValueError(f"with_footprint_price: price must be finite and >= 0, got {price}")
    costs = tuple(c + price * f for c, f in zip(problem.node_costs, problem.footprint))
    return replace(problem, node_costs=costs, footprint_budget=None)


def least_footprint(problem: ShardingProblem) -> float:
    """The least footprint over choices that honour followers (costs and peak memory
    ignored): each follower group's cheapest strategy, summed."""
    if not problem.footprint:
        return 0.0
    root, strategy_of = resolve_followers(problem)
    per_root: dict[int, np.ndarray] = {}
    for v, m in enumerate(problem.footprint):
        r = int(root[v])
        term = m[strategy_of[v]]
        per_root[r] = term if r not in per_root else per_root[r] + term
    return math.fsum(float(t.min()) for t in per_root.values())
