"""Where the predicted step of a 530B-class and a 1T-class Megatron-LM run goes (issue 44,
item 1): per-stage compute, recompute, collectives, resharding, stage-boundary transfers,
the embedding and the output-head stage, the steady state and the fill/drain bubble, each
beside its first-principles figure.

    python benchmarks/investigations/large_decomposition.py [--rows mt530,mt1t] [--write]
        [--label after]

Configurations: Narayanan et al. 2021 (Megatron-LM, SC21), Table 1: 529.6B (hidden 20480,
105 layers, 128 heads) on TP8 PP35, 2520 A100s, batch 2520, 163 TFLOP/s per GPU; 1008B
(hidden 25600, 128 layers, 160 heads) on TP8 PP64, 3072 A100s, batch 3072, 163 TFLOP/s;
sequence 2048, micro-batch 1, full recompute, 1F1B, no sequence parallelism, no
distributed optimizer. The published step time is ``4/3 F / (TFLOP/s x GPUs)`` (eq. 3
counts the recomputed forward), F the traced step's model FLOPs.

First principles beside each part (A100 bf16 peak 312 TFLOP/s): a transformer layer's
forward is ``24 b s h^2 (1 + s/6h)`` FLOPs (Narayanan et al. 2021, eq. 2 per layer without
the head), over TP; backward twice that; full recompute one more forward; the 1F1B bubble
``(p - 1) / m`` of the steady state (sec. 2.2.1). `--write` puts the table into
docs/benchmarks.md (section "Large-model decomposition", `benchmarks._results`),
appending this run's rows labelled `--label` to the rows already there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import validate_public as vp  # noqa: E402
from examples import gpt  # noqa: E402

SECTION = "## Large-model decomposition (530B and 1T, Megatron-LM 2021 Table 1)"
A100_BF16 = 312e12
STORE = ROOT / "benchmarks" / "results" / "large_decomposition.json"

GPT530 = gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 20480, 105, 128, dtype="bfloat16",
                       master_dtype="float32", layer_markers=True)
GPT1T = gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 25600, 128, 160, dtype="bfloat16",
                      master_dtype="float32", layer_markers=True)
ROWS = {
    "mt530": vp.PublishedRun("mt530", "Megatron-LM (NVIDIA)", GPT530, "gpt", "dgx-a100-80g",
                             2520, 9, 8, 35, 2520, 1, 163.0, True, "",
                             vp.MEGATRON_SRC.format("529.6B", 35, 2520, 2520, 163),
                             recompute="full", sequence_parallel=False,
                             distributed_optimizer=False),
    "mt1t": vp.PublishedRun("mt1t", "Megatron-LM (NVIDIA)", GPT1T, "gpt", "dgx-a100-80g",
                            3072, 6, 8, 64, 3072, 1, 163.0, True, "",
                            vp.MEGATRON_SRC.format("1008B", 64, 3072, 3072, 163),
                            recompute="full", sequence_parallel=False,
                            distributed_optimizer=False),
}


def decompose(run) -> dict:
    from autopar.cluster import Cluster
    from autopar.graph import trace
    from autopar.manual import MegatronConfig, megatron_plan_for_graph
    from autopar.search import microbatch_args

    step, args = vp._step(run)
    m = run.num_microbatches
    graph = trace(step, *microbatch_args(args, (1,), m), batch_argnums=(1,))
    published = graph.total_flops * m * 4 / 3 / (run.tflops_per_gpu * 1e12 * run.num_gpus)
    cluster = Cluster.from_profile(run.profile, num_hosts=run.num_gpus // 8)
    config = MegatronConfig(dp=run.dp, tp=run.tp, pp=run.pp, num_microbatches=m,
                            sequence_parallel=False, distributed_optimizer=False,
                            recompute="full")
    plan = megatron_plan_for_graph(graph, cluster, config, memory_budget=vp.UNLIMITED)
    stages = plan.stages
    mid = stages[len(stages) // 2]
    c = mid.sharding.cost
    cfg = run.model
    b, s, h = 1, cfg.seq_len, cfg.hidden
    layers_per_stage = mid.layers[1] - mid.layers[0]
    fwd = 24 * b * s * h * h * (1 + s / (6 * h)) * layers_per_stage / run.tp / A100_BF16
    slowest = max(st.time_per_microbatch for st in stages)
    busy = m * slowest
    return {
        "run": run.key, "m": m, "p": run.pp,
        "predicted": plan.predicted_step_time, "published": published,
        "mid_compute": c.compute, "mid_collectives": c.communication,
        "mid_resharding": c.resharding, "mid_recompute": mid.recompute_time,
        "mid_transfer": mid.transfer_time, "mid_total": mid.time_per_microbatch,
        "first_total": stages[0].time_per_microbatch,
        "last_total": stages[-1].time_per_microbatch,
        "slowest": slowest, "busy": busy, "fill_drain": plan.predicted_step_time - busy,
        "ideal_stage": 4 * fwd, "ideal_bubble": (run.pp - 1) / m * m * 4 * fwd,
    }


def table(rows: list[dict]) -> str:
    lines = [SECTION, "",
             "Per microbatch (ms) on a middle stage, then the step (s). *ideal*: the "
             "stage's forward, backward and recompute at peak bf16 (4 x 24bsh^2(1+s/6h) "
             "per layer over TP; Narayanan et al. 2021 eq. 2) and the 1F1B bubble (p-1) x "
             "that; no efficiency applied. Labels: *head as a layer*: the stages split "
             "the n + 1 pieces the n layer marks make; *Megatron's split*: num_layers / pp "
             "transformer layers per stage, the embedding with the first and the head with "
             "the last, as Megatron-LM splits them (`_chunk_bounds`); *tied embedding once "
             "per step*: the tied embedding's gradient summed and cast in the update, so "
             "the head's part is reduced over DP once per step, not every microbatch "
             "(`_layers._sum_shared_gradients_once`). Each label's rows were made at the "
             "commit that introduced it with this script and `--label`.", "",
             "| run | label | compute | collectives | resharding | recompute | boundary "
             "transfer | middle stage | first stage (embedding) | last stage (head) | "
             "ideal stage | m x slowest s | fill/drain s | ideal bubble s | predicted s | "
             "published s | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = lambda k, r=r: f"{r[k] * 1e3:.0f}"  # noqa: E731
        lines.append(
            f"| {r['run']} (m={r['m']}, p={r['p']}) | {r.get('label', '')} | "
            f"{ms('mid_compute')} | {ms('mid_collectives')} | {ms('mid_resharding')} | "
            f"{ms('mid_recompute')} | {ms('mid_transfer')} | {ms('mid_total')} | "
            f"{ms('first_total')} | {ms('last_total')} | {ms('ideal_stage')} | "
            f"{r['busy']:.1f} | {r['fill_drain']:.1f} | {r['ideal_bubble']:.1f} | "
            f"{r['predicted']:.1f} | {r['published']:.1f} | "
            f"{r['predicted'] / r['published']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--label", default="")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = []
    for key in args.rows.split(","):
        start = time.perf_counter()
        row = decompose(ROWS[key])
        row["label"] = args.label
        print(json.dumps(row), f"({time.perf_counter() - start:.0f} s)", flush=True)
        rows.append(row)
    if args.write:
        kept = json.loads(STORE.read_text()) if STORE.exists() else []
        kept = [r for r in kept if (r["run"], r["label"]) not in
                {(x["run"], x["label"]) for x in rows}] + rows
        STORE.parent.mkdir(parents=True, exist_ok=True)
        STORE.write_text(json.dumps(kept, indent=1))
        rows = kept
        from benchmarks._results import write_section

        write_section("large_decomposition", table(rows), path=vp.DOC)
    print(table(rows))


if __name__ == "__main__":
    main()
