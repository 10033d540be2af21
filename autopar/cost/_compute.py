"""Compute time (roofline) and per-device sizes of sharded tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, as JAX does)
import numpy as np

from autopar._memo import declare, memo
from autopar.cluster import Cluster, LogicalMesh, Spec
from autopar.cost._links import device_flops, write_bandwidth
from autopar.graph import dtype_itemsize


def compute_time(
    flops: float,
    bytes_accessed: float,
    cluster: Cluster,
    dtype: Any = "float32",
    *,
    matmul: bool = False,
    in_place: bool = False,
    gemm_shape: tuple[float, float, float] | None = None,
) -> float:
    """Seconds for an operator on one device, by the roofline model.

    **Arguments:**
    - `flops`: floating point operations per device.
    - `bytes_accessed`: bytes read plus written per device (for a node inside a fusion,
      only the bytes crossing the fusion's boundary: `autopar.graph.fusion_traffic`).
    - `cluster`: gives `peak_flops`, the efficiencies and `hbm_bandwidth`.
    - `dtype`: selects the peak (a name like ``"bfloat16"`` or a numpy/JAX dtype); for a
      dot, `rate_dtype` of its operands.
    - `matmul`: the operator is a GEMM (dot or convolution) of `flops`, so its efficiency
      comes from `gemm_efficiency` by its size; else `matmul_efficiency`.
    - `in_place`: the operator writes its results over donated inputs (the optimizer
      update of a step's state), so its bytes move at `write_bandwidth(cluster, True)`.
    - `gemm_shape`: for a matmul, its (M, N, K) per device (batch dimensions in M), which
      `gemm_efficiency` looks up in the profile's `gemm_shapes` where it has them.

    **Returns:** ``max(flops / (peak[dtype] · efficiency), bytes / bandwidth)``, the
    bandwidth `hbm_bandwidth` (or the in-place one).
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(
            f"compute_time needs flops >= 0 and bytes >= 0, got {flops} and {bytes_accessed}"
        )
    bandwidth = write_bandwidth(cluster, in_place) if in_place else cluster.hbm_bandwidth
    if flops == 0:
        return bytes_accessed / bandwidth
    rate = device_flops(cluster, dtype)
    if matmul:
        rate *= gemm_efficiency(cluster, flops, gemm_shape) / cluster.matmul_efficiency
    return max(flops / rate, bytes_accessed / bandwidth)


def gemm_efficiency(cluster: Cluster, flops: float,
                    shape: tuple[float, float, float] | None = None) -> float:
    """The fraction of peak a GEMM of `flops` FLOPs per device achieves on `cluster`.

    With its `shape`, (M, N, K) per device, on a profile with `gemm_shapes` (GEMMs timed by
    shape, a full grid): that table interpolated linearly in (log M, log N, log K) and held
    constant beyond its ends (`shape_efficiency`). Otherwise, by its size:

    Its size is the geometric mean of its dimensions, ``(M·N·K)**(1/3) = (flops / 2)**(1/3)``
    (batch dimensions count in M); the profile's `gemm_efficiency` table is interpolated
    linearly in log(size) and held constant beyond its ends. Small GEMMs fill few SMs
    (tile and wave quantization, launch overhead), large ones reach 70-85% of peak
    (REFERENCES.md, "Compute on GPUs"). A skinny GEMM (one small dimension) is bounded by
    its bytes in `compute_time`'s roofline rather than by this table. Without a table:
    `matmul_efficiency` for every size.

    **Example:** on dgx-a100-80g, 8192³ gives the table's last point (0.82), 1024³ about
    0.45.
    """
    if shape is not None and getattr(cluster, "gemm_shapes", None) and flops > 0:
        return shape_efficiency(cluster.gemm_shapes, shape)
    table = cluster.gemm_efficiency
    if not table or flops <= 0:
        return cluster.matmul_efficiency
    size = (flops / 2) ** (1 / 3)
    sizes = np.log([s for s, _ in table])
    return float(np.interp(np.log(size), sizes, [e for _, e in table]))


def shape_efficiency(table: Sequence[Sequence[float]], shape: Sequence[float]) -> float:
    """A `Cluster.gemm_shapes` table, ``((M, N, K, fraction), ...)`` on a full grid, at
    `shape` (M, N, K): trilinear interpolation in the logarithms of the sizes, each
    coordinate clamped to the grid's range.

    **Example:** on a grid of sizes 64 and 256 in each dimension, (128, 64, 64) lies
    halfway (in log) between (64, 64, 64) and (256, 64, 64): the mean of their fractions.
    """
    if not isinstance(table, tuple) or not all(isinstance(row, tuple) for row in table):
        table = tuple(tuple(row) for row in table)
    grid, axes = _shape_grid(table)
    weights = []  # per dimension: (index, weight) of the grid points around the query
    for axis, size in zip(axes, shape):
        logs = np.log(axis)
        x = float(np.clip(np.log(max(float(size), 1e-30)), logs[0], logs[-1]))
        hi = int(np.searchsorted(logs, x)) if len(logs) > 1 else 0
        if hi == 0:
            weights.append(((0, 1.0),))
            continue
        lo = hi - 1
        t = (x - logs[lo]) / (logs[hi] - logs[lo])
        weights.append(((lo, 1.0 - t), (hi, t)))
    return float(sum(wm * wn * wk * grid[im, jn, kk]
                     for im, wm in weights[0] for jn, wn in weights[1]
                     for kk, wk in weights[2]))


@memo("cost.gemm_shape_grid", "gemm_shapes table", maxsize=16)
def _shape_grid(table: tuple[tuple[float, ...], ...]) -> tuple[np.ndarray, list[list[float]]]:
    """`shape_efficiency`'s table as an array indexed by the (M, N, K) positions on its
    axes, and the axes' sorted sizes."""
    axes = [sorted({row[i] for row in table}) for i in range(3)]
    grid = np.full([len(a) for a in axes], np.nan)
    for m, n, k, fraction in table:
        grid[axes[0].index(m), axes[1].index(n), axes[2].index(k)] = fraction
    if np.isnan(grid).any():
        raise ValueError(f"gemm_shapes is not a full grid of M {axes[0]}, N {axes[1]}, "
                         f"K {axes[2]}")
    return grid, axes


def kernel_launch_time(cluster: Cluster, kernels: float) -> float:
    """Seconds `kernels` kernels cost besides their work on `cluster`: each its launch and
    the gap before the next, ``kernels · kernel_overhead`` (0 on a profile without it).

    A GPU runs a step's kernels one after another from one stream; a kernel that does next
    to nothing still takes a few microseconds (`autopar profile` times chains of tiny
    dependent kernels, `autopar.profile._accelerator.measure_kernel_floor`). A step of a
    24-layer GPT launches a few thousand, so at 3 us each this is several milliseconds.

    **Example:** 2000 kernels at ``kernel_overhead = 3e-6``: 6 ms.
    """
    if kernels < 0:
        raise ValueError(f"kernel_launch_time needs kernels >= 0, got {kernels}")
    return kernels * cluster.kernel_overhead


# Primitives that run on the matrix units: their rate is set by the operand dtypes.
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def rate_dtype(primitive: str, operand_dtypes: Sequence[Any], result_dtype: Any) -> str:
    """The dtype whose peak FLOP/s an operator runs at.

    A dot or convolution runs at the rate of its operands, not of its result: a bf16 x bf16
    dot with ``preferred_element_type=float32`` accumulates in f32 on the bf16 tensor cores
    (REFERENCES.md, "Compute on GPUs"), so it costs at the bf16 rate. Operands of different
    widths are promoted to the widest (XLA converts the narrower one), so a bf16 x f32 dot
    runs at the f32 rate. Every other operator uses its result dtype. Typed PRNG keys
    (``key<fry>``) run at the uint32 rate of their key data.

    **Arguments:**
    - `primitive`: the primitive name, e.g. ``"dot_general"``.
    - `operand_dtypes`: the dtypes of the array operands (constants included).
    - `result_dtype`: the dtype of the (first) result.

    **Returns:** a dtype name, e.g. ``"bfloat16"``.

    **Example:** ``rate_dtype("dot_general", ["bfloat16", "bfloat16"], "float32") ==
    "bfloat16"``.
    """
    if primitive in MATMUL_PRIMITIVES and operand_dtypes:
        return max((_rate_np_dtype(d) for d in operand_dtypes), key=lambda d: d.itemsize).name
    return _rate_np_dtype(result_dtype).name


def _rate_np_dtype(dtype: Any) -> np.dtype:
    """`np.dtype`, with typed PRNG keys (``"key<fry>"``, which NumPy rejects) as uint32.

    A key's arithmetic (threefry, splitting, folding) runs on its uint32 key data.
    """
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype("uint32")


def bytes_per_device(
    shape: Sequence[int], dtype: Any, spec: Spec, mesh: LogicalMesh
) -> float:
    """Bytes of the largest shard of a tensor split by `spec` on `mesh`.

    **Arguments:**
    - `shape`, `dtype`: the global tensor.
    - `spec`: per dimension, the mesh axes splitting it (see `autopar.cluster.Spec`).
    - `mesh`: gives the axis sizes.

    **Returns:** ``itemsize · prod(ceil(shape[d] / split[d]))``. For an even split this is
    ``NamedSharding(jax_mesh, to_partition_spec(spec)).shard_shape(shape)`` in bytes; an
    uneven split (which only arises inside ``jax.jit``) is padded up, as XLA pads it.
    """
    key = (tuple(shape), dtype, spec, mesh.shape, mesh.axis_names)
    try:
        cached = _SHARD_BYTES.get(key)
    except TypeError:  # a spec given as lists: not memoised
        return _bytes_per_device(shape, dtype, spec, mesh)
    if cached is not None:
        return cached
    result = _SHARD_BYTES[key] = _bytes_per_device(shape, dtype, spec, mesh)
    if len(_SHARD_BYTES) > _SHARD_BYTES_LIMIT:
        _SHARD_BYTES.clear()
    return result


# (shape, dtype, spec, mesh shape, axis names) -> bytes: the planner asks millions of times
# per search (issue 18), for a few thousand distinct tensors. Emptied when it grows large.
_SHARD_BYTES_LIMIT = 1 << 18
_SHARD_BYTES: dict = declare(
    {}, "cost.shard_bytes", "(shape, dtype, spec, mesh shape, axis names) -> bytes",
    scope="process", limit=_SHARD_BYTES_LIMIT)


def _bytes_per_device(shape, dtype, spec: Spec, mesh: LogicalMesh) -> float:
    if len(spec) != len(shape):
        raise ValueError(
            f"spec {spec} has {len(spec)} entries but the tensor has shape {tuple(shape)} "
            f"({len(shape)} dims); give one tuple of mesh axes per dimension"
        )
    used = [a for dim in spec for a in dim]
    unknown = [a for a in used if a not in mesh.axis_names]
    if unknown or len(set(used)) != len(used):
        raise ValueError(
            f"spec {spec} must use each axis of the mesh {mesh.axis_names} at most once; "
            f"unknown: {unknown}, used: {used}"
        )
    return float(math.prod(shard_shape(shape, spec, mesh)) * _itemsize(dtype))


def shard_shape(shape: Sequence[int], spec: Spec, mesh: LogicalMesh) -> tuple[int, ...]:
    """The largest shard's shape of a tensor of `shape` split by `spec` on `mesh`: each
    dimension over the product of its axes' sizes, rounded up (XLA pads an uneven split)."""
    return tuple(math.ceil(size / mesh.axis_size(axes)) for size, axes in zip(shape, spec))


def _itemsize(dtype: Any) -> int:
    """Bytes per element; typed PRNG keys (``"key<fry>"``) count as their key data."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return dtype_itemsize(str(dtype))
