"""Where the local check's predictions miss (issue 14): merged collectives, and a pipelined
plan's tasks run alone.

Two measurements on the 8 virtual CPU devices:

1. **Merged collectives.** For groups of 2, 4 and 8 devices (all groups at once), one
   program with 1, 8 and 32 independent small all-reduces (which XLA's combiner merges
   into one tuple all-reduce) or all-gathers (which XLA:CPU leaves apart), and the time
   each extra one adds. On XLA:CPU each operand of the merged all-reduce costs about what a
   collective of its own costs (the profile's `combined_operand_latency`).
2. **A pipelined plan's tasks.** GPT `small-test` (batch 16) planned on `cpu-local-measured`
   as the local check's ``auto 2 stages``; each stage's forward and backward program of one
   microbatch, run alone 15 times: wall and CPU milliseconds, against the stage's predicted
   compute per microbatch (at the profile's rate every device runs at a quarter of a core,
   so a 4-device task's CPU seconds should equal its predicted seconds).
3. **The step without collectives.** The same GPT's train step as a `shard_map` over the
   batch on the 8 devices with no collective (each device updates from its own rows), wall
   and CPU milliseconds, against the `data (8,)` plan's predicted compute (its CPU seconds:
   8 devices at a quarter of a core each, so twice the predicted seconds).
4. **One device on one core.** The step jitted on one CPU device, the process pinned to
   one core (`taskset -c 0`, a child process), for 1, 2, 4 and 8 sequences.

Usage: ``python benchmarks/local_cost_probe.py [--skip-collectives] [--skip-tasks]
[--skip-step]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ELEMENTS = 256  # float32 per device: a latency-bound collective


def _median_call(fn, args, repeats: int = 51) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def merged_collectives() -> None:
    devices = np.array(jax.devices())
    print("| group | kind | 1 op us | 8 ops us | 32 ops us | each extra op us | ops in HLO |")
    print("|---|---|---|---|---|---|---|")
    for n in (2, 4, 8):
        mesh = Mesh(devices.reshape(len(devices) // n, n), ("g", "x"))
        spec = P(("g", "x"))
        for kind in ("all_reduce", "all_gather"):
            seconds, hlo_ops = [], 0
            for k in (1, 8, 32):
                def body(*xs, kind=kind):
                    if kind == "all_reduce":
                        return tuple(lax.psum(list(xs), "x"))
                    return tuple(lax.all_gather(x, "x", tiled=True) for x in xs)

                fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * k,
                                           out_specs=(spec,) * k, check_vma=False))
                xs = [jax.device_put(jnp.full((len(devices) * ELEMENTS,), float(i)),
                                     NamedSharding(mesh, spec)) for i in range(k)]
                seconds.append(_median_call(fn, xs))
                text = fn.lower(*xs).compile().as_text()
                hlo_ops = text.count(f" {kind.replace('_', '-')}(")
            extra = (seconds[2] - seconds[0]) / 31
            print(f"| {n} | {kind} | {seconds[0] * 1e6:.0f} | {seconds[1] * 1e6:.0f} | "
                  f"{seconds[2] * 1e6:.0f} | {extra * 1e6:.0f} | {hlo_ops} (of 32) |", flush=True)


def pipeline_tasks() -> None:
    from bench_local import _cluster, _gpt_arrays, _Timer, local_plans

    from autopar.runtime import PipelineExecutable

    step, state, batch = _gpt_arrays("small-test", 16)
    p = local_plans(step, (state, batch), _cluster("cpu-local-measured"))["auto 2 stages"]()
    timer = _Timer(step, state, batch, p)
    captured = {}
    run_task = PipelineExecutable._run_task

    def spy(self, phase, stage, values, step_values, sums, running=None):
        def keep(fn, args):
            captured.setdefault((phase, stage), (fn, list(args)))
        return run_task(self, phase, stage, values, step_values, sums, keep)

    PipelineExecutable._run_task = spy
    try:
        timer._step()
    finally:
        PipelineExecutable._run_task = run_task
    print(f"plan: {[(s.layers, s.mesh.shape) for s in p.stages]}, "
          f"{p.num_microbatches} microbatches, predicted {p.predicted_step_time * 1e3:.1f} ms")
    print("| stage | task | wall ms | CPU ms | stage compute predicted per microbatch ms |")
    print("|---|---|---|---|---|")
    for (phase, stage), (fn, args) in sorted(captured.items(), key=lambda kv: kv[0][::-1]):
        jax.block_until_ready(fn(*args))
        walls, cpus = [], []
        for _ in range(15):
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        predicted = p.stages[stage].sharding.cost.compute
        print(f"| {stage} | {phase} | {statistics.median(walls) * 1e3:.2f} | "
              f"{statistics.median(cpus) * 1e3:.2f} | {predicted * 1e3:.2f} (forward and "
              f"backward) |", flush=True)


def step_without_collectives() -> None:
    from bench_local import _cluster, _gpt_arrays, local_plans

    step, state, batch = _gpt_arrays("small-test", 16)
    predicted = local_plans(step, (state, batch), _cluster("cpu-local-measured"))["data (8,)"]()
    compute = predicted.stages[0].sharding.cost.compute
    mesh = Mesh(np.array(jax.devices()), ("x",))
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()),
                               check_vma=False), donate_argnums=0)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    batch = jax.device_put(batch, NamedSharding(mesh, P("x")))
    for _ in range(3):
        state, _ = jax.block_until_ready(fn(state, batch))
    walls, cpus = [], []
    for _ in range(21):
        wall, cpu = time.perf_counter(), time.process_time()
        state, _ = jax.block_until_ready(fn(state, batch))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    print(f"step without collectives on 8 devices: wall {statistics.median(walls) * 1e3:.1f} "
          f"ms, CPU {statistics.median(cpus) * 1e3:.1f} ms; data (8,) predicted compute "
          f"{compute * 1e3:.1f} ms per device, {compute * 2e3:.1f} CPU ms in all")


def _one_device_step(batch_size: int) -> None:
    """In a child process of one CPU device: print the step's median wall ms."""
    from bench_local import _gpt_arrays

    step, state, batch = _gpt_arrays("small-test", batch_size)
    fn = jax.jit(step, donate_argnums=0)
    for _ in range(3):
        state, _ = jax.block_until_ready(fn(state, batch))
    times = []
    for _ in range(15):
        start = time.perf_counter()
        state, _ = jax.block_until_ready(fn(state, batch))
        times.append(time.perf_counter() - start)
    print(f"{statistics.median(times) * 1e3:.2f}")


def one_device_on_one_core() -> None:
    import subprocess

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    for batch_size in (1, 2, 4, 8):
        out = subprocess.run(
            ["taskset", "-c", "0", sys.executable, __file__, "--one-device", str(batch_size)],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.split()
        print(f"one device on one core, {batch_size} sequence(s): {out[-1]} ms per step",
              flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-collectives", action="store_true")
    parser.add_argument("--skip-tasks", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--one-device", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_device:
        _one_device_step(args.one_device)
        return
    if not args.skip_collectives:
        merged_collectives()
    if not args.skip_tasks:
        pipeline_tasks()
    if not args.skip_step:
        step_without_collectives()
        one_device_on_one_core()


if __name__ == "__main__":
    main()
