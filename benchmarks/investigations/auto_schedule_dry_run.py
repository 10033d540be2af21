"""`schedule="auto"` in dry runs where the bubble is large: 8 dense layers on one
dgx-a100-80g host, 2 device groups, 2 or 4 microbatches. The search logs each candidate's
predicted step time (1F1B and zero bubble per stage choice, interleaved 1F1B with v = 2
and 4); this prints the pick.

    python benchmarks/investigations/auto_schedule_dry_run.py
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import optax  # noqa: E402

import autopar  # noqa: E402
from examples import mlp  # noqa: E402

# (layer width, batch, microbatches): 1F1B bubbles of 1/3 and 1/5 on 2 device groups.
ROWS = ((16384, 4096, 2), (8192, 8192, 4))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for dim, batch, m in ROWS:
        cfg = mlp.MLPConfig(in_dim=dim, hidden=dim, out_dim=dim, num_layers=8,
                            layer_markers=True)
        optimizer = optax.adamw(1e-3)
        step = mlp.make_train_step(cfg, optimizer)
        args = (mlp.abstract_state(cfg, optimizer), mlp.abstract_batch(cfg, batch))
        start = time.process_time()
        p = autopar.plan(step, *args, cluster=autopar.Cluster.from_profile("dgx-a100-80g"),
                         num_stages=2, num_microbatches=m, schedule="auto", cache=False)
        print(f"{dim} x {dim} layers, batch {batch}, {m} microbatches: {p.schedule} "
              f"(v={p.virtual_stages}), {p.predicted_step_time:.4g} s predicted, F/B/W "
              f"shares {p.phase_shares}; {time.process_time() - start:.1f} s CPU")


if __name__ == "__main__":
    main()
