"""Brute-force reference for the sharding ILP: try every choice (tests only).

In: a small `ShardingProblem`. Out: the same `Solution` `solve` returns, found by
enumerating every strategy choice of the nodes that follow no one (followers derive
theirs), vectorised with numpy. Slow by design and exact; the tests check `solve` against it.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autopar.intra._ilp import (
    MemoryBudgetError,
    ShardingProblem,
    Solution,
    SolveStats,
    evaluate,
    peak_memory,
    resolve_followers,
)

# Enumeration holds every choice in memory (combinations x nodes int64), so a million
# combinations of a few dozen nodes is the most a test should ask for.
MAX_COMBINATIONS = 1_000_000


def all_choices(problem: ShardingProblem) -> np.ndarray:
    """Every follower-consistent choice, one per row, in lexicographic order of the leaders.

    **Arguments:**
    - `problem`: the problem; its leaders' strategy counts must multiply to at most
      `MAX_COMBINATIONS`.

    **Returns:** int64[num_combinations, num_nodes].
    """
    root, strategy_of = resolve_followers(problem)
    leaders = sorted({int(r) for r in root})
    sizes = [problem.num_strategies[v] for v in leaders]
    count = math.prod(sizes)
    if count > MAX_COMBINATIONS:
        raise ValueError(
            f"brute force would try {count} choices, more than {MAX_COMBINATIONS}; use "
            "solve() for problems this large."
        )
    leader_choices = np.indices(sizes).reshape(len(sizes), -1).T
    column = {v: k for k, v in enumerate(leaders)}
    choices = [strategy_of[v][leader_choices[:, column[int(root[v])]]] for v in range(len(root))]
    return np.stack(choices, axis=1)


def _objectives(problem: ShardingProblem, choices: np.ndarray) -> np.ndarray:
    total = np.zeros(len(choices))
    for v, cost in enumerate(problem.node_costs):
        total += cost[choices[:, v]]
    for (u, v), matrix in zip(problem.edges, problem.edge_costs):
        total += matrix[choices[:, u], choices[:, v]]
    return total


def _peaks(problem: ShardingProblem, choices: np.ndarray) -> np.ndarray:
    peak = np.zeros(len(choices))
    for group in problem.memory_groups:
        total = sum(problem.node_memory[v][choices[:, v]] for v in group)
        peak = np.maximum(peak, total)
    return peak


def least_memory_brute_force(problem: ShardingProblem) -> float:
    """`least_memory` by enumeration. **Returns:** bytes per device."""
    choices = all_choices(problem)
    best = int(np.argmin(_peaks(problem, choices)))
    return peak_memory(problem, choices[best])


def solve_brute_force(problem: ShardingProblem) -> Solution:
    """`solve` by enumeration; ties go to the lexicographically first leader choice.

    **Arguments:**
    - `problem`: a small problem (see `MAX_COMBINATIONS`).

    **Returns:** an optimal `Solution` (stats count no ILP variables).

    **Raises:** `MemoryBudgetError` if no choice fits the budget.
    """
    start = time.perf_counter()
    choices = all_choices(problem)
    objective = _objectives(problem, choices)
    if problem.memory_budget is not None and problem.memory_groups:
        peaks = _peaks(problem, choices)
        fits = peaks <= problem.memory_budget
        if not fits.any():
            least = peak_memory(problem, choices[int(np.argmin(peaks))])
            raise MemoryBudgetError(problem.memory_budget, least)
        objective = np.where(fits, objective, np.inf)
    if problem.footprint_budget is not None:
        footprint = sum(m[choices[:, v]] for v, m in enumerate(problem.footprint))
        fits = footprint <= problem.footprint_budget
        if not fits.any():
            raise MemoryBudgetError(problem.footprint_budget, float(footprint.min()), "footprint")
        objective = np.where(fits, objective, np.inf)
        if np.isinf(objective).all():
            raise MemoryBudgetError(problem.memory_budget, float(_peaks(problem, choices).min()))
    best = tuple(int(k) for k in choices[int(np.argmin(objective))])
    stats = SolveStats(
        num_nodes=problem.num_nodes,
        num_nodes_after_merge=problem.num_nodes - len(problem.followers),
        num_ilp_nodes=0,
        num_variables_before_merge=0,
        num_variables=0,
        num_constraints=0,
        build_time=0.0,
        solve_time=time.perf_counter() - start,
        solver="brute_force",
        formulation="enumeration",
    )
    return Solution(best, evaluate(problem, best), "optimal", stats)
