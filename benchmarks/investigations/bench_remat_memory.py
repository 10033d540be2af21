"""Do the published large Megatron-LM configurations fit with activation recompute?

On dgx-a100-80g virtual clusters (abstract tracing, nothing runs), for GPT-3 175B (96
layers, hidden 12288, sequence 2048) on 64 GPUs with tp 8 x pp 8 and MT-NLG 530B (105
layers, hidden 20480, 128 heads) on 280 GPUs with tp 8 x pp 35 (Korthikanti et al. 2022,
table 3; Smith et al. 2022): the Megatron plan's predicted memory per device of every stage
with recompute "none", "selective" and "full", and whether it fits 80 GB; then
`autopar.plan` of GPT-3 175B on the same 64 GPUs with its time.

Precision, as Megatron-LM trains these models: bfloat16 parameters, activations and
gradients, and fp32 optimizer state -- a master copy of the weights and Adam's two moments
(`examples.megatron_published.mixed_precision_adamw`): 2 + 2 + 12 = 16 bytes per
parameter (Megatron-LM keeps fp32 gradients too, 18 bytes; Rajbhandari et al. 2020 count
16 with bf16 gradients).

Usage: ``python benchmarks/investigations/bench_remat_memory.py [--auto [--layers N]]
[--models 175B,530B] [--recompute selective] [--microbatches 64]
[--rows gpt-13B@8,gpt-39B@8] [--log-level INFO]``.

Measured (2 CPU cores shared by six agents at load ~15, so times are upper bounds), with
kept activations counted as XLA keeps them (`autopar.graph.stored_residuals`: a GPT layer
with tp + sp keeps 32 sbh/t + its attention core, Korthikanti et al.'s 34 sbh/t less their
two dropout masks; tests/test_remat.py::test_layer_activation_bytes_follow_korthikanti):
Session 16 (quiet machine; the Megatron scorer no longer keeps a matrix's weight gradient as
"model"-axis partial sums until the update, `_penalise_model_stacks`): 175B tp8 pp8 sp,
microbatches = stages: none fits, 74.4 GiB on stage 0 (last 43.5), step 2.916 s; selective
56.6 GiB (last 41.6), step 3.018 s; full 48.3 GiB (last 40.7), step 3.904 s; each planned
in about 20 s. The same at 16 and 64 microbatches (`--models 175B --microbatches 64`):
56.6 GiB with selective; before the change it grew, 67.5 GiB at 8 and 89.1 at 64, which
did not fit. 530B tp8 pp35 sp: none
needs 85.5 GiB on stage 0 (does not fit); selective fits, 59.5 GiB (last 28.2), step
9.040 s; full 47.0 GiB (stage 0 44.3, last 28.0), step 11.861 s.
Earlier, with those stacks: 175B tp8 pp8 sp: none needed 85.3 GiB on stage 0; selective
67.5 GiB (last stage 51.5), step 3.213 s, 138 s to plan; full 59.3 GiB (stage 0
59.1, last 50.6), step 4.182 s. 530B tp8 pp35 sp: none needed 96.5 GiB on stage 0;
selective 73.8 GiB on the fullest stage (stage 0 70.5, last 35.4), step 9.257 s,
173 s to plan; full 63.4 GiB (stage 17, which holds 4 of the 106 layer pieces;
stage 0 55.3, last 35.3), step 12.456 s. (Before the
fusion rule, 530B with selective needed 85.7 GiB on stage 0: every GELU and layer-norm
intermediate JAX's autodiff reads was counted as kept.) gpt-13B@8 at 64 microbatches
(before the fusion rule): one stage on (4, 2), layers recomputing a mix of none and
selective, 79.1 GiB, planned in 2973 s. gpt-39B@8 at 64 microbatches (with the fusion
rule): no plan, the smallest shortfall 0.0131 GiB per device (layers [1, 32) on a 1x2
submesh), 609 s. Later (commit of branch s8-memory, load ~16): one stage on the (1, 8)
submesh (`num_stages=1, submeshes=[(1, 8)]`) plans at 64 microbatches: mesh (4, 2), layers
recomputing a mix of none, selective and full, 79.996 GiB of 80 per device, step 215.9 s,
296 s CPU (1436 s wall); its terms at the leanest memory level on an (8,) mesh with full
recompute match a hand count: optimizer state 54.64 GiB (fp32 master + Adam moments, 12 B
x 39.09e9 / 8 = 54.60), accumulated fp32 gradients 18.20 (18.20), kept layer inputs 1.47
(48 x 16 x 1024 x 8192 x 2 B / 8 = 1.50), working memory 3.77 (the embedding layer's).
Not finished within the time limits: `--auto` (175B, over 35 minutes; again on branch
s10-memory at nice 10 under load 7-10, `--auto --models "" --log-level INFO`: tracing
47.7 s, then after 70 min wall, 16.3 CPU min, still in the first stage DP's cost
evaluation (`_evaluate` -> `_fitting_level` -> `choose_remat`), interrupted;
a cProfile of 4 layers at 175B widths: 99% of 1635 s in 193 layer ILPs, half building
the problems, half in HiGHS including tie-breaking). Branch s11-big (the stage DP pruned
by the best even plan, first commit d8884fc; nice 10, load ~3-4): still in the first stage
DP's cost evaluation when `timeout 1800` stopped it, 780 CPU s, 360 layer ILPs (156 at
level 0 in 43 CPU s; the leaner levels of the 2-D shapes (2, 4), (4, 2), (4, 4), (2, 8),
(8, 2) took 570 of the rest, 10-20 CPU s per MIP); see docs/benchmarks.md, planning time.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from autopar.cluster import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere
from examples.megatron_published import (  # noqa: E402
    MODELS,
    PROFILE,
    megatron_memory,
    model_step,
)

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="175B,530B")
    parser.add_argument("--recompute", default="none,selective,full")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="the Megatron plans' microbatch count, each of one sequence "
                        "(default: as many as stages)")
    parser.add_argument("--auto", action="store_true", help="also autopar.plan GPT-3 175B")
    parser.add_argument("--layers", type=int, default=None,
                        help="--auto: GPT-3 175B's widths with this many layers (default 96)")
    parser.add_argument("--log-level", default="WARNING",
                        help="e.g. INFO: the planner's progress (stage DPs, layer ILPs)")
    parser.add_argument("--rows", default="", help="benchmark rows to plan with autopar at "
                        "64 microbatches, e.g. gpt-13B@8,gpt-39B@8 (bench_large's models)")
    args = parser.parse_args()
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(message)s")
    for key in filter(None, args.rows.split(",")):
        plan_row(key)
    for name in filter(None, args.models.split(",")):
        for recompute in args.recompute.split(","):
            start = time.perf_counter()
            plan, fits, detail = megatron_memory(name, recompute, args.microbatches)
            seconds = time.perf_counter() - start
            if fits:
                peaks = [stage_peak(plan, s) for s in range(plan.num_stages)]
                print(f"{name} tp8 pp{len(peaks)} sp recompute={recompute}, "
                      f"{plan.num_microbatches} mb: fits; "
                      f"stage memory max {max(peaks) / GiB:.1f} GiB (stage 0 "
                      f"{peaks[0] / GiB:.1f}, last {peaks[-1] / GiB:.1f}); step "
                      f"{plan.predicted_step_time:.3f} s; planned in {seconds:.0f} s")
            else:
                print(f"{name} recompute={recompute}: does not fit ({detail[:200]}); "
                      f"{seconds:.0f} s")
    if args.auto:
        from autopar.search import plan as auto_plan

        cfg, hosts, _, _ = MODELS["175B"]
        if args.layers is not None:
            cfg = dataclasses.replace(cfg, num_layers=args.layers)
        step, abstract = model_step(cfg, 64)
        cluster = Cluster.from_profile(PROFILE, num_hosts=hosts)
        start, cpu = time.perf_counter(), time.process_time()
        p = auto_plan(step, *abstract, cluster=cluster, num_microbatches=64, cache=False)
        print(f"autopar.plan 175B ({cfg.num_layers} layers) on 64 GPUs: {p.num_stages} "
              f"stages, meshes {sorted({tuple(s.mesh.shape) for s in p.stages})}, "
              f"{p.num_microbatches} mb, remat {sorted({r for s in p.stage_remat for r in s})}"
              f", step {p.predicted_step_time:.3f} s; planned in "
              f"{time.perf_counter() - start:.0f} s ({time.process_time() - cpu:.0f} CPU s)")
        if args.layers is None:  # the published plan on the same batch, for comparison
            megatron, fits, _ = megatron_memory("175B", "selective", 64)
            if fits:
                print(f"Megatron tp8 pp8 sp selective, 64 mb: step "
                      f"{megatron.predicted_step_time:.3f} s; autopar/Megatron "
                      f"{p.predicted_step_time / megatron.predicted_step_time:.3f}")


def plan_row(key: str, num_microbatches: int = 64) -> None:
    """`autopar.plan` of a `bench_large` row (e.g. "gpt-13B@8": its bf16 model, adamw,
    global batch 1024) with `num_microbatches`, printing the plan and its remat."""
    from autopar.search import plan as auto_plan
    from benchmarks.bench_large import Row
    from benchmarks.bench_large import model_step as row_step

    family, rest = key.split("-", 1)
    model, gpus = rest.split("@")
    row = Row(family, model, int(gpus) // 8)
    step, abstract = row_step(row)
    cluster = Cluster.from_profile(PROFILE, num_hosts=row.num_hosts)
    start = time.perf_counter()
    try:
        p = auto_plan(step, *abstract, cluster=cluster, num_microbatches=num_microbatches,
                      cache=False)
    except ValueError as err:
        print(f"{key} at {num_microbatches} mb: no plan ({str(err)[:300]}); "
              f"{time.perf_counter() - start:.0f} s")
        return
    remat = [",".join(sorted(set(r))) for r in p.stage_remat]
    print(f"{key} at {num_microbatches} mb: {p.num_stages} stage(s), meshes "
          f"{[tuple(s.mesh.shape) for s in p.stages]}, remat per stage {remat}, memory "
          f"{[round(s.predicted_memory / GiB, 1) for s in p.stages]} GiB, step "
          f"{p.predicted_step_time:.3f} s; planned in {time.perf_counter() - start:.0f} s")


def stage_peak(plan, stage: int) -> float:
    """The planner's predicted bytes per device of a stage (`Stage.predicted_memory`)."""
    return plan.stages[stage].predicted_memory


if __name__ == "__main__":
    main()
