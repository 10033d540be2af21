"""Predicted step time of a GPT written with `jax.lax.scan` over its layers against its
Python-loop twin, on the meshes `tests/test_scan_layers.py` checks (issue 16: within 5%).

    python benchmarks/investigations/scan_loop_ratio.py

Prints, per mesh, the scanned and the looped plan's predicted step time and their ratio:
(8,) and (2, 4) on the cpu-local profile (method "shard", the test's wide GPT), and two
dgx-a100-80g hosts (GPT-3 XL's width with two layers, batch 16). No plan cache.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import test_scan_layers as t

    import autopar
    from examples import gpt

    rows = [(f"cpu-local {mesh}", t.WIDE, t.CPU, t.BATCH,
             dict(mesh_shape=mesh, ilp_time_limit=900)) for mesh in [(8,), (2, 4)]]
    rows.append(("2 dgx-a100-80g hosts", gpt.GPTConfig(gpt.PADDED_VOCAB, 1024, 2048, 2, 16),
                 autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2), 16, {}))
    print("| mesh | scanned s | looped s | scanned / looped |")
    print("|---|---|---|---|")
    for name, cfg, cluster, batch, options in rows:
        scanned = t._plan(dataclasses.replace(cfg, scan_layers=True), cluster, batch,
                          cache=False, **options)
        looped = t._plan(cfg, cluster, batch, cache=False, **options)
        ratio = scanned.predicted_step_time / looped.predicted_step_time
        print(f"| {name} | {scanned.predicted_step_time:.6g} | "
              f"{looped.predicted_step_time:.6g} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
