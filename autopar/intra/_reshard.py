"""Resharding: the collectives (and their time) that turn one spec of a tensor into another.

Per mesh axis, going from `src` to `dst`:
- split in both on the same dimension: nothing;
- split in `src`, not in `dst`: all-gather along that axis;
- split in `dst` only: each device slices its part locally, free;
- split on different dimensions: all-to-all.
Gathers run first (on the shrinking source split), then all-to-alls, then free slices.
"""

from __future__ import annotations

from autopar.cluster._mesh import LogicalMesh, Spec
from autopar.cost import bytes_per_device, collective_time
from autopar.intra._strategies import Collective


def _axis_dims(spec: Spec) -> dict[str, int]:
    return {a: d for d, axes in enumerate(spec) for a in axes}


def reshard_collectives(
    shape: tuple[int, ...], dtype: str, src: Spec, dst: Spec, mesh: LogicalMesh
) -> tuple[Collective, ...]:
    """The collectives needed to go from `src` to `dst` (empty when free).

    On a dimension split over several axes, only a common leading run of axes stays put.
    An axis after that run which the target keeps on the same dimension must change
    position in the device order: one collective-permute (send/recv) of the local block,
    as XLA's partitioner does, before the other axes are gathered or exchanged.
    """
    if src == dst:
        return ()
    src_dims, dst_dims = _axis_dims(src), _axis_dims(dst)
    current = [list(axes) for axes in src]
    out: list[Collective] = []
    moved: set[str] = set()
    for a, b in zip(src, dst):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        permuted = tuple(x for x in a[k:] if x in b[k:])
        if permuted:
            per_device = bytes_per_device(shape, dtype, src, mesh)
            out.append(Collective("send_recv", permuted, per_device))
            moved.update(permuted)
    for axis in mesh.axis_names:
        if axis in src_dims and axis not in dst_dims:
            full = bytes_per_device(shape, dtype, _spec(current), mesh) * mesh.axis_size(axis)
            out.append(Collective("all_gather", (axis,), full))
            current[src_dims[axis]].remove(axis)
    for axis in mesh.axis_names:
        if axis in src_dims and axis in dst_dims and src_dims[axis] != dst_dims[axis]:
            per_device = bytes_per_device(shape, dtype, _spec(current), mesh)
            out.append(Collective("all_to_all", (axis,), per_device))
            current[src_dims[axis]].remove(axis)
            current[dst_dims[axis]].append(axis)
    return tuple(out)


def _spec(current: list[list[str]]) -> Spec:
    return tuple(tuple(axes) for axes in current)


def reshard_time(
    shape: tuple[int, ...],
    dtype: str,
    src: Spec,
    dst: Spec,
    mesh: LogicalMesh,
    cluster,
    cache: dict | None = None,
) -> float:
    """Seconds to reshard a tensor from `src` to `dst` on `mesh`.

    `cache`, if given, memoises results for one (mesh, cluster) pair.
    """
    if src == dst:
        return 0.0
    key = (tuple(shape), dtype, src, dst)
    if cache is not None and key in cache:
        return cache[key]
    seconds = sum(
        collective_time(c.kind, c.nbytes, cluster, mesh, c.axes)
        for c in reshard_collectives(shape, dtype, src, dst, mesh)
    )
    if cache is not None:
        cache[key] = seconds
    return seconds
