"""Models with memory rows start from their LP relaxation too (issue 45).

HiGHS solves the relaxation of every sharding model first, memory rows included: an
integral one is the optimum, a fractional one gives an incumbent (rounded, improved node
by node within the budget: `_descent_in_budget`) and duals that fix strategies for the MIP
and for the tie-break's first round. Every path must give the brute-force optimum, the
lowest-index plan among equal-cost optima.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import spy_integral_relaxation

from autopar.intra._ilp import (
    ShardingProblem,
    merge_followers,
    merged_memory_groups,
    peak_memory,
    resolve_followers,
    solve,
)
from autopar.intra._ilp_reference import solve_brute_force

pytest.importorskip("highspy")


def _problem(seed: int, budget_share: float, frustrated: bool) -> ShardingProblem:
    """7 nodes, every pair joined, 3 strategies; strategy 0 the cheapest and the largest
    in memory, so the budget (`budget_share` of the way from the least to the most memory
    of the whole graph in one group) binds. Frustrated: neighbours are charged for
    agreeing, so the relaxation splits nodes."""
    rng = np.random.default_rng(seed)
    n = 7
    edges = tuple(itertools.combinations(range(n), 2))
    same = 2.0 * np.eye(3) if frustrated else 2.0 * (1.0 - np.eye(3))
    memory = tuple(np.array([3.0, 2.0, 1.0]) + rng.random(3) for _ in range(n))
    least = sum(float(m.min()) for m in memory)
    most = sum(float(m.max()) for m in memory)
    return ShardingProblem(
        tuple(np.array([0.0, 1.0, 2.0]) + rng.random(3) for _ in range(n)),
        edges,
        tuple(same + 0.1 * rng.random((3, 3)) for _ in edges),
        node_memory=memory,
        memory_groups=(tuple(range(n)),),
        memory_budget=least + budget_share * (most - least),
    )




@pytest.mark.parametrize("frustrated", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_memory_rows_solved_from_the_relaxation_give_the_optimum(seed, frustrated,
                                                                 monkeypatch):
    integral = spy_integral_relaxation(monkeypatch)
    problem = _problem(seed, 0.5, frustrated)
    found, reference = solve(problem), solve_brute_force(problem)
    assert integral, "the relaxation of a model with a memory row is tried"
    assert math.isclose(found.objective, reference.objective, rel_tol=1e-12)
    assert found.choices == reference.choices
    assert peak_memory(problem, found.choices) <= problem.memory_budget
    assert found.stats.tie_break == "canonical"


def test_a_fractional_relaxation_under_memory_solves_within_the_incumbent(monkeypatch):
    """The incumbent of a frustrated model under a binding budget fits it, and the MIP
    over the strategies kept for plans as cheap finds the brute-force optimum."""
    import autopar.intra._ilp as ilp

    integral = spy_integral_relaxation(monkeypatch)
    incumbents = []
    descent = ilp._descent_in_budget

    def spy(graph, choice, groups, budget):
        found = descent(graph, choice, groups, budget)
        incumbents.append(found)
        return found

    monkeypatch.setattr(ilp, "_descent_in_budget", spy)
    problem = _problem(0, 0.5, frustrated=True)
    found, reference = solve(problem), solve_brute_force(problem)
    assert integral[0] is False and incumbents and incumbents[0] is not None
    assert found.choices == reference.choices


def test_descent_in_budget_keeps_the_budget_or_gives_up():
    from autopar.intra._ilp import _descent_in_budget

    problem = _problem(1, 0.3, frustrated=True)
    root, strategy_of = resolve_followers(problem)
    graph = merge_followers(problem, root, strategy_of)
    groups = merged_memory_groups(problem, root, strategy_of)
    budget = problem.memory_budget
    # From the leanest plan every move is checked against the budget: the result fits.
    leanest = {v: int(np.argmin(problem.node_memory[v])) for v in range(7)}
    found = _descent_in_budget(graph, leanest, groups, budget)
    assert found is not None
    assert peak_memory(problem, tuple(found[v] for v in range(7))) <= budget
    # Where neighbours want to agree, the largest plan (every node on its cheapest
    # strategy) is over the budget and the descent only moves to cheaper strategies:
    # no node moves, and the plan is not handed out as an incumbent.
    agreeing = _problem(1, 0.3, frustrated=False)
    graph = merge_followers(agreeing, root, strategy_of)
    groups = merged_memory_groups(agreeing, root, strategy_of)
    assert peak_memory(agreeing, (0,) * 7) > agreeing.memory_budget
    assert _descent_in_budget(graph, dict.fromkeys(range(7), 0), groups,
                              agreeing.memory_budget) is None


def test_dominance_checked_in_chunks_matches_every_column_at_once(monkeypatch):
    """A hub node (many neighbours, more columns than `_EXACT_CHUNK_COLUMNS`): the pairs
    dropped chunk by chunk are exactly those the exact terms over every column reject,
    planted dominated strategies (a copy plus a constant) included."""
    import autopar.intra._ilp_reduce as reduce

    rng = np.random.default_rng(0)
    size, neighbours = 12, 40
    cost = rng.random(size)
    matrices = [rng.random((size, int(rng.integers(8, 20)))) for _ in range(neighbours)]
    for dominated, by in ((5, 2), (9, 4), (11, 2)):  # b = a + a constant: a dominates b
        cost[dominated] = cost[by] + 0.25
        for m in matrices:
            m[dominated] = m[by] + 0.01
    assert sum(m.shape[1] for m in matrices) > reduce._EXACT_CHUNK_COLUMNS
    chunked = reduce._dominates(cost, matrices)
    monkeypatch.setattr(reduce, "_EXACT_CHUNK_COLUMNS", 10**9)
    whole = reduce._dominates(cost, matrices)
    np.testing.assert_array_equal(chunked, whole)
    assert chunked[2, 5] and chunked[4, 9] and chunked[2, 11] and chunked.sum() >= 3
