"""Collectives of the local one-mesh plans: the cost model's count against XLA's (issue 14).

Plans GPT `small-test` (batch 16) on the 8 virtual CPU devices as `shard (8,)`, `data (8,)`,
`zero2 (8,)` and Megatron dp8 tp1 (`bench_local.local_plans`), compiles each plan's step
and prints, per plan, the predicted step time, the collectives the cost model charges
(`PredictedCost.collectives`: count and MiB per device) and the collective instructions
in XLA's optimized HLO of the step; with ``--time``, the CPU time per step over the cores
(3 interleaved rounds of 5 steps, medians).

Usage: ``python benchmarks/investigations/local_hlo_probe.py [--time] [--plan NAME ...] [--shapes]``
(``--plan``: other local plans, one-stage ones; ``--shapes``: also each collective's
result shape in the HLO).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections import Counter

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
_HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/investigations
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]

import jax  # noqa: E402
from bench_local import _cluster, _cpu_per_core, _gpt_arrays, _Timer, local_plans  # noqa: E402

PLANS = ("shard (8,)", "data (8,)", "zero2 (8,)", "megatron dp8 tp1 pp1")
COLLECTIVES = r"(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)\("


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time", action="store_true", help="also time the steps")
    parser.add_argument("--plan", action="append", default=None,
                        help=f"a one-stage local plan to probe (repeatable; default: {PLANS})")
    parser.add_argument("--shapes", action="store_true",
                        help="print each collective's result shape and count")
    args = parser.parse_args()
    step, state, batch = _gpt_arrays("small-test", 16)
    makers = local_plans(step, (state, batch), _cluster("cpu-local-measured"))
    timers = {}
    for name in args.plan or PLANS:
        p = makers[name]()
        timer = _Timer(step, state, batch, p, _cpu_per_core)
        timers[name] = (p, timer)
        compiled = timer.run._last
        fn = compiled.fn if p.runtime == "spmd" else compiled.fn.fused.fn
        hlo = fn.lower(*jax.tree.leaves((timer.state, batch))).compile().as_text()
        found = Counter(re.findall(COLLECTIVES, hlo))
        model = {kind: f"{n:.0f} ({nbytes / 2**20:.2f} MiB)"
                 for kind, (n, nbytes) in p.stages[0].sharding.cost.collectives.items()}
        print(f"{name}: predicted {p.predicted_step_time * 1e3:.2f} ms; model {model}; "
              f"HLO {dict(found)}", flush=True)
        if args.shapes:
            shapes = Counter(re.findall(r"= (\S+) " + COLLECTIVES, hlo))
            for (shape, kind), count in sorted(shapes.items(), key=lambda kv: kv[0][1]):
                print(f"    {kind} {shape} x{count}")
    if args.time:
        for _ in range(3):
            for _, timer in timers.values():
                timer.time_steps(5)
        for name, (p, timer) in timers.items():
            print(f"{name}: predicted {p.predicted_step_time * 1e3:.2f} ms, measured "
                  f"{statistics.median(timer.times) * 1e3:.2f} ms (CPU per core)")


if __name__ == "__main__":
    main()
