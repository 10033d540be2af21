"""The sharding ILP against brute force, hand-computed costs and its own error messages."""

import dataclasses
import math

import numpy as np
import pytest

from autopar.intra._ilp import (
    MemoryBudgetError,
    ShardingProblem,
    evaluate,
    footprint_total,
    least_footprint,
    least_memory,
    peak_memory,
    solve,
    with_footprint_price,
)
from autopar.intra._ilp_reference import (
    all_choices,
    least_memory_brute_force,
    solve_brute_force,
)

NUM_RANDOM_PROBLEMS = 40
RELATIVE_TOLERANCE = 1e-9


def random_problem(seed: int) -> ShardingProblem:
    """<= 8 nodes, <= 4 strategies. Even seeds: dense graphs (degree >= 3, so the ILP is not
    reduced away); odd seeds: sparse DAGs. Every third seed has followers, seeds 1 and 2 mod 4
    a memory budget between the least and the largest memory."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 9))
    sizes = rng.integers(1 if seed % 5 == 0 else 2, 5, n)
    cost_scale = rng.choice([1e-6, 1e-3, 1.0])  # seconds, as the cost model produces
    node_costs = [rng.random(s) * cost_scale for s in sizes]
    edges = []
    for v in range(1, n):
        if seed % 2 == 0:
            producers = [u for u in range(v) if rng.random() < 0.75]
        else:
            producers = rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False)
        edges += [(int(u), v) for u in producers]
    edges += [edges[0][::-1]] if rng.random() < 0.3 else []  # a parallel edge, reversed
    edge_costs = [rng.random((sizes[u], sizes[v])) * cost_scale for u, v in edges]
    followers = {}
    if seed % 3 == 0:
        for v in range(1, n):
            if rng.random() < 0.3:
                u = int(rng.integers(0, v))
                followers[v] = (u, rng.integers(0, sizes[v], sizes[u]))
    memory = {}
    if seed % 4 in (1, 2):
        node_memory = tuple(rng.integers(1, 2**30, s).astype(float) for s in sizes)
        groups = tuple(
            tuple(sorted(int(v) for v in rng.choice(n, int(rng.integers(2, n + 1)), replace=False)))
            for _ in range(int(rng.integers(1, 4)))
        )
        free = ShardingProblem(tuple(node_costs), node_memory=node_memory, memory_groups=groups,
                               followers=followers)
        least = least_memory_brute_force(free)
        most = max(sum(node_memory[v].max() for v in g) for g in groups)
        budget = least + rng.uniform(0, 0.5) * (most - least)
        memory = dict(node_memory=node_memory, memory_groups=groups, memory_budget=budget)
    return ShardingProblem(tuple(node_costs), tuple(edges), tuple(edge_costs),
                           followers=followers, **memory)


_SOLUTIONS = {}


def solved(seed: int):
    """(problem, ILP solution, brute-force solution), computed once per seed."""
    if seed not in _SOLUTIONS:
        problem = random_problem(seed)
        _SOLUTIONS[seed] = (problem, solve(problem), solve_brute_force(problem))
    return _SOLUTIONS[seed]


def assert_same_optimum(problem, solution, reference):
    assert math.isclose(solution.objective, reference.objective, rel_tol=RELATIVE_TOLERANCE,
                        abs_tol=1e-300), (solution.choices, reference.choices)
    assert solution.objective == evaluate(problem, solution.choices)  # also checks followers
    if problem.memory_budget is not None:
        assert peak_memory(problem, solution.choices) <= problem.memory_budget


@pytest.mark.parametrize("seed", range(NUM_RANDOM_PROBLEMS))
def test_ilp_matches_brute_force(seed):
    problem, solution, reference = solved(seed)
    assert solution.status == "optimal"
    assert_same_optimum(problem, solution, reference)


def test_random_problems_exercise_every_feature():
    seeds = range(NUM_RANDOM_PROBLEMS)
    with_ilp = [s for s in seeds if solved(s)[1].stats.num_ilp_nodes > 0]
    assert len(with_ilp) >= NUM_RANDOM_PROBLEMS // 3
    assert any(solved(s)[0].followers and s in with_ilp for s in seeds)
    assert any(solved(s)[0].memory_budget is not None and s in with_ilp for s in seeds)
    assert any(solved(s)[1].stats.num_ilp_nodes == 0 for s in seeds)  # fully reduced


@pytest.mark.parametrize("seed", [0, 2, 4, 6, 9, 10])
def test_product_formulation_matches_brute_force(seed):
    problem, _, reference = solved(seed)
    assert_same_optimum(problem, solve(problem, formulation="product"), reference)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 6])
def test_cbc_matches_brute_force(seed):
    problem, _, reference = solved(seed)
    solution = solve(problem, solver="cbc")
    assert solution.stats.solver in ("cbc", "none")
    assert_same_optimum(problem, solution, reference)


def three_node_problem(**memory) -> ShardingProblem:
    """Three nodes, strategy 0 = replicated, 1 = sharded; every pair joined.

    Costs (s0, s1, s2): c0 + c1 + c2 + R01 + R12 + R02
      000: 1 + 2 + 1.5 + 0 + 0 + 0     = 4.5
      001: 1 + 2 + 0.9 + 0 + 1.5 + 1   = 6.4
      010: 1 + .5 + 1.5 + 2 + .5 + 0   = 5.5
      011: 1 + .5 + 0.9 + 2 + 0 + 1    = 5.4
      100: 3 + 2 + 1.5 + 1 + 0 + 1     = 8.5
      101: 3 + 2 + 0.9 + 1 + 1.5 + 0   = 8.4
      110: 3 + .5 + 1.5 + 0 + .5 + 1   = 6.5
      111: 3 + .5 + 0.9 + 0 + 0 + 0    = 4.4   <- optimum without a budget
    Memory 2 bytes replicated, 4 sharded (contrived), one group: 6 + 2 * (number sharded).
    """
    return ShardingProblem(
        node_costs=([1.0, 3.0], [2.0, 0.5], [1.5, 0.9]),
        edges=((0, 1), (1, 2), (0, 2)),
        edge_costs=([[0, 2], [1, 0]], [[0, 1.5], [0.5, 0]], [[0, 1], [1, 0]]),
        node_memory=([2.0, 4.0],) * 3,
        memory_groups=((0, 1, 2),),
        names=("matmul", "add", "relu"),
        **memory,
    )


def test_hand_computed_three_node_example():
    solution = solve(three_node_problem())
    assert solution.choices == (1, 1, 1)
    assert solution.objective == pytest.approx(4.4, rel=1e-12)
    # At most one sharded node fits 9 bytes: 000 (4.5) beats 001 (6.4), 010 (5.5), 100 (8.5).
    solution = solve(three_node_problem(memory_budget=9.0))
    assert solution.choices == (0, 0, 0)
    assert solution.objective == pytest.approx(4.5, rel=1e-12)
    assert peak_memory(three_node_problem(), solution.choices) == 6.0


def test_infeasible_budget_reports_least_memory():
    with pytest.raises(MemoryBudgetError,
                       match=r"least memory per device .* reaches is .*\(6 B\)") as info:
        solve(three_node_problem(memory_budget=5.0))
    assert info.value.least_memory == 6.0 and info.value.budget == 5.0
    assert "Raise memory_budget to at least 6" in str(info.value)


def test_jointly_infeasible_groups_found_by_the_solver():
    # Each group alone fits 5 bytes, but node 1 follows node 0 and the two groups need
    # opposite choices; the least achievable peak is 10.
    problem = ShardingProblem(
        node_costs=([0.0, 1.0], [0.0, 0.0], [1.0, 0.0, 2.0]),
        edges=((0, 2), (1, 2), (0, 2)),
        edge_costs=(np.ones((2, 3)), np.ones((2, 3)), np.eye(2, 3)),
        node_memory=([0.0, 10.0], [10.0, 0.0], [1.0, 1.0, 1.0]),
        memory_groups=((0,), (1,)),
        memory_budget=5.0,
        followers={1: (0, [0, 1])},
    )
    with pytest.raises(MemoryBudgetError,
                       match=r"least memory per device .* reaches is .*\(10 B\)"):
        solve(problem)
    assert least_memory(problem) == 10.0


@pytest.mark.parametrize("seed", [1, 2, 5, 6, 9])
def test_least_memory_matches_brute_force(seed):
    problem = random_problem(seed)
    assert least_memory(problem) == least_memory_brute_force(problem)


def test_followers_are_merged_and_honoured():
    # 2 follows 1 follows 0 (a chain), 4 follows 3; edge (0, 2) lies inside one group.
    rng = np.random.default_rng(7)
    sizes = [3, 2, 4, 3, 2]
    edges = ((0, 2), (2, 3), (1, 4), (0, 3), (3, 1))
    problem = ShardingProblem(
        node_costs=tuple(rng.random(s) for s in sizes),
        edges=edges,
        edge_costs=tuple(rng.random((sizes[u], sizes[v])) for u, v in edges),
        followers={1: (0, [1, 0, 1]), 2: (1, [3, 2]), 4: (3, [1, 1, 0])},
    )
    solution = solve(problem)
    s = solution.choices
    assert s[1] == [1, 0, 1][s[0]] and s[2] == [3, 2][s[1]] and s[4] == [1, 1, 0][s[3]]
    assert solution.stats.num_nodes == 5 and solution.stats.num_nodes_after_merge == 2
    assert solution.stats.num_variables_before_merge == sum(sizes) + 12 + 12 + 4 + 9 + 6
    assert solution.objective == pytest.approx(solve_brute_force(problem).objective, rel=1e-12)


def test_parallel_edges_are_summed():
    rng = np.random.default_rng(3)
    costs = (rng.random(3), rng.random(2))
    first, second = rng.random((3, 2)), rng.random((2, 3))
    split = ShardingProblem(costs, ((0, 1), (1, 0)), (first, second))
    summed = ShardingProblem(costs, ((0, 1),), (first + second.T,))
    assert solve(split).choices == solve(summed).choices == solve_brute_force(summed).choices


def test_long_chain_is_eliminated_exactly():
    # 40 nodes in a chain: too many for brute force, solved by dynamic programming here.
    rng = np.random.default_rng(11)
    costs = [rng.random(4) for _ in range(40)]
    matrices = [rng.random((4, 4)) for _ in range(39)]
    problem = ShardingProblem(tuple(costs), tuple((v, v + 1) for v in range(39)), tuple(matrices))
    best = costs[0]
    for v in range(1, 40):
        best = (best[:, None] + matrices[v - 1]).min(axis=0) + costs[v]
    solution = solve(problem)
    assert solution.stats.num_ilp_nodes == 0 and solution.stats.solver == "none"
    assert solution.objective == pytest.approx(best.min(), rel=1e-12)


def test_same_problem_same_choices():
    first = [solve(random_problem(seed)).choices for seed in (0, 4, 8)]
    again = [solve(random_problem(seed)).choices for seed in (0, 4, 8)]
    assert first == again


def test_ties_go_to_the_lowest_strategy():
    # Strategies 0 and 2 of every node are identical copies: the plan must use 0, never 2.
    rng = np.random.default_rng(5)
    n = 6
    base_costs = [rng.random(2) for _ in range(n)]
    costs = tuple(np.array([c[0], c[1], c[0]]) for c in base_costs)
    edges = tuple((u, v) for u in range(n) for v in range(u + 1, n))
    matrices = []
    for _ in edges:
        m = rng.random((2, 2))
        matrices.append(m[np.ix_([0, 1, 0], [0, 1, 0])])
    solution = solve(ShardingProblem(costs, edges, tuple(matrices)))
    assert 2 not in solution.choices


def test_evaluate_rejects_a_follower_mismatch():
    problem = ShardingProblem(([0.0, 1.0], [0.0, 1.0]), followers={1: (0, [1, 0])})
    assert evaluate(problem, (0, 1)) == 1.0
    with pytest.raises(ValueError, match="node 1 follows node 0 and must pick strategy 1"):
        evaluate(problem, (0, 0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(node_costs=([1.0], [np.nan])), "NaN or infinite"),
        (dict(node_costs=([1.0], [2.0]), edges=((0, 0),), edge_costs=([[0.0]],)),
         "two different nodes"),
        (dict(node_costs=([1.0], [2.0, 3.0]), edges=((0, 1),), edge_costs=(np.zeros((2, 1)),)),
         r"shape \(1, 2\)"),
        (dict(node_costs=([1.0, 2.0], [2.0, 3.0]), followers={0: (1, [0, 1]), 1: (0, [1, 0])}),
         "followers form a cycle"),
        (dict(node_costs=([1.0, 2.0], [2.0]), followers={1: (0, [0, 1])}),
         "strategy index in \\[0, 1\\)"),
        (dict(node_costs=([1.0], [2.0]), memory_groups=((0, 1),)), "without node_memory"),
        (dict(node_costs=([1.0],), memory_budget=-1.0), "positive number of bytes"),
    ],
)
def test_invalid_problems_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardingProblem(**kwargs)


def test_invalid_solve_options_are_rejected():
    problem = three_node_problem()
    with pytest.raises(ValueError, match="time_limit must be a positive"):
        solve(problem, time_limit=0)
    with pytest.raises(ValueError, match='solver must be "auto", "highs" or "cbc"'):
        solve(problem, solver="gurobi")


def test_no_plan_within_the_time_limit_raises():
    # 120 nodes, 8 strategies, each joined to 6 others: nothing is reduced away, and no MILP
    # solver finds a plan in a millisecond.
    rng = np.random.default_rng(1)
    n, size = 120, 8
    edges = tuple((v, w) for v in range(n) for w in (v + 1, v + 7, v + 23) if w < n)
    problem = ShardingProblem(tuple(rng.random((n, size))),
                              edges, tuple(rng.random((len(edges), size, size))))
    with pytest.raises(RuntimeError, match="found no plan within time_limit=0.001 s"):
        solve(problem, time_limit=1e-3)


def _with_random_footprint(seed):
    """`random_problem(seed)` with a footprint of up to 1 MiB per strategy."""
    base = random_problem(seed)
    rng = np.random.default_rng(100 + seed)
    footprint = tuple(rng.integers(0, 2**20, len(c)).astype(float) for c in base.node_costs)
    return dataclasses.replace(base, footprint=footprint)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 6, 9])
def test_footprint_budget_matches_brute_force(seed):
    # A second, weighted limit over every node (a stage's memory held for the whole run),
    # alone (even seeds without memory groups) or beside the peak-memory groups.
    unlimited = _with_random_footprint(seed)
    fastest = solve_brute_force(unlimited)
    least = least_footprint(unlimited)
    assert least == min(
        footprint_total(unlimited, c) for c in all_choices(unlimited)
    )
    at_fastest = footprint_total(unlimited, fastest.choices)
    budget = least + 0.4 * (at_fastest - least) if at_fastest > least else at_fastest
    problem = dataclasses.replace(unlimited, footprint_budget=budget)
    try:
        reference = solve_brute_force(problem)
    except MemoryBudgetError:
        with pytest.raises(MemoryBudgetError):
            solve(problem)
        return
    solution = solve(problem)
    assert_same_optimum(problem, solution, reference)
    assert footprint_total(problem, solution.choices) <= budget


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 6, 9])
def test_priced_footprint_matches_brute_force(seed):
    # The Lagrangian memory levels: cost + price x footprint, minimised over every choice
    # (peak-memory groups kept where the problem has them), for growing prices; the
    # optima hold no more and cost no less as the price grows.
    unpriced = _with_random_footprint(seed)
    scale = max(float(np.ptp(c)) for c in unpriced.node_costs) / 2**20
    held, cost = [], []
    for multiple in (0.0, 0.1, 1.0, 10.0, 1e4):
        problem = with_footprint_price(unpriced, multiple * scale)
        try:
            reference = solve_brute_force(problem)
        except MemoryBudgetError:
            with pytest.raises(MemoryBudgetError):
                solve(problem)
            return
        solution = solve(problem)
        assert_same_optimum(problem, solution, reference)
        held.append(footprint_total(unpriced, solution.choices))
        cost.append(evaluate(unpriced, solution.choices))
    assert all(b <= a for a, b in zip(held, held[1:])), held
    assert all(b >= a * (1 - 1e-9) for a, b in zip(cost, cost[1:])), cost
    assert held[-1] == least_footprint(unpriced) or unpriced.memory_budget is not None


def test_footprint_price_needs_a_footprint_and_a_sane_price():
    problem = ShardingProblem(node_costs=(np.array([0.0, 1.0]),))
    with pytest.raises(ValueError, match="no footprint to price"):
        with_footprint_price(problem, 1.0)
    priced = dataclasses.replace(problem, footprint=(np.array([3.0, 1.0]),))
    with pytest.raises(ValueError, match="finite and >= 0"):
        with_footprint_price(priced, -1.0)
    # 3 bytes at cost 0 against 1 byte at cost 1: a price above 0.5 per byte flips it.
    assert solve(with_footprint_price(priced, 0.4)).choices == (0,)
    assert solve(with_footprint_price(priced, 0.6)).choices == (1,)


def test_footprint_error_names_the_least_footprint():
    problem = ShardingProblem(
        node_costs=(np.array([0.0, 1.0]), np.array([0.0, 1.0])),
        footprint=(np.array([8.0, 3.0]), np.array([5.0, 2.0])),
        footprint_budget=4.0,
    )
    with pytest.raises(MemoryBudgetError,
                       match=r"least footprint .* reaches is .*\(5 B\)") as error:
        solve(problem)
    assert error.value.kind == "footprint" and error.value.least_memory == 5.0
    # Footprints 13, 10, 8, 5 at costs 0, 1, 1, 2: under 9 the cheapest that fits is (1, 0).
    assert solve(dataclasses.replace(problem, footprint_budget=9.0)).choices == (1, 0)


def coupled_tie_problem():
    """Six nodes, every pair joined (so nothing is reduced away), with a unique optimum;
    then nodes 1 and 4 get a copy of their optimal strategy at index 0 (the others move up
    one), and the edge between them charges 10 for a copy beside a non-copy. Two plans are
    optimal: both copies, or both originals; moving either node alone costs 10 more, so a
    node-by-node tie-break cannot get from one to the other.

    **Returns:** the problem, its canonical plan (both copies: the lowest indices) and the
    other optimum (both originals).
    """
    rng = np.random.default_rng(21)
    n, pair = 6, (1, 4)
    edges = tuple((u, v) for u in range(n) for v in range(u + 1, n))
    costs = [rng.random(2) for _ in range(n)]
    matrices = [rng.random((2, 2)) for _ in edges]
    best = solve_brute_force(ShardingProblem(tuple(costs), edges, tuple(matrices))).choices
    # index map of each node: its new strategies as old ones
    old = [np.array([best[v], 0, 1]) if v in pair else np.arange(2) for v in range(n)]
    copy = [np.array([True, False, False]) if v in pair else np.zeros(2, bool) for v in range(n)]
    new_matrices = []
    for (u, v), m in zip(edges, matrices):
        m = m[np.ix_(old[u], old[v])]
        if (u, v) == pair:
            m = m + 10.0 * (copy[u][:, None] != copy[v][None, :])
        new_matrices.append(m)
    problem = ShardingProblem(tuple(c[k] for c, k in zip(costs, old)), edges, tuple(new_matrices))
    canonical = tuple(0 if v in pair else best[v] for v in range(n))
    originals = tuple(1 + best[v] if v in pair else best[v] for v in range(n))
    return problem, canonical, originals


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_coupled_tie_goes_to_the_lowest_strategies(solver):
    problem, canonical, originals = coupled_tie_problem()
    assert evaluate(problem, originals) == pytest.approx(evaluate(problem, canonical), rel=1e-12)
    one_moved = tuple(k if v == 1 else o for v, (k, o) in enumerate(zip(canonical, originals)))
    assert evaluate(problem, one_moved) > evaluate(problem, canonical) + 9
    solution = solve(problem, solver=solver)
    assert solution.stats.num_ilp_nodes == 6 and solution.stats.tie_break == "canonical"
    assert solution.choices == canonical == solve_brute_force(problem).choices


def duplicated_ties(seed: int) -> ShardingProblem:
    """Every strategy duplicated at a higher index, and some nodes given equal strategies:
    many equal-cost optima, one canonical plan."""
    base = random_problem(seed)
    twice = lambda c: np.concatenate([c, c])
    costs = [twice(c) for c in base.node_costs]
    for v in range(0, base.num_nodes, 3):
        costs[v] = np.full_like(costs[v], costs[v].min())
    matrices = [np.block([[m, m], [m, m]]) for m in base.edge_costs]
    return ShardingProblem(tuple(costs), base.edges, tuple(matrices))


@pytest.mark.parametrize("seed", [0, 4, 8])
def test_highs_and_cbc_break_ties_alike(seed):
    problem = duplicated_ties(seed)
    highs, cbc = solve(problem, solver="highs"), solve(problem, solver="cbc")
    assert highs.choices == cbc.choices
    assert highs.objective == pytest.approx(solve_brute_force(problem).objective, rel=1e-9)


@pytest.mark.parametrize("seed", [2, 4])
def test_every_fixing_round_keeps_the_canonical_plan(seed, monkeypatch):
    """HiGHS's tie-break fixes strategies in rounds (the first solve's simplex duals, a
    second simplex round on large models, forced here by `vertex_round_columns=0`, then
    the interior point), CBC's in one: the same canonical plan."""
    import autopar.intra._ilp as ilp

    rounds = []
    real = ilp._fixed_within

    def spy(*args):
        rounds.append(args[1].node_columns.keys())
        return real(*args)

    monkeypatch.setattr(ilp, "_fixed_within", spy)
    problem = duplicated_ties(seed)
    highs = solve(problem, solver="highs", vertex_round_columns=0)
    assert len(rounds) >= 2, rounds  # the second simplex round and the interior point ran
    assert highs.choices == solve(problem, solver="cbc").choices
    rounds.clear()  # by default this small LP skips the second round: one round, same plan
    assert solve(problem, solver="highs").choices == highs.choices
    assert len(rounds) == 1, rounds


def test_vertex_round_columns_is_checked():
    with pytest.raises(ValueError, match="vertex_round_columns must be a non-negative"):
        solve(duplicated_ties(0), vertex_round_columns=-1)


def test_time_limit_is_reported(monkeypatch):
    # The solver's status is forced: a real time limit that stops with a plan is not
    # repeatable. Stopped in the first solve: status "time_limit", no tie-break.
    import autopar.intra._ilp as ilp

    real = ilp.run_model

    def stopped(*args, **kwargs):
        values, status = real(*args, **kwargs)
        return values, "time_limit" if status == "optimal" else status

    monkeypatch.setattr(ilp, "run_model", stopped)
    problem, _, _ = coupled_tie_problem()
    solution = solve(problem)
    assert solution.status == "time_limit" and solution.stats.tie_break == "skipped"
    assert solution.objective == pytest.approx(solve_brute_force(problem).objective, rel=1e-9)

    # Stopped in the tie-break solve (the one with gap_rel=0): optimal, not canonical.
    def tie_break_stopped(*args, **kwargs):
        values, status = real(*args, **kwargs)
        stop = kwargs.get("gap_rel") == 0.0 and status == "optimal"
        return values, "time_limit" if stop else status

    monkeypatch.setattr(ilp, "run_model", tie_break_stopped)
    # (this problem's first plan is proved canonical without that solve, `_lowest_kept`:
    # turned off here so that the solve runs)
    monkeypatch.setattr(ilp, "_lowest_kept", lambda choice, keep: False)
    solution = solve(problem)
    assert solution.status == "optimal" and solution.stats.tie_break == "incomplete"


def test_wall_clock_seconds_do_not_stop_the_tie_break(monkeypatch):
    """A loaded machine (wall seconds far beyond CPU seconds) gets the same canonical plan:
    the time limit counts CPU seconds of this process (issue 18: on main a tiny GPT's
    leaner-memory MIP took 30 wall s of its 60 on a loaded machine, its tie-break stopped
    "incomplete" and the stage DP's answer changed with the load)."""
    import time as real_time

    import autopar.intra._ilp as ilp

    problem, canonical, _ = coupled_tie_problem()
    wall = [real_time.perf_counter()]

    def loaded_perf_counter():  # every wall-clock reading 100 s after the last
        wall[0] += 100.0
        return wall[0]

    monkeypatch.setattr(ilp.time, "perf_counter", loaded_perf_counter)
    solution = solve(problem, time_limit=50.0)
    assert solution.status == "optimal" and solution.stats.tie_break == "canonical"
    assert solution.choices == canonical
