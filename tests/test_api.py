"""The decorator's contract: caching executables, plans saved and reused, the plan cache."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import cluster as _cluster

import autopar
from autopar.search._cache import PlanCache
from examples import mlp

CFG = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=3)
OPT = optax.sgd(0.1)


def _setup(batch_size=16):
    state = mlp.init_state(CFG, OPT, jax.random.key(0))
    batch = mlp.make_batch(CFG, batch_size, jax.random.key(1))
    return mlp.make_train_step(CFG, OPT), state, batch


def test_same_shapes_do_not_trace_again_and_new_shapes_do():
    step, state, batch = _setup()
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", donate_argnums=())
    state1, _ = par(state, batch)
    state2, _ = par(state1, batch)
    assert par.num_traces == 1
    par(state, mlp.make_batch(CFG, 32, jax.random.key(2)))
    assert par.num_traces == 2


def test_state_keeps_its_sharding_and_donation_is_honoured():
    step, state, batch = _setup()
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", mesh_shape=(8,),
                               donate=True)
    new_state, _ = par(state, batch)
    compiled = par._last
    flat_in = jax.tree.leaves(new_state)
    for x, sharding in zip(flat_in, compiled.in_shardings):
        assert x.sharding.is_equivalent_to(sharding, x.ndim), "state would be resharded"
    donated = jax.tree.leaves(new_state)
    newer, _ = par(new_state, batch)
    assert all(x.is_deleted() for x in donated), "donated state buffers must be reused"
    assert not any(x.is_deleted() for x in jax.tree.leaves(newer))


def test_save_load_and_run_gives_identical_results(tmp_path):
    step, state, batch = _setup()
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", donate_argnums=())
    out_a, metrics_a = par(state, batch)
    path = tmp_path / "plan.json"
    par.plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded.to_json() == par.plan.to_json()
    again = autopar.autoparallel(step, plan=str(path), donate_argnums=())
    out_b, metrics_b = again(state, batch)
    assert float(metrics_a["loss"]) == float(metrics_b["loss"])
    for a, b in zip(jax.tree.leaves(out_a), jax.tree.leaves(out_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plan_for_another_model_is_refused(tmp_path):
    step, state, batch = _setup()
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", donate_argnums=())
    par(state, batch)
    path = tmp_path / "plan.json"
    par.plan.save(path)
    other = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
    other_step = mlp.make_train_step(other, OPT)
    other_state = mlp.init_state(other, OPT, jax.random.key(0))
    reuse = autopar.autoparallel(other_step, plan=str(path), donate_argnums=())
    with pytest.raises(ValueError, match="different program"):
        reuse(other_state, batch)


def test_shardings_eject_into_a_plain_jit():
    step, state, batch = _setup()
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", donate_argnums=())
    expected, _ = par(state, batch)
    by_path = par.plan.shardings_by_path()
    paths = [i.path for i in par.plan.inputs]
    shardings = [by_path[p] for p in paths]
    leaves, tree = jax.tree.flatten((state, batch))
    placed = [jax.device_put(x, s) for x, s in zip(leaves, shardings)]
    out, _ = jax.jit(step)(*jax.tree.unflatten(tree, placed))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_shardings_are_pytrees_shaped_like_the_arguments():
    step, state, batch = _setup()
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", donate_argnums=())
    expected, _ = par(state, batch)
    in_sh = par.plan.shardings(like=(state, batch))
    assert jax.tree.structure(in_sh) == jax.tree.structure((state, batch))
    assert jax.tree.structure(par.shardings()) == jax.tree.structure((state, batch))
    placed = jax.device_put((state, batch), in_sh)
    for x, s in zip(jax.tree.leaves(placed), jax.tree.leaves(in_sh)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    out, _ = jax.jit(step, in_shardings=in_sh)(*placed)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    with pytest.raises(TypeError, match=r"pass like=\(state, batch\)"):
        par.plan.shardings()


def test_pipeline_shardings_put_each_leaf_on_its_stage():
    cfg = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=4, layer_markers=True)
    state = mlp.abstract_state(cfg, OPT)
    batch = mlp.abstract_batch(cfg, 16)
    plan = autopar.plan(
        mlp.make_train_step(cfg, OPT), state, batch, cluster=_cluster(), cache=False,
        num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(4,)],
    )
    in_sh = plan.shardings(like=(state, batch))
    by_path = {i.path: i for i in plan.inputs}
    meshes = {tuple(sorted(d.id for d in s.device_set)) for s in jax.tree.leaves(in_sh)}
    assert len(meshes) == 2, "leaves sit on both stages' devices"
    assert all(s.mesh.devices.size == 4 for s in jax.tree.leaves(in_sh))
    assert set(by_path) and {i.stage for i in by_path.values()} == {0, 1}


def _count_solves(monkeypatch):
    import autopar.intra._planner as planner

    calls = []
    real = planner.solve

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "solve", counting)
    return calls


def test_cache_hit_skips_the_search_and_a_corrupt_entry_is_survived(tmp_path, monkeypatch):
    step, state, batch = _setup()
    cache = PlanCache(tmp_path, enabled=True)
    calls = _count_solves(monkeypatch)
    first = autopar.plan(step, state, batch, cluster=_cluster(), method="shard", cache=cache)
    assert len(calls) > 0
    solved = len(calls)
    second = autopar.plan(step, state, batch, cluster=_cluster(), method="shard", cache=cache)
    assert len(calls) == solved, "a cache hit must not solve any ILP"
    assert second.to_json() == first.to_json()  # the stored plan, timings and all
    (entry,) = list(tmp_path.glob("*.json"))
    entry.write_text("{ not json")
    third = autopar.plan(step, state, batch, cluster=_cluster(), method="shard", cache=cache)
    assert len(calls) > solved, "a corrupt entry is a miss"
    assert third.specs_by_path() == first.specs_by_path(), "planning is deterministic"
    assert third.stages[0].sharding.var_specs == first.stages[0].sharding.var_specs
    assert entry.read_text().startswith("{"), "the corrupt entry was replaced"


def test_the_top_level_is_small_and_every_name_exists():
    assert len(autopar.__all__) <= 16, autopar.__all__
    assert len(set(autopar.__all__)) == len(autopar.__all__)
    missing = [name for name in autopar.__all__ if not hasattr(autopar, name)]
    assert not missing, f"autopar.__all__ names what autopar lacks: {missing}"
    # What left the top level is reached through its part.
    from autopar.app import AutoParallel, Comparison  # noqa: F401
    from autopar.cluster import Link, LogicalMesh  # noqa: F401
    from autopar.graph import OpGraph, Role, trace  # noqa: F401
    from autopar.intra import ShardingPlan  # noqa: F401
    from autopar.manual import MegatronConfig  # noqa: F401
    from autopar.report import diff_plans, explain  # noqa: F401

    assert issubclass(autopar.errors.MemoryBudgetError, ValueError)
    assert autopar.errors.MemoryBudgetError is autopar.intra.MemoryBudgetError
