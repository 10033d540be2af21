"""Why MT-NLG 530B and Megatron-LM's 530B disagree on the same shapes (issue 44, item 1).

    python benchmarks/investigations/mtnlg_vs_narayanan.py [--load F.json ...] [--write]

Both ran a 530B GPT (hidden 20,480, 105 layers, sequence 2,048) as TP8 PP35 with
micro-batch 1 and full recompute on DGX A100 (Selene): Smith et al. 2022 (MT-NLG,
Megatron-DeepSpeed) at 126 / 121 / 113 TFLOP/s per GPU on 2240 / 2800 / 3360 GPUs, batch
1920; Narayanan et al. 2021 (Megatron-LM, Table 1) at 163 TFLOP/s on 2520 GPUs, batch 2520.
Both count TFLOP/s with eq. 3 of Narayanan et al. (recompute included; `validate_public`'s
module docstring checks MT-NLG's 126 against its 60.1 s iteration).

The published step over ``m + p - 1`` (a 1F1B step is that many stage slots) is the time
of one microbatch on one stage, which takes the pipeline bubble out: what is left to
differ is the stage's own work. Printed per run: the published step, m, that per-slot
time, and (with `--load`, `validate_public --save` files) the predicted one. Then what the
configurations make differ by first principles:
- the stage-boundary transfer without Megatron-LM's scatter/gather (Narayanan et al. 2021,
  sec. 4.1: each of the tp ranks sends only 1/tp of the activation, all-gathered over
  NVLink at the far end): `autopar.cost.boundary_transfer_time` of the activation and its
  gradient, spread over the stage's devices (scatter/gather) or sent whole by every
  tensor-parallel rank (without);
- the share of the gap that leaves for the rest (kernels, the runtime: Megatron-LM 2021's
  fused kernels, sec. 4.2, against Megatron-DeepSpeed's pipeline engine), which the
  publications do not break down.

`--write` puts the result into docs/benchmarks.md (section "MT-NLG against Megatron-LM at
530B", `benchmarks._results`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import validate_public as vp  # noqa: E402

# Narayanan et al. 2021, Table 1, 529.6B: 2520 GPUs, batch 2520 (m = 280 at dp 9), 163
# TFLOP/s; its published step, eq. 3 with the traced model's FLOPs, is 54.13 s
# (`large_decomposition`'s mt530 row).
SECTION = "## MT-NLG against Megatron-LM at 530B (the same shapes, 27% apart)"
NARAYANAN = dict(key="megatron-lm-530b (Narayanan 2021)", gpus=2520, dp=9, pp=35, m=280,
                 step=54.13)


def per_slot(step: float, m: int, p: int) -> float:
    """Seconds of one microbatch on one stage: a 1F1B step is m + p - 1 stage slots."""
    return step / (m + p - 1)


def main() -> None:
    from autopar.cluster import Cluster
    from autopar.cost import boundary_transfer_time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", nargs="*", default=(),
                        help="validate_public --save files with the MT-NLG rows' predictions")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    predicted = {}
    for path in args.load:
        with open(path) as f:
            for key, row in json.load(f).items():
                if "predicted" in row:
                    predicted[key] = row["predicted"]
    runs = [r for r in vp.RUNS if r.key.startswith("mtnlg-530b")]
    lines = [SECTION, "",
             "The same 530B shapes, TP8 PP35, micro-batch 1, full recompute on DGX A100: "
             "MT-NLG (Smith et al. 2022, Megatron-DeepSpeed) against Megatron-LM (Narayanan "
             "et al. 2021, Table 1). A 1F1B step is m + p - 1 stage slots, so the published "
             "step over that is one microbatch on one stage, bubble removed. Predicted: "
             "`validate_public`'s rows (`--load`) and `large_decomposition`'s latest mt530 "
             "row.", "",
             "| run | GPUs | m | published s/step | published ms per microbatch-stage | "
             "predicted ms per microbatch-stage |",
             "|---|---|---|---|---|---|"]
    slots = {}
    for run in runs:
        # the paper's seconds per iteration (Smith et al. 2022, sec. 2.4), which its
        # TFLOP/s (the rows' published step) restate
        step = {2240: 60.1, 2800: 50.2, 3360: 44.4}[run.num_gpus]
        m, p = run.num_microbatches, run.pp
        slots[run.key] = per_slot(step, m, p)
        pred = predicted.get(run.key)
        shown = f"{per_slot(pred, m, p) * 1e3:.0f}" if pred else "—"
        lines.append(f"| {run.key} | {run.num_gpus} | {m} | {step:.1f} | "
                     f"{slots[run.key] * 1e3:.0f} | {shown} |")
    n = NARAYANAN
    ref = per_slot(n["step"], n["m"], n["pp"])
    # its prediction: `large_decomposition`'s newest mt530 row, when stored
    store = os.path.join(os.path.dirname(os.path.dirname(vp.DOC)), "benchmarks", "results",
                         "large_decomposition.json")
    mt530 = []
    if os.path.exists(store):
        with open(store) as f:
            mt530 = [r for r in json.load(f) if r["run"] == "mt530"]
    shown = f"{per_slot(mt530[-1]['predicted'], n['m'], n['pp']) * 1e3:.0f}" if mt530 else "—"
    lines += [f"| {n['key']} | {n['gpus']} | {n['m']} | {n['step']:.2f} | {ref * 1e3:.0f} | "
              f"{shown} |",
              "", "What the configurations make differ, per microbatch-stage:", ""]
    cfg = vp.MTNLG
    activation = cfg.seq_len * cfg.hidden * 2  # one sequence's bf16 activation, bytes
    for run in runs:
        cluster = Cluster.from_profile(run.profile, num_hosts=run.num_gpus // 8)
        stage_devices = run.dp * run.tp
        crossing = run.dp * run.micro_batch * activation
        gathered = boundary_transfer_time(crossing, cluster, stage_devices)
        whole = boundary_transfer_time(crossing * run.tp, cluster, stage_devices)
        gap = slots[run.key] - ref
        lines.append(
            f"- {run.key}: {gap * 1e3:.0f} ms more than Megatron-LM "
            f"({slots[run.key] / ref - 1:+.0%}). The stage-boundary transfer with "
            f"scatter/gather takes {gathered * 1e3:.1f} ms, without it {whole * 1e3:.1f} ms: "
            f"{(whole - gathered) * 1e3:.1f} ms of the gap. Left for kernels and runtime, "
            f"which neither paper breaks down: {(gap - whole + gathered) * 1e3:.0f} ms "
            f"({(gap - whole + gathered) / ref:+.0%} of Megatron-LM's slot).")
    text = "\n".join(lines) + "\n"
    if args.write:
        from benchmarks._results import write_section

        write_section("mtnlg_vs_narayanan", text, path=vp.DOC)
    print(text)


if __name__ == "__main__":
    main()
