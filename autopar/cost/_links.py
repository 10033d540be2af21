"""Link choice: which bandwidth and latency a group of devices gets from a cluster's profile.

In: a `Cluster` record (its `intra_host`, `inter_host`, measured tables) and a group size,
a collective kind or a dtype. Out: a `Link`, a factor, seconds or FLOP/s. The collective
and compute formulas (`_collective`, `_compute`) and the backends call these; the `Cluster`
only holds the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, as JAX does)
import numpy as np

from autopar.cluster import Cluster, Link


def nearest_group_entry(table: Sequence[tuple[int, Any]], group_size: int) -> Any:
    """The value of `table`'s entry whose group size is nearest to `group_size` in log2,
    a tie going to the larger; `table` holds ``(group_size, value)`` pairs.

    **Example:** entries for 2, 4 and 8: a group of 3 gets the entry of 4.
    """
    target = np.log2(group_size)
    _, value = min(table, key=lambda entry: (abs(np.log2(entry[0]) - target), -entry[0]))
    return value


def intra_link(cluster: Cluster, group_size: int, kind: str | None = None) -> Link:
    """The link a collective over `group_size` devices of one host runs over.

    With `intra_host_by_group`: the entry of the measured group size nearest to
    `group_size` in log2 (a tie goes to the larger), so that a pair of devices pays what
    pairs paid when the profile timed every pair of the host at once. Without it:
    `intra_host`. With the collective's `kind` and a profile with
    `collective_bandwidth_by_kind`, its bandwidth times that kind's factor.

    **Example:** measured for groups of 2, 4 and 8: a group of 3 gets the entry of 4.
    """
    table = cluster.intra_host_by_group
    if not table or group_size < 2:
        link = cluster.intra_host
    else:
        link = nearest_group_entry(table, group_size)
    scale = kind_bandwidth_scale(cluster, kind)
    return link if scale == 1.0 else Link(link.bandwidth * scale, link.latency)


def kind_bandwidth_scale(cluster: Cluster, kind: str | None) -> float:
    """The factor `collective_bandwidth_by_kind` gives collective `kind` inside a host;
    1 without the table, for a kind it does not list, or for None."""
    for name, scale in cluster.collective_bandwidth_by_kind or ():
        if name == kind:
            return scale
    return 1.0


def group_collective_latency(cluster: Cluster, group_size: int) -> float | None:
    """Seconds one collective over `group_size` devices of a host adds inside a program
    (`collective_latency_by_group`, the entry of the measured group size nearest in log2,
    a tie to the larger, as `intra_link`); None without the table."""
    table = cluster.collective_latency_by_group
    if not table or group_size < 2:
        return None
    return nearest_group_entry(table, group_size)


def write_bandwidth(cluster: Cluster, in_place: bool = False) -> float:
    """Device memory bandwidth (bytes/s) of work writing fresh buffers, or, with
    `in_place`, writing over its donated inputs (`inplace_bandwidth` when the profile
    measured it, else `hbm_bandwidth`)."""
    if in_place and cluster.inplace_bandwidth is not None:
        return cluster.inplace_bandwidth
    return cluster.hbm_bandwidth


def rail_share(nics_per_host: int, devices_per_host: int) -> float:
    """The share of one rail's bandwidth each device gets when all `devices_per_host`
    devices of a host talk at once over its `nics_per_host` rails, each device using at
    most one rail (NCCL binds a GPU to its nearest NIC): ``min(r, d) / d``."""
    return min(nics_per_host, devices_per_host) / devices_per_host


def network_link(cluster: Cluster) -> Link:
    """Each device's link to other hosts when every device of its host talks at once.

    With `nics_per_host` = r: the host's r rails shared by its devices (`rail_share`),
    ``inter_host.bandwidth · min(r, devices_per_host) / devices_per_host``. Without it:
    `inter_host` as given (the documented default: its bandwidth is already per device).

    **Example:** DGX A100, 8 rails of 25 GB/s for 8 GPUs: 25 GB/s per GPU; a host with
    one 3.125 GB/s NIC for 8 GPUs: 0.39 GB/s per GPU.
    """
    if cluster.nics_per_host is None:
        return cluster.inter_host
    share = rail_share(cluster.nics_per_host, cluster.devices_per_host)
    return Link(cluster.inter_host.bandwidth * share, cluster.inter_host.latency)


def device_flops(cluster: Cluster, dtype: Any = "float32") -> float:
    """Achievable FLOP/s per device for `dtype`: peak × `matmul_efficiency`.

    A dtype the profile does not list (e.g. an integer type) uses the float32 figure.
    """
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    peak = cluster.peak_flops.get(name, cluster.peak_flops["float32"])
    return peak * cluster.matmul_efficiency
