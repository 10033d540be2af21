"""Checkpoints across plans: train under one plan, save, restore under another, go on."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import autopar
from examples import mlp

CFG = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=4, layer_markers=True)
OPT = optax.adam(1e-2)


def _steps(step, state, batch, n):
    for _ in range(n):
        state, _ = step(state, batch)
    return state


def test_restore_under_a_pipelined_plan_continues_training(tmp_path):
    state = mlp.init_state(CFG, OPT, jax.random.key(0))
    batch = mlp.make_batch(CFG, 16, jax.random.key(1))
    one_mesh = autopar.autoparallel(
        mlp.make_train_step(CFG, OPT), method="shard", mesh_shape=(2, 4), donate_argnums=(),
        cache=False,
    )
    reference = _steps(one_mesh, state, batch, 6)

    trained = _steps(one_mesh, state, batch, 3)
    autopar.checkpoint.save(tmp_path / "step3", trained)
    pipelined = autopar.autoparallel(
        mlp.make_train_step(CFG, OPT), num_stages=2, num_microbatches=2,
        submeshes=[(1, 4)], logical_shapes=[(2, 2)], donate_argnums=(), cache=False,
    )
    pipelined(state, batch)  # plan B (a step from the initial state: its plan, nothing kept)
    assert pipelined.plan.num_stages == 2
    assert [s.mesh.shape for s in pipelined.plan.stages] == [(2, 2), (2, 2)]
    restored = autopar.checkpoint.restore(tmp_path / "step3", like=pipelined)
    for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(pipelined.shardings()[0])):
        assert x.sharding.is_equivalent_to(want, x.ndim)
    continued = _steps(pipelined, restored, batch, 3)
    for a, b in zip(jax.tree.leaves(continued.params), jax.tree.leaves(reference.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert_trees_close(continued.opt_state, reference.opt_state, 1e-5)


def test_restore_onto_a_plan_needs_the_state_structure(tmp_path):
    state = mlp.init_state(CFG, OPT, jax.random.key(0))
    batch = mlp.make_batch(CFG, 16, jax.random.key(1))
    plan = autopar.plan(mlp.make_train_step(CFG, OPT), state, batch, method="data", cache=False)
    autopar.checkpoint.save(tmp_path / "ckpt", state)
    with pytest.raises(TypeError, match="needs target="):
        autopar.checkpoint.restore(tmp_path / "ckpt", like=plan)
    restored = autopar.checkpoint.restore(
        tmp_path / "ckpt", like=plan, target=mlp.abstract_state(CFG, OPT)
    )
    assert_trees_close(restored, state, 0.0)
    with pytest.raises(ValueError, match="exists already"):
        autopar.checkpoint.save(tmp_path / "ckpt", state)
