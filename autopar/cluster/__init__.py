"""Clusters and logical meshes, as plain data.

In: a cost profile name or JSON file, or the local JAX devices. Out: a `Cluster` (hosts ×
devices, memory, FLOP/s, per-level links) and `LogicalMesh`es over its device ids.
Measuring the local devices into a profile is `autopar.profile` (after `cost`, whose
formulas it fits).
"""

from autopar.cluster._cluster import Cluster, Link, local_devices
from autopar.cluster._mesh import (
    DEFAULT_AXIS_NAMES,
    LogicalMesh,
    Spec,
    replicated,
    spec_axes,
    spec_str,
    to_partition_spec,
)
from autopar.cluster._profiles import available_profiles, local_profile_path, profile_dirs

__all__ = [
    "DEFAULT_AXIS_NAMES",
    "Cluster",
    "Link",
    "LogicalMesh",
    "Spec",
    "available_profiles",
    "local_devices",
    "local_profile_path",
    "profile_dirs",
    "replicated",
    "spec_axes",
    "spec_str",
    "to_partition_spec",
]
