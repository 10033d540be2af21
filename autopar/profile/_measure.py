"""Measuring the local devices into a cost profile (``autopar profile``).

In: the JAX devices of this process (or of all processes under ``jax.distributed``). Out: a
`ProfileResult` whose `cluster` holds the measured figures and whose `save` writes a profile
JSON that `Cluster.from_profile` loads.

Measured: large-matmul FLOP/s per dtype and memory bandwidth (an elementwise op), each on
all devices at once, as they run in a sharded step; all-reduce, all-gather,
reduce-scatter, all-to-all (``jax.shard_map`` with ``lax.psum``, ``all_gather``,
``psum_scatter``, ``all_to_all``) and send/recv (``lax.ppermute`` around a ring) over a
range of message sizes in groups of 2..N devices, every device busy: N / n groups of n
run at once, as a sharded step runs a collective over one mesh axis. Every function is
compiled once, warmed up, and timed as the median of repeats with ``block_until_ready``.
Latency and bandwidth per link level are a least-squares fit of the alpha-beta formulas
(`autopar.cost.fit_link`); inside a host also one fit per group size
(`Cluster.intra_host_by_group`), since groups that share the host's cores, memory or
switch do not see one bandwidth per device whatever their size (8 virtual CPU devices on
2 cores: 4 pairs at once move 4 MiB each in 5.3 ms, one pair alone in 1.2 ms, all 8 in
one group in 2.2 ms).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.cluster import Cluster, local_devices
from autopar.cost import COLLECTIVE_KINDS, CollectiveKind, CollectiveSample
from autopar.profile._fit import (
    RawFigures,
    fit_links,
    fitted_cluster,
    measured_json,
    note_alone,
    profile_note,
)

AXIS = "d"
GROUPS = "g"  # the mesh axis over concurrent groups of a collective
KiB, MiB = 2**10, 2**20
COLLECTIVE_DTYPE = jnp.float32
MATMUL_DTYPES = ("float32", "bfloat16")
# GPUs and TPUs reach their peak only on far larger matrices than CPUs (4096 and up), so on
# an accelerator the `ProfileOptions.matmul_sizes` are scaled by this factor.
ACCELERATOR_MATMUL_SCALE = 8
# GEMM grids likewise, from (16, 64, 256, 1024) on CPU to (256, ..., 16384): a layer's
# matmuls on one GPU, tokens of a microbatch by hidden, FFN and vocabulary widths, and the
# attention's head dimension.
ACCELERATOR_GEMM_SCALE = 16
# Likewise the bytes of the bandwidth probe (16 MiB on CPU would sit in a H100's 50 MB L2).
ACCELERATOR_BANDWIDTH_SCALE = 64

CLOCKS = ("wall", "cpu-per-core")

# Group sizes for collectives on N devices: 2, 4, 8, ... and N; or just 2 and N.
DeviceCountPolicy = Literal["powers_of_two", "two_and_all"]


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What `measure_profile` measures.

    **Arguments:**
    - `message_sizes`: collective message sizes in bytes (rounded so they split evenly).
    - `device_counts`: group sizes for collectives, or a `DeviceCountPolicy`.
    - `repeats`, `warmup`: timed and untimed calls per compiled function.
    - `matmul_sizes`: square matmul sizes per device on CPU (times
      `ACCELERATOR_MATMUL_SCALE` on accelerators); the fastest counts as peak, and the
      others give `gemm_efficiency` (small sizes are timed as several independent
      matmuls in one program, `measure_matmul`).
    - `gemm_sizes`: the sizes of M, N and K per device whose every combination
      `measure_gemm_shapes` times on accelerators (times `ACCELERATOR_GEMM_SCALE`, in
      bfloat16), and on CPU (in the first of `MATMUL_DTYPES`) with `gemm_shapes_on_cpu`:
      the profile's `gemm_shapes` (empty: not measured).
    - `gemm_shapes_on_cpu`: also time the grid on CPU (``autopar profile --gemm-shapes``;
      80 s on 8 virtual devices of a 2-core VM). Off by default: there its smallest
      shapes are mostly a program launch, and three runs differed by 20-30% per shape,
      more than the shape effects it showed at the local GPT's shapes (session 22).
    - `bandwidth_bytes`: bytes per device of the elementwise op that measures bandwidth.
    - `transpose_sizes`: bytes per device read by the transposing copies of
      `measure_transpose` (CPU only; empty: not measured).
    - `dispatch_repeats`: timed calls of the trivial program that measures
      `Cluster.dispatch_overhead` (`measure_dispatch`).
    - `concurrent_groups`: time a collective over n devices on all N devices at once, in
      N / n groups of n (True, the default: what a sharded step does), or on the first n
      devices alone (False; also where n does not divide N).
    - `clock`: ``"wall"`` (default: `time.perf_counter`) or ``"cpu-per-core"``: this process's
      CPU seconds (`time.process_time`, all its threads) divided by the cores the program
      can keep busy, ``min(cores this process may run on, devices it runs on)``; the
      trivial program of `measure_dispatch`, one host thread's work, by 1. On a machine
      shared with other jobs this estimates the time with the machine to itself, which
      their load does not inflate (exact for programs that keep those cores busy; XLA:CPU
      runs each virtual device on its own thread).
    """

    message_sizes: tuple[int, ...]
    device_counts: tuple[int, ...] | DeviceCountPolicy = "powers_of_two"
    repeats: int = 7
    warmup: int = 2
    matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)
    gemm_sizes: tuple[int, ...] = (16, 64, 256, 1024)
    gemm_shapes_on_cpu: bool = False
    bandwidth_bytes: int = 16 * MiB
    dispatch_repeats: int = 201
    transpose_sizes: tuple[int, ...] = tuple(2**k * 256 * KiB for k in range(6))
    concurrent_groups: bool = True
    clock: Literal["wall", "cpu-per-core"] = "wall"

    def __post_init__(self):
        if self.clock not in CLOCKS:
            raise ValueError(f"ProfileOptions.clock must be one of {CLOCKS}, got {self.clock!r}")


FULL = ProfileOptions(message_sizes=tuple(4**k * 4 * KiB for k in range(7)))  # 4 KiB..16 MiB
QUICK = ProfileOptions(
    message_sizes=(16 * KiB, 256 * KiB, 4 * MiB),
    device_counts="two_and_all",
    repeats=5,
    warmup=1,
    matmul_sizes=(256, 512),
    gemm_sizes=(64, 256),
    bandwidth_bytes=8 * MiB,
    dispatch_repeats=51,
    transpose_sizes=(512 * KiB, 2 * MiB),
)


@dataclass(frozen=True)
class ProfileResult:
    """A measured profile: the `cluster`, a `note` on how it was measured, and `measured`,
    the JSON-ready raw data (timings, fits per collective kind, matmul rates)."""

    cluster: Cluster
    note: str
    measured: Mapping[str, Any]

    def to_json(self) -> dict:
        return {**self.cluster.to_json(), "note": self.note, "measured": dict(self.measured)}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ProfileResult:
        cluster = {k: v for k, v in data.items() if k not in ("note", "measured")}
        return ProfileResult(Cluster.from_json(cluster), data["note"], data["measured"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile JSON that `Cluster.from_profile(path)` loads."""
        self.cluster.save(path, note=self.note, measured=dict(self.measured))


def measure_profile(
    options: ProfileOptions = FULL,
    devices: Sequence | None = None,
    log: Callable[[str], None] | None = None,
) -> ProfileResult:
    """Measure the devices and fit a `Cluster`.

    Under ``jax.distributed`` every process must call this; each measures its own devices,
    then all of them together (one device per process) for the inter-host level, and every
    process returns the figures of process 0, so that all derive the same plans.

    One accelerator alone (``autopar profile --devices 1`` on a GPU) has nothing to
    communicate with: its links are the built-in profile's for its device kind (the
    `note` says so), and it also measures what `autopar.profile._accelerator` times (the
    smallest kernel's cost, memory bandwidth by size, fused throughput) and GEMMs by shape.
    CPU devices need at least two.

    **Arguments:**
    - `options`: `FULL` (default, under 2 minutes on 8 virtual CPU devices), `QUICK`, or
      your own `ProfileOptions`.
    - `devices`: the JAX devices to measure, the same number on every process; default all
      (`local_devices`).
    - `log`: called with one progress line per measurement group; default: stderr.

    **Returns:** a `ProfileResult`; ``result.save(path)`` writes the profile JSON.
    """
    log = log or _log_to_stderr
    start = time.perf_counter()
    devices = list(devices) if devices is not None else local_devices()
    hosts = sorted({d.process_index for d in devices})
    mine = [d for d in devices if d.process_index == jax.process_index()]
    alone = len(mine) < 2 and len(hosts) < 2
    accelerator = not _on_cpu(mine)
    if alone and not accelerator:
        raise ValueError(
            f"profiling CPU devices needs >= 2 of them (or >= 2 processes), got {len(mine)}; "
            "run `autopar profile --devices 8`, or set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax"
        )
    if accelerator:  # its L2 cache holds what a CPU's memory bandwidth probe moves
        options = dataclasses.replace(
            options, bandwidth_bytes=options.bandwidth_bytes * ACCELERATOR_BANDWIDTH_SCALE)
    raw = _measure_devices(devices, hosts, mine, alone, accelerator, options, log)
    links = fit_links(raw, mine[0].device_kind, alone, log)
    cluster = fitted_cluster(raw, links, len(hosts), len(mine), mine[0].device_kind,
                             _device_memory(mine), _shared_cores(mine))
    by_group = links.by_group or ()
    for level, link in (("intra_host", links.intra), ("inter_host", links.inter),
                        *((f"intra_host, groups of {n}", link) for n, link in by_group)):
        log(f"fit {level}: latency {link.latency * 1e6:.1f} us, "
            f"bandwidth {link.bandwidth / 1e9:.3f} GB/s per device")
    measured = measured_json(raw, links, time.perf_counter() - start)
    if links.base is None:
        note = profile_note(len(hosts), bool(raw.inter))
    else:
        note = note_alone(links.base)
    result = ProfileResult(cluster, note, measured)
    return ProfileResult.from_json(_from_process_zero(result.to_json()))


def _measure_devices(devices, hosts, mine, alone: bool, accelerator: bool,
                     options: ProfileOptions, log) -> RawFigures:
    """Every measurement of `measure_profile`, in its order: this process's devices
    (`mine`), then one device per host for the inter-host level (best effort)."""
    flops = {dtype: measure_matmul(dtype, mine, options, log) for dtype in MATMUL_DTYPES}
    gemm_dtype = "bfloat16" if accelerator else MATMUL_DTYPES[0]
    shapes = measure_gemm_shapes(gemm_dtype, mine, options, log)
    hbm = measure_bandwidth(mine, options, log)
    inplace = measure_bandwidth(mine, options, log, in_place=True)
    dispatch = measure_dispatch(mine, options, log)
    combined = measure_combined_latency(mine, options, log) if not alone else 0.0
    transpose = measure_transpose(mine, options, log)
    latency = measure_collective_latency(mine, options, log) if len(mine) >= 2 else None
    intra = measure_collectives(mine, options, log, "intra-host") if len(mine) >= 2 else []
    inter = []
    if len(hosts) >= 2:  # one device per host: the inter-host level (best effort)
        leaders = [next(d for d in devices if d.process_index == h) for h in hosts]
        across = dataclasses.replace(options, device_counts=(len(leaders),))
        inter = measure_collectives(leaders, across, log, "inter-host")
    extra = _accelerator_figures(mine, options, log) if accelerator else \
        _cpu_figures(mine, options, log)
    return RawFigures(flops, gemm_dtype, shapes, hbm, inplace, dispatch, combined, transpose,
                       latency, intra, inter, extra)


# Independent GEMMs per program of `measure_gemm_shapes` at most: its 64 programs compile
# in about a second each on 8 CPU devices (with 64 GEMMs, 3.4 s: 218 s per grid).
MAX_GEMMS_PER_SHAPE = 16


def measure_gemm_shapes(
    dtype: str, devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> dict[tuple[int, int, int], float]:
    """FLOP/s per device of GEMMs of every (M, N, K) per device from `options.gemm_sizes`
    (scaled by `ACCELERATOR_GEMM_SCALE` on accelerators), on all `devices` at once, as
    `measure_matmul` times squares: each program runs r independent GEMMs of its shape on
    operands of their own, r chosen so that it does about the work of one square matmul
    of half the largest `matmul_sizes` (at most `MAX_GEMMS_PER_SHAPE`: the smallest
    shapes' programs are then mostly their launch, as they are wherever they run alone).

    A step's GEMMs are rarely square: tensor parallelism splits N or K, attention contracts
    over the head dimension, and on a CPU a GEMM with K = 32 ran at half the rate of a
    square one of the same FLOPs (512 x 32 x 128 at 0.25-0.29 of peak against 0.52 for
    its size). The profile keeps the table (`Cluster.gemm_shapes`) and the cost model
    interpolates it by shape (`autopar.cost.gemm_efficiency`).
    """
    if not options.gemm_sizes or (_on_cpu(devices) and not options.gemm_shapes_on_cpu):
        return {}
    mesh = Mesh(np.array(devices), (AXIS,))
    spec = PartitionSpec(AXIS)
    accelerator = not _on_cpu(devices)
    scale = ACCELERATOR_GEMM_SCALE if accelerator else 1
    sizes = [scale * size for size in options.gemm_sizes]
    work = 2.0 * ((ACCELERATOR_MATMUL_SCALE if accelerator else 1)
                  * max(options.matmul_sizes) // 2) ** 3
    rates = {}
    start = time.perf_counter()
    for m in sizes:
        for n in sizes:
            for k in sizes:
                flops = 2.0 * m * n * k
                count = max(1, min(MAX_GEMMS_PER_SHAPE, round(work / flops)))
                fn = jax.shard_map(partial(_independent_matmuls, count=count), mesh=mesh,
                                   in_specs=(spec,) * (2 * count), out_specs=(spec,) * count)
                operands = []
                for _ in range(count):
                    operands += [_filled((len(devices) * m, k), dtype, mesh),
                                 _filled((len(devices) * k, n), dtype, mesh)]
                rates[(m, n, k)] = flops * count / _median_seconds(fn, tuple(operands), options)
                del operands
    best = max(rates, key=rates.get)
    worst = min(rates, key=rates.get)
    log(f"GEMM shapes ({dtype}, {len(rates)} of M x N x K in {sizes}) on {len(devices)} "
        f"devices: {rates[worst] / 1e9:.2f} GFLOP/s per device at {worst} to "
        f"{rates[best] / 1e9:.2f} at {best} ({time.perf_counter() - start:.1f} s)")
    return rates


def measure_collectives(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None], level: str
) -> list[CollectiveSample]:
    """Time every collective kind at every message size in groups of n devices: all
    `devices` at once in groups of n (`ProfileOptions.concurrent_groups`, where n divides
    their number), else the first n devices alone."""
    samples = []
    for n in _device_counts(options.device_counts, len(devices)):
        if not 2 <= n <= len(devices):
            raise ValueError(f"device count {n} is not in 2..{len(devices)} (devices measured)")
        concurrent = options.concurrent_groups and len(devices) % n == 0
        group_devices = devices if concurrent else devices[:n]
        groups = len(group_devices) // n
        where = f"{groups} groups of {n} devices" if groups > 1 else f"{n} devices"
        for kind in COLLECTIVE_KINDS:
            group_start = time.perf_counter()
            group = [time_collective(kind, size, group_devices, options, group_size=n)
                     for size in options.message_sizes]
            samples += group
            times = [s.seconds for s in group]
            log(f"{level} {kind:<14} on {where}, {_size_str(group[0].nbytes)}.."
                f"{_size_str(group[-1].nbytes)}: {min(times) * 1e3:.3f}..{max(times) * 1e3:.3f}"
                f" ms ({time.perf_counter() - group_start:.1f} s)")
    return samples


def time_collective(
    kind: CollectiveKind, nbytes: int, devices: Sequence, options: ProfileOptions,
    group_size: int | None = None,
) -> CollectiveSample:
    """Median time of one collective of `nbytes` (as `collective_time` counts) on `devices`,
    in groups of `group_size` consecutive devices running at once (default: one group of
    all of them)."""
    n = group_size or len(devices)
    if n < 1 or len(devices) % n:
        raise ValueError(f"group_size {group_size} must divide the {len(devices)} devices")
    itemsize = jnp.dtype(COLLECTIVE_DTYPE).itemsize
    elements = max(n, round(nbytes / itemsize / n) * n)  # so that every split is even
    local_shape, body = _collective_body(kind, elements, n)
    mesh = Mesh(np.array(devices).reshape(len(devices) // n, n), (GROUPS, AXIS))
    spec = PartitionSpec((GROUPS, AXIS))
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    x = _filled((len(devices) * local_shape[0], *local_shape[1:]), COLLECTIVE_DTYPE, mesh)
    seconds = _median_seconds(fn, (x,), options)
    return CollectiveSample(kind, n, float(elements * itemsize), seconds)


def measure_matmul(
    dtype: str, devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> dict[int, float]:
    """FLOP/s per device of square matmuls run on all `devices` at once, by size.

    Each program runs ``r`` independent matmuls of its size, each on operands of its own,
    r chosen so that every program does about the work of one matmul of the largest size
    (at most `MAX_MATMULS_PER_PROGRAM`): a small matmul then costs what it does inside a
    step, not the launch of a program of its own (on 8 CPU devices a launch is ~0.15 ms, a
    whole 128 x 128 matmul ~0.35 ms), and it reads operands that the matmul before it did
    not just touch, as a step's matmuls read their weights. (Chaining ``y = y @ a`` instead
    keeps both operands in cache: on 8 virtual devices of a 2-core AMD EPYC, 128 x 128 ran
    at 24.3 GFLOP/s per device chained and at 11.9 independent, 64 x 64 at 19 and 7.1.)
    """
    mesh = Mesh(np.array(devices), (AXIS,))
    spec = PartitionSpec(AXIS)
    scale = 1 if _on_cpu(devices) else ACCELERATOR_MATMUL_SCALE
    sizes = [scale * size for size in options.matmul_sizes]
    by_size = {}
    for size in sizes:
        count = max(1, min(MAX_MATMULS_PER_PROGRAM, round((max(sizes) / size) ** 3)))
        fn = jax.shard_map(partial(_independent_matmuls, count=count), mesh=mesh,
                           in_specs=(spec,) * (2 * count), out_specs=(spec,) * count)
        operands = tuple(_filled((len(devices) * size, size), dtype, mesh)
                         for _ in range(2 * count))
        by_size[size] = 2 * size**3 * count / _median_seconds(fn, operands, options)
        del operands
    best = max(by_size, key=by_size.get)
    log(f"matmul {dtype:<9} on {len(devices)} devices: {by_size[best] / 1e9:.2f} GFLOP/s "
        f"per device (best at {best}x{best}, sizes {list(by_size)})")
    return by_size


# Independent matmuls per program of `measure_matmul` at most: enough that a program's
# launch is a few percent of its time at the smallest size, few enough to compile fast
# and hold the operands (64 pairs of 256 x 256 float32: 32 MiB per device).
MAX_MATMULS_PER_PROGRAM = 64


def _independent_matmuls(*operands: jax.Array, count: int) -> tuple[jax.Array, ...]:
    """``operands[2i] @ operands[2i + 1]`` for i < `count`: none reads another's result."""
    return tuple(operands[2 * i] @ operands[2 * i + 1] for i in range(count))


def measure_bandwidth(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None],
    in_place: bool = False,
) -> float:
    """Memory bandwidth per device: bytes read + written by ``x * 2 + 1`` per second.

    With `in_place`, `x` is donated and each call's result is the next call's input, so the
    program writes over its input, as a training step's optimizer update writes its
    donated state (`Cluster.inplace_bandwidth`); else every call writes a fresh buffer
    (`Cluster.hbm_bandwidth`, what a step's activations pay). On CPU the two differ: a
    fresh buffer's pages fault on first touch (2.27 against 8.4 GB/s on 8 virtual devices
    of a 2-core VM, cpu-per-core clock)."""
    mesh = Mesh(np.array(devices), (AXIS,))
    itemsize = jnp.dtype(jnp.float32).itemsize
    elements = options.bandwidth_bytes // itemsize
    fn = jax.shard_map(lambda x: x * 2 + 1, mesh=mesh, in_specs=PartitionSpec(AXIS),
                       out_specs=PartitionSpec(AXIS))
    x = _filled((len(devices) * elements,), jnp.float32, mesh)
    seconds = _median_seconds(fn, (x,), options, donate=in_place)
    bandwidth = 2 * elements * itemsize / seconds
    how = "in place (donated)" if in_place else "fresh output"
    log(f"memory bandwidth on {len(devices)} devices ({how}): {bandwidth / 1e9:.2f} GB/s "
        "per device")
    return bandwidth


# Blocks of compute in the programs of `measure_collective_latency`, and what each holds:
# light blocks, many of them, so that the collectives are a large part of the program and
# stand out of its noise (with 24 blocks of 4 matmuls of 128 x 128 the three runs of a
# group of 4 gave 1-64 us; with these, 110-134 us).
LATENCY_PROBE_BLOCKS = 64
LATENCY_PROBE_MATMULS = 2
LATENCY_PROBE_SIZE = 64


def measure_collective_latency(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> tuple[tuple[int, float], ...] | None:
    """What a small collective adds to a program whose next compute reads its result, by
    group size (`Cluster.collective_latency_by_group`); None for fewer than 2 devices.

    For each group size n of `options.device_counts` (all `devices` at once, in groups of
    n): a program of `LATENCY_PROBE_BLOCKS` blocks of compute (`LATENCY_PROBE_MATMULS`
    chained ``tanh(x @ w)`` on 64 x 64 per device), each followed by an all-reduce or
    an all-gather of 8 rows that the next block reads, against the same blocks without
    them: the difference per collective, the mean of the two kinds, at least 0. This is
    the collective as a step runs it, between its kernels, the devices' threads arriving
    at it together. On 8 virtual CPU devices of a 2-core AMD EPYC, three runs: 58-78 /
    110-134 / 181-216 us per collective in groups of 2 / 4 / 8, where the per-step
    latencies fitted on collectives timed alone (`measure_collectives`: 146 / 57 / 28 us)
    charged an all-reduce 292 / 342 / 389 us and an all-gather 146 / 171 / 195 us.
    """
    if len(devices) < 2:
        return None
    size, blocks = LATENCY_PROBE_SIZE, LATENCY_PROBE_BLOCKS
    w = jnp.full((size, size), 1e-3, jnp.float32)
    entries = []
    for n in _device_counts(options.device_counts, len(devices)):
        if len(devices) % n:
            continue
        mesh = Mesh(np.array(devices).reshape(len(devices) // n, n), (GROUPS, AXIS))
        spec = PartitionSpec((GROUPS, AXIS))
        x = _filled((len(devices) * size, size), jnp.float32, mesh)
        costs = []
        for kind in ("all_reduce", "all_gather"):
            seconds = []
            for between in (False, True):
                def body(x, between=between, kind=kind):
                    for _ in range(blocks):
                        for _ in range(LATENCY_PROBE_MATMULS):
                            x = jnp.tanh(x @ w)
                        if between:
                            part = (lax.psum(x[:8], AXIS) if kind == "all_reduce"
                                    else lax.all_gather(x[:8], AXIS, tiled=True))
                            x = x + part.sum() * 1e-3
                    return x

                fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                   check_vma=False)
                seconds.append(_median_seconds(fn, (x,), options))
            costs.append(max(0.0, (seconds[1] - seconds[0]) / blocks))
        entries.append((n, sum(costs) / len(costs)))
        log(f"collective between compute in groups of {n}: all-reduce "
            f"{costs[0] * 1e6:.0f} us, all-gather {costs[1] * 1e6:.0f} us")
    return tuple(entries) or None


# Inputs the loop of `measure_transpose` sums and writes transposed: a fused copy reads
# several (the residual stream's gradient in a GPT's backward sums about a dozen).
TRANSPOSE_PROBE_INPUTS = 8
TRANSPOSE_PROBE_COLUMNS = 128


def measure_transpose(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> tuple[tuple[float, float], ...] | None:
    """The rate of a transposing copy by the bytes its loop reads per device
    (`Cluster.transpose_bandwidth`), on all `devices` at once; None off CPU.

    For each size in `options.transpose_sizes`: `TRANSPOSE_PROBE_INPUTS` inputs of
    [rows, `TRANSPOSE_PROBE_COLUMNS`] float32 per device, together that many bytes, summed
    (each scaled) and written transposed, [columns, rows]: one loop fusion that reads its
    inputs in strides, as XLA:CPU's copies of dot operands do
    (`layout_copies`, `autopar.cost.backends`). The rate is (bytes read + written) /
    time. On 8 virtual devices of a 2-core AMD EPYC it fell from 1.8 GB/s per device at
    256 KiB to 0.75 GB/s at 8 MiB, where the same sum written as is moved 1.7-6 GB/s.
    """
    if not _on_cpu(devices) or not options.transpose_sizes:
        return None
    mesh = Mesh(np.array(devices), (AXIS,))
    k, columns = TRANSPOSE_PROBE_INPUTS, TRANSPOSE_PROBE_COLUMNS
    itemsize = jnp.dtype(jnp.float32).itemsize

    def transposed_sum(*xs):
        total = xs[0]
        for i, x in enumerate(xs[1:]):
            total = total + x * (i + 2)
        return total.T

    fn = jax.shard_map(transposed_sum, mesh=mesh, in_specs=(PartitionSpec(AXIS),) * k,
                       out_specs=PartitionSpec(None, AXIS))
    table = []
    for nbytes in options.transpose_sizes:
        rows = max(1, nbytes // (k * columns * itemsize))
        xs = tuple(_filled((len(devices) * rows, columns), jnp.float32, mesh)
                   for _ in range(k))
        read = k * rows * columns * itemsize
        seconds = _median_seconds(fn, xs, options)
        table.append((float(read), (read + read / k) / seconds))
        del xs
    log(f"transposing copy on {len(devices)} devices: "
        + ", ".join(f"{_size_str(size)} read {rate / 1e9:.2f} GB/s" for size, rate in table)
        + " per device")
    return tuple(table)


def measure_dispatch(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> float:
    """Seconds to launch one program on `devices` and see it finish: the median over
    `options.dispatch_repeats` calls of a trivial jitted program (``x + 1`` on one element
    per device), which costs nothing but its launch: `Cluster.dispatch_overhead` when
    the pipeline runtime's own cost per task cannot be measured (`autopar profile` takes
    that one, `autopar.app._task_overhead`, where it can)."""
    mesh = Mesh(np.array(devices), (AXIS,))
    fn = jax.jit(lambda x: x + 1)
    x = _filled((len(devices),), jnp.float32, mesh)
    repeats = dataclasses.replace(options, repeats=options.dispatch_repeats)
    seconds = _median_seconds(fn, (x,), repeats, num_devices=1)  # one host thread's work
    log(f"dispatch of a trivial program on {len(devices)} devices: {seconds * 1e6:.1f} us")
    return seconds


# Operands of the merged and chained programs of `measure_combined_latency`, and the bytes
# per device of each: small, so that each collective's time is its latency.
COMBINE_PROBE_OPERANDS = 16
COMBINE_PROBE_BYTES = 1 * KiB


def measure_combined_latency(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> float:
    """The share of a collective's latency that each operand of a merged one still pays
    (`Cluster.combined_operand_latency`).

    For all-reduce and all-gather over all `devices`, three programs of small collectives
    (`COMBINE_PROBE_BYTES` per device): one collective; k = `COMBINE_PROBE_OPERANDS`
    independent ones, which XLA's combiner may merge; k chained ones (each reads the last
    one's result), which it cannot. The share is what each extra independent collective
    costs over what each extra chained one costs, ``(merged - one) / (chained - one)``,
    clipped to [0, 1]; the figure is the mean over the two kinds. About 1 on XLA:CPU (its
    tuple all-reduce rendezvouses once per operand, its all-gathers are not merged).
    """
    mesh = Mesh(np.array(devices), (AXIS,))
    spec = PartitionSpec(AXIS)
    n, k = len(devices), COMBINE_PROBE_OPERANDS
    elements = max(n, COMBINE_PROBE_BYTES // jnp.dtype(COLLECTIVE_DTYPE).itemsize // n * n)
    shares = []
    for kind in ("all_reduce", "all_gather"):
        local_shape, collective = _collective_body(kind, elements, n)

        def merged(x, count, collective=collective):
            # Different inputs, so that XLA neither shares nor chains them.
            results = [collective(x + i) for i in range(count)]
            return sum(r.sum() for r in results) + x

        def chained(x, collective=collective, local=local_shape[0]):
            for _ in range(k):
                x = collective(x)[:local] + 1  # each reads the last one's result
            return x

        x = _filled((n * local_shape[0],), COLLECTIVE_DTYPE, mesh)
        times = [
            _median_seconds(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec,
                                          check_vma=False), (x,), options)
            for fn in (partial(merged, count=1), partial(merged, count=k), chained)
        ]
        one, many, chain = times
        share = (many - one) / (chain - one) if chain > one else 1.0
        shares.append(min(1.0, max(0.0, share)))
        log(f"combined {kind} over {n} devices: one {one * 1e6:.0f} us, {k} independent "
            f"{many * 1e6:.0f} us, {k} chained {chain * 1e6:.0f} us: each operand of a "
            f"merged one pays {shares[-1]:.2f} of a collective's latency")
    return round(sum(shares) / len(shares), 3)


def _collective_body(kind: CollectiveKind, elements: int, n: int):
    """The per-device input shape and shard_map body of `kind` over `elements` elements."""
    if kind == "all_reduce":
        return (elements,), partial(lax.psum, axis_name=AXIS)
    if kind == "all_gather":
        return (elements // n,), partial(lax.all_gather, axis_name=AXIS, tiled=True)
    if kind == "reduce_scatter":
        return (elements,), partial(lax.psum_scatter, axis_name=AXIS, tiled=True)
    if kind == "all_to_all":
        return (n, elements // n), partial(lax.all_to_all, axis_name=AXIS, split_axis=0,
                                           concat_axis=0, tiled=True)
    assert kind == "send_recv", f"no measurement for collective {kind!r}"
    ring = [(i, (i + 1) % n) for i in range(n)]
    return (elements,), partial(lax.ppermute, axis_name=AXIS, perm=ring)


def _filled(shape: tuple[int, ...], dtype, mesh: Mesh) -> jax.Array:
    """Ones of `shape`, split on the first dimension over all of `mesh`'s axes; made on
    the devices themselves."""
    sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()


def _median_seconds(
    fn: Callable, args: tuple, options: ProfileOptions, num_devices: int | None = None,
    donate: bool = False,
) -> float:
    """Compile `fn` once for `args`, warm up, and return the median time of the repeats,
    by `options.clock`; with ``"cpu-per-core"``, CPU seconds over ``min(cores, num_devices)``
    (`num_devices` None: the devices of the first argument's sharding). With `donate`,
    `fn` takes one argument, donated, and each call's result is the next call's argument."""
    if num_devices is None:
        num_devices = len(args[0].sharding.device_set)
    compiled = jax.jit(fn, donate_argnums=(0,) if donate else ()).lower(*args).compile()
    if donate:
        state = [jnp.copy(args[0])]  # the caller's array stays valid

        def call():
            state[0] = compiled(state[0])
            return state[0]
    else:
        def call():
            return compiled(*args)
    for _ in range(options.warmup):
        jax.block_until_ready(call())
    if options.clock == "wall":
        clock, parallelism = time.perf_counter, 1
    else:
        clock, parallelism = time.process_time, max(1, min(usable_cores(), num_devices))
    times = []
    for _ in range(options.repeats):
        start = clock()
        jax.block_until_ready(call())
        times.append((clock() - start) / parallelism)
    return statistics.median(times)


def _shared_cores(devices: Sequence) -> int | None:
    """`Cluster.host_cores`: on CPU, the cores this process's device threads share when
    they outnumber them; else None (every accelerator computes on its own)."""
    cores = usable_cores()
    return cores if _on_cpu(devices) and cores < len(devices) else None


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _device_counts(
    counts: tuple[int, ...] | DeviceCountPolicy, num_devices: int
) -> tuple[int, ...]:
    if counts == "two_and_all":
        return tuple(sorted({2, num_devices}))
    if counts == "powers_of_two":
        powers = [2**k for k in range(1, int(math.log2(num_devices)) + 1)]
        return tuple(sorted(set(powers) | {num_devices}))
    return tuple(counts)


def _device_memory(devices: Sequence) -> float:
    """Bytes per device: the runtime's limit, else physical memory shared by the devices."""
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(physical // len(devices))


def _on_cpu(devices: Sequence) -> bool:
    """Whether `devices` are CPU devices (XLA:CPU's virtual devices), not accelerators."""
    return devices[0].platform == "cpu"


def _accelerator_figures(devices: Sequence, options: ProfileOptions,
                         log: Callable[[str], None]) -> dict:
    """The one-device measurements of `autopar.profile._accelerator`: the profile's
    `kernel_overhead` and, under ``"measured"``, the raw tables."""
    from autopar.profile import _accelerator as probes

    floor = probes.measure_kernel_floor(devices, options, log)
    return {
        "kernel_overhead": round(min(floor.values()), 9),
        "measured": {
            "kernel_floor": floor,
            "bandwidth_by_size": probes.measure_bandwidth_by_size(devices, options, log),
            "fused_throughput": probes.measure_fused_throughput(devices, options, log),
        },
    }


def _cpu_figures(devices: Sequence, options: ProfileOptions,
                 log: Callable[[str], None]) -> dict:
    """On CPU devices, the profile's `kernel_overhead`: XLA:CPU's cost per kernel of a
    step-sized program, every device at once (`autopar.profile._kernel_cpu`)."""
    from autopar.profile._kernel_cpu import measure_cpu_kernel_overhead

    if len(devices) < 2:
        return {}
    return {"kernel_overhead": round(measure_cpu_kernel_overhead(devices, options, log), 9)}


def _from_process_zero(data: dict) -> dict:
    """`data` as process 0 has it, on every process (a JSON round trip)."""
    if jax.process_count() == 1:
        return json.loads(json.dumps(data))
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(data).encode(), dtype=np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(payload.size)))
    buffer = payload if jax.process_index() == 0 else np.zeros(size, np.uint8)
    buffer = multihost_utils.broadcast_one_to_all(buffer)
    return json.loads(np.asarray(buffer, dtype=np.uint8).tobytes().decode())


def _size_str(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / KiB:g} KiB"


def _log_to_stderr(line: str) -> None:
    print(f"[autopar profile] {line}", file=sys.stderr, flush=True)
