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
from autopar.cluster import Cluster
from autopar.cost import (
    bubble_fraction,
    pipeline_latency,
    stage_dispatch_time,
    tasks_per_step,
)
from autopar.cost.backends._xla_cpu import host_work_per_step
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
    """Each stage's seconds per microbatch, with launching its programs."""
    dispatch = stage_dispatch_time(
        plan.cluster, plan.num_stages, plan.num_microbatches, plan.schedule
    )
    return [stage.time_per_microbatch + dispatch for stage in plan.stages]


# `dispatch_overhead` of the cpu-local profile: seconds per program launched.
LAUNCH = Cluster.from_profile("cpu-local").dispatch_overhead


def test_dispatch_time_by_hand():
    """A stage of a pipeline launches a forward and a backward task per microbatch (zero
    bubble: three) and its update once per step; a one-stage plan one program per step."""
    assert LAUNCH > 0
    assert tasks_per_step(1, 8) == 1
    assert tasks_per_step(2, 4) == 2 * 4 + 1
    assert tasks_per_step(4, 4, "zero_bubble") == 3 * 4 + 1
    cluster = Cluster.from_profile("cpu-local")
    assert stage_dispatch_time(cluster, 2, 4) == pytest.approx(9 * LAUNCH / 4, rel=1e-12)
    assert stage_dispatch_time(cluster, 1, 8) == pytest.approx(LAUNCH / 8, rel=1e-12)
    # a plan keeps the cluster as JSON: the same figure
    assert stage_dispatch_time(cluster.to_json(), 2, 4) == stage_dispatch_time(cluster, 2, 4)
    free = Cluster.from_profile("cpu-local").with_shape(1, 8)
    assert stage_dispatch_time(dataclasses.replace(free, dispatch_overhead=0.0), 2, 4) == 0
    with pytest.raises(ValueError, match="dispatch_overhead must be"):
        dataclasses.replace(free, dispatch_overhead=-1.0)
    with pytest.raises(ValueError, match="task_device_overhead must be a finite number"):
        dataclasses.replace(free, task_device_overhead=float("nan"))
    # the device threads' CPU per task survives the JSON a plan keeps, and is read from it
    busy = dataclasses.replace(free, task_device_overhead=2e-4)
    assert Cluster.from_json(busy.to_json()).task_device_overhead == 2e-4
    assert host_work_per_step(busy.to_json(), [4, 4], 4) == pytest.approx(
        host_work_per_step(busy, [4, 4], 4)) == pytest.approx(2 * 9 * (LAUNCH + 8e-4))


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
    # one program per step, whatever the microbatches (`tasks_per_step`)
    cost = plan.stages[0].time_per_microbatch
    assert plan.predicted_step_time == pytest.approx(num_microbatches * cost + LAUNCH,
                                                     rel=1e-12)


def test_one_mesh_plan_is_its_stage_cost():
    plan = _plan(method="shard")
    assert plan.runtime == "spmd" and plan.num_microbatches == 1
    assert plan.predicted_step_time == pytest.approx(
        plan.stages[0].sharding.cost.total + LAUNCH, rel=1e-12
    )


def test_pipelined_plan_is_alpas_latency():
    plan = _plan(num_stages=2, num_microbatches=4, **PIPELINE)
    times = _stage_times(plan)
    assert len(times) == 2
    assert plan.predicted_step_time == pytest.approx(sum(times) + 3 * max(times), rel=1e-12)
    # each stage: 4 forward + 4 backward tasks and its update, over 4 microbatches
    plain = [stage.time_per_microbatch for stage in plan.stages]
    assert [t - p for t, p in zip(times, plain)] == pytest.approx([9 * LAUNCH / 4] * 2)


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
