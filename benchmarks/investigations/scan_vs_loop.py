"""A GPT whose layers are a `jax.lax.scan` over stacked weights against its Python-loop
twin on the local 8 CPU devices: predicted and measured step time, and their ranking
(issue 44, item 2).

    python benchmarks/investigations/scan_vs_loop.py [--config small-test] [--batch 16]
        [--profile cpu-local-measured] [--steps 5] [--rounds 3] [--mesh 8]

Both forms do the same arithmetic; the planner gives them the same predicted compute (within
2%, `tests/test_same_math.py`). What XLA:CPU really runs differently for the scanned form is
its while loop: every iteration slices each stacked operand (`dynamic-slice`, a copy of the
layer's weights) and writes each stacked result (`dynamic-update-slice`), and the loop's
iterations cannot overlap one another's kernels. The cost model charges that as its own
term (`autopar.cost.backends._xla_cpu.scan_iteration_time`, behind the profile's
`loop_iteration_overhead`). Each form is planned with method "shard" on one mesh, compiled,
then timed in `--rounds` interleaved rounds of `--steps` steps (wall clock, medians; the
machine is shared, so figures are noisy: compare within one run). Prints, per form, the
prediction split into compute / collectives / resharding and the scan term, the measured
median per round and overall, and whether the scanned/loop ranking of the predictions
agrees with the measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path[:0] = [str(ROOT)]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small-test")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--profile", default="cpu-local-measured")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mesh", default="8", help="logical mesh shape, e.g. 8 or 2,4")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    import autopar
    from examples import gpt

    cluster = autopar.Cluster.from_profile(args.profile)
    mesh = tuple(int(n) for n in args.mesh.split(","))
    base = gpt.CONFIGS[args.config]
    forms = {"scanned": dataclasses.replace(base, scan_layers=True), "loop": base}
    runs = {}
    for name, cfg in forms.items():
        optimizer = optax.adamw(1e-3)
        step = gpt.make_train_step(cfg, optimizer)
        state = jax.jit(lambda key, cfg=cfg, o=optimizer: gpt.init_state(cfg, o, key))(
            jax.random.key(0))
        batch = jax.jit(lambda key, cfg=cfg: gpt.make_batch(cfg, args.batch, key))(
            jax.random.key(1))
        plan = autopar.plan(step, state, batch, cluster=cluster, method="shard",
                            mesh_shape=mesh, cache=False)
        run = autopar.autoparallel(step, plan=plan, cache=False)
        state = jax.tree.map(jnp.copy, state)
        state, metrics = run(state, batch)  # compiles
        jax.block_until_ready((state, metrics))
        runs[name] = {"plan": plan, "run": run, "state": state, "batch": batch, "rounds": []}
    for _ in range(args.rounds):
        for r in runs.values():
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                r["state"], metrics = r["run"](r["state"], r["batch"])
                jax.block_until_ready((r["state"], metrics))
                times.append(time.perf_counter() - start)
            r["rounds"].append(statistics.median(times))
    print(f"{args.config}, batch {args.batch}, mesh {mesh}, profile {args.profile}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps (wall clock, medians)")
    print("| form | predicted ms | compute | collectives | resharding | measured ms per round "
          "| measured ms |")
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        p, c = r["plan"], r["plan"].stages[0].sharding.cost
        r["measured"] = statistics.median(r["rounds"])
        rounds = " / ".join(f"{t * 1e3:.1f}" for t in r["rounds"])
        print(f"| {name} | {p.predicted_step_time * 1e3:.1f} | {c.compute * 1e3:.1f} | "
              f"{c.communication * 1e3:.1f} | {c.resharding * 1e3:.1f} | {rounds} | "
              f"{r['measured'] * 1e3:.1f} |")
    s, loop = runs["scanned"], runs["loop"]
    predicted = s["plan"].predicted_step_time / loop["plan"].predicted_step_time
    measured = s["measured"] / loop["measured"]
    per_round = [a / b for a, b in zip(s["rounds"], loop["rounds"])]
    agree = (predicted > 1) == (measured > 1)
    print(f"scanned / loop: predicted {predicted:.3f}, measured {measured:.3f} (per round "
          f"{', '.join(f'{x:.3f}' for x in per_round)}); ranking "
          f"{'agrees' if agree else 'DISAGREES'}")


if __name__ == "__main__":
    main()
