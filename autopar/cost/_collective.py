"""Communication time: collectives over logical mesh axes and transfers between meshes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from autopar.cluster._cluster import Cluster, Link
from autopar.cluster._mesh import LogicalMesh
from autopar.cost._formulas import CollectiveKind, alpha_beta_terms, hierarchical_terms


def link_for(cluster: Cluster, device_ids: Sequence[int]) -> Link:
    """The link a group of devices talks over.

    **Arguments:**
    - `cluster`: the cluster.
    - `device_ids`: cluster device ids of the group.

    **Returns:** `cluster.intra_host` if all devices are on one host, else
    `cluster.network_link()` (each device's share of its host's NICs).
    """
    hosts = {cluster.host_of(d) for d in device_ids}
    return cluster.intra_host if len(hosts) <= 1 else cluster.network_link()


def collective_time(
    kind: CollectiveKind,
    nbytes: float,
    cluster: Cluster,
    mesh: LogicalMesh,
    axes: str | tuple[str, ...],
) -> float:
    """Seconds for one collective over mesh `axes` (ring alpha-beta model).

    **Arguments:**
    - `kind`: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"`` or
      ``"send_recv"``.
    - `nbytes`: per participant for all_reduce, all_to_all and send_recv; the full gathered
      tensor for all_gather, the full tensor before scattering for reduce_scatter (so a
      reduce-scatter followed by an all-gather of the same S costs one all-reduce of S).
    - `cluster`: gives the links; `mesh` device ids are cluster device ids.
    - `axes`: the mesh axes the collective runs over; n is the product of their sizes.

    **Returns:** the slowest group's time (all groups run at once, every device of a host
    on its own rail); 0 when n == 1. A group on one host is a ring over
    ``cluster.intra_link(n)`` (`intra_host`, or the link measured for groups of that size
    when the profile has `intra_host_by_group`):
    ``latency_steps · alpha + wire_bytes / bandwidth`` (`alpha_beta_terms`). A group with
    g > 1 devices on each of k > 1 hosts runs the two-level algorithm
    (`hierarchical_terms`): rings inside the hosts over ``intra_link(g)``, rings across hosts
    over each device's rail (`Cluster.network_link`). One device per host, or uneven
    counts per host: one ring over the network.

    **Example:** all-reduce of 1 GiB over the 8 GPUs of a DGX A100:
    ``2·7/8·2**30 / 300e9 + 2·7·5e-6`` ≈ 6.33 ms; over 2 DGX A100 (16 GPUs) it adds
    ``2·1/2·2**30/8 / 25e9 + 2·10e-6`` ≈ 5.39 ms across hosts, 11.7 ms in all.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    _check_axes(mesh, axes)
    n = mesh.axis_size(axes)
    alpha_beta_terms(kind, nbytes, n)  # checks the arguments
    if n == 1:
        return 0.0
    return max(_group_time(kind, nbytes, cluster, group) for group in mesh.groups(axes))


def _group_time(kind: CollectiveKind, nbytes: float, cluster: Cluster, group) -> float:
    per_host = Counter(cluster.host_of(d) for d in group)
    counts = set(per_host.values())
    if len(per_host) == 1:
        return alpha_beta_terms(kind, nbytes, len(group)).seconds(cluster.intra_link(len(group)))
    if len(counts) == 1 and (g := counts.pop()) > 1:
        terms = hierarchical_terms(kind, nbytes, g, len(per_host))
        return terms.seconds(cluster.intra_link(g), cluster.network_link())
    return alpha_beta_terms(kind, nbytes, len(group)).seconds(cluster.network_link())


def transfer_time(
    nbytes: float,
    cluster: Cluster,
    src_device_ids: Sequence[int],
    dst_device_ids: Sequence[int],
) -> float:
    """Seconds to move a tensor from one device set to another (cross-mesh send/recv).

    **Arguments:**
    - `nbytes`: bytes that cross, in total (the tensor size when each element is received
      once; times the number of replicas if every destination replica is sent separately).
    - `cluster`: gives the links.
    - `src_device_ids`, `dst_device_ids`: cluster device ids of the two meshes.

    **Returns:** ``alpha + nbytes / (k · bandwidth)``: the bytes are spread over
    k = min(len(src), len(dst)) point-to-point streams in parallel, over the inter-host
    link if the two sets together span hosts. 0 if the sets are equal or nbytes is 0.
    """
    if nbytes < 0:
        raise ValueError(f"transfer_time: nbytes must be >= 0, got {nbytes}")
    if not src_device_ids or not dst_device_ids:
        raise ValueError(
            "transfer_time needs at least one source and one destination device, got "
            f"src={tuple(src_device_ids)} dst={tuple(dst_device_ids)}"
        )
    if nbytes == 0 or set(src_device_ids) == set(dst_device_ids):
        return 0.0
    link = link_for(cluster, [*src_device_ids, *dst_device_ids])
    num_streams = min(len(set(src_device_ids)), len(set(dst_device_ids)))
    return link.latency + nbytes / (num_streams * link.bandwidth)


def _check_axes(mesh: LogicalMesh, axes: tuple[str, ...]) -> None:
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"mesh axes {missing} are not in the mesh, whose axes are {mesh.axis_names} "
            f"(shape {mesh.shape}); name axes of this mesh"
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh axes {axes} repeat an axis; name each axis once")
