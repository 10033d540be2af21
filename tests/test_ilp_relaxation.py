"""The first HiGHS solve takes the LP relaxation's optimum when it is integral (issue 18).

`run_model` has HiGHS solve the relaxation first and returns it when every binary is 0 or 1;
otherwise it runs the MIP. Both paths must give the brute-force optimum, and the test
checks which path each problem took.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import spy_integral_relaxation

from autopar.intra._ilp import ShardingProblem, evaluate, solve
from autopar.intra._ilp_reference import solve_brute_force

pytest.importorskip("highspy")


def _complete(num_nodes: int, node_cost, edge_cost) -> ShardingProblem:
    """Every pair of nodes joined (each node keeps 4 neighbours: nothing is eliminated
    before the solver sees it)."""
    edges = tuple(itertools.combinations(range(num_nodes), 2))
    return ShardingProblem(
        tuple(np.array(node_cost(v), float) for v in range(num_nodes)),
        edges,
        tuple(np.array(edge_cost, float) for _ in edges),
    )


@pytest.mark.parametrize("name", ["agreeing", "frustrated"])
def test_integral_relaxation_or_mip_gives_the_optimum(name, monkeypatch):
    integral = spy_integral_relaxation(monkeypatch)
    if name == "agreeing":
        # Neighbours want the same strategy and every node prefers strategy 0: the
        # relaxation's optimum is the integral all-zero choice, of cost 0.
        problem = _complete(5, lambda v: [0.0, 1.0 + v, 2.0], 1.0 - np.eye(3))
    else:
        # Neighbours want different strategies, of which there are 2 for 5 nodes: the
        # relaxation splits every node half and half (cost 0); the MIP pays 4.
        problem = _complete(5, lambda v: [0.0, 0.0], np.eye(2))
    found, reference = solve(problem), solve_brute_force(problem)
    assert math.isclose(found.objective, reference.objective, abs_tol=1e-12)
    assert found.choices == reference.choices
    assert integral == [name == "agreeing"], integral


def _frustrated(seed: int) -> ShardingProblem:
    """7 nodes, every pair joined, 3 strategies: neighbours are charged for agreeing (plus
    noise), so no plan pleases every edge and the relaxation splits nodes over strategies."""
    rng = np.random.default_rng(seed)
    edges = tuple(itertools.combinations(range(7), 2))
    return ShardingProblem(
        tuple(rng.random(3) for _ in range(7)),
        edges,
        tuple(2.0 * np.eye(3) + rng.random((3, 3)) for _ in edges),
    )


@pytest.mark.parametrize("seed", range(2))
def test_fractional_relaxation_solves_within_the_incumbent(seed, monkeypatch):
    """A fractional relaxation: the MIP over the strategies reduced-cost fixing keeps for
    plans as cheap as the rounded, locally improved relaxation; still the optimum."""
    import autopar.intra._ilp as ilp

    calls = []
    real = ilp._solve_within_incumbent

    def spy(reduction, model, *args):
        values, status = real(reduction, model, *args)
        calls.append((len(model.cost), status))
        return values, status

    monkeypatch.setattr(ilp, "_solve_within_incumbent", spy)
    # Which HiGHS MIPs ran, and with presolve or not: the MIP started from the incumbent
    # without (`without_presolve`), the tie-break with.
    from autopar.intra import _ilp_model

    mips = []
    highs = _ilp_model._HighsBuilt._highs

    def spy_highs(built, mip, options):
        if mip:
            mips.append(("tie-break" if built.tie_break else "first",
                         options.get("presolve", "on")))
        return highs(built, mip, options)

    monkeypatch.setattr(_ilp_model._HighsBuilt, "_highs", spy_highs)
    problem = _frustrated(seed)
    found, reference = solve(problem), solve_brute_force(problem)
    assert calls and calls[0][1] == "optimal", calls
    assert mips[0] == ("first", "off"), mips
    assert all(presolve == "on" for kind, presolve in mips if kind == "tie-break"), mips
    assert math.isclose(found.objective, reference.objective, rel_tol=1e-12)
    assert found.choices == reference.choices


def test_local_descent_reaches_a_local_optimum():
    from autopar.intra._ilp import _local_descent, merge_followers, resolve_followers

    problem = _frustrated(0)
    graph = merge_followers(problem, *resolve_followers(problem))
    choice = _local_descent(graph, dict.fromkeys(range(7), 0))
    for v in range(7):
        local = graph.local_cost(v, choice)
        assert local[choice[v]] == local.min(), (v, local)
    assert evaluate(problem, tuple(choice[v] for v in range(7))) < evaluate(problem, (0,) * 7)
