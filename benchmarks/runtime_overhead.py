"""The pipeline runtime's overhead and overlap, on 8 virtual CPU devices.

1. A one-stage plan run by the pipeline runtime against a hand-written `jax.jit` of the same
   step with the plan's shardings (`train_step.shardings()`): median seconds per step over
   interleaved rounds (each round times `--steps` steps of each, in turn).
2. A 4-stage pipeline (8 microbatches) under 1F1B, interleaved 1F1B (v = 2) and zero bubble:
   the measured idle share of the device groups (bubble) against the predicted one
   (`Plan.bubble_fraction`, and the simulated chart `plan_schedule`), and the fraction of
   the step with at least 2 device groups busy.

Timings come from `record_timeline`, which waits for every task (one thread per device
group), so they measure the schedule, not the asynchronous dispatch of a plain step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/runtime_overhead.py [--rounds 5 --steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from autopar.report import plan_schedule  # noqa: E402
from autopar.report._gantt import idle_fraction  # noqa: E402
from examples import gpt  # noqa: E402

CONFIG = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, seq_len=32, num_layers=8,
                             layer_markers=True)
BATCH = 16


def _timed(fn, state, batch, steps: int) -> float:
    """Median seconds of `steps` steps, each waited for."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = fn(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_stage_overhead(rounds: int, steps: int) -> dict:
    optimizer = optax.adamw(1e-3)
    step = gpt.make_train_step(CONFIG, optimizer)
    state = gpt.init_state(CONFIG, optimizer, jax.random.key(0))
    batch = gpt.make_batch(CONFIG, BATCH, jax.random.key(1))
    par = autopar.autoparallel(step, donate_argnums=(), num_stages=1, num_microbatches=1)
    par(state, batch)
    assert par.plan.runtime == "pipeline" and par.plan.num_stages == 1
    in_sh = par.shardings()
    hand = jax.jit(step, in_shardings=in_sh)
    placed = jax.device_put((state, batch), in_sh)
    jax.block_until_ready(hand(*placed))
    runtime, jitted = [], []
    for _ in range(rounds):
        runtime.append(_timed(par, *placed, steps))
        jitted.append(_timed(hand, *placed, steps))
    r, j = statistics.median(runtime), statistics.median(jitted)
    return {"runtime_s": r, "jit_s": j, "ratio": r / j}


def _busy_groups_fraction(timeline, groups: int) -> float:
    """Fraction of the step (first start to last end) with at least 2 device groups busy."""
    events = sorted(
        (when, delta, t.stage % groups)
        for t in timeline for when, delta in ((t.start, 1), (t.end, -1))
    )
    busy = [0] * groups
    overlap, last = 0.0, events[0][0]
    for when, delta, g in events:
        if sum(1 for n in busy if n > 0) >= 2:
            overlap += when - last
        busy[g] += delta
        last = when
    return overlap / (events[-1][0] - events[0][0])


def _idle(timeline, groups: int) -> float:
    tasks = [dataclasses.replace(t, stage=t.stage % groups) for t in timeline]
    return idle_fraction(tasks)


def pipeline_bubbles(rounds: int) -> list[dict]:
    optimizer = optax.sgd(1e-2)
    step = gpt.make_train_step(CONFIG, optimizer)
    state = gpt.init_state(CONFIG, optimizer, jax.random.key(0))
    batch = gpt.make_batch(CONFIG, BATCH, jax.random.key(1))
    rows = []
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)):
        extra = {"virtual_stages": v} if v > 1 else {}
        par = autopar.autoparallel(
            step, donate_argnums=(), num_stages=4, num_microbatches=8, schedule=schedule,
            submeshes=[(1, 2)], logical_shapes=[(2,)], **extra,
        )
        par(state, batch)
        best = None
        for _ in range(rounds):
            _, timeline = par.record_timeline(state, batch)
            tasks = [t for t in timeline if t.kind != "apply"]
            measured = _idle(tasks, 4)
            if best is None or measured < best[0]:
                best = (measured, _busy_groups_fraction(tasks, 4))
        plan = par.plan
        simulated = [t for t in plan_schedule(plan) if t.kind != "apply"]
        rows.append({
            "schedule": schedule if v == 1 else f"{schedule} (v={v})",
            "measured_bubble": best[0],
            "predicted_bubble": plan.bubble_fraction,
            "simulated_bubble": _idle(simulated, 4),
            "two_or_more_busy": best[1],
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    overhead = one_stage_overhead(args.rounds, args.steps)
    print(f"one-stage plan (pipeline runtime) {overhead['runtime_s'] * 1e3:.2f} ms/step, "
          f"hand-written jax.jit with plan shardings {overhead['jit_s'] * 1e3:.2f} ms/step, "
          f"ratio {overhead['ratio']:.3f}")
    print("| schedule (4 device groups, 8 microbatches) | measured bubble | predicted "
          "(cost model) | simulated chart | >= 2 groups busy |")
    print("|---|---|---|---|---|")
    for row in pipeline_bubbles(args.rounds):
        print(f"| {row['schedule']} | {row['measured_bubble']:.3f} | "
              f"{row['predicted_bubble']:.3f} | {row['simulated_bubble']:.3f} | "
              f"{row['two_or_more_busy']:.3f} |")


if __name__ == "__main__":
    main()
