"""The pipeline runtime's overhead and overlap, on 8 virtual CPU devices.

1. A one-stage plan run by the pipeline runtime (one compiled program per step,
   `autopar.runtime._fused`) and task by task, against a hand-written `jax.jit` of the
   same step with the plan's shardings (`train_step.shardings()`): median wall and process
   (CPU) seconds per step over interleaved rounds (each round times `--steps` steps of
   each, in turn); and the plan's sharding plan lowered as one SPMD `jax.jit`
   (`lower_sharding_plan`), which separates the runtime's cost from the plan's layouts
   (every intermediate pinned, where the hand-written `jax.jit` lets XLA choose). Process
   time counts every thread of this process (XLA's included),
   so it is less disturbed than wall time by other work on a shared machine.
2. A 4-stage pipeline (8 microbatches) under 1F1B, interleaved 1F1B (v = 2) and zero bubble:
   the measured idle share of the device groups (bubble) against the predicted one
   (`Plan.bubble_fraction`, and the simulated chart `plan_schedule`), and the fraction of
   the step with at least 2 device groups busy.

Part 2 times tasks with `record_timeline`, which waits for every task (one thread per device
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
from autopar.lower import lower_sharding_plan  # noqa: E402
from autopar.report import plan_schedule  # noqa: E402
from autopar.report._gantt import idle_fraction  # noqa: E402
from examples import gpt  # noqa: E402

CONFIG = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, seq_len=32, num_layers=8,
                             layer_markers=True)
BATCH = 16


def _timed(fn, state, batch, steps: int) -> tuple[float, float]:
    """Median wall and process (CPU) seconds of `steps` steps, each waited for."""
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn(state, batch)
        jax.block_until_ready(out)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def one_stage_overhead(rounds: int, steps: int) -> dict:
    """Seconds per step (wall and process time, medians over interleaved rounds) of a
    one-stage plan as the runtime runs it (one program per step, `FusedStep`), of the
    same plan run task by task (forward, backward, update programs: the runtime before
    `FusedStep`, kept for reference), and of a hand-written `jax.jit` of the step with
    the plan's shardings."""
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
    executable = par.pipeline
    fused = executable.fused

    def tasks(state, batch):
        executable.fused = None  # the task runtime for this step
        try:
            return par(state, batch)
        finally:
            executable.fused = fused

    jax.block_until_ready(tasks(*placed))
    spmd = _plan_as_one_jit(par, state, batch)
    jax.block_until_ready(spmd())
    times = {"runtime": [], "tasks": [], "spmd": [], "jit": []}
    for _ in range(rounds):
        times["runtime"].append(_timed(par, *placed, steps))
        times["tasks"].append(_timed(tasks, *placed, steps))
        times["spmd"].append(_timed(lambda *_: spmd(), None, None, steps))
        times["jit"].append(_timed(hand, *placed, steps))
    result = {"mesh": tuple(par.plan.stages[0].sharding.mesh.shape)}
    for name, rows in times.items():
        result[f"{name}_wall_s"] = statistics.median(w for w, _ in rows)
        result[f"{name}_cpu_s"] = statistics.median(c for _, c in rows)
    for name in ("runtime", "tasks", "spmd"):
        for clock in ("wall", "cpu"):
            result[f"{name}_{clock}_ratio"] = (
                result[f"{name}_{clock}_s"] / result[f"jit_{clock}_s"]
            )
    return result


def _plan_as_one_jit(par, state, batch):
    """The one-stage plan's sharding plan lowered as one SPMD `jax.jit` of its stage graph
    (`lower_sharding_plan`, as a one-mesh plan runs): the plan's own layouts, every
    intermediate pinned, without the runtime. Returns a thunk running it."""
    graph = par.pipeline.partition.stage_graphs[0]
    fn, in_shardings, _ = lower_sharding_plan(graph, par.plan.stages[0].sharding)
    by_var = dict(zip(par.pipeline.graph.invars, jax.tree.leaves((state, batch))))
    args = [jax.device_put(by_var[v], s) for v, s in zip(graph.invars, in_shardings)]
    return lambda: fn(*args)


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
    parser.add_argument("--skip-bubbles", action="store_true",
                        help="only the one-stage overhead")
    parser.add_argument("--skip-overhead", action="store_true",
                        help="only the 4-stage bubbles")
    args = parser.parse_args()
    if not args.skip_overhead:
        _print_overhead(args)
    if not args.skip_bubbles:
        _print_bubbles(args)


def _print_overhead(args) -> None:
    overhead = one_stage_overhead(args.rounds, args.steps)
    print(f"one-stage plan on mesh {overhead['mesh']}, ms/step (median over {args.rounds} "
          f"interleaved rounds of {args.steps} steps): wall, process time, ratio to jax.jit")
    print("| run | wall ms | process ms | wall / jit | process / jit |")
    print("|---|---|---|---|---|")
    for name, label in (("runtime", "autopar runtime (one program per step)"),
                        ("tasks", "task by task (forward, backward, update)"),
                        ("spmd", "the plan's layouts as one SPMD jit (no runtime)"),
                        ("jit", "hand-written jax.jit, plan shardings")):
        wall, cpu = overhead[f"{name}_wall_s"] * 1e3, overhead[f"{name}_cpu_s"] * 1e3
        ratios = ("1 | 1" if name == "jit" else
                  f"{overhead[f'{name}_wall_ratio']:.3f} | {overhead[f'{name}_cpu_ratio']:.3f}")
        print(f"| {label} | {wall:.2f} | {cpu:.2f} | {ratios} |")


def _print_bubbles(args) -> None:
    print("| schedule (4 device groups, 8 microbatches) | measured bubble | predicted "
          "(cost model) | simulated chart | >= 2 groups busy |")
    print("|---|---|---|---|---|")
    for row in pipeline_bubbles(args.rounds):
        print(f"| {row['schedule']} | {row['measured_bubble']:.3f} | "
              f"{row['predicted_bubble']:.3f} | {row['simulated_bubble']:.3f} | "
              f"{row['two_or_more_busy']:.3f} |")


if __name__ == "__main__":
    main()
