"""docs/benchmarks.md's large-model and local sections from the stored results
(benchmarks/results.json).

In: the results dict `run_benchmarks.py` stores and the names of every row. Out: markdown
with the large-model table, the rows not run yet and the command that runs them, and the
local predicted-versus-measured table with its Spearman rank correlation.
"""

from __future__ import annotations

# The acceptance bars of issue 6: autopar's predicted throughput over the best Megatron
# grid plan's, on the same cost model.
GPT_BAR = 0.97
MOE_BAR = 1.2
# Below this Spearman value the report says what the cost model misses (issue 6).
SPEARMAN_BAR = 0.7
COMMAND = "python -m benchmarks bench_large"  # run_benchmarks.py --no-local
# Families with their own section (another profile, no bar): the rows' key prefix.
LLAMA = "llama-"
# Why rows fall short, as found when the table was first generated (issue 6 asks for it).
# Why rows fall short of the bar, by model family (printed for the families with such
# rows; checked against the plans).
SHORTFALL_CAUSES = {
    "moe": """- MoE (bar 1.2): Alpa's 3.5x-9.7x MoE speed-ups were measured against DeepSpeed,
  whose MoE layers lacked good expert parallelism then. The Megatron baseline here already
  places the experts over the data axis (expert parallelism with all-to-all), is scored
  by the same cost model, and is searched over the same dp x tp x pp x sequence-parallel
  grid, so both planners choose from the same layout family for the expert layers;
  autopar's gain comes from mixing mesh shapes per stage and from where it splits the
  attention and the update, 5-10% here. We know of no honest way to a 1.2x gap against
  this baseline.""",
    "gpt": """- GPT (bar 0.97): where autopar falls short or finds no plan, memory is the limit.
  Kept activations per layer and microbatch shrink below one full split only by
  recompute, and the leaner layer plans the stage DP takes under memory pressure come
  in steps (`LEVEL_PRICES` in `autopar/inter/_levels.py`: points of the
  latency/footprint hull), not exactly at the memory a stage has. Resharding where the
  embedding and head layers meet the blocks (about 1% at 13B) is added when a stage is
  stitched; the stage DP does not see it.""",
}


def sections(results: dict, all_rows: list[str]) -> dict[str, str]:
    """The markdown of the page's two sections this data fills, by section name
    (`benchmarks._results.write_section`): "bench_large" (the large-model and Llama tables)
    and "bench_local" (the local plans).

    **Arguments:**
    - `results`: ``{"rows": {key: record}, "local": record | None}``.
    - `all_rows`: every row name, in table order.
    """
    rows = results.get("rows", {})
    large = [_large_section(rows, [k for k in all_rows if not _llama(k)]),
             _llama_section(rows, [k for k in all_rows if _llama(k)])]
    return {"bench_large": "\n".join(p for p in large if p),
            "bench_local": _local_section(results.get("local"))}


def render(results: dict, all_rows: list[str]) -> str:
    """Both sections as one markdown page (`sections`), raw figures in
    `benchmarks/results.json`."""
    return "\n".join(["# Benchmarks\n", *sections(results, all_rows).values()])


def _large_section(rows: dict, all_rows: list[str]) -> str:
    lines = [
        "## Large models on virtual dgx-a100-80g clusters (dry runs)\n",
        "Nothing executes: both planners are scored by the same cost model "
        "(`cost_profiles/dgx-a100-80g.json`). bfloat16 parameters and activations, AdamW, "
        "global batch 1024, layer marks on. TFLOP/s per GPU = the step's FLOPs "
        "(`trace(step, ...).total_flops`) / (predicted step time x GPUs). *ratio* = "
        "autopar's predicted throughput / the best Megatron plan's (bar: "
        f"{GPT_BAR} for GPT, {MOE_BAR} for MoE). Megatron grid: `megatron_grid_search`'s "
        "(the one `autopar compare` searches): dp x tp x pp x sequence parallelism x "
        "ZeRO-1 x recompute x interleaving, pruned by Megatron's rules (tp inside a host, "
        "tp | heads, pp·v | layers), the same microbatch counts as autopar, recompute "
        "only where a configuration does not fit without it, each stage's memory "
        "checked with its in-flight activations as autopar's stage DP does. *Weights "
        "split across hosts*: matmul weights the autopar plan splits, where the matmul "
        "reads them, on a mesh axis spanning hosts (tensor parallelism over the slow "
        "links). Planning seconds are wall time on a 2-core CPU; autopar's phases are "
        "trace and stage DP + layer ILPs, "
        "summed over the microbatch counts tried.\n",
        "How to read it: *ratio* above 1 means autopar's plan is predicted faster than "
        "the best plan of the Megatron grid on the same cost model (a claim about the "
        "search, not about measured speed; `bench_local` and `validate_public` check the "
        "cost model itself). The plan columns show where the two differ: autopar mixes mesh "
        "shapes per stage, schedules zero bubble where the bubble is worth it, and "
        "recomputes only the layers that would not fit.\n",
        "| row | GPUs | autopar TFLOP/s/GPU | Megatron TFLOP/s/GPU | ratio | bar | "
        "autopar plan | autopar schedule | autopar recompute | "
        "autopar weights split across hosts | "
        "Megatron plan | Megatron schedule | "
        "autopar planning (trace / DP+ILPs / total) | Megatron grid time | "
        "microbatches tried |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in all_rows:
        if key in rows:
            lines.append(_row_line(key, rows[key]))
    missing = [k for k in all_rows if k not in rows]
    lines.append("")
    short = [k for k in all_rows if k in rows and _short(k, rows[k])]
    if short:
        lines.append(f"Rows below the bar: {', '.join(short)}.\n")
        lines.append("Why rows fall short of the bar (checked against the plans):\n")
        families = dict.fromkeys(k.split("-")[0] for k in short)
        lines.append("\n".join(SHORTFALL_CAUSES[f] for f in families) + "\n")
    notes = []
    for k in all_rows:
        if k not in rows:
            continue
        parts = list(rows[k].get("notes") or ())
        if rows[k].get("commit"):
            parts.append(f"planned at commit {rows[k]['commit']}")
        if parts:
            notes.append(f"- {k}: {'; '.join(parts)}")
    if notes:
        lines += ["Notes per row:\n", *notes, ""]
    if missing:
        lines.append(f"Rows not run yet: {', '.join(missing)}. Run them with\n")
        lines.append(f"    {COMMAND} --rows {' '.join(missing)}\n")
    else:
        lines.append("Every row was run.\n")
    return "\n".join(lines)


def _llama(key: str) -> bool:
    return key.startswith(LLAMA)


def _llama_section(rows: dict, llama_rows: list[str]) -> str:
    """Llama rows: scanned layers on dgx-h100 clusters, in the large-model table's form."""
    if not llama_rows:
        return ""
    lines = [
        "## Llama (scanned layers) on virtual dgx-h100 clusters (dry runs)\n",
        "examples/llama.py with `scan_layers=True` (its layers' weights stacked and run by "
        "`jax.lax.scan`, as MaxText writes it): Llama 3 8B and 70B shapes (grouped-query "
        "attention, SwiGLU, 128256-token vocabulary, 8192-token sequences), bfloat16 "
        "compute on fp32 master weights, AdamW, scored by `cost_profiles/dgx-h100.json`. "
        "autopar plans the scanned step (the stage DP may cut the scan's iterations into "
        "stages); Megatron plans the same model with its layers written as a Python loop "
        "(`megatron_plan` places no weight whose first use is a scan; Megatron-LM runs a "
        "loop), same grid as above. No acceptance bar. Columns as in the table above.\n",
        "| row | GPUs | autopar TFLOP/s/GPU | Megatron TFLOP/s/GPU | ratio | bar | "
        "autopar plan | autopar schedule | autopar weights split across hosts | "
        "Megatron plan | Megatron schedule | "
        "autopar planning (trace / DP+ILPs / total) | Megatron grid time | "
        "microbatches tried |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row_line(k, rows[k]) for k in llama_rows if k in rows]
    notes = [
        f"- {k}: " + "; ".join(
            [*(rows[k].get("notes") or ()), f"planned at commit {rows[k].get('commit')}"]
        )
        for k in llama_rows if k in rows
    ]
    lines += ["", *notes, ""]
    missing = [k for k in llama_rows if k not in rows]
    if missing:
        lines.append(f"Rows not run yet: {', '.join(missing)}. Run them with\n")
        lines.append(f"    {COMMAND} --microbatches 128 --rows {' '.join(missing)}\n")
    return "\n".join(lines)


def _row_line(key: str, r: dict) -> str:
    auto, meg = r.get("auto"), r.get("megatron")
    bar = "-" if _llama(key) else MOE_BAR if key.startswith("moe") else GPT_BAR
    ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}"
    phases = "-"
    if auto:
        p = auto["phases"]
        phases = (f"{p.get('trace', 0):.0f} / {p.get('stage_dp_and_ilps', 0):.0f} / "
                  f"{auto['planning_seconds']:.0f} s")
    return (
        f"| {key} | {r['num_gpus']} | {_tflops(auto)} | {_tflops(meg)} | {ratio} | {bar} | "
        f"{_cell(auto['plan_line']) if auto else '-'} | {_schedule(auto)} | "
        f"{_remat(auto) + ' | ' if not _llama(key) else ''}"
        f"{_tp_across(auto)} | "
        f"{_cell(meg['plan_line']) if meg else '-'} | {_schedule(meg)} | "
        f"{phases} | {_seconds(meg)} | "
        f"{', '.join(map(str, r['microbatches']))} |"
    )


def _schedule(result: dict | None) -> str:
    """The plan's pipeline schedule (`bench_large.schedule_label`); "?" for results
    stored before the column existed."""
    if not result:
        return "-"
    return result.get("schedule", "?")


def _remat(result: dict | None) -> str:
    """What autopar's plan recomputes (`bench_large.remat_label`); "?" for results stored
    before the column existed."""
    if not result:
        return "-"
    return result.get("remat", "?")


def _cell(text: str) -> str:
    """`text` safe inside a markdown table cell (plan lines separate stage meshes by |)."""
    return text.replace("|", "\\|")


def _tp_across(result: dict | None) -> str:
    """How many matmul weights the plan splits across hosts (tensor parallelism over the
    slow links): "none", or the count and the first."""
    if not result or "cross_host_splits" not in result:
        return "-"
    splits = result["cross_host_splits"]
    return "none" if not splits else f"{len(splits)} (e.g. {splits[0]})"


def _seconds(result: dict | None) -> str:
    return f"{result['planning_seconds']:.0f} s" if result else "-"


def _tflops(result: dict | None) -> str:
    if not result:
        return "-"
    return f"{result['tflops_per_gpu']:.1f} ({result['step_time']:.3g} s)"


def _short(key: str, r: dict) -> bool:
    bar = MOE_BAR if key.startswith("moe") else GPT_BAR
    return r.get("ratio") is None or r["ratio"] < bar


def _local_section(local: dict | None) -> str:
    if not local:
        return ("## Local plans on 8 virtual CPU devices\n\nNot run yet: "
                "`python -m benchmarks bench_local`.\n")
    lines = [
        "## Local plans on 8 virtual CPU devices\n",
        f"GPT `{local['config']}` (examples/gpt.py, float32, layer marks), batch "
        f"{local['batch']}, on 8 virtual CPU devices of this 2-core machine. Predictions use "
        f"the `{local['profile']}` profile; measured = median of "
        f"{local['steps'] * local.get('rounds', 1)} steps after one warm-up step "
        f"(`block_until_ready`"
        + {"process": "; by this process's CPU time, `time.process_time`",
           "cpu-per-core": "; by this process's CPU time over the cores it may use "
           "(`time.process_time() / len(os.sched_getaffinity(0))`)"}.get(local.get("clock"), "")
        + f"), timed in {local.get('rounds', 1)} round(s) of "
        f"{local['steps']} steps of every plan in turn"
        + (f"; planned and run at commit {local['commit']}" if local.get("commit") else "")
        + ".\n",
        "How to read it: the planner needs the cost model to rank plans as they run, so "
        "the figure that matters is the Spearman rank correlation between the predicted and "
        "measured columns (bar: 0.8, with the median measured / predicted within "
        "0.67-1.5); plans within a few percent of each other swap places from round to "
        "round on a shared machine.\n",
        "| plan | chosen layout | schedule | predicted | measured | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for p in local["plans"]:
        lines.append(
            f"| {p['name']} | {p['plan_line']} | {p.get('schedule', '?')} | "
            f"{p['predicted'] * 1e3:.2f} ms | "
            f"{p['measured'] * 1e3:.2f} ms | {p['measured'] / p['predicted']:.2f} |"
        )
    rho = local.get("spearman")
    lines.append("")
    if rho is None:
        lines.append("Too few plans ran for a rank correlation.\n")
    else:
        lines.append(f"Spearman rank correlation (predicted vs measured, "
                     f"{len(local['plans'])} plans): **{rho:.2f}**.\n")
        rounds = local.get("spearman_per_round") or []
        if len(rounds) > 1:
            lines.append(
                f"Per timing round: {', '.join(f'{r:.2f}' for r in rounds)}. Many of these "
                "plans run within a few percent of each other, so the machine's noise moves "
                "their order from round to round.\n")
    if local["plans"]:
        r = sorted(p["measured"] / p["predicted"] for p in local["plans"])
        lines.append(
            f"Measured / predicted: median {r[len(r) // 2]:.2f}, range {r[0]:.2f}-{r[-1]:.2f}: "
            "the absolute level follows the profile's figures"
            + (" (measured on another VM)" if local.get("profile") == "cpu-local" else "")
            + "; the planner only needs the ranking.\n"
        )
    if rho is not None and rho < SPEARMAN_BAR:
        lines.append(_misses(local["plans"]))
    return "\n".join(lines)


def _misses(plans: list[dict]) -> str:
    """What the cost model misses, with the measured/predicted ratios by runtime."""
    by_runtime: dict[str, list[float]] = {}
    for p in plans:
        by_runtime.setdefault(p.get("runtime", "?"), []).append(p["measured"] / p["predicted"])
    ratios = "; ".join(
        f"{runtime} plans {min(r):.2f}-{max(r):.2f} (median {sorted(r)[len(r) // 2]:.2f})"
        for runtime, r in sorted(by_runtime.items())
    )
    spread = max(p["measured"] for p in plans) / min(p["measured"] for p in plans)
    return (
        f"The correlation is below {SPEARMAN_BAR}. Measured / predicted by runtime: "
        f"{ratios}. The measured times of all plans lie within {spread:.1f}x of each other, "
        "so small errors reorder them. What the cost model misses here (see the text below "
        "the table): (1) XLA:CPU's code for some fusions, e.g. the transposed copy of a "
        "weight gradient's operand fused with a long elementwise chain, whose strided reads "
        "slow down many times once they outgrow the cache (Megatron dp2 tp4); (2) a "
        "pipelined plan's runtime work beside its tasks (cross-stage moves, update programs, "
        "the Python of the schedule), and on 8 devices sharing 2 cores the stages' work adds "
        "up rather than running side by side.\n"
    )
