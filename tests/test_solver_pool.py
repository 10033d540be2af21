"""The solver pool (issue 18, deliver 5): independent sharding ILPs solved side by side in
worker processes give what solving them one by one here gives."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import autopar
from autopar.intra import MemoryBudgetError, ShardingProblem, solve
from autopar.intra._pool import JOBS_ENV, SolverPool, WorkerDied, jobs
from tests.test_planning_speed import _same_choice, _search, _tiny_gpt_graph


def _problem(seed: int, budget: float | None = None) -> ShardingProblem:
    """A chain of 6 nodes with 3 strategies each, random costs, a follower, and (with
    `budget`) a memory limit over every pair of neighbours."""
    rng = np.random.default_rng(seed)
    n = 6
    memory = tuple(rng.uniform(1.0, 4.0, 3) for _ in range(n))
    return ShardingProblem(
        tuple(rng.uniform(0.0, 5.0, 3) for _ in range(n)),
        tuple((i, i + 1) for i in range(n - 1)),
        tuple(rng.uniform(0.0, 3.0, (3, 3)) for _ in range(n - 1)),
        node_memory=memory if budget is not None else (),
        memory_groups=tuple((i, i + 1) for i in range(n - 1)) if budget is not None else (),
        memory_budget=budget,
        followers={5: (4, np.array([2, 1, 0]))},
    )


@pytest.fixture
def pool():
    pool = SolverPool(2)
    yield pool
    pool.close()


def test_problems_pickle_as_checked():
    problem = _problem(0, budget=6.0)
    again = pickle.loads(pickle.dumps(problem))
    assert dict(again.followers).keys() == {5}
    a, b = solve(again), solve(problem)
    assert (a.choices, a.objective) == (b.choices, b.objective)


def test_the_pool_solves_as_this_process_does(pool):
    """Solutions (choices, objective, status) equal those of `solve` here, in the order
    submitted; a solve's `MemoryBudgetError` comes back with its numbers."""
    problems = [_problem(seed, budget=7.0) for seed in range(6)]
    futures = [pool.submit(p) for p in problems]
    for problem, future in zip(problems, futures):
        got, want = future.result(), solve(problem)
        assert (got.choices, got.objective, got.status) == (
            want.choices, want.objective, want.status
        )
    tight = _problem(1, budget=1.0)
    with pytest.raises(MemoryBudgetError) as here:
        solve(tight)
    with pytest.raises(MemoryBudgetError) as there:
        pool.submit(tight).result()
    assert (there.value.budget, there.value.least_memory) == (
        here.value.budget, here.value.least_memory
    )
    assert str(there.value) == str(here.value)


def test_a_worker_that_dies_is_replaced(pool, monkeypatch):
    """A killed worker's problem goes to a new worker; a problem that kills its worker
    twice raises `WorkerDied`, and the pool goes on."""
    problem = _problem(3)
    assert pool.submit(problem).result().choices == solve(problem).choices
    for worker in pool._workers:
        worker.process.kill()
        worker.process.wait()
    results = [pool.submit(problem).result() for _ in range(4)]
    assert {r.choices for r in results} == {solve(problem).choices}
    assert all(w.process.poll() is None for w in pool._workers)

    from autopar.intra import _pool

    monkeypatch.setattr(_pool._Worker, "call", _dies)
    with pytest.raises(WorkerDied, match="worker stopped"):
        pool.submit(problem).result()
    monkeypatch.undo()
    assert pool.broken  # `solver_pool` hands out no broken pool
    assert pool.submit(problem).result().choices == solve(problem).choices


def _dies(self, payload):
    self.process.kill()
    self.process.wait()
    raise WorkerDied(f"a sharding ILP worker stopped (exit status {self.process.poll()})")


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_a_bad_jobs_setting_is_named(raw, monkeypatch):
    monkeypatch.setenv(JOBS_ENV, raw)
    with pytest.raises(ValueError, match=rf"{JOBS_ENV}='{raw}' is not a number of worker"):
        jobs()


def test_jobs_setting(monkeypatch):
    monkeypatch.setenv(JOBS_ENV, "3")
    assert jobs() == 3
    monkeypatch.delenv(JOBS_ENV)
    assert jobs() >= 1


# The searches below plan on the 1-D meshes of 2 and 4 devices. The (2, 2) mesh's leaner
# levels took 4 of every 5 seconds of them (40 s), and the pool gets the same kinds of
# batches without it: every layer on every mesh before the DP, a stage's layers at a
# level, levels 1 to 7 and more on both meshes under the budget.
SHAPES = [(2,), (4,)]


def _stage_choice(graph, layers, tied, budget, monkeypatch, pooled: bool):
    monkeypatch.setenv(JOBS_ENV, "2" if pooled else "1")
    return _search(graph, layers, tied, budget, monkeypatch, prune=True, devices=(2, 4),
                   logical_shapes=SHAPES)


def test_pooled_search_makes_the_same_choice(monkeypatch):
    """The tiny GPT's stage choice (1-D meshes of 2 and 4 devices) under a budget that
    needs leaner memory levels is the same, to the last spec, with the layer ILPs solved
    in the pool as here; the pool
    solved the batches (every layer on every mesh before the DP; a stage's layers at a
    level), and the table holds the same costs."""
    from autopar.intra import _pool

    graph, layers, tied = _tiny_gpt_graph()
    unlimited, _ = _stage_choice(graph, layers, tied, None, monkeypatch, pooled=False)
    budget = 0.7 * max(c.memory for c in unlimited.dp.stage_costs)
    here, here_table = _stage_choice(graph, layers, tied, budget, monkeypatch, pooled=False)
    submitted = []
    original = _pool.SolverPool.submit

    def counted(self, problem, **kwargs):
        submitted.append(problem)
        return original(self, problem, **kwargs)

    monkeypatch.setattr(_pool.SolverPool, "submit", counted)
    pooled, pooled_table = _stage_choice(graph, layers, tied, budget, monkeypatch,
                                         pooled=True)
    _pool._close_pool()
    assert any(key[2] > 0 for key in here_table._cache)  # leaner levels in play
    assert len(submitted) > 1
    _same_choice(pooled, here)
    for key, cost in pooled_table._cache.items():
        if key in here_table._cache:
            other = here_table._cache[key]
            assert (cost is None) == (other is None)
            if cost is not None:
                assert cost == other


def test_workers_that_cannot_start_leave_the_search_to_this_process(monkeypatch, caplog):
    """Workers that die on start (here: a bootstrap that exits) cost the search nothing
    but a warning: its ILPs are solved here, to the same choice, and the broken pool is
    not used again."""
    from autopar.intra import _pool

    graph, layers, tied = _tiny_gpt_graph()
    here, _ = _stage_choice(graph, layers, tied, None, monkeypatch, pooled=False)
    _pool._close_pool()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_pool, "_POOL", None)
        patch.setattr(_pool, "_BOOTSTRAP", "import sys; sys.exit(3)  # {packages}")
        with caplog.at_level("WARNING", logger="autopar"):
            pooled, _ = _stage_choice(graph, layers, tied, None, monkeypatch, pooled=True)
        broken = _pool._POOL
        _pool._close_pool()
    _same_choice(pooled, here)
    assert broken is not None and broken.broken
    assert "solving its ILP here instead" in caplog.text


def test_prefetch_builds_the_likely_slowest_ilps_first(monkeypatch):
    """`prefetch` builds (and so submits) a batch's ILPs meshes with more axes of size > 1
    first, then more devices (`solve_order`), whatever order they were asked in; the
    costs are those of the ILPs solved one at a time."""
    from autopar.inter import StageOptions, _layer_table, layer_cost_table
    from autopar.intra import _pool
    from autopar.intra._options import ShardOptions

    wanted = {k: (0, shape, 0) for k, shape in enumerate([(1,), (2,), (4,), (2, 2), (8,),
                                                           (2, 4), (4, 2), (1, 4)])}
    order = [shape for _, (_, shape, _) in _layer_table.solve_order(wanted)]
    assert order == [(2, 4), (4, 2), (2, 2), (8,), (4,), (1, 4), (2,), (1,)]

    graph, layers, tied = _tiny_gpt_graph()
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    options = StageOptions(shard=ShardOptions())
    built = []
    prepare = _layer_table.prepare_on_mesh

    def spy(sub, cluster, mesh, *args, **kwargs):
        built.append(mesh.shape)
        return prepare(sub, cluster, mesh, *args, **kwargs)

    monkeypatch.setattr(_layer_table, "prepare_on_mesh", spy)
    asked = [(k, shape, 0) for shape in [(2,), (2, 2)] for k in range(layers.num_layers)]
    monkeypatch.setenv(JOBS_ENV, "2")
    pooled = layer_cost_table(graph, layers, cluster, 4, options, tied)
    pooled.prefetch(asked)
    _pool._close_pool()
    first = [s for i, s in enumerate(built) if s not in built[:i]]
    assert first == [(2, 2), (2,)], built
    monkeypatch.setenv(JOBS_ENV, "1")
    here = layer_cost_table(graph, layers, cluster, 4, options, tied)
    for k, shape, level in asked:
        assert pooled.cost(k, shape, level) == here.cost(k, shape, level)


def test_warm_up_starts_the_shared_pool_once(monkeypatch):
    """`warm_up` (called by `autopar.plan` before tracing) starts the shared pool's
    workers, which then solve as this process does; with one job it starts nothing."""
    from autopar.intra import _pool

    _pool._close_pool()
    monkeypatch.setattr(_pool, "_POOL", None)
    monkeypatch.setenv(JOBS_ENV, "1")
    _pool.warm_up()
    assert _pool._POOL is None
    monkeypatch.setenv(JOBS_ENV, "2")
    _pool.warm_up()
    pool = _pool._POOL
    try:
        assert pool is not None and pool.started and len(pool._workers) == 2
        workers = list(pool._workers)
        _pool.warm_up()
        assert pool._workers == workers  # started once
        problem = _problem(2, budget=7.0)
        assert pool.submit(problem).result().choices == solve(problem).choices
    finally:
        _pool._close_pool()
