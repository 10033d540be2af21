"""The cluster of a multi-process run: hosts are processes, as `Cluster.local()` has them."""

from __future__ import annotations

import dataclasses
from collections import Counter


def multiprocess_cluster():
    """`Cluster.local()` for a multi-process run.

    Same result as `Cluster.local()` (hosts = JAX processes, figures from the local profile),
    but the device memory is read from one of this process's own devices: JAX refuses
    `memory_stats()` on another process's device, which `Cluster.local()` asks on process
    1 and up.

    **Returns:** a `Cluster` with `jax.process_count()` hosts.
    """
    import jax

    from autopar.cluster._cluster import _local_base_profile, local_devices

    devices = local_devices()
    per_host = Counter(d.process_index for d in devices)
    if len(set(per_host.values())) != 1:
        raise ValueError(
            f"processes own different numbers of devices {dict(per_host)}; autopar needs the "
            "same number of devices on every process. Start every process with the same "
            "devices visible (autopar launch --devices-per-process K)."
        )
    kind = devices[0].device_kind
    base = _local_base_profile(kind)
    stats = jax.local_devices()[0].memory_stats() or {}
    return dataclasses.replace(
        base,
        name=f"local ({base.name})",
        num_hosts=len(per_host),
        devices_per_host=next(iter(per_host.values())),
        device_kind=kind,
        device_memory=stats.get("bytes_limit", base.device_memory),
    )
