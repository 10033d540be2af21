"""autopar against Megatron on virtual clusters, and local runs: docs/benchmarks.md's
"bench_large" and "bench_local" sections.

    python -m benchmarks run_benchmarks           # every row, then the local plans
    python -m benchmarks run_benchmarks --quick   # gpt-1.3B@8, gpt-2.6B@16, local
    python -m benchmarks bench_large --rows gpt-39B@64   # = run_benchmarks --no-local
    python -m benchmarks bench_local              # = run_benchmarks --local-only
    python -m benchmarks run_benchmarks --list    # the row names

Each finished row is stored in benchmarks/results.json at once and the markdown is
rewritten from it, so an interrupted run keeps what it finished and later runs add rows.
A run writing elsewhere (``--out O.md``) stores its rows beside it (``O.json``) unless
``--results`` says where, so that a quick check leaves the page's results alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from _results import write_section  # noqa: E402
from bench_large import (  # noqa: E402
    Row,
    RowResult,
    least_memory_per_device,
    run_row,
)
from bench_markdown import sections  # noqa: E402

log = logging.getLogger("autopar.benchmarks")

RESULTS = HERE / "results.json"
OUTPUT = HERE.parent / "docs" / "benchmarks.md"
GPT_MODELS = ("1.3B", "2.6B", "6.7B", "13B", "39B")
HOSTS = (1, 2, 4, 8)  # 8, 16, 32, 64 GPUs of dgx-a100-80g
# MoE on 16 and 32 GPUs at the sizes Alpa benchmarks there (Zheng et al. 2022, Table 4:
# 10B on 16 GPUs, 27B on 32).
MOE_ROWS = (Row("moe", "10B", 2), Row("moe", "27B", 4))
# Llama 3 8B on one DGX H100 and 70B on four, layers scanned (`bench_large.model_step`).
# Global batch 256 sequences of 8192 tokens, 2M tokens (Llama 3 405B's pre-training began
# at 4M tokens a step: Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.4.1);
# run them with `--microbatches 128` (2 sequences each).
LLAMA_ROWS = (
    Row("llama", "8B", 1, global_batch=256, profile="dgx-h100"),
    Row("llama", "70B", 4, global_batch=256, profile="dgx-h100"),
)
# A small global batch, where a pipeline's bubble is large: GPT 2.6B on 32 GPUs with 32
# sequences a step (64K tokens), run with `--microbatches 8` (4 sequences each). The
# cross-host gradient all-reduce of data parallelism weighs more against the smaller
# step's compute, so the planner pipelines (4 stages), and with 8 microbatches 1F1B idles
# 3/11 of the step: what `schedule="auto"` weighs zero bubble and interleaving against.
SMALL_BATCH_ROWS = (Row("gpt", "2.6B", 4, global_batch=32, tag="-b32"),)
ALL_ROWS = (tuple(Row("gpt", m, h) for m in GPT_MODELS for h in HOSTS) + SMALL_BATCH_ROWS
            + MOE_ROWS + LLAMA_ROWS)
QUICK_ROWS = ("gpt-1.3B@8", "gpt-2.6B@16")
# Microbatch counts both planners try for a global batch of 1024 (16 sequences per
# microbatch). 16 microbatches do not fit 80 GB for 1.3B on 8 GPUs without remat; each
# further count repeats both searches (pass `--microbatches 32 64` to try two).
DEFAULT_MICROBATCHES = (64,)
# Rows whose memory does not allow the counts asked for (13B and 39B on few GPUs) double
# the count, for both planners, up to this many (2 sequences per microbatch): first while
# even a perfectly split plan could not fit (`least_memory_per_device`), then while either
# planner finds no plan.
MAX_MICROBATCHES = 512


def select_rows(names: list[str] | None, quick: bool) -> list[Row]:
    """The rows named on the command line (all rows when none and not --quick)."""
    by_key = {row.key: row for row in ALL_ROWS}
    wanted = list(QUICK_ROWS) if quick and not names else names or list(by_key)
    unknown = [n for n in wanted if n not in by_key]
    if unknown:
        raise ValueError(
            f"unknown row(s) {', '.join(unknown)}; rows are named family-model@gpus, one of "
            f"{', '.join(by_key)}"
        )
    return [by_key[n] for n in wanted]


def load_results(path: Path) -> dict:
    """The stored results: ``{"rows": {key: row dict}, "local": {...} | None}``."""
    if path.exists():
        return json.loads(path.read_text())
    return {"rows": {}, "local": None}


def save(results: dict, path: Path, output: Path) -> None:
    """Merge the results into the stored ones (another run may have added rows meanwhile),
    store them and rewrite from them the page's sections this run added to ("bench_large"
    for rows, "bench_local" for the local plans; the rest of `output` is left as it is)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time reads, merges and writes
        stored = load_results(path)
        stored["rows"].update(results["rows"])
        if results.get("local"):
            stored["local"] = results["local"]
        path.write_text(json.dumps(stored, indent=1, sort_keys=True))
        ran = {"bench_large": bool(results["rows"]), "bench_local": bool(results.get("local"))}
        for name, markdown in sections(stored, [row.key for row in ALL_ROWS]).items():
            if ran[name]:  # a section is stamped by the run that changed it
                write_section(name, markdown, path=output)


def code_version() -> str:
    """The commit the planners ran at (short hash, "-dirty" with uncommitted changes to
    the code that plans), or "unknown" outside a git checkout."""
    root = HERE.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "autopar", "examples",
             "benchmarks/bench_large.py"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if changes else "")


def plan_row(row: Row, counts: tuple[int, ...], schedule: str = "auto",
             megatron_grid: bool = True) -> tuple[tuple[int, ...], RowResult]:
    """Both planners on `row`, with more microbatches where memory asks for them (see
    `MAX_MICROBATCHES`). **Returns:** the counts used and the result, whose notes say why
    the counts changed."""
    notes = []
    device_memory = row.cluster().device_memory
    while max(counts) * 2 <= min(MAX_MICROBATCHES, row.global_batch):
        least = least_memory_per_device(row, max(counts))
        if least <= device_memory:
            break
        notes.append(f"{max(counts)} microbatches: even a plan splitting everything over "
                     f"every GPU needs {least / 2**30:.0f} GiB per GPU")
        counts = (max(counts) * 2,)
    result = run_row(row, counts, schedule=schedule, megatron_grid=megatron_grid)
    missing_any = result.auto is None or (megatron_grid and result.megatron is None)
    while missing_any and max(counts) * 2 <= min(MAX_MICROBATCHES, row.global_batch):
        missing = " and ".join(
            name for name, r in (("autopar", result.auto), ("Megatron", result.megatron))
            if r is None
        )
        notes.append(f"{max(counts)} microbatches: no {missing} plan fits")
        counts = (max(counts) * 2,)
        log.info("%s: retrying with %d microbatches", row.key, counts[0])
        result = run_row(row, counts, schedule=schedule, megatron_grid=megatron_grid)
        missing_any = result.auto is None or (megatron_grid and result.megatron is None)
    if notes:
        result = dataclasses.replace(result, notes=(*notes, *result.notes))
    return counts, result


def row_record(result: RowResult, microbatches, seconds: float) -> dict:
    """A row result as plain JSON data."""
    record = dataclasses.asdict(result)
    record["ratio"] = result.ratio
    record["microbatches"] = list(microbatches)
    record["wall_seconds"] = seconds
    record["commit"] = code_version()
    return record


def run_local_part(args) -> dict:
    """Run the local plans; returns their JSON record with the Spearman correlation."""
    from bench_local import run_local, spearman

    results, per_round = run_local(args.local_config, args.local_batch, args.local_steps,
                                   args.profile, rounds=args.local_rounds,
                                   clock=args.local_clock)
    record = {
        "config": args.local_config,
        "batch": args.local_batch,
        "steps": args.local_steps,
        "rounds": args.local_rounds,
        "clock": args.local_clock,
        "commit": code_version(),
        "profile": args.profile,
        "plans": [dataclasses.asdict(r) for r in results],
        "spearman": None,
    }
    if len(results) >= 2:
        predicted = [r.predicted for r in results]
        record["spearman"] = spearman(predicted, [r.measured for r in results])
        record["spearman_per_round"] = [spearman(predicted, times) for times in per_round]
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="*", help="rows to run, e.g. gpt-1.3B@8 moe-10B@16")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_ROWS)}")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    parser.add_argument("--microbatches", type=int, nargs="+", default=DEFAULT_MICROBATCHES)
    parser.add_argument("--schedule", default="auto",
                        help="autopar's schedule option (default: auto, the planner chooses "
                             "by predicted step time; the tables show the chosen one)")
    parser.add_argument("--no-local", action="store_true", help="skip the local plans")
    parser.add_argument("--no-megatron", action="store_true",
                        help="skip the Megatron grid (autopar's plan and schedule only)")
    parser.add_argument("--local-only", action="store_true", help="only the local plans")
    parser.add_argument("--local-config", default="small-test")
    parser.add_argument("--local-batch", type=int, default=16)
    parser.add_argument("--local-steps", type=int, default=10,
                        help="steps timed per plan in each round (default: 10)")
    parser.add_argument("--local-rounds", type=int, default=3,
                        help="rounds of timing every plan in turn (default: 3)")
    parser.add_argument("--local-clock", choices=("wall", "process", "cpu-per-core"),
                        default="wall",
                        help="time local steps by wall clock, by this process's CPU time "
                        "(less distorted by other processes on a shared machine), or by "
                        "that CPU time over the cores the process may use (the clock of "
                        "`autopar profile --clock cpu-per-core`)")
    parser.add_argument("--profile", default="cpu-local",
                        help="cost profile of the local predictions (name or JSON path)")
    parser.add_argument("--results", type=Path, default=None,
                        help="where rows are stored and merged (default: "
                        "benchmarks/results.json when writing docs/benchmarks.md, else "
                        "the --out path with the suffix .json)")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = (RESULTS if args.out.resolve() == OUTPUT.resolve()
                        else args.out.with_suffix(".json"))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.list:
        print("\n".join(row.key for row in ALL_ROWS))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Only this run's rows: `save` merges them into the stored ones, so several runs (e.g.
    # one per CPU core, each with its own --rows) can share one results file.
    results = {"rows": {}, "local": None}
    rows = [] if args.local_only else select_rows(args.rows, args.quick)
    for i, row in enumerate(rows):
        log.info("row %d/%d: %s ...", i + 1, len(rows), row.key)
        start = time.perf_counter()
        counts, result = plan_row(row, tuple(args.microbatches), args.schedule,
                                  not args.no_megatron)
        seconds = time.perf_counter() - start
        results["rows"][row.key] = row_record(result, counts, seconds)
        save(results, args.results, args.out)
        log.info("row %s done in %.0f s: ratio %s", row.key, seconds, result.ratio)
    if not args.no_local:
        log.info("local plans ...")
        results["local"] = run_local_part(args)
        save(results, args.results, args.out)
    save(results, args.results, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
