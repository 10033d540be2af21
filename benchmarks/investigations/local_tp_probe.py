"""Why Megatron dp2 tp4 runs 2x its prediction on 8 virtual CPU devices (issue 14, local check).

Two measurements, by this process's CPU time (`time.process_time`, all threads; medians):

1. ``megatron_plan`` dp2 tp4 and dp4 tp2 (pp1) of GPT `small-test` at batch 8, 16 and 32:
   predicted step time (`cpu-local`) and CPU time per step, 3 interleaved rounds of 5 steps.
   The slowdown follows the per-device batch (8 rows: dp2 at batch 16, dp4 at batch 32),
   not the tensor-parallel degree.
2. The XLA:CPU fusion behind it, alone: K inputs of shape [B, 64, 128] per device summed
   elementwise and written transposed as [128, B*64] (the layout XLA:CPU gives the
   activation operand of a weight-gradient dot), on all 8 devices, against the same sum
   written untransposed. The per-device profile of the dp2 tp4 step
   (``jax.profiler.trace``) puts two such loop fusions (``copy_bitcast_fusion``: 14 inputs
   of [8, 64, 128], the residual stream's gradient summed over the later layers' layer-norm
   terms, transposed for a weight gradient) at about 45% of its compute; in dp4 tp2 the
   same fusions read [4, 64, 128] and take under 2%.

Usage: ``python benchmarks/investigations/local_tp_probe.py [--skip-plans] [--skip-fusion]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
_HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/investigations
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_local import _cluster, _gpt_arrays, _Timer  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from autopar.manual import megatron_plan  # noqa: E402

PLANS = ((2, 4, 8), (4, 2, 16), (2, 4, 16), (4, 2, 32))  # (dp, tp, batch)


def plans() -> None:
    cluster = _cluster("cpu-local")
    timers = {}
    for dp, tp, batch_size in PLANS:
        step, state, batch = _gpt_arrays("small-test", batch_size)
        p = megatron_plan(step, state, batch, cluster=cluster, dp=dp, tp=tp, pp=1,
                          num_microbatches=1)
        timers[(dp, tp, batch_size)] = (p, _Timer(step, state, batch, p, time.process_time))
    for _ in range(3):
        for _, timer in timers.values():
            timer.time_steps(5)
    for (dp, tp, batch_size), (p, timer) in timers.items():
        print(f"dp{dp} tp{tp} batch {batch_size} ({batch_size // dp} rows per device): "
              f"predicted {p.predicted_step_time * 1e3:.1f} ms, CPU "
              f"{statistics.median(timer.times) * 1e3:.1f} ms per step", flush=True)


def fusion_seconds(num_inputs: int, rows: int, transpose: bool) -> float:
    """CPU seconds of the summed (and maybe transposed) fusion on all 8 devices."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))

    def body(xs, ys, ws):
        xs, ys, ws = xs[:, 0], ys[:, 0], ws[:, 0]
        total = sum((xs[k] * ws[k] - ys[k][..., None]) * ys[k][..., None] * 0.5
                    for k in range(num_inputs))
        if transpose:
            total = jnp.transpose(total, (2, 0, 1)).reshape(128, rows * 64)
        return total[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "d"),) * 3,
                               out_specs=P("d")))
    sharding = NamedSharding(mesh, P(None, "d"))
    n = len(devices)
    args = (jax.device_put(jnp.ones((num_inputs, n, rows, 64, 128)), sharding),
            jax.device_put(jnp.ones((num_inputs, n, rows, 64)), sharding),
            jax.device_put(jnp.ones((num_inputs, n, 128)), sharding))
    compiled = fn.lower(*args).compile()
    for _ in range(3):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(20):
        start = time.process_time()
        jax.block_until_ready(compiled(*args))
        times.append(time.process_time() - start)
    return statistics.median(times)


def fusion() -> None:
    for num_inputs in (8, 16, 24):
        for rows in (2, 4, 8):
            transposed = fusion_seconds(num_inputs, rows, True)
            plain = fusion_seconds(num_inputs, rows, False)
            inputs = num_inputs * rows * 64 * 128 * 4
            print(f"{num_inputs} inputs of [{rows}, 64, 128] ({inputs / 2**20:.1f} MiB per "
                  f"device): transposed {transposed * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms "
                  f"CPU ({transposed / plain:.1f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-plans", action="store_true")
    parser.add_argument("--skip-fusion", action="store_true")
    args = parser.parse_args()
    if not args.skip_plans:
        plans()
    if not args.skip_fusion:
        fusion()


if __name__ == "__main__":
    main()
