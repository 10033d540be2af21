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

from autopar.intra._ilp import ShardingProblem, solve
from autopar.intra._ilp_model import _HighsBuilt
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
    integral = []
    relaxation = _HighsBuilt.integral_relaxation

    def spy(self, *args):
        values = relaxation(self, *args)
        integral.append(values is not None)
        return values

    monkeypatch.setattr(_HighsBuilt, "integral_relaxation", spy)
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
