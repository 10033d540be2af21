"""`autopar.inter._ilp_driver.drive`: generators' ILPs solved, the garbage collector's first
threshold raised while they are built (issue 45) and restored after."""

from __future__ import annotations

import gc

import numpy as np

from autopar.graph._collector import PLANNING_GC_THRESHOLD as BUILD_GC_THRESHOLD
from autopar.inter._ilp_driver import drive
from autopar.intra import ShardingProblem, solve


class _Prepared:
    """What `drive` needs of a `PreparedILP`: the problem and the solve's arguments."""

    def __init__(self, problem):
        self.problem, self.solve_args = problem, {}


def _problem(seed: int) -> ShardingProblem:
    rng = np.random.default_rng(seed)
    return ShardingProblem(
        tuple(rng.uniform(0.0, 5.0, 3) for _ in range(4)),
        tuple((i, i + 1) for i in range(3)),
        tuple(rng.uniform(0.0, 3.0, (3, 3)) for _ in range(3)),
    )


def _steps(seed: int, seen: list, made: dict | None = None):
    """A generator as `LayerCostTable._level_steps` is: yields two ILPs (seeds `seed` and
    `seed + 10`; `made`: id of each problem -> its seed), returns their choices; records
    the collector's threshold while it builds."""
    made = {} if made is None else made
    seen.append(gc.get_threshold()[0])
    problem = _problem(seed)
    made[id(problem)] = seed
    first = yield _Prepared(problem)
    seen.append(gc.get_threshold()[0])
    problem = _problem(seed + 10)
    made[id(problem)] = seed + 10
    second = yield _Prepared(problem)
    return first.choices, second.choices


def test_drive_solves_with_fewer_collections_and_restores_the_threshold():
    before = gc.get_threshold()
    seen: list[int] = []
    results = drive([_steps(0, seen), _steps(1, seen)], pool=None)
    assert results == [(solve(_problem(s)).choices, solve(_problem(s + 10)).choices)
                       for s in (0, 1)]
    assert seen and all(t == max(before[0], BUILD_GC_THRESHOLD) for t in seen), seen
    assert gc.get_threshold() == before


def test_drive_leaves_a_disabled_collector_and_a_higher_threshold_alone():
    before = gc.get_threshold()
    seen: list[int] = []
    try:
        gc.set_threshold(10 * BUILD_GC_THRESHOLD, *before[1:])
        drive([_steps(2, seen)], pool=None)
        assert seen == [10 * BUILD_GC_THRESHOLD] * 2
        assert gc.get_threshold()[0] == 10 * BUILD_GC_THRESHOLD
        gc.set_threshold(*before)
        gc.disable()
        seen.clear()
        drive([_steps(3, seen)], pool=None)
        assert seen == [before[0]] * 2 and not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*before)


class _DonePool:
    """A pool whose futures are done on `submit` (solved there), recording the order."""

    broken = False

    def __init__(self):
        self.submitted = []

    def submit(self, problem, **solve_args):
        from concurrent.futures import Future

        self.submitted.append(problem)
        future = Future()
        future.set_result(solve(problem, **solve_args))
        return future


def test_a_solve_that_came_back_is_sent_on_before_the_next_build():
    """A generator whose solve is back gets it between two builds: its second ILP is in
    flight before the next generator's first is built; the results are those of the
    solves one by one."""
    pool = _DonePool()
    seen: list[int] = []
    made: dict[int, int] = {}
    results = drive([_steps(4, seen, made), _steps(5, seen, made)], pool=pool)
    assert results == [(solve(_problem(s)).choices, solve(_problem(s + 10)).choices)
                       for s in (4, 5)]
    assert [made[id(p)] for p in pool.submitted] == [4, 14, 5, 15]
