"""Clusters and logical meshes, as plain data.

In: a cost profile name or JSON file, or the local JAX devices. Out: a `Cluster` (hosts ×
devices, memory, FLOP/s, per-level links) and `LogicalMesh`es over its device ids.
``autopar profile`` (`measure_profile`) measures the local devices into a profile.
"""

from autopar.cluster._cluster import (
    Cluster,
    Link,
    available_profiles,
    local_devices,
    local_profile_path,
    profile_dirs,
)
from autopar.cluster._mesh import LogicalMesh, Spec, replicated, spec_str, to_partition_spec
from autopar.cluster._profile import (  # after _cluster: _profile imports autopar.cost
    FULL,
    QUICK,
    ProfileOptions,
    ProfileResult,
    measure_profile,
)

__all__ = [
    "FULL",
    "QUICK",
    "Cluster",
    "Link",
    "LogicalMesh",
    "ProfileOptions",
    "ProfileResult",
    "Spec",
    "available_profiles",
    "local_devices",
    "local_profile_path",
    "measure_profile",
    "profile_dirs",
    "replicated",
    "spec_str",
    "to_partition_spec",
]
