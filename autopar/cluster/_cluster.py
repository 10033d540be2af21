"""Clusters as plain data: hosts × devices, memory, peak FLOP/s and per-level links.

A `Cluster` comes from a cost profile (a JSON file, schema in ``cost_profiles/README.md``),
from the local devices (`Cluster.local`), or is built by hand. It holds no JAX objects, so
planning for a virtual cluster needs no devices. Finding and reading profiles is
`autopar.cluster._profiles`, which the loading methods call.

Device ids: device ``host * devices_per_host + local_index``; `local_devices` lists the JAX
devices of this machine (or of all processes under ``jax.distributed``) in that order.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The collective kinds a profile may name (`collective_bandwidth_by_kind`): the cost model's
# `autopar.cost.COLLECTIVE_KINDS`, which sits above this module (tests/test_cost_fidelity.py
# checks that the two agree).
COLLECTIVE_KIND_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# JSON keys a profile may carry besides the `Cluster` fields: free text, per-field sources,
# and the raw data of a measured profile. They are documentation; loading ignores them.
INFORMATIONAL_KEYS = ("note", "sources", "measured")


@dataclass(frozen=True)
class Link:
    """One level of the interconnect in the alpha-beta model.

    **Arguments:**
    - `bandwidth`: bytes/s per device in one direction, with every device of the level
      communicating at once (the SPMD case).
    - `latency`: seconds per message step (alpha).
    """

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"Link.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"Link.latency must be >= 0 seconds, got {self.latency!r}")

    def to_json(self) -> dict:
        return {"bandwidth": self.bandwidth, "latency": self.latency}


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: `num_hosts` hosts of `devices_per_host` devices each.

    **Arguments:**
    - `name`: the profile name, e.g. ``"dgx-a100-80g"``.
    - `num_hosts`, `devices_per_host`: the shape; device ids run host-major.
    - `device_kind`: as JAX reports it, e.g. ``"NVIDIA A100-SXM4-80GB"`` or ``"cpu"``.
    - `device_memory`: bytes of memory per device.
    - `peak_flops`: FLOP/s per device by dtype name (``"float32"`` is required).
    - `matmul_efficiency`: the fraction of peak a large matmul achieves, in (0, 1].
    - `hbm_bandwidth`: device memory bandwidth in bytes/s.
    - `intra_host`, `inter_host`: the `Link` inside a host and between hosts. With
      `nics_per_host` set, `inter_host.bandwidth` is one NIC's (one rail's); without it,
      each device's share of the network with every device communicating at once.
    - `gemm_efficiency`: optional ``((size, fraction of peak), ...)`` by increasing size,
      where size is the geometric mean ``(M·N·K)**(1/3)`` of a GEMM per device; the cost
      model interpolates it in log(size) (`autopar.cost.gemm_efficiency`). None: every
      matmul runs at `matmul_efficiency`.
    - `nics_per_host`: network ports (rails) per host, e.g. 8 on a DGX A100 or H100 (one
      per GPU); None for a profile without rail information. See `autopar.cost.network_link`.
    - `overlap`: the fraction of a hideable collective (data-parallel gradient reduction
      during the backward, ZeRO-3 parameter gathers, pipeline sends) the runtime runs
      concurrently with compute, in [0, 1]; 0 (the default): every collective in series.
      See `autopar.cost.exposed_time`.
    - `fused_attention`: the runtime runs attention as one fused kernel (FlashAttention,
      cuDNN's fused attention on Hopper): the sequence x sequence scores, probabilities
      and their gradients stay on chip, so no bytes of them cross device memory
      (`autopar.graph.fusion_traffic`). False (the default): they are written and read
      like any fusion's results.
    - `dispatch_overhead`: seconds the host spends launching one program (one pipeline
      task: a stage's forward or backward of one microbatch, its update), whatever its
      size; `autopar profile` runs a small two-stage pipeline through the runtime and
      takes its host thread time per task (`autopar.app._task_overhead`; a trivial
      jitted call alone, the figure it took before, costs a fraction of that).
      `autopar.cost.stage_dispatch_time` charges it per task. 0 (the default): free.
    - `task_device_overhead`: CPU seconds each device's thread spends per task besides the
      task's work (XLA:CPU's launch on the device thread, its buffers' allocation and
      release, the thread pool's search for more work once the task is done): measured by
      the same pipeline probe, the process's CPU per task less the host thread's and the
      tasks' predicted work, per device. On devices that share a host's cores
      (`host_cores`) it is work on those cores: `autopar.cost.pipelined_step_time` adds
      it to the host's work. 0 (the default; GPU profiles): free.
    - `intra_host_by_group`: optional ``((group size, Link), ...)``: the intra-host link
      fitted per group size from collectives timed with every device of the host busy,
      in devices_per_host / size groups running at once (as a sharded step runs them;
      `autopar profile` measures it). `autopar.cost.intra_link` picks the entry for a group; None:
      `intra_host` for every group size.
    - `inplace_bandwidth`: optional device memory bandwidth in bytes/s of elementwise work
      that writes its results over its donated inputs (a training step's optimizer update
      of its parameters and state); `autopar profile` times ``x * 2 + 1`` on a donated
      buffer. None: `hbm_bandwidth` (the rate with a fresh output buffer). On CPU a fresh
      buffer pays first-touch page faults, so the two differ (2.27 against 8.4 GB/s on the
      2-core VM of `cpu-local-measured`). See `autopar.cost.write_bandwidth`.
    - `combined_operand_latency`: the share of its own latency that each operand of a
      combined collective still pays, in [0, 1]. 0 (the default): XLA's combiner merges
      independent collectives of a kind into one that pays the latency once (XLA:GPU
      issues the merged operands as one NCCL group). 1: every operand pays a collective's
      latency, as XLA:CPU's in-process collectives do (a tuple all-reduce rendezvouses
      once per operand, and its all-gathers are not merged: a 32-operand all-reduce over
      8 CPU devices took 236 us more per operand than a one-operand one). `autopar
      profile` measures it (`measure_combined_latency`); see
      `autopar.cost.combined_collective_time`.
    - `transpose_bandwidth`: optional ``((bytes read per device, bytes/s), ...)`` by
      increasing size: the rate (bytes read plus written per second per device, every
      device of the host at once) of a loop that reads its inputs in another memory order
      than it writes (a transposing copy). XLA:CPU makes such copies of the operands its
      matmul kernels take in another order (`autopar.cost.backends`, XLA:CPU's
      `layout_copies`), and they slow down as their strided reads outgrow the caches;
      `autopar profile` measures them on CPU (`measure_transpose`). None: layout copies
      cost nothing extra (and XLA:GPU makes none). See XLA:CPU's `layout_copy_time`.
    - `collective_latency_by_group`: optional ``((group size, seconds), ...)``: what one
      collective over a group of that many devices of a host adds to a program whose next
      kernel reads its result, whatever its kind, every group of the host at once
      (`autopar profile` measures it between blocks of compute,
      `measure_collective_latency`). With it a collective inside a host pays this latency
      in place of its ring steps times the link's latency (XLA:CPU's in-process
      collectives meet once per collective; see `collective_latency`). None: ring steps.

    - `host_cores`: optional number of CPU cores all devices of a host share (XLA:CPU's
      virtual devices run one thread each on the process's cores); the per-device figures
      of such a profile are each device's share with every device of the host busy, and a
      pipeline's devices that run while others idle go faster
      (`autopar.cost._schedule.simulate_shared`, through XLA:CPU's backend). `autopar
      profile` sets it on CPU when the devices outnumber the cores. None: every device
      computes on its own (GPUs).
    - `gemm_shapes`: optional ``((M, N, K, fraction of peak), ...)``: GEMMs timed by shape
      per device (batch dimensions counted in M), every combination of a few sizes of each
      (a full grid; `autopar profile` measures it, `measure_gemm_shapes`). The cost model
      interpolates it in log(M), log(N), log(K) for a dot of known shape
      (`autopar.cost.gemm_efficiency`), in place of `gemm_efficiency`, which still prices
      GEMMs of unknown shape (convolutions). None: `gemm_efficiency` for every GEMM.
    - `collective_bandwidth_by_kind`: optional ``((kind, factor), ...)``: each collective
      kind's bandwidth inside a host relative to the intra-host link, the alpha-beta fit of
      that kind's samples alone over the fit of all kinds (`autopar profile` fits both from
      the same collectives). XLA:CPU's all-to-all moves a byte 3-4 times slower than its
      all-reduce (`cpu-local-measured`: 0.275 against 1.13). `autopar.cost.intra_link` applies it.
      None: every kind at the link's bandwidth.
    - `kernel_overhead`: seconds each kernel of a program costs besides its work: its
      launch and the gap before the next one, what a chain of tiny dependent kernels takes
      per kernel (`autopar profile` measures it on accelerators,
      `autopar.profile._accelerator.measure_kernel_floor`, and on CPU in a program of a
      small step's size, every device busy, `autopar.profile._kernel_cpu`: XLA:CPU's
      thunks cost 12-17 us each there on the 2-core VM). The cost model adds it once
      per kernel, the kernels being the groups `autopar.graph.kernel_roots` makes of a
      program's operators by its fusion model. 0 (the default): kernels cost only their
      work.
    - `token_imbalance`: the busiest device's routed MoE tokens over the mean, >= 1: what
      the expert-parallel all-to-alls, grouped GEMMs and routed-token buffers are scaled
      by (`autopar.cost.ep_region_exchange_bytes`, `ep_grouped_gemm_time`,
      `ep_buffer_bytes`). 1.0 (the default, `autopar.cost.DEFAULT_TOKEN_IMBALANCE`): the
      balanced routing that auxiliary-loss and bias balancing drive toward; set the
      max/mean load you measure, or e.g. 1.25, the skew a capacity factor of 1.25
      provisions (Switch Transformer, Fedus et al. 2022).

    **Example:**
    ```python
    cluster = Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    cluster.num_devices        # 16
    cluster.host_of(9)         # 1
    ```
    """

    name: str
    num_hosts: int
    devices_per_host: int
    device_kind: str
    device_memory: float
    peak_flops: Mapping[str, float]
    matmul_efficiency: float
    hbm_bandwidth: float
    intra_host: Link
    inter_host: Link
    nics_per_host: int | None = None
    gemm_efficiency: tuple[tuple[float, float], ...] | None = None
    overlap: float = 0.0
    fused_attention: bool = False
    dispatch_overhead: float = 0.0
    task_device_overhead: float = 0.0
    intra_host_by_group: tuple[tuple[int, Link], ...] | None = None
    inplace_bandwidth: float | None = None
    combined_operand_latency: float = 0.0
    transpose_bandwidth: tuple[tuple[float, float], ...] | None = None
    collective_latency_by_group: tuple[tuple[int, float], ...] | None = None
    host_cores: int | None = None
    kernel_overhead: float = 0.0
    gemm_shapes: tuple[tuple[float, float, float, float], ...] | None = None
    collective_bandwidth_by_kind: tuple[tuple[str, float], ...] | None = None
    token_imbalance: float = 1.0  # autopar.cost.DEFAULT_TOKEN_IMBALANCE

    def __post_init__(self):
        # A private copy, so that the frozen cluster cannot change through the caller's dict.
        object.__setattr__(self, "peak_flops", dict(sorted(self.peak_flops.items())))
        if self.intra_host_by_group is not None:
            by_group = tuple(sorted(((int(n), link) for n, link in self.intra_host_by_group),
                                     key=lambda entry: entry[0]))
            object.__setattr__(self, "intra_host_by_group", by_group)
        if self.gemm_efficiency is not None:
            table = tuple((float(size), float(eff)) for size, eff in self.gemm_efficiency)
            object.__setattr__(self, "gemm_efficiency", table)
        if self.collective_latency_by_group is not None:
            table = tuple(sorted((int(n), float(t)) for n, t in self.collective_latency_by_group))
            object.__setattr__(self, "collective_latency_by_group", table)
        if self.transpose_bandwidth is not None:
            table = tuple((float(size), float(rate)) for size, rate in self.transpose_bandwidth)
            object.__setattr__(self, "transpose_bandwidth", table)
        if self.gemm_shapes is not None:
            table = tuple(sorted(tuple(float(x) for x in row) for row in self.gemm_shapes))
            object.__setattr__(self, "gemm_shapes", table)
        if self.collective_bandwidth_by_kind is not None:
            scales = dict(self.collective_bandwidth_by_kind)
            table = tuple(sorted((str(kind), float(scale)) for kind, scale in scales.items()))
            object.__setattr__(self, "collective_bandwidth_by_kind", table)
        _check_cluster(self)

    def __hash__(self) -> int:
        values = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return hash(tuple(tuple(v.items()) if isinstance(v, dict) else v for v in values))

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def host_of(self, device_id: int) -> int:
        """The host of cluster device `device_id`."""
        if not 0 <= device_id < self.num_devices:
            raise ValueError(
                f"device id {device_id} is not in cluster {self.name!r}, which has devices "
                f"0..{self.num_devices - 1} ({self.num_hosts} hosts × {self.devices_per_host})"
            )
        return device_id // self.devices_per_host

    def devices_of_host(self, host: int) -> tuple[int, ...]:
        """The device ids of host `host`."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(
                f"host {host} is not in cluster {self.name!r}, which has hosts "
                f"0..{self.num_hosts - 1}"
            )
        first = host * self.devices_per_host
        return tuple(range(first, first + self.devices_per_host))

    def with_shape(self, num_hosts: int, devices_per_host: int) -> Cluster:
        """The same hardware with another number of hosts and devices per host."""
        return dataclasses.replace(self, num_hosts=num_hosts, devices_per_host=devices_per_host)

    def to_json(self) -> dict:
        """A JSON-ready dict in the profile schema (``cost_profiles/README.md``)."""
        optional = {} if self.nics_per_host is None else {"nics_per_host": self.nics_per_host}
        if self.gemm_efficiency is not None:
            optional["gemm_efficiency"] = [list(point) for point in self.gemm_efficiency]
        if self.overlap:
            optional["overlap"] = self.overlap
        if self.fused_attention:
            optional["fused_attention"] = True
        if self.dispatch_overhead:
            optional["dispatch_overhead"] = self.dispatch_overhead
        if self.task_device_overhead:
            optional["task_device_overhead"] = self.task_device_overhead
        if self.inplace_bandwidth is not None:
            optional["inplace_bandwidth"] = self.inplace_bandwidth
        if self.combined_operand_latency:
            optional["combined_operand_latency"] = self.combined_operand_latency
        if self.host_cores is not None:
            optional["host_cores"] = self.host_cores
        if self.kernel_overhead:
            optional["kernel_overhead"] = self.kernel_overhead
        if self.gemm_shapes is not None:
            optional["gemm_shapes"] = [list(row) for row in self.gemm_shapes]
        if self.collective_bandwidth_by_kind is not None:
            optional["collective_bandwidth_by_kind"] = dict(self.collective_bandwidth_by_kind)
        if self.token_imbalance != 1.0:
            optional["token_imbalance"] = self.token_imbalance
        if self.collective_latency_by_group is not None:
            optional["collective_latency_by_group"] = {
                str(n): t for n, t in self.collective_latency_by_group
            }
        if self.transpose_bandwidth is not None:
            optional["transpose_bandwidth"] = [list(point) for point in self.transpose_bandwidth]
        if self.intra_host_by_group is not None:
            optional["intra_host_by_group"] = {
                str(n): link.to_json() for n, link in self.intra_host_by_group
            }
        return {
            "name": self.name,
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "device_kind": self.device_kind,
            "device_memory": self.device_memory,
            "peak_flops": dict(self.peak_flops),
            "matmul_efficiency": self.matmul_efficiency,
            "hbm_bandwidth": self.hbm_bandwidth,
            "intra_host": self.intra_host.to_json(),
            "inter_host": self.inter_host.to_json(),
            **optional,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any], source: str = "<dict>") -> Cluster:
        """Parse a profile dict; `source` names it in error messages."""
        from autopar.cluster._profiles import parse_profile

        return parse_profile(data, source)

    def save(self, path: str | os.PathLike, **informational: Any) -> None:
        """Write the profile JSON; `informational` adds keys such as ``note`` or ``sources``."""
        unknown = set(informational) - set(INFORMATIONAL_KEYS)
        assert not unknown, f"informational keys must be among {INFORMATIONAL_KEYS}: {unknown}"
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({**self.to_json(), **informational}, indent=2) + "\n")
        os.replace(partial, path)  # atomic: processes sharing a folder never see half a file

    @staticmethod
    def from_profile(
        name_or_path: str | os.PathLike,
        num_hosts: int | None = None,
        devices_per_host: int | None = None,
    ) -> Cluster:
        """Load a cost profile by name (see `available_profiles`) or from a JSON file path.

        **Arguments:**
        - `name_or_path`: ``"dgx-a100-80g"``, ``"dgx-h100"``, ``"p3.16xlarge-v100"``,
          ``"cpu-local"``, or a path to a profile JSON (e.g. one `autopar profile` wrote).
        - `num_hosts`, `devices_per_host`: override the profile's default shape.

        **Returns:** the `Cluster`.
        """
        from autopar.cluster._profiles import load_profile

        cluster = load_profile(name_or_path)
        return cluster.with_shape(
            num_hosts if num_hosts is not None else cluster.num_hosts,
            devices_per_host if devices_per_host is not None else cluster.devices_per_host,
        )

    @staticmethod
    def local() -> Cluster:
        """The cluster of the JAX devices this process sees.

        Hosts are JAX processes (`process_index`), so this also works under
        ``jax.distributed``. The figures come from the measured profile at ``$AUTOPAR_PROFILE``
        or ``~/.cache/autopar/local-profile.json`` (written by ``autopar profile``) if it was
        measured on the same kind of device, else from a built-in profile for the device kind
        (``cpu-local`` for unknown kinds). Shape and kind always come from the real devices.
        """
        devices = local_devices()
        per_host = Counter(d.process_index for d in devices)
        if len(set(per_host.values())) != 1:
            raise ValueError(
                f"processes own different numbers of devices {dict(per_host)}; autopar needs "
                "the same number of devices on every host. Start every process with the "
                "same devices visible."
            )
        kind = devices[0].device_kind
        from autopar.cluster._profiles import local_base_profile

        base = local_base_profile(kind)
        # memory_stats only answers for this process's own devices
        own = [d for d in devices if d.process_index == devices[0].client.process_index()]
        stats = (own or devices)[0].memory_stats() or {}
        return dataclasses.replace(
            base,
            name=f"local ({base.name})",
            num_hosts=len(per_host),
            devices_per_host=next(iter(per_host.values())),
            device_kind=kind,
            device_memory=stats.get("bytes_limit", base.device_memory),
        )


def local_devices() -> list:
    """All JAX devices in cluster device id order: by process (host), then device id."""
    import jax

    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def _kind_scale_problems(table) -> list[str]:
    """What is wrong with `collective_bandwidth_by_kind`: an unknown kind, or a factor
    that is not a finite number > 0."""
    if table is None:
        return []
    problems = []
    unknown = [kind for kind, _ in table if kind not in COLLECTIVE_KIND_NAMES]
    if unknown:
        problems.append(f"collective_bandwidth_by_kind has unknown kind(s) {unknown}; the "
                        f"kinds are {list(COLLECTIVE_KIND_NAMES)}")
    if not all(np.isfinite(scale) and scale > 0 for _, scale in table):
        problems.append(f"collective_bandwidth_by_kind factors must be finite and > 0, got "
                        f"{dict(table)}")
    return problems


def _gemm_shape_problems(table) -> list[str]:
    """What is wrong with a `gemm_shapes` table: not a full grid of positive sizes, or a
    fraction outside (0, 1]."""
    if table is None:
        return []
    if not table:
        return ["gemm_shapes must hold at least one row (or be left out)"]
    problems = []
    axes = [sorted({row[i] for row in table}) for i in range(3)]
    if any(a[0] <= 0 for a in axes):
        problems.append(f"gemm_shapes sizes must be > 0, got M {axes[0]}, N {axes[1]}, "
                        f"K {axes[2]}")
    if len({row[:3] for row in table}) != len(table) or \
            len(table) != len(axes[0]) * len(axes[1]) * len(axes[2]):
        problems.append(
            f"gemm_shapes must hold every combination of its sizes once (M {axes[0]}, "
            f"N {axes[1]}, K {axes[2]}: {len(axes[0]) * len(axes[1]) * len(axes[2])} rows), "
            f"got {len(table)} rows")
    if not all(0 < row[3] <= 1 for row in table):
        problems.append("gemm_shapes fractions must be in (0, 1]")
    return problems


def _compute_problems(cluster: Cluster) -> list[str]:
    """Sizes, FLOP/s, memory and bandwidths, the GEMM efficiency table."""
    problems = []
    for name in ("num_hosts", "devices_per_host"):
        value = getattr(cluster, name)
        if not isinstance(value, (int, np.integer)) or value < 1:
            problems.append(f"{name} must be an integer >= 1, got {value!r}")
    if "float32" not in cluster.peak_flops:
        problems.append(f"peak_flops must list 'float32', got {sorted(cluster.peak_flops)}")
    if not all(v > 0 for v in cluster.peak_flops.values()):
        problems.append(f"peak_flops must be > 0, got {dict(cluster.peak_flops)}")
    if not 0 < cluster.matmul_efficiency <= 1:
        problems.append(f"matmul_efficiency must be in (0, 1], got {cluster.matmul_efficiency}")
    for name in ("device_memory", "hbm_bandwidth"):
        if not getattr(cluster, name) > 0:
            problems.append(f"{name} must be > 0, got {getattr(cluster, name)!r}")
    inplace = cluster.inplace_bandwidth
    if inplace is not None and not (np.isfinite(inplace) and inplace > 0):
        problems.append(f"inplace_bandwidth must be a finite number > 0 or None, got {inplace!r}")
    table = cluster.gemm_efficiency
    if table is not None:
        sizes = [size for size, _ in table]
        if not table or sizes != sorted(set(sizes)) or sizes[0] <= 0:
            problems.append(f"gemm_efficiency sizes must be > 0 and increasing, got {sizes}")
        if not all(0 < eff <= 1 for _, eff in table):
            problems.append(f"gemm_efficiency fractions must be in (0, 1], got {table}")
    return problems


def _measured_table_problems(cluster: Cluster) -> list[str]:
    """`host_cores` and the measured tables of latency by group and transposing copies."""
    problems = []
    cores = cluster.host_cores
    if cores is not None and (not isinstance(cores, (int, np.integer)) or cores < 1):
        problems.append(f"host_cores must be an integer >= 1 or None, got {cores!r}")
    latency = cluster.collective_latency_by_group
    if latency is not None:
        sizes = [n for n, _ in latency]
        if not latency or sizes[0] < 2 or len(set(sizes)) != len(sizes):
            problems.append(
                f"collective_latency_by_group needs distinct group sizes >= 2, got {sizes}")
        if not all(np.isfinite(t) and t >= 0 for _, t in latency):
            problems.append(
                f"collective_latency_by_group seconds must be finite and >= 0, got {latency}")
    table = cluster.transpose_bandwidth
    if table is not None:
        sizes = [size for size, _ in table]
        if not table or sizes != sorted(set(sizes)) or sizes[0] <= 0:
            problems.append(f"transpose_bandwidth sizes must be > 0 and increasing, got {sizes}")
        if not all(np.isfinite(rate) and rate > 0 for _, rate in table):
            problems.append(f"transpose_bandwidth rates must be finite and > 0, got {table}")
    return problems


def _overhead_problems(cluster: Cluster) -> list[str]:
    """Per-task and per-kernel seconds, overlap and the merged collectives' latency share."""
    problems = []
    if not (np.isfinite(cluster.dispatch_overhead) and cluster.dispatch_overhead >= 0):
        problems.append(
            f"dispatch_overhead must be a finite number of seconds >= 0, got "
            f"{cluster.dispatch_overhead!r}"
        )
    if not (np.isfinite(cluster.task_device_overhead) and cluster.task_device_overhead >= 0):
        problems.append(
            f"task_device_overhead must be a finite number of seconds >= 0, got "
            f"{cluster.task_device_overhead!r}"
        )
    if not (np.isfinite(cluster.kernel_overhead) and cluster.kernel_overhead >= 0):
        problems.append(
            f"kernel_overhead must be a finite number of seconds >= 0, got "
            f"{cluster.kernel_overhead!r}"
        )
    if not 0 <= cluster.overlap <= 1:
        problems.append(f"overlap must be in [0, 1], got {cluster.overlap!r}")
    if not (np.isfinite(cluster.token_imbalance) and cluster.token_imbalance >= 1):
        problems.append(
            f"token_imbalance must be a finite number >= 1 (the busiest device's routed "
            f"tokens over the mean), got {cluster.token_imbalance!r}"
        )
    if not 0 <= cluster.combined_operand_latency <= 1:
        problems.append(
            f"combined_operand_latency must be in [0, 1], got {cluster.combined_operand_latency!r}"
        )
    return problems


def _link_problems(cluster: Cluster) -> list[str]:
    """NICs, the links within and across hosts, and the links by group size."""
    problems = []
    nics = cluster.nics_per_host
    if nics is not None and (not isinstance(nics, (int, np.integer)) or nics < 1):
        problems.append(f"nics_per_host must be an integer >= 1 or None, got {nics!r}")
    for name in ("intra_host", "inter_host"):
        if not isinstance(getattr(cluster, name), Link):
            problems.append(f"{name} must be a Link, got {getattr(cluster, name)!r}")
    by_group = cluster.intra_host_by_group
    if by_group is not None:
        sizes = [n for n, _ in by_group]
        if not by_group or sizes[0] < 2 or len(set(sizes)) != len(sizes):
            problems.append(f"intra_host_by_group needs distinct group sizes >= 2, got {sizes}")
        if not all(isinstance(link, Link) for _, link in by_group):
            problems.append(f"intra_host_by_group values must be Links, got {by_group!r}")
    return problems


def _check_cluster(cluster: Cluster) -> None:
    """Raise a ValueError naming every field of `cluster` out of its range."""
    problems = (_compute_problems(cluster) + _gemm_shape_problems(cluster.gemm_shapes)
                + _kind_scale_problems(cluster.collective_bandwidth_by_kind)
                + _measured_table_problems(cluster) + _overhead_problems(cluster)
                + _link_problems(cluster))
    if problems:
        raise ValueError(f"invalid cluster {cluster.name!r}: " + "; ".join(problems))
