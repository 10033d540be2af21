"""A node's cost in the layer ILP, one formula each: its compute with what it adds besides
the roofline, the reductions of its partial results, its layout copies and kernel launch,
and the batch a graph input brings from the host.

In: plain numbers (FLOPs and bytes per device, copies as ``(bytes, fan-in, fused)``,
reductions as ``(kind, bytes, axes, combined)``), a `Cluster` and a `LogicalMesh`. Out:
seconds or bytes. `autopar.intra._strategies` enumerates a node's strategies and asks these
for each one's price.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost._collective import collective_time, combined_collective_time
from autopar.cost._compute import compute_time, kernel_launch_time
from autopar.cost.backends import backend_for


def node_compute_seconds(
    flops: float,
    bytes_accessed: float,
    cluster: Cluster,
    dtype: Any = "float32",
    *,
    matmul: bool = False,
    in_place: bool = False,
    gemm_shape: tuple[float, float, float] | None = None,
    extra_seconds: float = 0.0,
) -> float:
    """Seconds of a node's work on one device: its roofline (`compute_time` of its FLOPs
    and the bytes crossing its fusion's boundary, per device) plus `extra_seconds`, what it
    costs besides (`layout_copy_seconds` and `kernel_seconds`)."""
    return compute_time(flops, bytes_accessed, cluster, dtype, matmul=matmul,
                        in_place=in_place, gemm_shape=gemm_shape) + extra_seconds


def reduction_seconds(kind: str, nbytes: float, cluster: Cluster, mesh: LogicalMesh,
                      axes, combined: bool = False) -> float:
    """Seconds of one collective reducing a node's partial results over mesh `axes`:
    `combined_collective_time` where XLA's combiner merges it with the step's other
    independent reductions (`combined`), else `collective_time`."""
    if combined:
        return combined_collective_time(kind, nbytes, cluster, mesh, axes)
    return collective_time(kind, nbytes, cluster, mesh, axes)


def reductions_seconds(reductions: Iterable[tuple[str, float, Any, bool]], cluster: Cluster,
                       mesh: LogicalMesh) -> float:
    """The sum of `reduction_seconds` over ``(kind, bytes, axes, combined)`` collectives."""
    return sum(reduction_seconds(kind, nbytes, cluster, mesh, axes, combined)
               for kind, nbytes, axes, combined in reductions)


def layout_copy_seconds(cluster: Cluster,
                        copies: Iterable[tuple[float, int, bool, bool]]) -> float:
    """Seconds a node's layout copies add on `cluster`: each ``(bytes per device, fan-in,
    fused, strided)`` priced by its backend's `layout_copy_seconds` (`autopar.cost.backends`;
    strided False: a scan's per-iteration slice of a stacked operand)."""
    backend = backend_for(cluster)
    total = 0.0
    for nbytes, fan_in, fused, strided in copies:
        total += backend.layout_copy_seconds(cluster, nbytes, fan_in, fused, strided)
    return total


def kernel_seconds(cluster: Cluster, is_kernel_root: bool) -> float:
    """The launch of one kernel (`kernel_launch_time`) for the node that stands for a
    kernel (`autopar.graph.kernel_roots`), else 0."""
    return kernel_launch_time(cluster, 1) if is_kernel_root else 0.0


def batch_feed_seconds(nbytes: float, cluster: Cluster, dtype: Any = "float32") -> float:
    """Seconds a device spends writing the `nbytes` of the batch it holds, which arrive from
    the host every step (a replicated batch is copied to every device)."""
    return compute_time(0.0, nbytes, cluster, dtype)


def unfused_bytes(in_bytes: Sequence[float | None], out_bytes: Sequence[float]) -> float:
    """Bytes per device a node moves outside any fusion: every operand (None, a constant,
    counts 0) and every result."""
    return float(sum(b or 0 for b in in_bytes) + sum(out_bytes))


def repriced_copy_seconds(copies: Iterable[tuple[float, float, float]]) -> float:
    """Seconds a stage's layout copies cost beyond what its layers' ILPs charged them: for
    each node's ``(weight, seconds on the stage's graph, seconds on its layer's graph)``
    (both `layout_copy_seconds`, at the same operand layouts), the weight times the
    difference. A layer's graph starts at the layer's inputs, so its copies' fan-in stops
    there; on the stage's graph it reaches back over the layer edge."""
    extra = 0.0
    for weight, on_stage, on_layer in copies:
        extra += weight * (on_stage - on_layer)
    return extra


def fusion_boundary_bytes(in_bytes: Sequence[float | None], out_bytes: Sequence[float | None],
                          reads: Sequence[bool], writes: Sequence[bool]) -> float:
    """Bytes per device a node moves to and from device memory inside a fusion: the
    operands it reads from memory (`reads[i]`, `autopar.graph.FusionTraffic.reads`) and the
    results it writes there (`writes[j]`); None entries (constants) count 0."""
    read = sum(b or 0 for b, hbm in zip(in_bytes, reads) if hbm)
    written = sum(b or 0 for b, hbm in zip(out_bytes, writes) if hbm)
    return float(read + written)
