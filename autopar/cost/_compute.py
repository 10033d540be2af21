"""Compute time (roofline) and per-device sizes of sharded tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, as JAX does)
import numpy as np

from autopar.cluster._cluster import Cluster
from autopar.cluster._mesh import LogicalMesh, Spec
from autopar.graph._opgraph import dtype_itemsize


def compute_time(
    flops: float, bytes_accessed: float, cluster: Cluster, dtype: Any = "float32"
) -> float:
    """Seconds for an operator on one device, by the roofline model.

    **Arguments:**
    - `flops`: floating point operations per device.
    - `bytes_accessed`: bytes read plus written per device.
    - `cluster`: gives `peak_flops`, `matmul_efficiency` and `hbm_bandwidth`.
    - `dtype`: selects the peak (a name like ``"bfloat16"`` or a numpy/JAX dtype).

    **Returns:** ``max(flops / (peak[dtype] · matmul_efficiency), bytes / hbm_bandwidth)``.
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(
            f"compute_time needs flops >= 0 and bytes >= 0, got {flops} and {bytes_accessed}"
        )
    return max(flops / cluster.flops(dtype), bytes_accessed / cluster.hbm_bandwidth)


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
    shard = [math.ceil(size / mesh.axis_size(dim)) for size, dim in zip(shape, spec)]
    return float(math.prod(shard) * _itemsize(dtype))


def _itemsize(dtype: Any) -> int:
    """Bytes per element; typed PRNG keys (``"key<fry>"``) count as their key data."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return dtype_itemsize(str(dtype))
