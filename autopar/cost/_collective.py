"""Communication time: collectives over logical mesh axes and transfers between meshes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from autopar.cluster import Cluster, Link, LogicalMesh
from autopar.cost._formulas import (
    AlphaBetaTerms,
    CollectiveKind,
    TwoLevelTerms,
    alpha_beta_terms,
    hierarchical_terms,
)
from autopar.cost._links import intra_link, network_link
from autopar.cost.backends import backend_for


def link_for(cluster: Cluster, device_ids: Sequence[int]) -> Link:
    """The link a group of devices talks over.

    **Arguments:**
    - `cluster`: the cluster.
    - `device_ids`: cluster device ids of the group.

    **Returns:** `cluster.intra_host` if all devices are on one host, else
    `network_link(cluster)` (each device's share of its host's NICs).
    """
    hosts = {cluster.host_of(d) for d in device_ids}
    return cluster.intra_host if len(hosts) <= 1 else network_link(cluster)


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
    ``intra_link(cluster, n, kind)`` (`intra_host`, or the link measured for groups of that
    size when the profile has `intra_host_by_group`; its bandwidth scaled by the kind's
    measured factor, `collective_bandwidth_by_kind`):
    ``latency_steps · alpha + wire_bytes / bandwidth`` (`alpha_beta_terms`); where the
    cluster's backend gives what a collective adds inside a program
    (`Backend.collective_latency`: XLA:CPU's `Cluster.collective_latency_by_group`, its
    in-process collectives meeting once per collective), that latency once in place of
    the ring steps'. A group with g > 1 devices on each of k > 1 hosts runs the two-level
    algorithm (`hierarchical_terms`): rings inside the hosts over ``intra_link(g)``, rings
    across hosts over each device's rail (`network_link`). One device per host,
    or uneven counts per host: one ring over the network.

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
    return max(_group_time(kind, nbytes, cluster, group)
               for group in _distinct_groups(cluster, mesh, axes))


# XLA's combiners merge independent collectives of one kind over the same replica groups
# into one, up to this many bytes per combined collective: kDefaultAllReduceCombineThreshold
# (and the all-gather and reduce-scatter ones) in xla/service/collective_utils.h,
# ``30 * 1024 * 1024 + 7``, the default of xla_gpu_all_reduce_combine_threshold_bytes;
# the GPU compiler's "post-fusion optimization" pipeline runs AllGatherCombiner,
# AllReduceCombiner and ReduceScatterCombiner with it (and at most 256 operands). XLA:CPU
# merges a sharded step's gradient all-reduces the same way (one tuple all-reduce in the
# optimized HLO of the local GPT's data-parallel step; tests/test_cost.py checks it), and
# Megatron-LM / PyTorch DDP bucket their gradient reductions likewise.
COMBINE_THRESHOLD_BYTES = 30 * 1024 * 1024
COMBINE_MAX_OPERANDS = 256
COMBINED_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter"})


def collectives_seconds(collectives: Iterable[tuple[CollectiveKind, float, tuple[str, ...]]],
                        cluster: Cluster, mesh: LogicalMesh, memo: dict | None = None) -> float:
    """Seconds of collectives run one after another on `mesh` (a resharding's steps): the
    sum of `collective_time` of each ``(kind, bytes, axes)``.

    `memo`, if given, is a dict for this one (mesh, cluster) pair; each collective's seconds
    are kept there under ``("collective", kind, bytes, axes)`` (tensors of many shapes share
    their collectives: issue 18, `collective_time` was a fifth of gpt-39B's search).
    """
    seconds = 0.0
    for kind, nbytes, axes in collectives:
        if memo is None:
            seconds += collective_time(kind, nbytes, cluster, mesh, axes)
            continue
        key = ("collective", kind, nbytes, axes)
        if key not in memo:
            memo[key] = collective_time(kind, nbytes, cluster, mesh, axes)
        seconds += memo[key]
    return seconds


def combined_collective_time(
    kind: CollectiveKind,
    nbytes: float,
    cluster: Cluster,
    mesh: LogicalMesh,
    axes: str | tuple[str, ...],
    threshold: float = COMBINE_THRESHOLD_BYTES,
) -> float:
    """Seconds for one collective that XLA's combiner merges with others like it.

    Independent collectives of one kind over the same groups (a data-parallel step's
    gradient all-reduces, which nothing else in the step waits on before the update) are
    merged into buckets of up to `threshold` bytes (`COMBINE_THRESHOLD_BYTES`), and each
    bucket pays the per-collective latency once: so each collective pays the bandwidth part
    of `collective_time` in full and ``min(1, nbytes / threshold)`` of its latency part,
    its share of a full bucket. Summed over the merged collectives that is
    ``total / threshold`` latencies, one per full bucket (`combined_bucket_count`),
    less than one latency per group short when the last bucket is partly full. Kinds
    outside `COMBINED_KINDS` (send_recv, all_to_all) are charged as `collective_time`.

    A runtime whose merged collective still pays per operand says so through its
    backend's `merged_latency_share` (XLA:CPU, whose tuple all-reduce rendezvouses once
    per operand: with the profile's `combined_operand_latency` s each collective pays
    ``s + (1 − s) · min(1, nbytes / threshold)`` of its latency, all of it at s = 1).

    **Example:** 50 gradient all-reduces of 64 KiB over 8 devices with 12 us latency: one
    bucket, so their latency is ``50 · 64 KiB / 30 MiB · 14 · 12 us`` ≈ 18 us instead of
    ``50 · 14 · 12 us`` = 8.4 ms; the bandwidth part is unchanged.
    """
    if not threshold > 0:
        raise ValueError(f"combined_collective_time: threshold must be > 0 bytes, got {threshold}")
    if kind not in COMBINED_KINDS:
        return collective_time(kind, nbytes, cluster, mesh, axes)
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    _check_axes(mesh, axes)
    n = mesh.axis_size(axes)
    alpha_beta_terms(kind, nbytes, n)  # checks the arguments
    if n == 1:
        return 0.0
    share = backend_for(cluster).merged_latency_share(cluster, nbytes, threshold)
    return max(_group_time(kind, nbytes, cluster, group, share)
               for group in _distinct_groups(cluster, mesh, axes))


def combined_bucket_count(
    sizes: Sequence[float], threshold: float = COMBINE_THRESHOLD_BYTES,
    max_operands: int = COMBINE_MAX_OPERANDS,
) -> int:
    """How many collectives XLA's combiner leaves of independent ones of `sizes` bytes
    (one kind, one group): greedily in order, a bucket takes the next collective while its
    bytes stay within `threshold` and it has fewer than `max_operands`; a collective larger
    than `threshold` is a bucket of its own. 0 for none.

    **Example:** ``combined_bucket_count([20 << 20, 20 << 20, 1 << 20]) == 2``.
    """
    buckets, held, count = 0, 0.0, 0
    for size in sizes:
        if buckets and held + size <= threshold and count < max_operands:
            held, count = held + size, count + 1
        else:
            buckets, held, count = buckets + 1, size, 1
    return buckets


def _distinct_groups(cluster: Cluster, mesh: LogicalMesh, axes: tuple[str, ...]) -> list:
    """One group of each distinct layout on the hosts among `mesh.groups(axes)`:
    `_group_time` depends on a group only through its devices' counts per host, so the
    slowest group is among these. Memoised on the mesh per axes and cluster shape (issue
    45: Llama 3 405B's meshes of hundreds of hosts have thousands of groups per axis;
    timing each was 130 of the 199 s its first 70 layer ILPs took to build, under
    cProfile)."""
    memo = mesh.__dict__.setdefault("_distinct_groups", {})
    key = (axes, cluster.num_hosts, cluster.devices_per_host)
    found = memo.get(key)
    if found is None:
        layouts: dict[tuple[int, ...], tuple[int, ...]] = {}
        for group in mesh.groups(axes):
            per_host = Counter(cluster.host_of(d) for d in group)
            layouts.setdefault(tuple(sorted(per_host.values())), group)
        found = memo[key] = list(layouts.values())
    return found


def _group_time(kind: CollectiveKind, nbytes: float, cluster: Cluster, group,
                latency_share: float = 1.0) -> float:
    per_host = Counter(cluster.host_of(d) for d in group)
    counts = set(per_host.values())
    if len(per_host) == 1:
        terms = alpha_beta_terms(kind, nbytes, len(group))
        measured = backend_for(cluster).collective_latency(cluster, len(group))
        if measured is not None:  # what one collective adds inside a program, measured
            link = intra_link(cluster, len(group), kind)
            return latency_share * measured + terms.wire_bytes / link.bandwidth
        return _scaled(terms, latency_share).seconds(intra_link(cluster, len(group), kind))
    if len(counts) == 1 and (g := counts.pop()) > 1:
        two = hierarchical_terms(kind, nbytes, g, len(per_host))
        two = TwoLevelTerms(_scaled(two.intra, latency_share), _scaled(two.inter, latency_share))
        return two.seconds(intra_link(cluster, g, kind), network_link(cluster))
    terms = _scaled(alpha_beta_terms(kind, nbytes, len(group)), latency_share)
    return terms.seconds(network_link(cluster))


def _scaled(terms: AlphaBetaTerms, latency_share: float) -> AlphaBetaTerms:
    if latency_share == 1.0:
        return terms
    return AlphaBetaTerms(terms.latency_steps * latency_share, terms.wire_bytes)


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
