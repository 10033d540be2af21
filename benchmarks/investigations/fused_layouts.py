"""Where a one-stage plan's step loses time to the hand-written `jax.jit`: its layouts.

The one-stage plan of `runtime_overhead.py` (GPT tiny, mesh (2, 4), AdamW) run as one
program (`autopar.runtime._fused.FusedStep`) built three ways, against a hand-written
`jax.jit` with the plan's input shardings, in interleaved rounds (medians of wall and
process seconds per step), with the collectives of each compiled program (and, with
`--microbatches` > 1, how many run inside the accumulation loop):

- "runtime": as the runtime builds it (the plan's constraints inside each segment, the
  update's inputs and results pinned, nothing between the forward and backward segments);
- "segment edges pinned": also every segment's inputs and results pinned (the runtime
  before this change, as if each segment were its own program);
- "input shardings only": no constraint inside at all (XLA propagates from the inputs, as
  in the hand-written `jax.jit`): what is left once the plan's own layouts are dropped.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/investigations/fused_layouts.py [--rounds 5 --steps 10 --microbatches 1]

It times the programs alone (called with the flat arguments, no donation, the same state
every step): the one-stage overhead as a user meets it, autopar's call path and donation
included, is `runtime_overhead.py`'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import jax  # noqa: E402
import optax  # noqa: E402
from runtime_overhead import BATCH, CONFIG, build, collectives  # noqa: E402

import autopar  # noqa: E402
from examples import gpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=1)
    args = parser.parse_args()
    optimizer = optax.adamw(1e-3)
    step = gpt.make_train_step(CONFIG, optimizer)
    state = gpt.init_state(CONFIG, optimizer, jax.random.key(0))
    batch = gpt.make_batch(CONFIG, BATCH, jax.random.key(1))
    par = autopar.autoparallel(step, donate_argnums=(), num_stages=1,
                               num_microbatches=args.microbatches)
    par(state, batch)
    in_sh = par.shardings()
    placed = jax.device_put((state, batch), in_sh)
    flat = jax.tree.leaves(placed)
    runs = {v: build(par.pipeline, v) for v in
            ("runtime", "segment edges pinned", "input shardings only")}
    hand = jax.jit(step, in_shardings=in_sh)
    counts = {v: collectives(f.fn.lower(*flat).compile().as_text()) for v, f in runs.items()}
    counts["hand-written jax.jit"] = collectives(hand.lower(*placed).compile().as_text())
    fns = {v: (lambda f=f: f(flat)) for v, f in runs.items()}
    fns["hand-written jax.jit"] = lambda: hand(*placed)
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list] = {v: [] for v in fns}
    for _ in range(args.rounds):
        for v, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                jax.block_until_ready(fn())
            times[v].append(((time.perf_counter() - wall) / args.steps,
                             (time.process_time() - cpu) / args.steps))
    jit_wall = statistics.median(w for w, _ in times["hand-written jax.jit"])
    jit_cpu = statistics.median(c for _, c in times["hand-written jax.jit"])
    print(f"mesh {par.plan.stages[0].sharding.mesh.shape}, {args.microbatches} microbatch(es), "
          f"medians of {args.rounds} interleaved rounds of {args.steps} steps")
    print("| program | wall ms | process ms | wall / jit | process / jit | all-gather | "
          "all-reduce | all-to-all | permute | in the loop (all) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in fns:
        wall = statistics.median(w for w, _ in times[v])
        cpu = statistics.median(c for _, c in times[v])
        c = counts[v]

        def total(op, c=c):
            return c[("step", op)] + c[("loop", op)]

        in_loop = sum(n for (where, _), n in c.items() if where == "loop")
        print(f"| {v} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {wall / jit_wall:.3f} | "
              f"{cpu / jit_cpu:.3f} | {total('all-gather')} | {total('all-reduce')} | "
              f"{total('all-to-all')} | {total('collective-permute')} | {in_loop} |")


if __name__ == "__main__":
    main()
