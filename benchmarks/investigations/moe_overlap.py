"""Does the overlapped expert exchange (``moe_overlap``) pay on the local devices, and does
the cost model predict what it measures?

    python -m benchmarks.investigations.moe_overlap [--rounds 7] [--steps 3] [--batch 16]

The "ep-test" dropless MoE (16 experts of width 256, top-2, hidden 64) on the 8 local CPU
devices, planned on one (8,) mesh, with every grouped GEMM of its layer scans put in the
all-to-all expert-parallel layout over the mesh (the CPU profile's search splits the
expert widths instead, so the layout is put on the searched plan by hand, as
`tests/test_moe_dropless.py` does). Two plans of that layout: each grouped GEMM whole
(``ep:x``) or in two token chunks (``ep:x+overlap``, `autopar.lower._experts`). Both run
in interleaved rounds (their order alternating), each round timing `--steps` steps of
each on two clocks: wall (`time.perf_counter`) and cpu-per-core (this process's CPU
seconds over the cores it may use, the clock ``autopar profile --clock cpu-per-core``
measured the `cpu-local-measured` profile with; it holds still when other processes
load the machine, but it cannot see a saving made of a device's thread waiting less);
the medians are compared.

Predicted: per grouped GEMM the strategy costs of `autopar.intra._strategies_moe` on the
profile (`--profile`, default ``cpu-local-measured``), times the scan's trip count, summed:
the whole exchange's all-to-all seconds, and the seconds the chunked form saves (negative:
it costs). Measured: the median step times and their difference. Timing on shared cores
is noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402
from autopar.graph import trace  # noqa: E402
from autopar.intra._scan import opened_body  # noqa: E402
from autopar.intra._strategies import CostContext  # noqa: E402
from autopar.intra._strategies_moe import (  # noqa: E402
    OVERLAPPED,
    ep_layout,
    expert_parallel_strategies,
)
from autopar.profile._measure import usable_cores  # noqa: E402
from examples import moe_dropless as moe  # noqa: E402


def expert_parallel(plan, graph, overlapped: bool):
    """`plan` with every grouped GEMM of its layer scans in the all-to-all layout over all
    of its mesh axes, chunked when `overlapped`; with (trip count, body, node) of each."""
    stage = plan.stages[0]
    sharding = stage.sharding
    axes = tuple(a for a, n in zip(sharding.mesh.axis_names, sharding.mesh.shape) if n > 1)
    name = f"ep:{''.join(axes)}" + (OVERLAPPED if overlapped else "")
    bodies, nodes = [], []
    for body_plan in sharding.scan_bodies:
        params = graph.nodes[body_plan.node].params
        body = opened_body(params)
        var_specs = list(body_plan.var_specs)
        ragged = [n for n in body.nodes if n.primitive == "ragged_dot_general"]
        ids = {n.id for n in ragged}
        operand_specs = [o for o in body_plan.operand_specs if o[0] not in ids]
        for node in ragged:
            split_dims, out_dim = ep_layout(node, body)
            for p, (v, d) in enumerate(zip(node.inputs, split_dims)):
                ndim = len(body.vars[v].shape)
                operand_specs.append((node.id, p, tuple(axes if i == d else ()
                                                        for i in range(ndim))))
            (out,) = node.outputs
            ndim = len(body.vars[out].shape)
            var_specs[out] = tuple(axes if i == out_dim else () for i in range(ndim))
            nodes.append((params["length"], body, node))
        bodies.append(dataclasses.replace(
            body_plan, var_specs=tuple(var_specs), operand_specs=tuple(operand_specs),
            strategies=tuple((n.id, name) for n in ragged)))
    sharding = dataclasses.replace(sharding, scan_bodies=tuple(bodies))
    stage = dataclasses.replace(stage, sharding=sharding)
    return dataclasses.replace(plan, stages=(stage,)), nodes, axes


def predicted(nodes, axes, cluster, mesh):
    """(all-to-all seconds of the whole exchanges, seconds the chunked form saves) per
    step: each grouped GEMM's two EP strategies, times its scan's trip count."""
    ctx = CostContext(cluster, mesh, moe_overlap="auto")
    plain = f"ep:{''.join(axes)}"
    a2a = saving = 0.0
    for trips, body, node in nodes:
        by_name = {s.name: s for s in expert_parallel_strategies(node, body, ctx)}
        whole, chunked = by_name[plain], by_name[plain + OVERLAPPED]
        a2a += trips * whole.comm_cost
        saving += trips * (whole.cost - chunked.cost)
    return a2a, saving


def ep_setup(argv, description: str):
    """The command line (rounds, steps, batch, config, profile) and the dropless MoE it
    names: (args, step, state, batch, cluster, the "shard" search's plan on (8,), graph).
    Shared with `moe_dispatch_once`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--config", default="ep-test")
    parser.add_argument("--profile", default="cpu-local-measured")
    args = parser.parse_args(argv)

    cfg = moe.CONFIGS[args.config]
    optimizer = optax.adamw(1e-3)
    step = moe.make_train_step(cfg, optimizer)
    state = moe.init_state(cfg, optimizer, jax.random.key(0))
    batch = moe.make_batch(cfg, args.batch, jax.random.key(1))
    cluster = autopar.Cluster.from_profile(args.profile)
    searched = autopar.plan(step, state, batch, cluster=cluster, method="shard",
                            mesh_shape=(8,), cache=False)
    graph = trace(step, state, batch)
    return args, step, state, batch, cluster, searched, graph


CLOCKS = ("wall", "cpu-per-core")  # the clocks `interleaved_times` reads


def interleaved_times(runs: dict, state, batch, rounds: int, steps: int) -> dict:
    """Seconds per step of each run in `runs`, rounds interleaved (order reversed every
    other round), on the wall clock and the cpu-per-core clock: {(clock, label): [...]}.
    Shared with `moe_dispatch_once`."""
    cores = usable_cores()
    clocks = {"wall": time.perf_counter, "cpu-per-core": lambda: time.process_time() / cores}
    times = {(clock, label): [] for clock in clocks for label in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for label in order:
            start = {clock: read() for clock, read in clocks.items()}
            for _ in range(steps):
                out = runs[label](state, batch)
            jax.block_until_ready(out)
            for clock, read in clocks.items():
                times[clock, label].append((read() - start[clock]) / steps)
    return times


def main(argv=None) -> None:
    args, step, state, batch, cluster, searched, graph = ep_setup(
        argv, __doc__.splitlines()[0])
    runs, losses = {}, {}
    for label, overlapped in (("off", False), ("on", True)):
        plan, nodes, axes = expert_parallel(searched, graph, overlapped)
        runs[label] = autopar.autoparallel(step, plan=plan, donate_argnums=(), cache=False)
        _, metrics = runs[label](state, batch)  # compile
        losses[label] = float(metrics["loss"])
    a2a, saving = predicted(nodes, axes, cluster, searched.stages[0].sharding.mesh)

    times = interleaved_times(runs, state, batch, args.rounds, args.steps)
    print(f"{args.config}, batch {args.batch}, {len(nodes)} grouped GEMMs per step "
          f"(trip-counted: {sum(t for t, _, _ in nodes)}), EP over {axes} on 8 CPU devices; "
          f"profile {args.profile}")
    print(f"  first-step loss off {losses['off']:.6f}  on {losses['on']:.6f}")
    print(f"  predicted all-to-all of the whole exchanges: {a2a * 1e3:.2f} ms per step")
    print(f"  predicted saving with overlap: {saving * 1e3:+.2f} ms per step "
          "(positive: overlap faster)")
    for clock in CLOCKS:
        off, on = (statistics.median(times[clock, k]) for k in ("off", "on"))
        print(f"  {clock} clock, median of {args.rounds} rounds x {args.steps} steps: "
              f"off {off * 1e3:.2f} ms  on {on * 1e3:.2f} ms  measured saving "
              f"{(off - on) * 1e3:+.2f} ms")
        for label in runs:
            print(f"    rounds {label:<3}: " + " ".join(f"{t * 1e3:.1f}"
                                                     for t in times[clock, label]))


if __name__ == "__main__":
    main()
