"""A scanned stack's three predictions of one candidate plan, side by side (issue 16).

For a model whose layers are a `jax.lax.scan` over stacked weights, the pipeline search
predicts a candidate's step time three ways (`search/_pipeline.py`): the stage DP's sum of
its layers' costs on the step traced one sub-scan per iteration; the stage plans stitched
from those layer plans on that same step (the DP's sum plus what joining the layers costs);
and the plan re-made on the step with the stack cut back into one sub-scan per stage, which
is the plan that runs. On the iteration-split step the three should agree closely. They
did not for a mixed-precision stack (fp32 master weights cast to bf16 before the scan):
`graph.split_stacked` left the master stacks whole, so every iteration read, and the stitch
resharded, the whole cast stack (llama-8B on one DGX H100: 55.45 s by the DP, 272.2 s
stitched, 45.07 s re-made). This script prints the three figures, the layer ILPs solved
and the planner's CPU seconds for the Llama example (scanned, layers checkpointed, bf16 on
fp32 master weights, AdamW) planned abstractly on a `dgx-h100` host.

Run: ``python benchmarks/investigations/scan_split_gap.py`` (llama-1B, one stage, 16
microbatches of a batch of 64), ``--config 1B --num-layers 8 --stages 2 --microbatches 16``.
Takes minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import optax  # noqa: E402

import autopar  # noqa: E402
from examples import llama  # noqa: E402

FIGURES = {
    "stage DP": re.compile(r"stage DP's sum of layer costs ([0-9.e+-]+) s"),
    "stitched": re.compile(r"microbatch\(es\): \d+ stage\(s\), predicted ([0-9.e+-]+) s"),
    "re-made on the cut stack": re.compile(r"cut back into scans: predicted ([0-9.e+-]+) s"),
    "stage DP (no join cost)": re.compile(r"stage DP: \d+ stage\(s\), ([0-9.e+-]+) s predicted"),
}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1B", help="a key of examples/llama.py's CONFIGS")
    parser.add_argument("--num-layers", type=int, default=None, help="override the depth")
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    cfg = llama.CONFIGS[args.config]
    cfg = dataclasses.replace(
        cfg, num_layers=args.num_layers or cfg.num_layers, dtype="bfloat16",
        master_dtype="float32", scan_layers=True, remat_layers=True, layer_markers=False,
    )
    optimizer = optax.adamw(1e-4)
    step = llama.make_train_step(cfg, optimizer)
    state, batch = llama.abstract_state(cfg, optimizer), llama.abstract_batch(cfg, args.batch)
    handler = _Lines()
    logger = logging.getLogger("autopar")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    cpu = time.process_time()
    plan = autopar.plan(step, state, batch, cluster=autopar.Cluster.from_profile("dgx-h100"),
                        num_stages=args.stages, num_microbatches=args.microbatches,
                        cache=False)
    cpu = time.process_time() - cpu
    text = "\n".join(handler.lines)
    found = {}
    for name, pattern in FIGURES.items():
        match = pattern.search(text)
        if match:
            found[name] = float(match.group(1))
    ilps = re.search(r"(\d+) layer ILPs", text)
    print(f"llama-{args.config} ({cfg.num_layers} layers) on 1 x 8 dgx-h100, "
          f"{args.stages} stage(s), {args.microbatches} microbatches of {args.batch}:")
    for name, value in found.items():
        print(f"  {name:28s} {value:.4g} s")
    print(f"  plan.predicted_step_time     {plan.predicted_step_time:.4g} s")
    print(f"  layer ILPs solved            {ilps.group(1) if ilps else '?'}")
    print(f"  planning CPU                 {cpu:.1f} s")
    return found


if __name__ == "__main__":
    main()
