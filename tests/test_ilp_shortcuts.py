"""Issue 45's exact shortcuts in building and solving a layer ILP: the resharding memo's
entry shared by tensors that differ only in dimensions left whole, and the tie-break
answered without its second solve when the first solve's plan takes every node's lowest
strategy left. Each must give what the long way gives."""

from __future__ import annotations

import numpy as np
import pytest

import autopar.intra._ilp as ilp
from autopar.cluster import Cluster, LogicalMesh
from autopar.intra._ilp import ShardingProblem, solve
from autopar.intra._ilp_model import _class_sums
from autopar.intra._ilp_reference import solve_brute_force
from autopar.intra._reshard import _reduced_key, reshard_time
from tests.test_ilp import coupled_tie_problem, duplicated_ties


@pytest.fixture(scope="module")
def machine():
    return Cluster.from_profile("dgx-a100-80g"), LogicalMesh.create((2, 4))


def test_tensors_alike_but_for_whole_dimensions_share_a_resharding_entry(machine):
    cluster, mesh = machine
    x, y = mesh.axis_names
    src, dst = ((), (), (x, y)), ((), (), ())  # an all-gather of the last dimension
    cache: dict = {}
    first = reshard_time((4, 3, 64), "float32", src, dst, mesh, cluster, cache)
    # (12, 1, 64) leaves 12 elements whole per column too: the entry is reused...
    key = _reduced_key((12, 1, 64), "float32", src, dst)
    assert key in cache and cache[key] == first
    before = len(cache)
    again = reshard_time((12, 1, 64), "float32", src, dst, mesh, cluster, cache)
    assert again == first == reshard_time((12, 1, 64), "float32", src, dst, mesh, cluster)
    assert len(cache) == before + 1  # only its own exact key was added
    # ... and what it reuses is what the collectives cost: no more, no less
    assert first > 0
    # a tensor with other whole dimensions, another dtype or other split sizes misses
    for shape, dtype in (((6, 1, 64), "float32"), ((4, 3, 64), "bfloat16"),
                         ((4, 3, 128), "float32")):
        assert _reduced_key(shape, dtype, src, dst) not in cache
        other = reshard_time(shape, dtype, src, dst, mesh, cluster, cache)
        assert other == reshard_time(shape, dtype, src, dst, mesh, cluster)
        assert other != first
    # every dimension split on some side: no reduced key
    assert _reduced_key((8, 64), "float32", ((x,), ()), ((), (y,))) is None


def test_class_sums_keep_column_order():
    columns = np.arange(10, 17)
    classes = np.array([2, 0, 2, 1, 0, 2, 1])
    sums = _class_sums(columns, classes, 3)
    assert [s.tolist() for s in sums] == [[11, 14], [13, 16], [10, 12, 15]]


@pytest.mark.parametrize("seed", [2, 8, 10, None])
def test_tie_break_shortcut_gives_the_second_solves_plan(seed, monkeypatch):
    """On problems with many equal-cost optima (`duplicated_ties`; None: the coupled tie,
    whose first plan is proved canonical by the shortcut), the plan with the shortcut is
    the plan without it."""
    problem = coupled_tie_problem()[0] if seed is None else duplicated_ties(seed)
    calls = []
    real = ilp._lowest_kept

    def spy(choice, keep):
        calls.append(real(choice, keep))
        return calls[-1]

    monkeypatch.setattr(ilp, "_lowest_kept", spy)
    short = solve(problem, solver="highs")
    monkeypatch.setattr(ilp, "_lowest_kept", lambda choice, keep: False)
    long = solve(problem, solver="highs")
    assert short.choices == long.choices and short.stats.tie_break == "canonical"
    assert short.objective == pytest.approx(solve_brute_force(problem).objective, rel=1e-12)
    assert calls and (seed is not None or calls[-1])


def test_tie_break_shortcut_proves_a_lowest_plan_canonical():
    # Two nodes, both strategies of each equally good: the first solve's plan (0, 0) takes
    # the lowest strategies, so it is canonical without a second solve.
    problem = ShardingProblem(
        (np.array([1.0, 1.0]), np.array([2.0, 2.0])), ((0, 1),), (np.zeros((2, 2)) + 1.0,)
    )
    solution = solve(problem, solver="highs")
    assert solution.choices == (0, 0) and solution.stats.tie_break == "canonical"
    assert ilp._lowest_kept({0: 0, 1: 2}, {0: np.array([0, 1]), 1: np.array([2, 5])})
    assert not ilp._lowest_kept({0: 1, 1: 2}, {0: np.array([0, 1]), 1: np.array([2, 5])})
