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
5. **Per-kernel overhead.** A chain of K small matmul + tanh pairs (8 x 8 and 64 x 64 per
   device) on 1, 4 and 8 devices at once, K = 1 and 256: what each extra kernel adds in
   wall and CPU microseconds (a fixed cost per XLA:CPU kernel would make small
   microbatches dear; it is well under a microsecond).
6. **Collectives between compute.** On each group size (all groups at once), a program of
   16 blocks of 4 chained 128 x 128 matmul + tanh per device, with and without a small
   all-reduce (or all-gather) after each block that the next block reads: what one
   collective in the middle of a step costs, against the profile's latency (fitted on
   collectives alone).
7. **A pipelined step's timeline.** ``auto 2 stages`` (or each ``--timeline-plan``) run
   with its timeline recorded (`record_timeline`: each task blocks until done): every
   task's start and end, the medians per stage and kind against the stage's predicted
   seconds per microbatch, and the unrecorded step's median.

8. **CPU per step against the predicted work.** All 12 local plans (3 interleaved rounds
   of 6 steps): wall time and this process's CPU seconds over the cores per step, against
   the plan's predicted work (per device group, its devices times its microbatches times
   its stage's predicted seconds, summed over the stages and divided by the 8 devices:
   what the step would take if no device ever waited); the pipelined plans once more with
   every task waited for before the next is launched (nothing overlaps). On this host the
   8 devices share the cores, so a plan's CPU over the cores is the time its work takes
   when the cores are always busy.

9. **Matmuls by shape and operand layout.** The local GPT's matmul shapes (M x K times
   K x N per device, 1 to 8 sequences of 64 tokens per device, tensor-parallel splits,
   the attention's K = 32) and square ones, on all 8 devices at once, each program
   several independent matmuls on operands of their own (as `autopar profile` times
   them), by CPU seconds over the cores: plain (``a @ b``), with the left operand stored
   transposed (``a.T @ b``, a weight gradient's ``x.T @ dy``) and with the right one
   stored transposed (``a @ b.T``, an input gradient's ``dy @ w.T``), against the
   profile's `gemm_efficiency` at the same FLOPs.

10. **Each pipelined task's thunks.** For each stage's forward and backward of
   ``--op-profile NAME`` (a pipelined local plan), run alone 10 times under
   `jax.profiler.trace`: its CPU per call, and the time its HLO instructions take summed
   over the device threads, by kind; how much of the compute is copies and transposes
   (`LAYOUT_THUNKS`), and how much the collectives take (waits for the other devices
   included).

11. **A one-program step's layout copies.** ``--step-profile NAME`` (a one-stage local
   plan): 5 whole steps under `jax.profiler.trace`, the thunks' time per device and step,
   the copies and transposes apart, against what the cost model charges the step's layout
   copies (`autopar.cost.backends._xla_cpu.layout_copies` on the plan's layouts,
   `layout_copy_time` on `cpu-local-measured`).

The tasks of (2) are timed with and without their gradient accumulation (the version that
adds into the running sums against the first microbatch's, which starts them): what
accumulating a microbatch's gradients costs.

Usage: ``python benchmarks/investigations/local_cost_probe.py [--skip-collectives] [--skip-tasks]
[--skip-step] [--skip-kernels] [--skip-between] [--skip-timeline]
[--timeline-plan NAME ...] [--skip-work] [--skip-shapes] [--op-profile NAME ...]
[--step-profile NAME ...]``
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
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ELEMENTS = 256  # float32 per device: a latency-bound collective


def _median_call(fn, args, repeats: int = 51, clock=time.perf_counter) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = clock()
        jax.block_until_ready(fn(*args))
        times.append(clock() - start)
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


def _local_plan(name: str = "auto 2 stages"):
    """GPT `small-test` (batch 16) planned on `cpu-local-measured` as the local check's
    plan `name`: (the plan, a `_Timer` of it, compiled and warmed up)."""
    from bench_local import _cluster, _gpt_arrays, _Timer, local_plans

    step, state, batch = _gpt_arrays("small-test", 16)
    p = local_plans(step, (state, batch), _cluster("cpu-local-measured"))[name]()
    return p, _Timer(step, state, batch, p)


def _captured_tasks(timer) -> dict:
    """Every task of one step of `timer`'s pipelined plan, with a copy of its arguments:
    ``{(phase, stage, adds to the sums): (program, arguments)}``."""
    from autopar.runtime import PipelineExecutable

    captured = {}
    run_task = PipelineExecutable._run_task

    def spy(self, phase, stage, values, step_values, sums, running=None):
        def keep(fn, args):
            adds = fn is self.tasks[(phase, stage)].fn_sum
            if (phase, stage, adds) not in captured:  # copies: the sums are donated
                captured[(phase, stage, adds)] = (fn, [jnp.copy(x) for x in args])
        return run_task(self, phase, stage, values, step_values, sums, keep)

    PipelineExecutable._run_task = spy
    try:
        timer._step()
    finally:
        PipelineExecutable._run_task = run_task
    return captured


def pipeline_tasks() -> None:
    p, timer = _local_plan()
    captured = _captured_tasks(timer)
    print(f"plan: {[(s.layers, s.mesh.shape) for s in p.stages]}, "
          f"{p.num_microbatches} microbatches, predicted {p.predicted_step_time * 1e3:.1f} ms")
    print("| stage | task | gradients | wall ms | CPU ms | stage compute predicted per "
          "microbatch ms |")
    print("|---|---|---|---|---|---|")
    for (phase, stage, adds), (fn, args) in sorted(captured.items(),
                                                    key=lambda kv: (kv[0][1], kv[0][0])):
        walls, cpus = [], []
        for k in range(18):
            fresh = [jnp.copy(x) for x in args] if adds else args  # donated sums
            jax.block_until_ready(fresh)
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*fresh))
            if k >= 3:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        predicted = p.stages[stage].sharding.cost.compute
        kind = "added to the sums" if adds else ("start the sums" if phase == "backward"
                                                  else "-")
        print(f"| {stage} | {phase} | {kind} | {statistics.median(walls) * 1e3:.2f} | "
              f"{statistics.median(cpus) * 1e3:.2f} | {predicted * 1e3:.2f} (forward and "
              f"backward) |", flush=True)


def kernel_overhead() -> None:
    print("| matmul | devices | each extra kernel, wall us | CPU us | CPU us per device |")
    print("|---|---|---|---|---|")
    for n in (8, 64):
        for count in (1, 4, 8):
            mesh = Mesh(np.array(jax.devices()[:count]), ("x",))
            w = jnp.full((n, n), 0.01)
            seconds = {}
            for k in (1, 256):
                def chain(x, k=k, w=w):
                    for _ in range(k):
                        x = jnp.tanh(x @ w)
                    return x

                fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
                x = jax.device_put(jnp.ones((count * n, n)), NamedSharding(mesh, P("x")))
                seconds[k] = (_median_call(fn, (x,), 31),
                              _median_call(fn, (x,), 31, clock=time.process_time))
            kernels = 2 * 255  # a dot and a tanh per link
            wall = (seconds[256][0] - seconds[1][0]) / kernels
            cpu = (seconds[256][1] - seconds[1][1]) / kernels
            print(f"| {n} x {n} | {count} | {wall * 1e6:.2f} | {cpu * 1e6:.2f} | "
                  f"{cpu / count * 1e6:.2f} |", flush=True)


def collectives_between_compute() -> None:
    devices = np.array(jax.devices())
    w = jnp.full((128, 128), 0.001)
    print("| group | kind | compute only ms | with 16 between ms | each us |")
    print("|---|---|---|---|---|")
    for n in (2, 4, 8):
        mesh = Mesh(devices.reshape(len(devices) // n, n), ("g", "x"))
        spec = P(("g", "x"))
        x = jax.device_put(jnp.ones((len(devices) * 128, 128)), NamedSharding(mesh, spec))
        for kind in ("all_reduce", "all_gather"):
            seconds = {}
            for between in (False, True):
                def body(x, between=between, kind=kind, w=w):
                    for _ in range(16):
                        for _ in range(4):
                            x = jnp.tanh(x @ w)
                        if between:
                            part = (lax.psum(x[:8], "x") if kind == "all_reduce"
                                    else lax.all_gather(x[:8], "x", tiled=True))
                            x = x + part.sum() * 1e-3
                    return x

                fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                           check_vma=False))
                seconds[between] = _median_call(fn, (x,), 21)
            each = (seconds[True] - seconds[False]) / 16
            print(f"| {n} | {kind} | {seconds[False] * 1e3:.2f} | {seconds[True] * 1e3:.2f} | "
                  f"{each * 1e6:.0f} |", flush=True)


def pipeline_timeline(name: str = "auto 2 stages") -> None:
    p, timer = _local_plan(name)
    unrecorded = timer.time_steps(10)
    for _ in range(2):  # the first recorded step warms up the recording path; keep the second
        (timer.state, _), timeline = timer.run.record_timeline(timer.state, timer.batch)
        jax.block_until_ready(timer.state)
    print(f"{name}: predicted {p.predicted_step_time * 1e3:.1f} ms, unrecorded step "
          f"{unrecorded * 1e3:.1f} ms (median of 10), recorded step ends at "
          f"{timeline[-1].end * 1e3:.1f} ms")
    print("| stage | task | microbatch | start ms | end ms |")
    print("|---|---|---|---|---|")
    by_kind: dict = {}
    for r in timeline:
        by_kind.setdefault((r.stage, r.kind), []).append(r.end - r.start)
        print(f"| {r.stage} | {r.kind} | {r.microbatch} | {r.start * 1e3:.2f} | "
              f"{r.end * 1e3:.2f} |")
    for s, stage in enumerate(p.stages):
        times = {kind: statistics.median(t) * 1e3 for (k, kind), t in by_kind.items() if k == s}
        print(f"stage {s}: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in times.items())
              + f"; predicted {stage.time_per_microbatch * 1e3:.2f} ms per microbatch (compute "
              f"{stage.sharding.cost.compute * 1e3:.2f}, collectives "
              f"{stage.sharding.cost.communication * 1e3:.2f}, resharding "
              f"{stage.sharding.cost.resharding * 1e3:.2f})", flush=True)


def cpu_against_work() -> None:
    from bench_local import (
        LOCAL_DEVICES,
        _cluster,
        _cpu_per_core,
        _gpt_arrays,
        _Timer,
        local_plans,
    )

    from autopar.runtime import PipelineExecutable

    step, state, batch = _gpt_arrays("small-test", 16)
    makers = local_plans(step, (state, batch), _cluster("cpu-local-measured"))
    timers = {name: _Timer(step, state, batch, make()) for name, make in makers.items()}
    run_task = PipelineExecutable._run_task

    def waited(self, *args, **kwargs):
        return jax.block_until_ready(run_task(self, *args, **kwargs))

    times: dict = {}
    try:
        for _ in range(3):
            for serial in (False, True):
                PipelineExecutable._run_task = waited if serial else run_task
                for name, timer in timers.items():
                    if serial and timer.run._last.plan.num_stages == 1:
                        continue
                    for _ in range(6):
                        wall, cpu = time.perf_counter(), _cpu_per_core()
                        timer._step()
                        times.setdefault((name, serial), []).append(
                            (time.perf_counter() - wall, _cpu_per_core() - cpu))
    finally:
        PipelineExecutable._run_task = run_task
    print("| plan | tasks | predicted ms | predicted work ms | wall ms | CPU / cores ms | "
          "CPU / cores / work |")
    print("|---|---|---|---|---|---|---|")
    for (name, serial), rows in times.items():
        p = timers[name].run._last.plan
        work = sum(len(s.sharding.mesh.device_ids) * p.num_microbatches * s.time_per_microbatch
                   for s in p.stages) / LOCAL_DEVICES
        wall = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        print(f"| {name} | {'one at a time' if serial else 'as run'} | "
              f"{p.predicted_step_time * 1e3:.1f} | {work * 1e3:.1f} | {wall * 1e3:.1f} | "
              f"{cpu * 1e3:.1f} | {cpu / work:.2f} |", flush=True)


# Thunks that only move or transpose data (XLA:CPU's names for them in a task's HLO).
LAYOUT_THUNKS = ("wrapped_copy", "bitcast_transpose_fusion", "transpose_copy_fusion",
                 "copy_bitcast_fusion", "bitcast_copy_fusion")


def _traced_events(call, calls: int) -> list:
    """The events of a `jax.profiler` trace of `calls` calls of `call()`."""
    import glob
    import gzip
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                call()
        trace = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[0]
        with gzip.open(trace) as handle:
            events = json.load(handle)
    return events["traceEvents"] if isinstance(events, dict) else events


def task_op_profiles(name: str) -> None:
    import re
    from collections import defaultdict

    p, timer = _local_plan(name)
    calls = 10
    for (phase, stage, adds), (fn, args) in sorted(_captured_tasks(timer).items(),
                                                    key=lambda kv: (kv[0][1], kv[0][0])):
        if adds:
            continue  # the version that adds into the running sums donates them
        text = fn.lower(*args).compile().as_text()
        entry = text[text.index("ENTRY"):]
        names = set(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = ", entry, re.M))
        _median_call(fn, args, 3)
        start = time.process_time()
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        cpu = (time.process_time() - start) / calls
        events = _traced_events(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)),
                                calls)
        by_kind: dict = defaultdict(float)
        for e in events:
            if e.get("ph") == "X" and e.get("name") in names:
                by_kind[re.sub(r"[._]\d+$", "", e["name"])] += e["dur"] * 1e-3 / calls
        collective = sum(ms for kind, ms in by_kind.items()
                         if kind.startswith(("all-", "reduce-scatter", "collective-")))
        compute = sum(by_kind.values()) - collective
        layout = sum(by_kind.get(kind, 0.0) for kind in LAYOUT_THUNKS)
        top = ", ".join(f"{kind} {ms:.2f}" for kind, ms in
                        sorted(by_kind.items(), key=lambda kv: -kv[1])[:6])
        print(f"{name}, stage {stage} {phase}: CPU {cpu * 1e3:.2f} ms per call; thunks over "
              f"the devices {compute:.2f} ms of compute, {layout:.2f} ms of it copies and "
              f"transposes ({layout / compute:.0%}), {collective:.2f} ms in collectives "
              f"(waits included); largest: {top}", flush=True)


def step_layout_copies(name: str) -> None:
    """A one-stage local plan's step profiled whole (5 steps under `jax.profiler.trace`):
    its HLO thunks' time per device and step by kind, the copies and transposes
    (`LAYOUT_THUNKS`) apart, against what the cost model charges the step's layout copies
    (`autopar.cost.backends._xla_cpu.layout_copies` priced by `layout_copy_time` on the
    plan's chosen layouts)."""
    import re
    from collections import defaultdict

    from bench_local import LOCAL_DEVICES, _cluster

    from autopar.cost import bytes_per_device
    from autopar.cost.backends._xla_cpu import layout_copies, layout_copy_time
    from autopar.runtime import PipelineExecutable

    made = []
    init = PipelineExecutable.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    PipelineExecutable.__init__ = keep
    try:
        p, timer = _local_plan(name)
    finally:
        PipelineExecutable.__init__ = init
    if p.num_stages != 1:
        raise SystemExit(f"--step-profile takes a one-stage plan; {name!r} has {p.num_stages}")
    if made:  # the pipeline runtime's one-program step: its stage graph
        graph, sharding = made[-1].partition.stage_graphs[0], made[-1].stage_plans[0]
    else:
        from bench_local import _gpt_arrays

        from autopar.graph import trace

        graph, sharding = trace(*_gpt_arrays("small-test", 16)), p.stages[0].sharding
    cluster = _cluster("cpu-local-measured")
    modelled = 0.0
    for node in graph.nodes:
        for copy in layout_copies(graph, node):
            v = node.inputs[copy.operand]
            spec = sharding.var_specs[v]
            if spec is not None:
                var = graph.vars[v]
                nbytes = bytes_per_device(var.shape, var.dtype, spec, sharding.mesh)
                modelled += layout_copy_time(nbytes, cluster, copy.fan_in, copy.fused)
    for _ in range(3):
        timer._step()
    calls = 5
    events = _traced_events(timer._step, calls)
    by_kind: dict = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and re.fullmatch(r"[a-z][\w-]*(\.\d+)?", e.get("name", "")) \
                and re.search(r"fusion|copy|transpose|all-|dot|reduce|scatter|gather", e["name"]):
            by_kind[re.sub(r"[._]\d+$", "", e["name"])] += e["dur"] * 1e-3 / calls / LOCAL_DEVICES
    collective = sum(ms for kind, ms in by_kind.items()
                     if kind.startswith(("all-", "reduce-scatter", "collective-")))
    compute = sum(by_kind.values()) - collective
    layout = sum(by_kind.get(kind, 0.0) for kind in LAYOUT_THUNKS)
    print(f"{name}: per device and step, thunks {compute:.1f} ms of compute, {layout:.2f} ms "
          f"of it copies and transposes ({layout / compute:.0%}), {collective:.1f} ms in "
          f"collectives (waits included); the model's layout copies {modelled * 1e3:.2f} ms",
          flush=True)
    top = sorted(by_kind.items(), key=lambda kv: -kv[1])[:12]
    print("    largest: " + ", ".join(f"{kind} {ms:.2f}" for kind, ms in top), flush=True)


# (M, K, N) per device: the local GPT's matmuls at 1, 2, 4 and 8 sequences of 64 tokens
# per device (K x N: the QKV, output, MLP-up and MLP-down weights, whole or split 4 ways)
# and square sizes.
MATMUL_SHAPES = (
    (64, 128, 384), (64, 128, 128), (64, 128, 512), (64, 512, 128), (128, 128, 384),
    (128, 128, 512), (128, 512, 128), (256, 128, 512), (512, 128, 128), (512, 128, 96),
    (512, 32, 128), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512),
)


def matmul_shapes() -> None:
    from bench_local import _cpu_per_core

    from autopar.cluster import Cluster
    from autopar.cost import device_flops
    from autopar.cost._compute import gemm_efficiency

    cluster = Cluster.from_profile("cpu-local-measured")
    peak = device_flops(cluster, "float32")
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("x",))
    spec = NamedSharding(mesh, P("x"))
    layouts = {"a @ b": lambda a, b: a @ b, "a.T @ b": lambda a, b: a.T @ b,
               "a @ b.T": lambda a, b: a @ b.T}
    print("| M x K x N | profile's efficiency | " + " | ".join(layouts) + " |")
    print("|---|---|" + "---|" * len(layouts))
    for m, k, n in MATMUL_SHAPES:
        flops = 2 * m * k * n
        count = max(1, min(64, round(2 * 512**3 / flops)))
        cells = []
        for layout, product in layouts.items():
            a_shape = (k, m) if layout == "a.T @ b" else (m, k)
            b_shape = (n, k) if layout == "a @ b.T" else (k, n)

            def body(*ops, product=product, count=count):
                return tuple(product(ops[2 * i], ops[2 * i + 1]) for i in range(count))

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * (2 * count),
                                       out_specs=(P("x"),) * count))
            ops = []
            for _ in range(count):
                ops.append(jax.device_put(jnp.full((len(devices) * a_shape[0], a_shape[1]),
                                                   0.01), spec))
                ops.append(jax.device_put(jnp.full((len(devices) * b_shape[0], b_shape[1]),
                                                   0.01), spec))
            seconds = _median_call(fn, ops, 15, clock=_cpu_per_core)
            cells.append(f"{flops * count / seconds / peak:.3f}")
            del ops
        print(f"| {m} x {k} x {n} | {gemm_efficiency(cluster, flops):.3f} | "
              + " | ".join(cells) + " |", flush=True)


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
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-between", action="store_true")
    parser.add_argument("--skip-timeline", action="store_true")
    parser.add_argument("--timeline-plan", action="append",
                        help="a pipelined local plan whose timeline to record (repeatable; "
                        "default: auto 2 stages)")
    parser.add_argument("--skip-work", action="store_true")
    parser.add_argument("--skip-shapes", action="store_true")
    parser.add_argument("--op-profile", action="append", default=[],
                        help="a pipelined local plan whose tasks to profile op by op "
                        "(repeatable; default: none)")
    parser.add_argument("--step-profile", action="append", default=[],
                        help="a one-stage local plan whose whole step to profile, its copies "
                        "and transposes against the model's layout copies (repeatable)")
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
    if not args.skip_kernels:
        kernel_overhead()
    if not args.skip_between:
        collectives_between_compute()
    if not args.skip_timeline:
        for name in args.timeline_plan or ["auto 2 stages"]:
            pipeline_timeline(name)
    if not args.skip_work:
        cpu_against_work()
    if not args.skip_shapes:
        matmul_shapes()
    for name in args.op_profile:
        task_op_profiles(name)
    for name in args.step_profile:
        step_layout_copies(name)


if __name__ == "__main__":
    main()
