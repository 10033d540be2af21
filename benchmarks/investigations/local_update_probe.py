"""What the optimizer update costs inside a step on 8 virtual CPU devices (issue 14, local check).

1. Megatron dp8 tp1 (replicated update) and the `shard (8,)` plan (ZeRO-style sharded update)
   of GPT `small-test`, batch 16, planned with `cpu-local-measured`, with SGD and with
   AdamW: predicted and measured step time (this process's CPU seconds over the usable
   cores, the "cpu-per-core" clock; 3 interleaved rounds of 7 steps, median).
2. Memory bandwidth as `autopar profile` measures it (``x * 2 + 1`` on all 8 devices, a
   fresh output buffer each call) against the same program updating its input in place
   (donated, as a training step updates its state), at 1, 4 and 16 MiB per device.

Usage: ``python benchmarks/investigations/local_update_probe.py``
"""

from __future__ import annotations

import dataclasses
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
import optax  # noqa: E402
from bench_local import _cluster, _cpu_per_core, _Timer, local_plans  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from examples import gpt  # noqa: E402

PLANS = ("megatron dp8 tp1 pp1", "shard (8,)")


def steps(optimizer_name: str) -> None:
    cfg = dataclasses.replace(gpt.CONFIGS["small-test"], layer_markers=True)
    optimizer = optax.adamw(1e-3) if optimizer_name == "adamw" else optax.sgd(1e-3)
    step = gpt.make_train_step(cfg, optimizer)
    state = jax.jit(lambda key: gpt.init_state(cfg, optimizer, key))(jax.random.key(0))
    batch = jax.jit(lambda key: gpt.make_batch(cfg, 16, key))(jax.random.key(1))
    makers = local_plans(step, (state, batch), _cluster("cpu-local-measured"))
    timers = {}
    for name in PLANS:
        p = makers[name]()
        timers[name] = (p, _Timer(step, state, batch, p, _cpu_per_core))
    for _ in range(3):
        for _, timer in timers.values():
            timer.time_steps(7)
    for name, (p, timer) in timers.items():
        print(f"{optimizer_name}: {name}: predicted {p.predicted_step_time * 1e3:.1f} ms, "
              f"measured {statistics.median(timer.times) * 1e3:.1f} ms", flush=True)


def bandwidth() -> None:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    cores = min(len(os.sched_getaffinity(0)), len(jax.devices()))
    for mib in (1, 4, 16):
        n = mib * 2**20 // 4
        for donate in (False, True):
            fn = jax.jit(jax.shard_map(lambda x: x * 2 + 1, mesh=mesh, in_specs=P("d"),
                                       out_specs=P("d")),
                         donate_argnums=(0,) if donate else ())
            x = jax.jit(lambda n=n: jnp.ones((len(jax.devices()) * n,), jnp.float32),
                        out_shardings=sharding)()
            times = []
            for i in range(18):
                start = time.process_time()
                if donate:
                    x = fn(x)
                    jax.block_until_ready(x)
                else:
                    jax.block_until_ready(fn(x))
                if i >= 3:  # warm-up
                    times.append((time.process_time() - start) / cores)
            seconds = statistics.median(times)
            print(f"x * 2 + 1 on {mib} MiB per device, "
                  f"{'in place (donated)' if donate else 'fresh output'}: "
                  f"{2 * n * 4 / seconds / 1e9:.2f} GB/s per device", flush=True)


def main() -> None:
    for optimizer_name in ("sgd", "adamw"):
        steps(optimizer_name)
    bandwidth()


if __name__ == "__main__":
    main()
