"""The logical mesh shapes the pipeline search leaves out: same plans, fewer ILPs (issue 18).

`autopar.inter.logical_mesh_shapes` leaves out, on a submesh of several hosts, the 2-D
shapes whose second axis does not divide a host's devices (both axes would cross hosts).
This script plans each row twice in fresh child processes, with those shapes left out (the
search as it runs) and with every shape (`every_mesh_shape=True`), and
prints for each: CPU seconds, layer ILPs solved, the predicted step time and the plan
(stages, layers, logical meshes, microbatches, schedule). Rows are GPT benchmark models on
several dgx-a100-80g hosts (no plan cache; 64 microbatches as `planning_time.py`'s rows),
or any row of the benchmarks page by its name (`run_benchmarks.py`'s rows, e.g.
``moe-27B@32`` or ``gpt-2.6B@32-b32``, at the microbatches that page plans them with),
planned with recompute searched and ``--schedule`` (default "auto", as the page's rows):

    python benchmarks/investigations/shape_pruning.py [--rows gpt-1.3B@32 gpt-2.6B@32] [--limit S]
    python benchmarks/investigations/shape_pruning.py --rows gpt-13B@64 moe-27B@32 --schedule auto

A row with 1 or 2 hosts of 8 GPUs loses no shape (every 2-D shape of 8 or 16 devices has a
second axis of 2, 4 or 8), so those rows are the same search either way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (model config, hosts of 8 GPUs, microbatches)
ROWS = {"gpt-1.3B@32": ("1.3B", 4, 64), "gpt-2.6B@32": ("2.6B", 4, 64),
        "gpt-1.3B@24": ("1.3B", 3, 64), "gpt-6.7B@64": ("6.7B", 8, 64)}
DEFAULT_ROWS = ("gpt-1.3B@24", "gpt-1.3B@32", "gpt-2.6B@32")
DEFAULT_LIMIT = 1800.0


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _row(name: str):
    """(bench_large Row, microbatches) of a row name: this script's GPT rows, else the
    benchmarks page's (64 microbatches; 8 for the small-batch row)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_large import Row
    from run_benchmarks import ALL_ROWS

    if name in ROWS:
        model, hosts, micro = ROWS[name]
        return Row("gpt", model, hosts), micro
    by_key = {row.key: row for row in ALL_ROWS}
    if name not in by_key:
        raise SystemExit(f"unknown row {name!r}; rows: {', '.join([*ROWS, *by_key])}")
    row = by_key[name]
    return row, 8 if row.global_batch < 64 else 64


def child(row: str, every: bool, schedule: str = "1f1b") -> dict:
    """Plan one row in this process; its figures."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, str(ROOT))
    import autopar
    from autopar.inter import _layer_table
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_large import model_step

    solved = [0]
    table = _layer_table.LayerCostTable
    original = table._solve_steps  # one call per layer ILP

    def counted(self, *args, **kwargs):
        solved[0] += 1
        return original(self, *args, **kwargs)

    table._solve_steps = counted
    spec, micro = _row(row)
    step, args = model_step(spec)
    cluster = spec.cluster()
    start, start_cpu = time.perf_counter(), _cpu()
    plan = autopar.plan(step, *args, cluster=cluster, num_microbatches=micro,
                        schedule=schedule, cache=False, every_mesh_shape=every)
    return {
        "row": row,
        "shapes": "every" if every else "pruned",
        "cpu_s": round(_cpu() - start_cpu, 1),
        "wall_s": round(time.perf_counter() - start, 1),
        "ilps": solved[0],
        "predicted_step_time": plan.predicted_step_time,
        "stages": [[list(s.layers), list(s.mesh.shape)] for s in plan.stages],
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
    }


def run(row: str, every: bool, limit: float, schedule: str) -> dict:
    command = [sys.executable, __file__, "--child", row, "--schedule", schedule]
    command += ["--every"] if every else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"row": row, "shapes": "every" if every else "pruned",
                "error": f"timed out at {limit:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"row": row, "shapes": "every" if every else "pruned",
                "error": (done.stderr or done.stdout)[-800:]}
    return json.loads(lines[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS),
                        help="rows to plan (default: %(default)s)")
    parser.add_argument("--schedule", default="auto",
                        help="the planner's schedule option (default %(default)s)")
    parser.add_argument("--limit", type=float, default=DEFAULT_LIMIT,
                        help="seconds per plan (default %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--every", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.every, args.schedule)), flush=True)
        return
    print("| row | shapes | CPU s | wall s | ILPs | predicted step s | plan | same plan | "
          "pruned / every - 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in args.rows:
        results = [run(row, every, args.limit, args.schedule) for every in (False, True)]
        pruned, every = (r.get("predicted_step_time") for r in results)
        within = "-" if pruned is None or every is None else f"{pruned / every - 1:+.2%}"
        same = ("-" if any("error" in r for r in results) else
                "yes" if all(results[0][k] == results[1][k] for k in
                             ("predicted_step_time", "stages", "num_microbatches", "schedule"))
                else "no")
        for r in results:
            if "error" in r:
                error = r["error"].splitlines()[-1]
                print(f"| {row} | {r['shapes']} | - | - | - | - | {error} | {same} | - |")
                continue
            plan = "; ".join(f"{a}-{b} on {tuple(m)}" for (a, b), m in r["stages"])
            print(f"| {row} | {r['shapes']} | {r['cpu_s']} | {r['wall_s']} | {r['ilps']} | "
                  f"{r['predicted_step_time']:.6g} | {plan}, {r['num_microbatches']} mb, "
                  f"{r['schedule']} | {same} | {within} |", flush=True)


if __name__ == "__main__":
    main()
