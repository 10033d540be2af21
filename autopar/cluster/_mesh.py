"""Logical meshes and sharding specs, as plain data.

A `Spec` says how each dimension of a tensor is split: ``spec[dim]`` is a tuple of mesh
axis names (major to minor), empty when the dimension is not split. It is the plain-data
form of `jax.sharding.PartitionSpec` (see `to_partition_spec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Spec = tuple[tuple[str, ...], ...]

DEFAULT_AXIS_NAMES = ("x", "y", "z", "w")


def replicated(ndim: int) -> Spec:
    return ((),) * ndim


def spec_axes(spec: Spec) -> tuple[str, ...]:
    """All mesh axes that split some dimension of the tensor."""
    return tuple(a for dim in spec for a in dim)


def spec_str(spec: Spec) -> str:
    """``(('x',), ())`` -> ``"P('x', None)"``, as users see specs."""
    parts = []
    for dim in spec:
        if not dim:
            parts.append("None")
        elif len(dim) == 1:
            parts.append(repr(dim[0]))
        else:
            parts.append("(" + ", ".join(repr(a) for a in dim) + ")")
    return "P(" + ", ".join(parts) + ")"


def to_partition_spec(spec: Spec):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*[(d[0] if len(d) == 1 else d) if d else None for d in spec])


@dataclass(frozen=True)
class LogicalMesh:
    """Devices arranged in a named n-d array.

    `device_ids` are cluster device ids in row-major order of `shape`.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_ids: tuple[int, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.axis_names):
            raise ValueError(
                f"mesh shape {self.shape} has {len(self.shape)} axes but "
                f"{len(self.axis_names)} axis names {self.axis_names} were given"
            )
        if math.prod(self.shape) != len(self.device_ids):
            raise ValueError(
                f"mesh shape {self.shape} needs {math.prod(self.shape)} devices, "
                f"got {len(self.device_ids)}"
            )

    @staticmethod
    def create(shape: tuple[int, ...], device_ids=None, axis_names=None) -> LogicalMesh:
        shape = tuple(int(s) for s in shape)
        if axis_names is None:
            axis_names = DEFAULT_AXIS_NAMES[: len(shape)]
        if device_ids is None:
            device_ids = range(math.prod(shape))
        return LogicalMesh(shape, tuple(axis_names), tuple(int(d) for d in device_ids))

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    def axis_size(self, axes: str | tuple[str, ...]) -> int:
        # memoised: the planner asks this hundreds of thousands of times per search
        sizes = self.__dict__.get("_axis_sizes")
        if sizes is None:
            sizes = {}
            object.__setattr__(self, "_axis_sizes", sizes)
        size = sizes.get(axes)
        if size is None:
            names = (axes,) if isinstance(axes, str) else axes
            size = sizes[axes] = math.prod(self.shape[self.axis_names.index(a)] for a in names)
        return size

    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape))

    def groups(self, axes: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """The device groups that communicate in a collective over `axes`.

        One group per combination of the other axes' coordinates; each group lists device
        ids in the order of the axes given.
        """
        if isinstance(axes, str):
            axes = (axes,)
        cached = self.__dict__.setdefault("_groups", {}).get(axes)
        if cached is not None:
            return list(cached)
        ids = np.asarray(self.device_ids).reshape(self.shape)
        idx = [self.axis_names.index(a) for a in axes]
        rest = [i for i in range(len(self.shape)) if i not in idx]
        arr = np.transpose(ids, rest + idx).reshape(-1, math.prod(self.shape[i] for i in idx))
        groups = tuple(tuple(int(d) for d in row) for row in arr)
        self.__dict__["_groups"][axes] = groups
        return list(groups)

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "device_ids": list(self.device_ids),
        }

    @staticmethod
    def from_json(d: dict) -> LogicalMesh:
        return LogicalMesh(tuple(d["shape"]), tuple(d["axis_names"]), tuple(d["device_ids"]))
