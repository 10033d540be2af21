"""The flax NNX Llama (grouped-query attention, `nnx.Optimizer`) trains under
`autopar.autoparallel` on 8 devices like one device: the model and optimizer state go in
and out of the step as a pytree (`nnx.split` outside, `nnx.merge` inside)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import run_steps

import autopar
from examples import nnx_llama

TINY = nnx_llama.CONFIGS["tiny"]


def _check(cfg, **options):
    graphdefs, state = nnx_llama.init_state(cfg, optax.adamw(1e-2, eps=1e-6), jax.random.key(0))
    batch = nnx_llama.make_batch(cfg, 8, jax.random.key(1))
    step = nnx_llama.make_train_step(graphdefs)
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), donate_argnums=(), **options
    )
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not [w for w in par.plan.warnings if "no sharding rule" in w], par.plan.warnings
    # The returned state is an nnx.State again: merge it back into a model.
    model, optimizer = nnx_llama.merge_train_state(graphdefs, par_state)
    assert int(optimizer.step[...]) == 3
    return par.plan, model


@pytest.mark.parametrize(
    "scan_layers", [pytest.param(False, marks=pytest.mark.extended), True],
    ids=["layers", "nnx_scan"],
)
def test_nnx_llama_shard_matches_one_device(scan_layers):
    plan, model = _check(
        dataclasses.replace(TINY, scan_layers=scan_layers), method="shard", mesh_shape=(2, 4)
    )
    paths = plan.specs_by_path()
    assert any(p.startswith("params/") and p.endswith("wq/kernel/value") for p in paths), paths
    assert any(p.startswith("opt_state/") for p in paths)


@pytest.mark.extended
def test_nnx_llama_pipelined_matches_one_device():
    plan, _ = _check(TINY, method="auto", num_stages=2, num_microbatches=2)
    assert plan.num_stages == 2
