"""The published plan-space data set: whole priced spaces of a fixed suite, and a summary.

    python -m benchmarks space_dataset                      # the whole suite (hours)
    python -m benchmarks space_dataset --rows gpt-1.3B@dgx-a100-80g:1 --local
    python -m benchmarks space_dataset --queries            # the docs' example queries
    python -m benchmarks space_dataset --add gpt-1.3B@dgx-a100-80g:2=space/space.jsonl

For each row of `SUITE` (a model on a cluster), `autopar.space.explore` prices the Megatron
grid and autopar's candidates (docs/space.md); the full space is written as
``OUT/<row>.jsonl`` (JSON Lines; OUT defaults to ``space-data/``, not committed) and the
row's summary (counts, the best Megatron and autopar plans, the memory/time frontier) is
merged into `SUMMARY` (``benchmarks/results/space_summary.json``, committed). With
``--local``, the small GPT's space on the 8 local CPU devices is also explored and a sample
of its plans (autopar's, and Megatron's fastest, leanest and middle feasible ones) is run
and timed, each measured step time set beside its prediction (``measured_step_time``).

The data set's version is `DATASET_VERSION`, with the rows' `autopar.space.SCHEMA_VERSION`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=8"])

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from autopar.space import SCHEMA_VERSION, Space, explore  # noqa: E402

log = logging.getLogger("autopar.benchmarks")

DATASET_VERSION = 2  # 2: schema 2 (stage-count rows), counts by kind, long/MoE rows
HERE = Path(__file__).resolve().parent
SUMMARY = HERE / "results" / "space_summary.json"
GIB = 2.0**30

# The fixed suite: model -> host counts (8 GPUs each), on both profiles. GPT 1.3B-39B as
# Alpa's weak-scaling table pairs them with GPUs (Zheng et al. 2022, Table 4: 1.3B on 8,
# 2.6B on 16, 6.7B on 32, 39B on 64), plus 1.3B on 16; 13B on 32; Llama 3 8B and 70B.
SUITE_MODELS = {
    "gpt-1.3B": (1, 2), "gpt-2.6B": (2,), "gpt-6.7B": (4,), "gpt-13B": (4,),
    "gpt-39B": (8,), "llama-8B": (1, 2), "llama-70B": (8,),
}
PROFILES = ("dgx-a100-80g", "dgx-h100")
# Long context and MoE: rows of benchmarks/bench_long_moe.py (by its key), each with that
# script's model, batch, cluster and grid (context parallelism for the long Llama,
# expert parallelism on the MoE's dense proxy; `grid_of`).
LONG_MOE = {"llama-8B-32k@dgx-h100:1": "llama-8B-32k@8",
            "mixtral-8x7B-4k@dgx-h100:2": "mixtral-8x7B-4k@16"}
SUITE = [f"{model}@{profile}:{hosts}" for model, counts in SUITE_MODELS.items()
         for profile in PROFILES for hosts in counts] + list(LONG_MOE)
BATCH = 8
# The small model that runs here, and its grid kept small enough to explore in minutes.
LOCAL = "gpt-small-test@cpu-local:1"
LOCAL_GRID = dict(microbatch_sizes=(2,), sequence_parallel=(False,),
                  distributed_optimizer=(False, True), recompute=("none",),
                  virtual_stages=(1,))


def parse_row(name: str) -> tuple[str, str, int]:
    """``"gpt-1.3B@dgx-a100-80g:2"`` -> (model, profile, hosts)."""
    try:
        model, rest = name.split("@")
        profile, hosts = rest.rsplit(":", 1)
        return model, profile, int(hosts)
    except ValueError:
        raise SystemExit(f"space_dataset: row {name!r} is not MODEL@PROFILE:HOSTS, e.g. "
                         f"gpt-1.3B@dgx-a100-80g:1; the suite: {', '.join(SUITE)}") from None


def explore_row(name: str, out: Path, grid: dict | None = None) -> Space:
    """Explore one row and write its full space to ``out/<name>.jsonl``."""
    from autopar.app._examples import named_model
    from autopar.cluster import Cluster

    if name in LONG_MOE:
        return explore_long_moe(name, out)
    model_name, profile, hosts = parse_row(name)
    model = named_model(model_name, BATCH, layer_markers=True)
    cluster = Cluster.from_profile(profile, hosts)
    grid = {"num_heads": getattr(model.config, "num_heads", None),
            "num_layers": getattr(model.config, "num_layers", None), **(grid or {})}
    space = explore(model.train_step, model.abstract_state, model.abstract_batch,
                    cluster=cluster, grid=grid, model=f"{model_name} batch {BATCH}",
                    command="python -m benchmarks space_dataset --rows " + name)
    space.write(out / f"{name.replace(':', '_')}.jsonl")
    return space


def grid_of(row, cfg) -> dict:
    """The grid `bench_long_moe.run_grid` prices for `row` (its keyword arguments)."""
    from autopar.manual import AttentionShape

    attention = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               cfg.num_layers)
    extra = (dict(moe=row.moe, ep_values=row.ep_values, etp_values=(None,),
                  attention=attention, cp_values=(1,)) if row.moe is not None
             else dict(attention=attention, cp_values=row.cp_values))
    return dict(microbatch_sizes=(1,),
                sequence_parallel=(False,) if row.tp_values == (1,) else (True,),
                distributed_optimizer=(True,), virtual_stages=(1,), pp_values=row.pp_values,
                tp_values=row.tp_values, num_heads=cfg.num_heads, **extra)


def explore_long_moe(name: str, out: Path) -> Space:
    """A long-context or MoE row (`LONG_MOE`): bench_long_moe's step and grid."""
    import bench_long_moe

    from autopar.cluster import Cluster

    row = next(r for r in bench_long_moe.ROWS if r.key == LONG_MOE[name])
    cfg, step, args = bench_long_moe.model_step(row)
    cluster = Cluster.from_profile(bench_long_moe.PROFILE, num_hosts=row.num_hosts)
    space = explore(step, *args, cluster=cluster, grid=grid_of(row, cfg),
                    model=f"{row.name} batch {row.global_batch} seq {row.seq_len}"
                          + (" (dense proxy)" if row.moe is not None else ""),
                    command="python -m benchmarks space_dataset --rows " + name)
    space.write(out / f"{name.replace(':', '_')}.jsonl")
    return space


def summary_of(name: str, space: Space) -> dict:
    """What the committed summary keeps of a row: counts, the best of each source, the
    frontier, and the measured rows."""
    def brief(row):
        if row is None:
            return None
        return {k: row[k] for k in ("label", "source", "step_time", "memory_peak",
                                    "num_stages", "meshes", "num_microbatches", "schedule",
                                    "remat", "measured_step_time")}

    counts = {}
    for kind in ("grid", "search", "stage_count"):
        rows = [r for r in space.rows if r["kind"] == kind]
        counts[kind] = {"rows": len(rows), "feasible": sum(r["feasible"] for r in rows)}
    fastest = {s: min(space.feasible(s), key=lambda r: r["step_time"], default=None)
               for s in ("megatron", "auto")}
    header = space.header
    return {
        "row": name,
        "schema_version": header["schema_version"],  # of the row's full space
        "model": header["model"],
        "profile": header["profile"],
        "cluster": header["cluster"],
        "memory_budget": header["memory_budget"],
        "seconds": round(header["seconds"].get("all", 0.0), 1),
        "counts": counts,
        "chosen": brief(next((r for r in space.rows if r["chosen"]), None)),
        "best_megatron": brief(fastest["megatron"]),
        "frontier": [{"memory": p.memory, "step_time": p.step_time, "label": p.label,
                      "source": p.source} for p in space.frontier()],
        "measured": [brief(r) for r in space.rows if r["measured_step_time"] is not None],
    }


def measure_local(space: Space, steps: int = 5, rounds: int = 2) -> None:
    """Run a sample of the local space's plans on the 8 CPU devices and set each row's
    `measured_step_time` (the median of `rounds` x `steps` timed steps, after one
    compiling step): autopar's plan and Megatron's fastest, leanest and middle ones."""
    from bench_local import _gpt_arrays, _Timer

    from autopar.cluster import Cluster
    from autopar.manual import megatron_plan

    step, state, batch = _gpt_arrays("small-test", BATCH)
    cluster = Cluster.from_profile("cpu-local")
    hand = sorted(space.feasible("megatron"), key=lambda r: r["step_time"])
    sample = {id(r): r for r in (hand[0], min(hand, key=lambda r: r["memory_peak"]),
                                 hand[len(hand) // 2])} if hand else {}
    timers = []
    chosen = next(r for r in space.rows if r["chosen"])
    timers.append((chosen, _Timer(step, state, batch, space.plan)))
    for row in sample.values():
        plan = megatron_plan(step, state, batch, cluster=cluster, dp=row["dp"], tp=row["tp"],
                             pp=row["pp"], num_microbatches=row["num_microbatches"],
                             distributed_optimizer=row["distributed_optimizer"],
                             sequence_parallel=row["sequence_parallel"],
                             recompute=row["remat"])
        assert abs(plan.predicted_step_time - row["step_time"]) <= 1e-12 * row["step_time"]
        timers.append((row, _Timer(step, state, batch, plan)))
    times: dict[int, list[float]] = {id(r): [] for r, _ in timers}
    for _ in range(rounds):  # plans in turn, so a slow spell falls on all of them
        for row, timer in timers:
            timer.time_steps(steps)
            times[id(row)] = timer.times
    for row, _ in timers:
        row["measured_step_time"] = statistics.median(times[id(row)])
        log.info("%s: predicted %.4g s, measured %.4g s", row["label"], row["step_time"],
                 row["measured_step_time"])


def explore_local(out: Path) -> Space:
    """The small GPT on the 8 local CPU devices, with measured step times."""
    from bench_local import _gpt_arrays

    from autopar.cluster import Cluster

    step, state, batch = _gpt_arrays("small-test", BATCH)
    import jax

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state, batch))
    space = explore(step, *abstract, cluster=Cluster.from_profile("cpu-local"),
                    grid={**LOCAL_GRID, "num_heads": 4}, model=f"gpt-small-test batch {BATCH}",
                    command="python -m benchmarks space_dataset --local")
    measure_local(space)
    space.write(out / f"{LOCAL.replace(':', '_')}.jsonl")
    return space


def merge_summary(entries: list[dict], path: Path = SUMMARY) -> None:
    """Write `entries` into the summary file, replacing rows of the same name."""
    data = {"dataset_version": DATASET_VERSION, "schema_version": SCHEMA_VERSION, "rows": []}
    if path.exists():
        data = json.loads(path.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    rows.update({e["row"]: e for e in entries})
    data.update(dataset_version=DATASET_VERSION, schema_version=SCHEMA_VERSION,
                suite=SUITE + [LOCAL], rows=[rows[k] for k in sorted(rows)])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# -- the example queries (docs/space.md) --------------------------------------------------

def best_under(entry: dict, memory: float) -> dict | None:
    """The fastest plan of a row under `memory` bytes per device: the frontier point of
    the largest memory not above it (a frontier point is the fastest plan at its memory)."""
    under = [p for p in entry["frontier"] if p["memory"] <= memory]
    return max(under, key=lambda p: p["memory"], default=None)


def megatron_gap(entry: dict) -> float | None:
    """How far the best Megatron plan is from the frontier: its time over the frontier's
    at its memory (1.0: on it)."""
    best = entry["best_megatron"]
    if best is None:
        return None
    point = best_under(entry, best["memory_peak"])
    return best["step_time"] / point["step_time"]


def queries(path: Path = SUMMARY) -> str:
    data = json.loads(path.read_text())
    lines = ["row | best plan under 40 GiB | best Megatron plan | its time over the frontier's "
             "| autopar's plan | frontier points", "---|---|---|---|---|---"]
    for entry in data["rows"]:
        best = best_under(entry, 40 * GIB)
        mega = entry["best_megatron"]
        gap = megatron_gap(entry)
        lines.append(
            f"{entry['row']} | "
            + (f"{best['label']}: {best['step_time'] * 1e3:.2f} ms, "
               f"{best['memory'] / GIB:.2f} GiB" if best else "none fits")
            + " | " + (f"{mega['label']}: {mega['step_time'] * 1e3:.2f} ms, "
                       f"{mega['memory_peak'] / GIB:.2f} GiB" if mega else "none")
            + " | " + (f"{gap:.3f}" if gap is not None else "-")
            + " | " + (f"{entry['chosen']['step_time'] * 1e3:.2f} ms, "
                       f"{entry['chosen']['memory_peak'] / GIB:.2f} GiB"
                       if entry.get("chosen") else "-")
            + f" | {len(entry['frontier'])}")
    measured = [(e["row"], m) for e in data["rows"] for m in e["measured"]]
    if measured:
        lines += ["", "row | plan | predicted | measured | measured / predicted",
                  "---|---|---|---|---"]
        for row, m in measured:
            lines.append(f"{row} | {m['label']} | {m['step_time'] * 1e3:.2f} ms | "
                         f"{m['measured_step_time'] * 1e3:.2f} ms | "
                         f"{m['measured_step_time'] / m['step_time']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks space_dataset",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None,
                        help="comma-separated rows MODEL@PROFILE:HOSTS (default: the suite)")
    parser.add_argument("--local", action="store_true",
                        help="also the small GPT on the 8 local devices, measured")
    parser.add_argument("--local-only", action="store_true", help="only the local row")
    parser.add_argument("--out", default="space-data", help="where the full spaces go")
    parser.add_argument("--summary", default=str(SUMMARY), help="the summary file")
    parser.add_argument("--add", default=None, metavar="ROW=FILE",
                        help="merge a space `autopar space --out` wrote for ROW (the same "
                        "exploration as the row's) into the summary, and exit")
    parser.add_argument("--queries", action="store_true",
                        help="print the docs' example queries against the summary and exit")
    args = parser.parse_args(argv)
    if args.queries:
        print(queries(Path(args.summary)))
        return 0
    if args.add:
        from autopar.space import load

        name, _, path = args.add.partition("=")
        parse_row(name)
        merge_summary([summary_of(name, load(path))], Path(args.summary))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out = Path(args.out)
    names = [] if args.local_only else (args.rows.split(",") if args.rows else SUITE)
    for name in names:
        parse_row(name)
    entries = []
    for name in names:
        start = time.perf_counter()
        space = explore_row(name, out)
        entries.append(summary_of(name, space))
        merge_summary(entries[-1:], Path(args.summary))
        print(f"{name}: {space.summary()} ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.local or args.local_only:
        space = explore_local(out)
        merge_summary([summary_of(LOCAL, space)], Path(args.summary))
        print(f"{LOCAL}: {space.summary()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
