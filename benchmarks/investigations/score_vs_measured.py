"""Does `autopar.score` price a hand-written `jax.jit` sharding as it runs? A hand FSDP
sharding of the example GPT (examples/gpt.py, "tiny"; parameters and optimizer state split
along their first dimension over all 8 devices, the batch split over them too) is scored
with the `cpu-local-measured` profile (as `bench_local`; `--profile local` for
`autopar.Cluster.local()`) and
run as that `jax.jit` on the 8 local devices (virtual CPU devices when no accelerator is
present); the median measured step time is printed against the prediction, and beside
them the same for autopar's own one-mesh plan of the step, measured in the same run.

Timing on shared cores is noisy: the script interleaves the two programs in rounds and
reports medians. Usage (about a minute):
``python benchmarks/investigations/score_vs_measured.py [--batch 16] [--steps 20]``
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("AUTOPAR_PLAN_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autopar  # noqa: E402
from autopar.profile._kernel_cpu import entry_kernels  # noqa: E402
from autopar.profile._measure import usable_cores  # noqa: E402


def fsdp_shardings(state, batch, mesh):
    """Hand FSDP: every array of two or more dimensions split along its first dimension
    over the data axis where it divides; the rest replicated; the batch split by rows."""
    size = mesh.shape["data"]

    def leaf(x):
        split = x.ndim >= 2 and x.shape[0] % size == 0
        return NamedSharding(mesh, P("data") if split else P())

    return (jax.tree.map(leaf, state),
            jax.tree.map(lambda x: NamedSharding(mesh, P("data")), batch))


def time_steps(step, state, batch, n, cpu=None):
    """`n` steps; their wall seconds (and, into `cpu`, this process's CPU seconds over the
    cores it may use: what the 8 device threads kept the cores busy)."""
    times = []
    for _ in range(n):
        start, start_cpu = time.perf_counter(), time.process_time()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append((time.process_time() - start_cpu) / usable_cores())
    return state, times


def hlo_counts(jitted, *args) -> str:
    """Kernels and collectives of a compiled program's entry computation (XLA's count, to
    set beside the cost model's `kernel_overhead` and collectives)."""
    text = jitted.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    found = Counter(re.findall(r" (all-reduce|all-gather|reduce-scatter|all-to-all|"
                               r"collective-permute)\(", entry))
    operands = sum(len(re.findall(r"f32\[|bf16\[|s32\[", line.split(" all-reduce(")[0]))
                   for line in re.findall(r".* all-reduce\(.*", entry))
    return (f"{entry_kernels(text)} kernels, collectives {dict(sorted(found.items()))}, "
            f"all-reduce operands {operands} (XLA:CPU rendezvouses once per operand)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default="tiny", choices=sorted(gpt.CONFIGS))
    parser.add_argument("--profile", default="cpu-local-measured",
                        help="cost profile of the predictions (bench_local's default); "
                             "'local' for autopar.Cluster.local()")
    args = parser.parse_args(argv)
    cfg, optimizer = gpt.CONFIGS[args.config], optax.adamw(1e-2)
    cluster = autopar.Cluster.local() if args.profile == "local" else \
        autopar.Cluster.from_profile(args.profile)
    step = gpt.make_train_step(cfg, optimizer)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    abstract = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, args.batch))
    shardings = fsdp_shardings(*abstract, mesh)
    theirs = autopar.score(step, *abstract, shardings=shardings, cluster=cluster)
    ours = autopar.autoparallel(method="shard", cluster=cluster)(step)

    state = jax.jit(lambda k: gpt.init_state(cfg, optimizer, k), out_shardings=shardings[0])(
        jax.random.key(0))
    batch = jax.device_put(gpt.make_batch(cfg, args.batch, jax.random.key(1)), shardings[1])
    hand = jax.jit(step, in_shardings=shardings, out_shardings=(shardings[0], None),
                   donate_argnums=(0,))
    ours_state = jax.tree.map(lambda x: x.copy(), state)
    state, _ = time_steps(hand, state, batch, 3)  # compile and warm up
    ours_state, _ = time_steps(ours, ours_state, batch, 3)
    hand_times, ours_times, hand_cpu, ours_cpu = [], [], [], []
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        state, t = time_steps(hand, state, batch, args.steps, hand_cpu)
        hand_times += t
        ours_state, t = time_steps(ours, ours_state, batch, args.steps, ours_cpu)
        ours_times += t
    load_after = os.getloadavg()
    rows = [("hand FSDP (autopar.score)", theirs.predicted_step_time, hand_times, hand_cpu),
            ("autopar method='shard'", ours.plan.predicted_step_time, ours_times, ours_cpu)]
    devices = jax.devices()
    print(f"GPT {args.config}, batch {args.batch}, profile {args.profile}, "
          f"{len(devices)} {devices[0].platform} devices, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"load average (1, 5, 15 min) before timing {load_before}, after {load_after} "
          f"on {os.cpu_count()} cores (the wall clock is only meaningful near 0)")
    print(f"{'plan':<28}{'predicted':>12}{'measured':>12}{'ratio':>8}{'cpu/core':>12}")
    for name, predicted, times, cpu in rows:
        measured = statistics.median(times)
        print(f"{name:<28}{predicted * 1e3:>10.3f}ms{measured * 1e3:>10.3f}ms"
              f"{measured / predicted:>8.2f}{statistics.median(cpu) * 1e3:>10.3f}ms")
    print("(cpu/core: this process's CPU seconds per step over the cores it may use; "
          "below the wall time, the cores idled at the step's rendezvous)")
    print(f"profile: kernel_overhead {cluster.kernel_overhead * 1e6:.2f} us per kernel")
    print(f"hand FSDP program: {hlo_counts(hand, *abstract)}")
    print(f"hand FSDP as scored: {theirs.stages[0].sharding.cost.collectives}")
    print()
    print(autopar.compare([theirs, ours.plan]))


if __name__ == "__main__":
    main()
