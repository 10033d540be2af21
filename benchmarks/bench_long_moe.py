"""Long context and MoE on virtual DGX H100 clusters: the Megatron grid with context /
expert parallelism against the grid without, and autopar's own plan where asked.

In: rows (a Llama at 32k or 128k tokens; a Mixtral-8x7B-like or DeepSeek-V3-like MoE as
its dense proxy, `autopar.manual.MoEShape`), each on a number of DGX H100 hosts. Out: a
table in ``docs/benchmarks.md`` (section "Long context and MoE"): per row the best grid
configuration and its predicted step time and TFLOP/s per GPU with CP (or EP) and
without, their ratio, and, with ``--auto ROW``, `autopar.plan`'s plan of the same step
(what each stage chose: mesh, CP algorithm and degree, remat; microbatches; peak memory)
and the grid's step time over autopar's.
Nothing executes: every figure comes from the shared cost model, the grid pricing CP and
EP as `autopar/manual/_context_experts.py` says (each configuration traced at its CP
rank's shapes; EP on the dense proxy).

The grid is restricted so that a row plans in minutes on a shared two-core machine:
sequence parallelism and the distributed optimizer on (what long-context and MoE runs
use), one sequence per microbatch per data-parallel rank, no interleaving, recompute tried
in order (none, selective, full) where a configuration does not fit, and each row's
tensor- and pipeline-parallel degrees (`Row.tp_values`, `Row.pp_values`): the rows
compare CP (EP) degrees at fixed tp and pp, not the whole grid. A row with a prime layer
count (DeepSeek-V3's 61) splits its layers unevenly over the stages (`Row.uneven_stages`).

TFLOP/s per GPU counts the traced step's FLOPs at the full sequence (attention's whole
s x s square, as the traced einsum does) over the predicted step time and the GPUs.

Usage: ``python -m benchmarks bench_long_moe [--rows KEY,...] [--auto KEY,...]
[--auto-limit SECONDS] [--no-write] [--save FILE] [--load FILE ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax  # noqa: E402

from autopar.cluster import Cluster  # noqa: E402
from autopar.graph import trace  # noqa: E402
from autopar.manual import AttentionShape, MoEShape, megatron_grid_search  # noqa: E402
from autopar.search import plan  # noqa: E402
from examples import llama  # noqa: E402

SECTION = "## Long context and MoE: the Megatron grid with CP / EP"
TERA = 1e12
PROFILE = "dgx-h100"

# Mixtral 8x7B (Jiang et al. 2024): hidden 4096, 32 layers, 32 heads, 8 K/V heads, 8
# experts of SwiGLU width 14,336, top-2, vocabulary 32,000. Its dense proxy: width 2 x
# 14,336.
MIXTRAL = llama.LlamaConfig(32000, 4096, 4096, 32, 32, 8, 2 * 14336, rope_theta=1e6)
MIXTRAL_MOE = MoEShape(num_experts=8, top_k=2, expert_ffn=14336, hidden=4096,
                       num_moe_layers=32, num_layers=32)
# DeepSeek-V3-like (DeepSeek-AI 2024, sec. 4.2), as benchmarks/validate_public.py traces it:
# MLA as multi-head attention of the same width; (8 + 1) x 2048 = 18,432, the dense layers'
# width.
DEEPSEEK = llama.LlamaConfig(129280, 4096, 7168, 61, 128, 128, 18432)
DEEPSEEK_MOE = MoEShape(num_experts=256, top_k=8, expert_ffn=2048, hidden=7168,
                        num_moe_layers=58, num_layers=61, num_shared=1)


@dataclass(frozen=True)
class Row:
    """A model (`LlamaConfig`, a dense proxy when `moe` is set) at `seq_len` tokens,
    `global_batch` sequences per step, on `num_hosts` DGX H100 hosts; the grid's pipeline
    degrees `pp_values` and expert degrees `ep_values`."""

    name: str
    model: llama.LlamaConfig
    seq_len: int
    global_batch: int
    num_hosts: int
    pp_values: tuple[int, ...] = (1,)
    moe: MoEShape | None = None
    ep_values: tuple[int, ...] | None = None
    cp_values: tuple[int, ...] | None = None  # None: every divisor of the devices
    tp_values: tuple[int, ...] | None = None  # None: every divisor
    uneven_stages: bool = False  # pp need not divide the layers (MoE rows' grid)

    @property
    def key(self) -> str:
        return f"{self.name}-{self.seq_len // 1024}k@{self.num_hosts * 8}"


# Each row's grid is cut to a few configurations (one tp, one or two pp) so that the rows plan
# on a shared two-core machine; `--rows` picks rows, and widening a row's values widens
# its grid.
ROWS = (
    Row("llama-8B", llama.CONFIGS["8B"], 32768, 32, 1, (1,), cp_values=(1, 2, 4),
        tp_values=(2,)),
    Row("llama-8B", llama.CONFIGS["8B"], 131072, 8, 8, (1,), cp_values=(1, 2, 4, 8),
        tp_values=(8,)),
    Row("llama-70B", llama.CONFIGS["70B"], 32768, 32, 8, (1, 4), cp_values=(1, 2, 4, 8),
        tp_values=(8,)),
    Row("llama-70B", llama.CONFIGS["70B"], 131072, 8, 8, (1, 4), cp_values=(1, 2, 4, 8),
        tp_values=(8,)),
    Row("mixtral-8x7B", MIXTRAL, 4096, 256, 2, (2,), MIXTRAL_MOE, (1, 8), tp_values=(1,)),
    Row("deepseek-v3", DEEPSEEK, 4096, 512, 32, (4, 8, 16), DEEPSEEK_MOE, (1, 8, 16, 32, 64),
        tp_values=(1,), uneven_stages=True),
)


def model_step(row: Row):
    """The row's train step (bf16, fp32 master weights and moments, layer marks) and its
    abstract arguments at the full sequence."""
    cfg = dataclasses.replace(row.model, seq_len=row.seq_len, dtype="bfloat16",
                              master_dtype="float32", layer_markers=True)
    optimizer = optax.adamw(1e-4)
    return cfg, llama.make_train_step(cfg, optimizer), (
        llama.abstract_state(cfg, optimizer), llama.abstract_batch(cfg, row.global_batch))


def run_grid(row: Row, cfg, step, args, cluster):
    """The grid with CP (dense rows) or EP (MoE rows): ``(best plan, results, seconds)``;
    its configurations at cp = 1 / ep = 1 are the grid without."""
    attention = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               cfg.num_layers)
    if row.moe is not None:
        extra = dict(moe=row.moe, ep_values=row.ep_values, etp_values=(None,),
                     attention=attention, cp_values=(1,), uneven_stages=row.uneven_stages)
    else:
        extra = dict(attention=attention, cp_values=row.cp_values)
    start = time.perf_counter()
    best, results = megatron_grid_search(
        step, *args, cluster=cluster, microbatch_sizes=(1,),
        sequence_parallel=(False,) if row.tp_values == (1,) else (True,),
        distributed_optimizer=(True,), virtual_stages=(1,), pp_values=row.pp_values,
        tp_values=row.tp_values, num_heads=cfg.num_heads, **extra)
    return best, results, time.perf_counter() - start


def _extended(config) -> bool:
    return config.cp > 1 or config.expert_parallel > 1


def auto_config(p) -> str:
    """What autopar's plan chose: stages, each stage's mesh, context parallelism
    (algorithm x degree), remat, and the microbatches."""
    stages = []
    for stage in p.stages:
        context = stage.sharding.context_parallel
        cp = (f"{context.algorithm} CP x{context.degree}" if context.degree > 1
              else "no CP")
        remat = sorted({str(r) for r in stage.remat}) or ["none"]
        stages.append(f"mesh {tuple(stage.mesh.shape)}, {cp}, remat {'/'.join(remat)}")
    return f"{p.num_stages} stage(s): {'; '.join(stages)}; {p.num_microbatches} mb"


def evaluate(row: Row, auto: bool, auto_options: dict | None = None,
             grid: dict | None = None) -> dict:
    """The row's grid results (or those of `grid`, a row saved earlier) and, with `auto`,
    autopar's plan."""
    cfg, step, args = model_step(row)
    cluster = Cluster.from_profile(PROFILE, num_hosts=row.num_hosts)
    flops = trace(step, *args, batch_argnums=(1,)).total_flops
    out = {"row": row.key}
    if grid is not None:
        out.update({k: grid[k] for k in ("with", "without") if k in grid})
        return _with_auto(out, row, auto, auto_options, step, args, cluster, flops)

    def result(config, seconds, **more):
        return dict(config=config.name, seconds=seconds,
                    tflops=flops / seconds / cluster.num_devices / TERA, **more)

    try:
        best, results, seconds = run_grid(row, cfg, step, args, cluster)
    except ValueError as err:
        out["with"] = dict(error=no_plan(str(err)))
        out["without"] = dict(error=no_plan(str(err), plain=True))
    else:
        costed = [(c, t) for c, t in results if isinstance(t, float)]
        out["with"] = result(*min(costed, key=lambda ct: ct[1]), costed=len(costed),
                             planning=seconds)
        plain = [(c, t) for c, t in costed if not _extended(c)]
        out["without"] = (result(*min(plain, key=lambda ct: ct[1])) if plain else
                          dict(error="no configuration without CP/EP fits"))
    print(row.key, out, flush=True)
    return _with_auto(out, row, auto, auto_options, step, args, cluster, flops)


def no_plan(message: str, plain: bool = False) -> str:
    """The grid's no-configuration error in one cell: its first line, how many
    configurations it listed (how many Megatron's rules pruned) and the closest miss, the
    one needing the least memory (counted with the experts where the grid got that far);
    `plain`: of the configurations without CP / EP only."""
    lines = message.splitlines()
    if plain:
        lines = [lines[0], *[x for x in lines[1:-1] if not re.search(
            r"megatron\([^)]*\b(cp|ep)=(?!1\b)\d+", x)], lines[-1]]
    reasons = [x for x in lines[1:-1] if "pruned:" not in x] or lines[1:2]
    needs = [(float(m.group(1)), x) for x in reasons
             if (m := re.search(r"needs ([0-9.]+) GiB", x))]
    # a configuration refused on the dense proxy's memory would need more with its real
    # experts; those that got to the expert terms say their whole need
    needs = [n for n in needs if "expert weights" in n[1]] or needs
    closest = min(needs)[1] if needs else (reasons or [""])[0]
    return (f"{lines[0].rstrip(':')}: none of {len(lines[1:-1])} configurations "
            f"({sum('pruned:' in x for x in lines)} pruned by Megatron's rules); "
            f"closest: {_short(closest)}")[:400]


class PlanningStopped(Exception):
    """autopar's planning ran past `--auto-limit` seconds; says how far it got."""


@contextlib.contextmanager
def _planning_limit(seconds: int | None):
    """Stop `plan` after `seconds` (SIGALRM), with how far it got: the last progress
    lines of the ``autopar`` logger (which microbatch count, the stage DP's bound) and the
    layer ILPs solved so far in the table being filled."""
    if not seconds:
        yield
        return
    progress: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith(("microbatch counts", "stage DP", "search")):
                progress.append(text)

    def stop(signum, frame):
        ilps = None
        while frame is not None and ilps is None:
            table = next((v for v in frame.f_locals.values()
                          if type(v).__name__ == "LayerCostTable"), None)
            ilps = getattr(table, "num_ilps", None)
            frame = frame.f_back
        raise PlanningStopped(
            f"planning stopped at {seconds} s"
            + (f", {ilps} layer ILPs solved in the current table" if ilps is not None
               else "") + "; last progress: " + " / ".join(progress[-2:]))

    handler, logger = Keep(level=logging.INFO), logging.getLogger("autopar")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.INFO, logging.INFO))
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        logger.removeHandler(handler)
        logger.setLevel(level)


def _short(reason: str) -> str:
    """A grid reason without the repeated layout name and the generic advice."""
    reason = re.sub(r"ValueError: the Megatron layout megatron\([^)]*\) ", "", reason.strip())
    return reason.split("; use a larger")[0]


def _with_auto(out: dict, row: Row, auto: bool, auto_options, step, args, cluster, flops
               ) -> dict:
    if auto:
        start = time.perf_counter()
        options = dict(auto_options or {})
        limit = options.pop("limit", None)
        try:
            with _planning_limit(limit):
                p = plan(step, *args, cluster=cluster, cache=False, **options)
            out["auto"] = dict(config=auto_config(p), seconds=p.predicted_step_time,
                               peak_gib=max(s.memory_per_device for s in p.stages) / 2**30,
                               tflops=flops / p.predicted_step_time / cluster.num_devices
                               / TERA, planning=time.perf_counter() - start)
        except ValueError as err:
            out["auto"] = dict(error=str(err).splitlines()[0][:160])
        except PlanningStopped as stop:
            out["auto"] = dict(error=str(stop)[:400])
        print(row.key, "auto", out["auto"], flush=True)
        if "error" not in out["auto"] and os.environ.get("BENCH_LONG_EXPLAIN"):
            print(p.explain(), flush=True)  # where autopar's step goes, by cause
    return out


def _cell(result: dict | None) -> str:
    if result is None:
        return "not run | — | —"
    if "error" in result:
        return f"no plan: {result['error']} | — | —"
    peak = f" ({result['peak_gib']:.1f} GiB)" if "peak_gib" in result else ""
    return (f"`{result['config']}`{peak} | {result['seconds']:.3g} | "
            f"{result['tflops']:.0f}")


def table(results: list[dict]) -> str:
    lines = [
        SECTION,
        "",
        "Dry runs on virtual DGX H100 clusters (`dgx-h100` profile), nothing executes. "
        "*With*: the best configuration of the Megatron grid searching context parallelism "
        "(the row's cp values whose 2·cp chunks divide the sequence; ring CP, Megatron's "
        "default) for the dense rows, expert parallelism (ep; etp = tp) on the MoE's "
        "dense proxy for the MoE rows, at each row's tp and pp; *without*: the best of "
        "the same grid's configurations at cp = 1 / ep = 1. Speedup: without over with "
        "(predicted step times). autopar's own plan of the same step is listed where run "
        "(`--auto`; `context_parallel=\"auto\"`: its search picks the CP algorithm and "
        "degree per stage beside TP, DP/ZeRO, PP, remat and the microbatches; its peak "
        "memory per device in brackets); grid / autopar: the grid's best step time over "
        "autopar's (below 1: autopar's plan is slower). Module docstring of "
        "`benchmarks/bench_long_moe.py`: the grid's restrictions and the FLOP count.",
        "",
        "| row | best with CP/EP | s/step | TFLOP/s/GPU | best without | s/step | "
        "TFLOP/s/GPU | speedup | autopar | s/step | TFLOP/s/GPU | grid / autopar |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        with_, without = r.get("with"), r.get("without")
        speedup = "—"
        if with_ and without and "seconds" in with_ and "seconds" in without:
            speedup = f"{without['seconds'] / with_['seconds']:.2f}"
        auto, versus = r.get("auto"), "—"
        if with_ and auto and "seconds" in with_ and "seconds" in auto:
            versus = f"{with_['seconds'] / auto['seconds']:.2f}"
        lines.append(f"| {r['row']} | {_cell(with_)} | {_cell(without)} | {speedup} | "
                     f"{_cell(auto)} | {versus} |")
    return "\n".join(lines + ["", *NOTES, *MOE_NOTES]) + "\n"


# Why the rows' autopar and grid columns differ, from
# `benchmarks/investigations/long_context_decomposition.py` (its command in each note).
NOTES = (
    "Row notes (`python benchmarks/investigations/long_context_decomposition.py --row KEY "
    "--grid tp=..,cp=..,mb=.. [--auto-options ...]`: both plans by stage, layer and kind "
    "of node, priced by the same model; `--grid-only` for the grid's alone):",
    "",
    "- **The grid prices a CP algorithm's attention core as autopar prices the same "
    "algorithm.** It traces at one CP rank's shapes, an (s/cp)^2 score piece; "
    "`context_terms` charges the rank's real core, the dots and the score-sized "
    "element-wise work (scale, mask, softmax and their gradients) alike: the local piece "
    "as the plan prices it node by node (`local_attention_core`) times cp x the share of "
    "the rank's dense s/cp x s core its algorithm computes under causal load balancing "
    "(`cost.context_core_time`; the ring's (cp + 1)/(2 cp), the share autopar's ring "
    "charges, `ring_compute_fraction`). On the same ring (queries over cp, heads over tp) "
    "autopar's planner prices the core 1.8% below the grid on both 8B rows "
    "(`ring_core_seconds`: the rank's GEMMs at their own shapes' efficiency, where the "
    "grid scales the local piece's, kernel launches with it). Before, it charged the "
    "dots on the whole s/cp x s "
    "share and the element-wise work on the local piece only (1/cp of the rank's): 22.6 s "
    "and 7.42 s on the 8B rows, ahead of autopar's plans. The rest of the step is alike "
    "(collectives and resharding within 0.6 s per step, no bubble, one stage each).",
    "- **llama-8B-32k@8** (`--grid tp=2,cp=4,mb=32`). Attention core per layer and "
    "one-sequence microbatch: the local piece costs 6.0 ms (dots 2.2, element-wise 3.9), "
    "the rank's ring core 15.1 ms (2.5 x); autopar's ring x8 on (4, 2) (sequence over "
    "all 8 devices, no TP) pays 9.0 ms of dots and 17.5 ms of element-wise work per "
    "two-sequence microbatch. With the grid's 32 microbatches fixed "
    "(`--auto-options num_microbatches=32`) autopar plans ring x8 on (8,) at 24.4 s.",
    "- **llama-8B-128k@64** (`--grid tp=8,cp=8,mb=8`). The local piece costs 6.0 ms per "
    "layer and microbatch, the rank's ring core 27.2 ms (4.5 x); autopar's ring x16 on "
    "(16, 4) pays 25.5 ms (9.0 ms of dots, 16.5 ms element-wise) and holds more state "
    "per device (71.0 against 18.8 GiB).",
)


# The MoE rows (`python -m benchmarks bench_long_moe --rows KEY`; the grid's reasons per
# configuration at INFO on the ``autopar`` logger).
MOE_NOTES = (
    "- **The MoE rows' autopar column plans the dense proxy** (the row's `LlamaConfig`, "
    "FFN width top-k x the expert width), as the grid traces it; the grid then adds EP's "
    "all-to-alls and the real experts' memory (`expert_terms`), autopar's plan has "
    "neither, so its peak memory and step time are those of the proxy, not of the MoE.",
    "- **deepseek-v3-4k@256: no Megatron configuration fits 256 H100s.** DeepSeek-V3 "
    "trained with 16-way PP, 64-way EP over 8 nodes and ZeRO-1 DP on 2,048 GPUs "
    "(H800s; DeepSeek-AI 2024, secs. 3.1-3.2); its 61 layers are prime, so the grid's rule pp | "
    "layers left pp = 1 only (351.8 GiB per device). The row now tries pp 4, 8 and 16 "
    "split unevenly (`uneven_stages`: Megatron-LM's --decoder-first/last-pipeline-num-"
    "layers) with ep 1, 8, 16, 32, 64 (ep <= a stage's dp), tp = 1, ZeRO-1 over dp: "
    "without recompute each fails on the proxy's activations (pp 4 / 8 / 16: 120.2 / "
    "98.5 / 84.0 GiB), with full recompute on the experts' weights, gradients and "
    "moments (ep = dp of a stage leaves ZeRO-1 nothing to shard them over): least "
    "pp=4, ep=64 at 103.7 GiB and pp=8, ep=32 at 104.1 GiB against 80 GiB. The published "
    "run of this very step on 256 H100s (NeMo AutoModel: TP1 PP4 EP64 VP8, FSDP over 64, "
    "8.18 s; validation row deepseek-v3-256) shards the parameters and gradients too "
    "(FSDP), which Megatron's ZeRO-1 does not, and autopar's memory model does not fit "
    "that row in 80 GiB either. autopar's own column plans the 38.6B-parameter dense proxy, which "
    "fits, so it has a plan where the MoE has none.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(r.key for r in ROWS))
    parser.add_argument("--auto", default="", help="rows to plan with autopar.plan too")
    parser.add_argument("--auto-microbatches", type=int,
                        help="fix autopar's microbatch count (default: its own search)")
    parser.add_argument("--auto-limit", type=int,
                        help="stop autopar's planning after this many seconds and report "
                        "how far it got (the row's autopar cell)")
    parser.add_argument("--grid-from", nargs="*", default=(),
                        help="JSON files saved earlier (--save) whose rows' grid results "
                        "are taken instead of running the grid again (autopar's plan still "
                        "runs where --auto asks)")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--save", help="also write the results to this JSON file")
    parser.add_argument("--load", nargs="*", default=(),
                        help="JSON files of results saved earlier (--save) to table with "
                        "this run's, in row order (processes can run disjoint --rows; a "
                        "later file's with / without / auto replace an earlier one's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    wanted, auto = args.rows.split(","), set(filter(None, args.auto.split(",")))
    unknown = [k for k in wanted if k not in {r.key for r in ROWS}]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from "
                         f"{', '.join(r.key for r in ROWS)}")
    loaded = {}
    for path in args.load:  # a later file's keys replace an earlier one's, row by row
        with open(path) as f:
            for r in json.load(f):
                loaded[r["row"]] = {**loaded.get(r["row"], {}), **r}
    auto_options = ({"num_microbatches": args.auto_microbatches}
                    if args.auto_microbatches else {})
    if args.auto_limit:
        auto_options["limit"] = args.auto_limit
    grids = {}
    for path in args.grid_from:
        with open(path) as f:
            grids.update({r["row"]: r for r in json.load(f)})
    fresh = [evaluate(row, row.key in auto, auto_options, grids.get(row.key)) for row in ROWS
             if row.key in wanted and row.key not in loaded]
    if args.save:
        with open(args.save, "w") as f:
            json.dump(fresh, f, indent=1)
    by_key = {**loaded, **{r["row"]: r for r in fresh}}
    section = table([by_key[r.key] for r in ROWS if r.key in by_key])
    print(section)
    if not args.no_write:
        from benchmarks._results import write_section

        write_section("bench_long_moe", section)


if __name__ == "__main__":
    main()
