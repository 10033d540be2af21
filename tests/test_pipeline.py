"""Pipelined plans: stages on submeshes, GPipe and 1F1B, microbatches; matches one device.

(Checks of pipelined plans that run nothing, and of the layer cost table the stage DP
reads: tests/test_pipeline_layer_costs.py.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import GPT, NO_MICROBATCH_CHECK, assert_trees_close, cluster, run_steps

import autopar
from autopar.runtime import overlap_fraction
from examples import gpt, mlp

LR = 1e-2

def _run(module, cfg, optimizer, batch_size, atol, reference=None, **pipeline):
    """3 steps under `autoparallel(**pipeline)` from the state of key 0 on the batch of key
    1 give one device's losses and state (`reference`: one device's 3 steps, when the
    caller has them already)."""
    state = module.init_state(cfg, optimizer, jax.random.key(0))
    batch = module.make_batch(cfg, batch_size, jax.random.key(1))
    step = module.make_train_step(cfg, optimizer)
    ref_losses, ref_state = reference or run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, cluster=cluster(), donate_argnums=(), **pipeline)
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state, ref_state, atol)
    return par


@pytest.fixture(scope="module")
def gpt_sgd_reference():
    """`_run`'s reference for the tiny GPT with SGD on batch 8, computed once for the
    pipelined plans below (the same state, batch and steps each time)."""
    optimizer = optax.sgd(LR)
    state = gpt.init_state(GPT, optimizer, jax.random.key(0))
    batch = gpt.make_batch(GPT, 8, jax.random.key(1))
    return run_steps(jax.jit(gpt.make_train_step(GPT, optimizer)), state, batch)


@pytest.mark.parametrize(
    "num_stages, schedule, num_microbatches, submeshes, logical_shapes",
    [
        (2, "1f1b", 2, [(1, 4)], None),  # 2-D logical meshes allowed
        (4, "gpipe", 4, [(1, 2)], [(2,)]),
        # The rest in the `extended` tier (CI time): the two above run both schedules, the
        # multi-host tests two stages across processes, test_pipeline_schedules the rest.
        pytest.param(4, "1f1b", 2, [(1, 2)], [(2,)], marks=pytest.mark.extended),
        pytest.param(3, "1f1b", 2, [(1, 2), (1, 4)], [(2,), (4,)],  # unequal submeshes
                     marks=pytest.mark.extended),
        pytest.param(2, "gpipe", 1, [(1, 4)], [(4,)], marks=pytest.mark.extended),
    ],
)
def test_gpt_pipeline_sgd(num_stages, schedule, num_microbatches, submeshes, logical_shapes,
                          gpt_sgd_reference):
    par = _run(
        gpt, GPT, optax.sgd(LR), 8, 1e-5, reference=gpt_sgd_reference,
        num_stages=num_stages, schedule=schedule, num_microbatches=num_microbatches,
        submeshes=submeshes, logical_shapes=logical_shapes,
    )
    plan = par.plan
    assert plan.num_stages == num_stages
    assert plan.num_microbatches == num_microbatches and plan.schedule == schedule
    sizes = sorted(len(s.mesh.device_ids) for s in plan.stages)
    assert sum(sizes) == 8
    if len(submeshes) == 2:
        assert sizes == [2, 2, 4], sizes
    used = [d for s in plan.stages for d in s.mesh.device_ids]
    assert sorted(used) == list(range(8)), "stages must use disjoint devices covering all"


# Extended tier (CI time): test_transformers_models' `llama-auto` checks the same in the
# default run (AdamW, an automatic 2-stage pipeline on 2 microbatches, losses rtol 1e-5 and
# state atol 0.1 * LR against one device), test_megatron_pipeline AdamW's state through
# the tiny GPT's 2-stage pipeline, and test_gpt_pipeline_sgd this GPT's automatic stages.
@pytest.mark.extended
def test_gpt_pipeline_adamw():
    _run(
        gpt, GPT, optax.adamw(LR, eps=1e-6), 8, 0.1 * LR,
        num_stages=2, num_microbatches=4, submeshes=[(1, 4)], logical_shapes=[(4,)],
    )


def test_mlp_manual_layer_boundaries():
    cfg = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=4, layer_markers=True)
    par = _run(
        mlp, cfg, optax.sgd(LR), 16, 1e-5,
        num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(4,)],
        **NO_MICROBATCH_CHECK,
    )
    assert par.plan.stages[0].layers[0] == 0 and par.plan.stages[-1].layers[1] == 5


def test_automatic_layers_without_marks():
    cfg = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=4)
    par = _run(
        mlp, cfg, optax.sgd(LR), 16, 1e-5,
        num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(4,)],
        **NO_MICROBATCH_CHECK,
    )
    assert par.plan.auto_layers == 8
    assert par.plan.stages[-1].layers[1] > 2


def test_four_stage_1f1b_timeline_overlaps():
    cfg = dataclasses.replace(GPT, hidden=64, seq_len=32)
    opt = optax.sgd(LR)
    state = gpt.init_state(cfg, opt, jax.random.key(0))
    batch = gpt.make_batch(cfg, 16, jax.random.key(1))
    par = autopar.autoparallel(
        gpt.make_train_step(cfg, opt), cluster=cluster(), donate_argnums=(), num_stages=4,
        num_microbatches=8, schedule="1f1b", submeshes=[(1, 2)], logical_shapes=[(2,)],
        **NO_MICROBATCH_CHECK,
    )
    par(state, batch)  # compile
    best = 0.0
    for _ in range(3):  # the best of up to 3 recorded steps (shared cores are noisy)
        _, timeline = par.record_timeline(state, batch)
        assert {t.stage for t in timeline} == {0, 1, 2, 3}
        assert len([t for t in timeline if t.kind == "forward"]) == 4 * 8
        best = max(best, overlap_fraction(timeline))
        if best > 0.1:
            break
    print(f"fraction of the step with >= 2 stages busy: {best:.2f}")
    assert best > 0.1, f"stages did not overlap (fraction {best:.2f})"


def test_batch_not_divisible_by_microbatches():
    opt = optax.sgd(LR)
    state = gpt.init_state(GPT, opt, jax.random.key(0))
    batch = gpt.make_batch(GPT, 6, jax.random.key(1))
    par = autopar.autoparallel(
        gpt.make_train_step(GPT, opt), cluster=cluster(), num_microbatches=4, donate_argnums=()
    )
    with pytest.raises(ValueError, match="not divisible by num_microbatches=4"):
        par(state, batch)
