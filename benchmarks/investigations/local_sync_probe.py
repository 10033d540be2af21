"""Where the tensor-parallel and pipelined local plans spend their extra CPU (issue 14):
two measurements on the 8 virtual CPU devices.

1. **Plans on one core.** The local plans' steps with the process pinned to one core
   (``taskset -c 0``, a child process): no core can idle, so wall time is CPU time, and a
   plan's time over Megatron dp8's is its work over dp8's. Session 22: dp8 136 ms,
   `shard (8,)` 148, dp4 tp2 187, dp2 tp4 238, `auto 4 stages` 200 (the model: 1.00,
   1.12 and 1.06 of dp8 for the last three).
2. **A collective between blocks of growing size.** 32 blocks (8 for the largest) of
   ``tanh(x @ w)`` on x [rows, 128] per device, in groups of 4 and of 8 (all groups at
   once), with and without a psum of 8 rows after each block that the next one reads:
   what one collective adds, in wall and CPU time, by the block's time. The profile's
   `measure_collective_latency` times it after near-empty blocks (64 x 64); after blocks
   of milliseconds it costs about a third of a block, up to 2-3 ms.

Usage: ``python benchmarks/investigations/local_sync_probe.py [--skip-one-core] [--skip-blocks]``
(about 3 minutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
_HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/investigations
sys.path[:0] = [os.path.dirname(_HERE), os.path.dirname(os.path.dirname(_HERE))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ONE_CORE_PLANS = ("megatron dp8 tp1 pp1", "shard (8,)", "megatron dp4 tp2 pp1",
                  "megatron dp2 tp4 pp1", "auto 4 stages")
BLOCK_ROWS = ((128, 32), (1024, 32), (4096, 32), (8192, 8), (32768, 8))


def time_plans(names) -> None:
    """Time `names` in this process (3 interleaved rounds of 5 steps): median wall and
    CPU ms per step against the prediction."""
    from bench_local import _cluster, _cpu_per_core, _gpt_arrays, _Timer, local_plans

    step, state, batch = _gpt_arrays("small-test", 16)
    makers = local_plans(step, (state, batch), _cluster("cpu-local-measured"))
    timers = {n: (p := makers[n](), _Timer(step, state, batch, p, _cpu_per_core))
              for n in names}
    walls = {n: [] for n in names}
    cpus = {n: [] for n in names}
    for _ in range(3):
        for n, (_, timer) in timers.items():
            for _ in range(5):
                wall, cpu = time.perf_counter(), time.process_time()
                timer._step()
                walls[n].append(time.perf_counter() - wall)
                cpus[n].append(time.process_time() - cpu)
    for n, (plan, _) in timers.items():
        print(f"{n:24s} predicted {plan.predicted_step_time * 1e3:6.1f} ms, wall "
              f"{statistics.median(walls[n]) * 1e3:6.1f} ms, CPU "
              f"{statistics.median(cpus[n]) * 1e3:6.1f} ms", flush=True)


def one_core() -> None:
    print("plans on one core (taskset -c 0):", flush=True)
    subprocess.run(["taskset", "-c", "0", sys.executable, __file__, "--plans",
                    *ONE_CORE_PLANS], check=True)


def blocks() -> None:
    devices = np.array(jax.devices())
    w = jnp.full((128, 128), 1e-3, jnp.float32)
    for group in (4, 8):
        mesh = Mesh(devices.reshape(len(devices) // group, group), ("g", "x"))
        spec = P(("g", "x"))
        for rows, count in BLOCK_ROWS:
            times = []
            for between in (False, True):
                def body(x, between=between, count=count):
                    for _ in range(count):
                        x = jnp.tanh(x @ w)
                        if between:
                            x = x + lax.psum(x[:8], "x").sum() * 1e-3
                    return x

                fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                           check_vma=False))
                x = jax.device_put(jnp.full((len(devices) * rows, 128), 0.01),
                                   NamedSharding(mesh, spec))
                jax.block_until_ready(fn(x))
                walls, cpus = [], []
                for _ in range(7):
                    wall, cpu = time.perf_counter(), time.process_time()
                    jax.block_until_ready(fn(x))
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.process_time() - cpu)
                times.append((statistics.median(walls), statistics.median(cpus)))
            (wall0, cpu0), (wall1, cpu1) = times
            print(f"groups of {group}, blocks of {rows} x 128 per device "
                  f"({wall0 / count * 1e3:.2f} ms wall each): a collective after each adds "
                  f"{(wall1 - wall0) / count * 1e3:.2f} ms wall, "
                  f"{(cpu1 - cpu0) / count * 1e3:.2f} ms CPU", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-one-core", action="store_true")
    parser.add_argument("--skip-blocks", action="store_true")
    parser.add_argument("--plans", nargs="+", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.plans:
        time_plans(args.plans)
        return
    if not args.skip_one_core:
        one_core()
    if not args.skip_blocks:
        blocks()


if __name__ == "__main__":
    main()
