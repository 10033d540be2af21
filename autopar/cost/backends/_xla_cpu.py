"""XLA:CPU: the costs its runtime adds, each charged where the profile measured it.

- Layout copies (`layout_copies`, `_xla_cpu_layout`): its GEMM kernels take each operand
  in one memory order, and a copy into that order reads in strides, at the profile's
  `transpose_bandwidth` (`layout_copy_time`).
- Returned gradients (`returned_gradient_time`): a pipelined backward's weight gradients
  are written transposed, and copied to row-major as the program returns them.
- Shared cores (`host_cores`): the virtual devices' threads share the process's cores, so
  a pipeline runs with processor sharing (`autopar.cost._schedule.simulate_shared`), its
  tasks' launches on the same cores (`host_work_per_step`, `task_device_overhead`).
- Collectives inside a program (`collective_latency_by_group`) rendezvous once per
  collective, and a merged collective still pays per operand (`combined_operand_latency`).
- No collective beside compute (`collective_concurrency`, 0): a collective runs on the
  device's own thread, synchronously (its rendezvous and copies block that device's
  program), so a chunked expert exchange runs its chunks one after the other.
- Scanned layers (`scan_slice_copies`): a `scan`'s while loop slices every stacked operand
  (`xs`: the layers' weights forward, the stacked residuals and weights backward) with a
  ``dynamic-slice`` that XLA:CPU materialises before the body's kernels read it, each
  iteration, where the unrolled twin reads the weights in place (`scan_slice_time`,
  priced as a straight copy whenever the profile prices layout copies).

A profile without a field (``cpu-local``) charges nothing for that behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.choices import Schedule
from autopar.cluster import Cluster
from autopar.cost._links import group_collective_latency
from autopar.cost._schedule import simulate_shared, tasks_per_step
from autopar.cost.backends._base import Backend, LayoutCopy, cluster_field
from autopar.cost.backends._xla_cpu_layout import layout_copies

SCAN_SLICE = "scan_slice"  # `autopar.intra._scan`'s marker (cost/ imports nothing of intra/)


def transpose_bandwidth(cluster, bytes_read: float) -> float:
    """Bytes per second per device (read plus written) of a transposing copy whose loop
    reads `bytes_read` bytes per device: the profile's `transpose_bandwidth` table
    interpolated linearly in log(bytes) and held constant beyond its ends; without a
    table, `hbm_bandwidth`.

    **Example:** on `cpu-local-measured`, about 1.1 GB/s at 1 MiB read per device against
    its 2.4 GB/s for a straight elementwise loop.
    """
    table = cluster.transpose_bandwidth
    if not table or bytes_read <= 0:
        return cluster.hbm_bandwidth
    sizes = np.log([size for size, _ in table])
    return float(np.interp(np.log(bytes_read), sizes, [rate for _, rate in table]))


def layout_copy_time(nbytes: float, cluster, fan_in: float = 1.0,
                     fused: bool = False) -> float:
    """Seconds a layout copy adds (`layout_copies`): a loop writes the `nbytes` per device
    of an operand in another memory order, reading ``fan_in · nbytes`` in strides.

    It moves ``(fan_in + 1) · nbytes`` at `transpose_bandwidth` for what it reads. A copy
    running inside the elementwise fusion that makes the operand (`fused`) replaces that
    fusion's straight loop, whose bytes the roofline already charges at `hbm_bandwidth`:
    only the difference is added. 0 on a profile without `transpose_bandwidth`.

    **Example:** a 1 MiB operand copied alone on a profile moving 1 GB/s transposed:
    ``2 MiB / 1e9`` s ≈ 2.1 ms.
    """
    if nbytes < 0 or fan_in < 1:
        raise ValueError(
            f"layout_copy_time needs nbytes >= 0 and fan_in >= 1, got {nbytes} and {fan_in}"
        )
    if cluster.transpose_bandwidth is None or nbytes == 0:
        return 0.0
    moved = (fan_in + 1.0) * nbytes
    seconds = moved / transpose_bandwidth(cluster, fan_in * nbytes)
    if fused:
        seconds -= moved / cluster.hbm_bandwidth
    return max(0.0, seconds)


def scan_slice_copies(node) -> tuple[LayoutCopy, ...]:
    """The copy XLA:CPU makes of a scan's stacked operand, slice by slice (module
    docstring): one straight copy of operand 0 of an opened scan's ``scan_slice`` marker
    (`autopar.intra._scan`), whose bytes per device are the whole stack's, so the copy
    prices every iteration's slice once. () for any other node; a carry or a loop
    invariant (``scan_enter``) is read in place, and the body writes its stacked results
    (``scan_stack``) in place with ``dynamic-update-slice``."""
    if node.primitive != SCAN_SLICE:
        return ()
    return (LayoutCopy(0, strided=False),)


def scan_slice_time(nbytes: float, cluster) -> float:
    """Seconds a scan's ``dynamic-slice`` copies of a stacked operand of `nbytes` per
    device (all its iterations) take: read once and written once at `hbm_bandwidth`,
    ``2 · nbytes / hbm_bandwidth``.

    **Example:** 4 layers of a 1 MiB weight stacked (4 MiB per device) at 2.4 GB/s:
    ``8 MiB / 2.4e9`` s ≈ 3.5 ms per pass over the stack.
    """
    if nbytes < 0:
        raise ValueError(f"scan_slice_time needs nbytes >= 0, got {nbytes}")
    return 2.0 * nbytes / cluster.hbm_bandwidth


def returned_gradient_time(nbytes: float, cluster) -> float:
    """Seconds a pipeline's backward task pays, per microbatch, to return the `nbytes`
    per device of weight gradients (its running sums) on XLA:CPU (a profile with
    `transpose_bandwidth`): its dots compute each weight gradient transposed (``A.T @ B``
    as ``(B.T @ A).T``, which one program hands its optimizer update as it is), and a
    program's result must be row-major, so every one passes a transposing fusion and a
    copy (``bitcast_transpose_fusion`` and ``wrapped_copy`` after each ``ynn_fusion`` in
    the backward HLO of the local GPT's pipelined stages): `layout_copy_time` plus
    ``2 · nbytes`` at `hbm_bandwidth`. 0 on other profiles (cuBLAS writes either order).
    `cluster` may be a `Cluster` or its JSON.
    """
    if cluster_field(cluster, "transpose_bandwidth") is None or nbytes <= 0:
        return 0.0
    if isinstance(cluster, dict):
        cluster = Cluster.from_json(cluster)
    return layout_copy_time(nbytes, cluster) + 2 * nbytes / cluster.hbm_bandwidth


def host_work_per_step(cluster, group_devices: Sequence[int], num_microbatches: int,
                       schedule: Schedule = "1f1b") -> float:
    """CPU seconds per step a pipeline's tasks cost besides their work, on a host whose
    devices share its cores: each stage launches `tasks_per_step` tasks, each costing the
    host thread `dispatch_overhead` and each of the stage's `group_devices` its device
    thread's `task_device_overhead` (XLA:CPU's launch and buffers on that thread, and its
    thread pool's search for more work when the task ends). `cluster` may be JSON.

    **Example:** 2 stages of 4 devices, 4 microbatches, 1F1B (9 tasks per stage), 1 ms per
    launch and 0.2 ms per device and task: ``2 * 9 * (1e-3 + 4 * 2e-4)`` = 32.4 ms.
    """
    tasks = tasks_per_step(len(group_devices), num_microbatches, schedule)
    device = float(cluster_field(cluster, "task_device_overhead") or 0.0)
    launch = float(cluster_field(cluster, "dispatch_overhead") or 0.0)
    return tasks * sum(launch + device * d for d in group_devices)


class XlaCpu(Backend):
    """XLA:CPU's rules (module docstring), each behind the profile field that measured it."""

    name = "xla:cpu"

    def layout_copies(self, graph, node) -> tuple[LayoutCopy, ...]:
        return scan_slice_copies(node) or layout_copies(graph, node)

    def prices_layout_copies(self, cluster) -> bool:
        return cluster_field(cluster, "transpose_bandwidth") is not None

    def layout_copy_seconds(self, cluster, nbytes: float, fan_in: float = 1.0,
                            fused: bool = False, strided: bool = True) -> float:
        if not strided:
            return scan_slice_time(nbytes, cluster)
        return layout_copy_time(nbytes, cluster, fan_in, fused)

    def returned_gradient_seconds(self, cluster, nbytes: float) -> float:
        return returned_gradient_time(nbytes, cluster)

    def shared_cores_step_time(self, cluster, forward, backward, num_microbatches,
                               group_devices, schedule, num_device_groups):
        """`simulate_shared` when the host's `host_cores` are fewer than its devices, on
        one host, for GPipe and 1F1B with one stage per device group and the stages'
        `group_devices` known; None otherwise."""
        cores = cluster_field(cluster, "host_cores")
        per_host = int(cluster_field(cluster, "devices_per_host") or 1)
        if not (cores and cores < per_host and cluster_field(cluster, "num_hosts") == 1
                and group_devices is not None and len(forward) > 1
                and num_device_groups == len(forward) and schedule in ("gpipe", "1f1b")):
            return None
        host = host_work_per_step(cluster, group_devices, num_microbatches, schedule)
        return simulate_shared(forward, backward, num_microbatches, group_devices, cores,
                               per_host, schedule, host_work=host)

    def collective_latency(self, cluster, group_size: int) -> float | None:
        return group_collective_latency(cluster, group_size)

    def merged_latency_share(self, cluster, nbytes: float, threshold: float) -> float:
        """XLA:CPU's tuple all-reduce rendezvouses once per operand: each operand pays
        ``s + (1 − s) · min(1, nbytes / threshold)`` of its latency, s the profile's
        `combined_operand_latency`."""
        amortised = cluster.combined_operand_latency
        return amortised + (1.0 - amortised) * min(1.0, nbytes / threshold)

    def collective_concurrency(self, cluster) -> float:
        """0: XLA:CPU's collectives are synchronous on the device's thread (module
        docstring), whatever the profile's `overlap` says of gradient reductions."""
        return 0.0


XLA_CPU = XlaCpu()
