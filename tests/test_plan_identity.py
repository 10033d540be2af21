"""A plan's predicted step time is the shared pipeline formula; equal plans save equal bytes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest

import autopar
from autopar.cost import bubble_fraction, pipeline_latency
from examples import mlp

REPO = Path(__file__).resolve().parent.parent
CFG = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=4, layer_markers=True)
PIPELINE = dict(submeshes=[(1, 4)], logical_shapes=[(4,)])


def _plan(**options) -> autopar.Plan:
    opt = optax.sgd(0.1)
    state = jax.eval_shape(lambda: mlp.init_state(CFG, opt, jax.random.key(0)))
    batch = jax.eval_shape(lambda: mlp.make_batch(CFG, 16, jax.random.key(1)))
    return autopar.plan(
        mlp.make_train_step(CFG, opt), state, batch, cluster="cpu-local", cache=False,
        **options,
    )


def _stage_times(plan: autopar.Plan) -> list[float]:
    return [stage.time_per_microbatch for stage in plan.stages]


def test_pipeline_latency_by_hand():
    assert pipeline_latency([2.0], 1) == 2.0
    assert pipeline_latency([2.0], 8) == 16.0  # one stage accumulating 8 microbatches
    assert pipeline_latency([1.0, 3.0, 2.0], 4) == 6.0 + 3 * 3.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="at least one stage"):
        pipeline_latency([], 2)


@pytest.mark.parametrize("num_microbatches", [1, 8])
def test_one_stage_plan_counts_every_microbatch(num_microbatches):
    plan = _plan(num_stages=1, num_microbatches=num_microbatches)
    assert plan.num_stages == 1 and plan.num_microbatches == num_microbatches
    (t,) = _stage_times(plan)
    assert plan.predicted_step_time == pytest.approx(num_microbatches * t, rel=1e-12)


def test_one_mesh_plan_is_its_stage_cost():
    plan = _plan(method="shard")
    assert plan.runtime == "spmd" and plan.num_microbatches == 1
    assert plan.predicted_step_time == plan.stages[0].sharding.cost.total


def test_pipelined_plan_is_alpas_latency():
    plan = _plan(num_stages=2, num_microbatches=4, **PIPELINE)
    times = _stage_times(plan)
    assert len(times) == 2
    assert plan.predicted_step_time == pytest.approx(sum(times) + 3 * max(times), rel=1e-12)


def test_timings_are_not_part_of_the_saved_plan(tmp_path):
    plan = _plan(method="shard")
    assert plan.timings  # measured ...
    assert "timings" not in plan.to_json()  # ... but not the plan's identity
    assert "solve_time" not in json.dumps(plan.to_json())
    again = dataclasses.replace(plan, timings={"search": 123.0})
    plan.save(tmp_path / "a.json")
    again.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert "timings" in plan.to_json(timings=True)


PLAN_SCRIPT = """
import sys, jax, optax, autopar
from examples import gpt
cfg = gpt.CONFIGS["tiny"]
opt = optax.adamw(1e-3)
state = jax.eval_shape(lambda: gpt.init_state(cfg, opt, jax.random.key(0)))
batch = jax.eval_shape(lambda: gpt.make_batch(cfg, 8, jax.random.key(1)))
plan = autopar.plan(gpt.make_train_step(cfg, opt), state, batch, cluster="cpu-local",
                    method="shard", mesh_shape=(2, 4), cache=False)
plan.save(sys.argv[1])
"""


@pytest.mark.slow
def test_same_plan_json_under_different_hash_seeds(tmp_path):
    """Two processes with different PYTHONHASHSEED write byte-identical plan files."""
    outputs = []
    for seed in ("1", "2"):
        path = tmp_path / f"plan{seed}.json"
        env = {**os.environ, "PYTHONHASHSEED": seed, "AUTOPAR_PLAN_CACHE": "0",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", PLAN_SCRIPT, str(path)], env=env, cwd=REPO,
                       check=True, timeout=300)
        outputs.append(path.read_bytes())
    assert outputs[0] == outputs[1]
