"""The pipeline runtime's overhead and overlap, on 8 virtual CPU devices.

1. A one-stage plan's training loop as a user writes it,
   ``state, metrics = train_step(state, batch)`` with the state donated (`donate=True`)
   and fed back, against the same loop over a hand-written `jax.jit` of the step given
   the plan's shardings (`train_step.shardings()` in, the
   shardings autopar's step returns out, `donate_argnums=0`), over the runtime's
   compiled program called directly (`FusedStep.fn`: the program without autopar's call
   path), and over that program built with no constraint inside (XLA propagating from the
   input shardings, as in the hand-written `jax.jit`; results pinned as the runtime's):
   what separates the plan's own layouts from the runtime. Each round runs `--steps`
   steps of each loop in turn (the order rotating from round to round), dispatched
   asynchronously and waited for once at the end, as a training loop runs; the figures
   are medians over the rounds of wall and process (CPU, every thread of this process,
   XLA's included) seconds per step, with the collectives of each compiled program and
   the load average before and after.
2. A 4-stage pipeline (8 microbatches) under 1F1B, interleaved 1F1B (v = 2) and zero bubble:
   the measured idle share of the device groups (bubble) against the predicted one
   (`Plan.bubble_fraction`, and the simulated chart `plan_schedule`), and the fraction of
   the step with at least 2 device groups busy.

Part 2 times tasks with `record_timeline`, which waits for every task (one thread per device
group), so they measure the schedule, not the asynchronous dispatch of a plain step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/runtime_overhead.py [--rounds 7 --steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
import autopar.lower._spmd as spmd  # noqa: E402
import autopar.runtime._fused as fused_module  # noqa: E402
from autopar.lower._hlo import _LINE  # noqa: E402
from autopar.report import plan_schedule  # noqa: E402
from autopar.report._gantt import idle_fraction  # noqa: E402
from examples import gpt  # noqa: E402

CONFIG = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, seq_len=32, num_layers=8,
                             layer_markers=True)
BATCH = 16
LOOPS = {
    "autopar": "autopar `train_step(state, batch)`",
    "program": "its compiled program called directly (`FusedStep.fn`)",
    "unpinned": "that program with no constraint inside (XLA propagates, as in the jit)",
    "jit": "hand-written `jax.jit`, the plan's shardings in and out, state donated",
}


def collectives(hlo: str) -> Counter:
    """(where, op) -> count, where is "loop" for computations a while loop runs (its body
    and what that calls), else "step"."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            bodies[name] = []
        elif name:
            bodies[name].append(line)
    calls = {
        n: set(re.findall(r"(?:body|condition|calls|to_apply)=\{?%?([\w.\-]+)", "\n".join(b)))
        for n, b in bodies.items()
    }
    stack = [r for b in bodies.values() for line in b if " while(" in line
             for r in re.findall(r"body=%?([\w.\-]+)", line)]
    loop: set[str] = set()
    while stack:
        c = stack.pop()
        if c not in loop and c in bodies:
            loop.add(c)
            stack += calls.get(c, ())
    found: Counter = Counter()
    for n, body in bodies.items():
        for line in body:
            m = _LINE.search(line)
            if m:
                found[("loop" if n in loop else "step", m.group("op"))] += 1
    return found


def build(pipeline, variant: str, donate_flat=()):
    """A `FusedStep` of `pipeline` with the layouts of `variant`: "runtime" (as the
    runtime builds it), "segment edges pinned" (every segment's inputs and results pinned,
    as if each were its own program), "input shardings only" (no constraint inside)."""
    segment_body, hooks = fused_module.segment_body, spmd.constraint_hooks
    try:
        if variant != "runtime":
            pin = variant == "segment edges pinned"
            fused_module.segment_body = (
                lambda *a, **k: segment_body(*a, **{**k, "constrain": pin})
            )
        if variant == "input shardings only":
            spmd.constraint_hooks = lambda plan, mesh: (lambda n, x: x, lambda n, x: x)
        return fused_module.FusedStep(pipeline, donate_flat)
    finally:
        fused_module.segment_body, spmd.constraint_hooks = segment_body, hooks


def _fresh_state(optimizer):
    return gpt.init_state(CONFIG, optimizer, jax.random.key(0))


def one_stage_overhead(rounds: int, steps: int) -> dict:
    """Seconds per step (wall and process time, medians over interleaved rounds) of the
    three training loops of `LOOPS` (see the module docstring), and the collectives of
    the runtime's program and of the hand-written `jax.jit`'s."""
    load = [os.getloadavg()[0]]
    optimizer = optax.adamw(1e-3)
    step = gpt.make_train_step(CONFIG, optimizer)
    batch = gpt.make_batch(CONFIG, BATCH, jax.random.key(1))
    par = autopar.autoparallel(step, num_stages=1, num_microbatches=1, donate=True)
    _, metrics = par(_fresh_state(optimizer), batch)  # plans; the state is donated
    assert par.plan.runtime == "pipeline" and par.plan.num_stages == 1
    in_sh = par.shardings()
    probe_state, _ = par(jax.device_put(_fresh_state(optimizer), in_sh[0]), batch)
    out_sh = jax.tree.map(lambda x: x.sharding, (probe_state, metrics))
    hand = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=0)
    fused = par.pipeline.fused
    out_tree = par.graph.out_tree
    batch = jax.device_put(batch, in_sh[1])
    # The same program with no constraint inside, its results pinned as the runtime's are.
    unpinned_step = build(par.pipeline, "input shardings only")
    unpinned = jax.jit(
        unpinned_step._step, in_shardings=unpinned_step.in_shardings,
        out_shardings=jax.tree.leaves(out_sh),
        donate_argnums=tuple(range(len(jax.tree.leaves(in_sh[0])))),
    )

    def flat_call(fn):
        def call(state, batch):
            outs = fn(*jax.tree.leaves(state), *jax.tree.leaves(batch))
            return jax.tree.unflatten(out_tree, outs)
        return call

    fns = {"autopar": par, "program": flat_call(fused.fn), "unpinned": flat_call(unpinned),
           "jit": hand}
    states = {name: jax.device_put(_fresh_state(optimizer), in_sh[0]) for name in fns}
    flat = [*jax.tree.leaves(states["program"]), *jax.tree.leaves(batch)]
    counts = {
        "program": collectives(fused.fn.lower(*flat).compile().as_text()),
        "unpinned": collectives(unpinned.lower(*flat).compile().as_text()),
        "jit": collectives(hand.lower(states["jit"], batch).compile().as_text()),
    }
    for name, fn in fns.items():  # compile and warm up
        states[name], _ = _loop(fn, states[name], batch, 2)
    times: dict[str, list] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            states[name], _ = _loop(fns[name], states[name], batch, steps)
            times[name].append(((time.perf_counter() - wall) / steps,
                                (time.process_time() - cpu) / steps))
    load.append(os.getloadavg()[0])
    result = {"mesh": tuple(par.plan.stages[0].sharding.mesh.shape), "counts": counts,
              "load": load}
    for name, rows in times.items():
        result[f"{name}_wall_s"] = statistics.median(w for w, _ in rows)
        result[f"{name}_cpu_s"] = statistics.median(c for _, c in rows)
        result[f"{name}_cpu_rounds"] = [c for _, c in rows]
    for name in fns:
        for clock in ("wall", "cpu"):
            result[f"{name}_{clock}_ratio"] = (
                result[f"{name}_{clock}_s"] / result[f"jit_{clock}_s"]
            )
        # The ratio per round (each round runs every loop once, close together in time).
        result[f"{name}_cpu_round_ratios"] = [
            c / j for c, j in zip(result[f"{name}_cpu_rounds"], result["jit_cpu_rounds"])
        ]
    return result


def _loop(fn, state, batch, steps: int):
    """`steps` training steps, the state fed back, waited for once at the end."""
    metrics = None
    for _ in range(steps):
        state, metrics = fn(state, batch)
    jax.block_until_ready((state, metrics))
    return state, metrics


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
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-bubbles", action="store_true",
                        help="only the one-stage overhead")
    parser.add_argument("--skip-overhead", action="store_true",
                        help="only the 4-stage bubbles")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace docs/benchmarks.md's runtime_overhead section with "
                        "this run's tables (stamped with commit, date, command and machine)")
    args = parser.parse_args()
    out = io.StringIO()
    with contextlib.redirect_stdout(Tee(sys.stdout, out)):
        if not args.skip_overhead:
            _print_overhead(args)
        if not args.skip_bubbles:
            _print_bubbles(args)
    if args.write_docs:
        from benchmarks._results import write_section

        write_section("runtime_overhead", DOCS_INTRO + "\n" + out.getvalue())


DOCS_INTRO = """## Runtime overhead and pipeline bubbles

On 8 virtual CPU devices, GPT `tiny` (hidden 64, sequence 32, 8 layers, batch 16).
First, a one-stage plan (mesh (2, 4), AdamW) as a user's training loop,
`state, metrics = train_step(state, batch)` with the state donated, against the same
loop over a hand-written `jax.jit` given the plan's shardings; then a 4-stage pipeline
(8 microbatches) under 1F1B, interleaved 1F1B (v = 2) and zero bubble, its measured idle
share against the predicted one.

How to read it: *process / jit* near 1 means autopar's runtime adds nothing to the step
the plan's layouts make (the row "no constraint inside" shows what XLA's own layouts would
give); process time is steadier than wall time on a shared machine. For the bubbles, the
order of the schedules and the predicted shares should match the measured ones.
"""


class Tee(io.TextIOBase):
    """Writes to several streams (the tables printed and kept for the docs)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


def _print_overhead(args) -> None:
    overhead = one_stage_overhead(args.rounds, args.steps)
    load = overhead["load"]
    print(f"one-stage plan on mesh {overhead['mesh']}, ms/step (median over {args.rounds} "
          f"interleaved rounds of {args.steps} steps, load average {load[0]:.1f} before, "
          f"{load[1]:.1f} after): wall, process time, ratio to jax.jit")
    print("| training loop | wall ms | process ms | wall / jit | process / jit | "
          "process / jit per round: median (min-max) |")
    print("|---|---|---|---|---|---|")
    for name, label in LOOPS.items():
        wall, cpu = overhead[f"{name}_wall_s"] * 1e3, overhead[f"{name}_cpu_s"] * 1e3
        per_round = overhead[f"{name}_cpu_round_ratios"]
        ratios = ("1 | 1 | -" if name == "jit" else
                  f"{overhead[f'{name}_wall_ratio']:.3f} | {overhead[f'{name}_cpu_ratio']:.3f}"
                  f" | {statistics.median(per_round):.3f} ({min(per_round):.3f}-"
                  f"{max(per_round):.3f})")
        print(f"| {label} | {wall:.2f} | {cpu:.2f} | {ratios} |")
    print("| program | all-gather | all-reduce | reduce-scatter | all-to-all | permute |")
    print("|---|---|---|---|---|---|")
    for name, counts in overhead["counts"].items():
        total = Counter()
        for (_, op), n in counts.items():
            total[op] += n
        print(f"| {LOOPS[name]} | {total['all-gather']} | {total['all-reduce']} | "
              f"{total['reduce-scatter']} | {total['all-to-all']} | "
              f"{total['collective-permute']} |")


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
