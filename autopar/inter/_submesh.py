"""Submesh shapes for pipeline stages, their logical meshes, and their place on the cluster.

Alpa (REFERENCES.md, "Stage DP") gives every pipeline stage a submesh of one of these
shapes on a cluster of `num_hosts` hosts with `devices_per_host` (M) devices each:
``(1, 1), (1, 2), (1, 4), ... (1, M)`` inside one host and ``(n, M)`` for n whole hosts.
When M is a power of two, any choice of such submeshes whose device counts add up to the
whole cluster can be packed onto it without a submesh straddling a host (`assign_devices`
does the packing; the tests check the claim).

In: the cluster shape. Out: plain numbers (shapes, device ids); nothing here knows JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SubmeshShape:
    """A block of `num_hosts` hosts times `devices_per_host` devices on each of them.

    **Arguments:**
    - `num_hosts`: hosts the submesh spans (1 for a submesh inside one host).
    - `devices_per_host`: devices it uses on each of those hosts.
    """

    num_hosts: int
    devices_per_host: int

    def __post_init__(self):
        for name in ("num_hosts", "devices_per_host"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"SubmeshShape.{name} must be a positive int, got {value!r}; a submesh "
                    "is num_hosts x devices_per_host devices, e.g. SubmeshShape(1, 4)"
                )

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def __str__(self) -> str:
        return f"{self.num_hosts}x{self.devices_per_host}"


def _check_cluster(num_hosts: int, devices_per_host: int) -> None:
    for name, value in (("num_hosts", num_hosts), ("devices_per_host", devices_per_host)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def submesh_shapes(num_hosts: int, devices_per_host: int) -> list[SubmeshShape]:
    """Alpa's submesh shapes for a cluster, smallest first.

    **Arguments:**
    - `num_hosts`, `devices_per_host`: the cluster shape.

    **Returns:**
    ``(1, 1), (1, 2), (1, 4), ...`` (powers of two below `devices_per_host`), then
    ``(1, devices_per_host)``, then ``(n, devices_per_host)`` for n = 2 .. `num_hosts`.
    For 2 hosts of 4 devices: ``1x1, 1x2, 1x4, 2x4``.
    """
    _check_cluster(num_hosts, devices_per_host)
    shapes = []
    size = 1
    while size < devices_per_host:
        shapes.append(SubmeshShape(1, size))
        size *= 2
    shapes.append(SubmeshShape(1, devices_per_host))
    shapes.extend(SubmeshShape(n, devices_per_host) for n in range(2, num_hosts + 1))
    return shapes


def logical_mesh_shapes(sub: SubmeshShape, every: bool = False) -> list[tuple[int, ...]]:
    """The logical mesh shapes to try for a stage on submesh `sub`.

    **Arguments:**
    - `sub`: the submesh.
    - `every`: also the shapes the search leaves out (below); for checking that rule.

    **Returns:**
    ``(d,)`` for its d devices; then, for a submesh of several whole hosts, the host-aligned
    ``(num_hosts, devices_per_host)`` (axis 0 crosses hosts, axis 1 stays inside them); then
    every other 2-D ``(a, d // a)`` with both sides > 1, by increasing a. A 1x8 submesh gives
    ``[(8,), (2, 4), (4, 2)]``; a 4x2 one ``[(8,), (4, 2)]``.

    On a submesh of several hosts, a 2-D shape whose second axis does not divide the
    devices of a host is left out: devices are numbered host by host, so some groups of
    that axis span hosts, and so do some of the first axis; a collective on either axis
    then waits for the hosts' network. Megatron-LM keeps tensor parallelism inside a node
    for that reason (Narayanan et al. 2021, section 3.3, takeaway 1). The shapes kept still
    split the devices every way a plan may want: the whole submesh as one axis, and a
    host-local axis of each size dividing a host with the rest along the other.
    `tests/test_stage_dp.py` checks that the search with every shape finds the same plans
    on clusters of several hosts.

    A one-host shape and its transpose, (2, 4) and (4, 2), are both solved: they are not
    one problem relabelled (issue 45 asked; `tests/test_twin_meshes.py`). The collectives
    see group sizes only and reshardings between specs with one axis per dimension
    relabel to the last bit, but a dimension split by both axes takes them in mesh order
    (`enumerate_assignments`): its major digit is the axis of 2 on (2, 4), the axis of 4
    on (4, 2), two tile orders that XLA's routes (`autopar.intra._reshard`) price apart.
    The demo's stage is on (4, 2), cheaper there than on (2, 4); without (4, 2) its
    prediction moves from 0.026407624841747968 to 0.028053746063622972 s (6 %;
    ``python -m benchmarks.investigations.twin_meshes demo --drop``).
    """
    if not isinstance(sub, SubmeshShape):
        raise TypeError(f"expected a SubmeshShape, got {type(sub).__name__}: {sub!r}")
    num_devices = sub.num_devices
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    if sub.num_hosts > 1 and sub.devices_per_host > 1:
        shapes.append((sub.num_hosts, sub.devices_per_host))
    for first in range(2, num_devices // 2 + 1):
        shape = (first, num_devices // first)
        if num_devices % first or shape in shapes:
            continue
        if not every and sub.num_hosts > 1 and sub.devices_per_host % shape[1]:
            continue  # the second axis would cross hosts (see above)
        shapes.append(shape)
    return shapes


def splittable_shapes(sub: SubmeshShape, dims, *more_dims) -> list[tuple[int, ...]]:
    """`logical_mesh_shapes(sub)` less the shapes with an axis that divides none of `dims`
    (the dimension sizes of a layer's tensors), nor, given `more_dims`, none of each
    further layer's.

    A split needs its mesh axes to divide the dimension evenly (`_strategies._divisible`),
    so such an axis can only replicate that layer: every tensor of it whole along the
    axis, every device of it doing the same work as the others. Llama 3 405B on 16,384
    GPUs: of its 2,051 submeshes, those of k hosts for every k but a power of two have no
    shape left (13 x 2^i divides a block's MLP width, 53,248, but no dimension of the
    embedding's), and the stage DP leaves them out (`choose_stages`): 15 submeshes and 51
    logical meshes are left of 8,195."""
    sets = [{int(d) for d in ds if int(d) > 1} for ds in (dims, *more_dims)]

    def splits(axis: int) -> bool:
        return axis == 1 or all(any(d % axis == 0 for d in sizes) for sizes in sets)

    return [shape for shape in logical_mesh_shapes(sub) if all(map(splits, shape))]


def _check_fits(sub: SubmeshShape, num_hosts: int, devices_per_host: int) -> None:
    if sub.devices_per_host > devices_per_host or sub.num_hosts > num_hosts:
        raise ValueError(
            f"submesh {sub} does not fit a cluster of {num_hosts} hosts x "
            f"{devices_per_host} devices; use the shapes from submesh_shapes("
            f"{num_hosts}, {devices_per_host})"
        )
    if sub.num_hosts > 1 and sub.devices_per_host != devices_per_host:
        raise ValueError(
            f"submesh {sub} spans {sub.num_hosts} hosts but uses only {sub.devices_per_host} "
            f"of the {devices_per_host} devices on each; a multi-host submesh must take "
            f"whole hosts, i.e. ({sub.num_hosts}, {devices_per_host})"
        )


def assign_devices(
    stage_submeshes: Sequence[SubmeshShape], num_hosts: int, devices_per_host: int
) -> list[tuple[int, ...]]:
    """Concrete device ids for each stage's submesh.

    Device id = ``host * devices_per_host + local index``. Whole-host submeshes (those with
    ``devices_per_host`` devices on each host) take whole hosts from host 0 up, in stage
    order; the smaller, host-local ones are then packed into the remaining free space,
    largest first, each into the first host with room, never straddling a host boundary.

    **Arguments:**
    - `stage_submeshes`: one submesh per stage.
    - `num_hosts`, `devices_per_host`: the cluster shape.

    **Returns:**
    For each stage, in order, the device ids of its submesh in row-major
    (host, local device) order; the lists are disjoint.

    Raises `ValueError` if the submeshes do not fit on the cluster.
    """
    _check_cluster(num_hosts, devices_per_host)
    for sub in stage_submeshes:
        if not isinstance(sub, SubmeshShape):
            raise TypeError(f"expected SubmeshShape entries, got {type(sub).__name__}: {sub!r}")
        _check_fits(sub, num_hosts, devices_per_host)
    assignment: list[tuple[int, ...] | None] = [None] * len(stage_submeshes)
    next_host = 0
    for stage, sub in enumerate(stage_submeshes):
        if sub.devices_per_host != devices_per_host:
            continue
        if next_host + sub.num_hosts > num_hosts:
            raise ValueError(_no_fit_message(stage_submeshes, num_hosts, devices_per_host))
        first = next_host * devices_per_host
        assignment[stage] = tuple(range(first, first + sub.num_devices))
        next_host += sub.num_hosts
    free = [devices_per_host] * num_hosts  # free devices per host; used ones are a prefix
    for host in range(next_host):
        free[host] = 0
    local = [s for s, sub in enumerate(stage_submeshes) if assignment[s] is None]
    local.sort(key=lambda s: -stage_submeshes[s].num_devices)  # stable: ties in stage order
    for stage in local:
        size = stage_submeshes[stage].num_devices
        host = next((h for h in range(num_hosts) if free[h] >= size), None)
        if host is None:
            raise ValueError(_no_fit_message(stage_submeshes, num_hosts, devices_per_host))
        first = host * devices_per_host + devices_per_host - free[host]
        assignment[stage] = tuple(range(first, first + size))
        free[host] -= size
    return [ids for ids in assignment if ids is not None]


def _no_fit_message(
    stage_submeshes: Sequence[SubmeshShape], num_hosts: int, devices_per_host: int
) -> str:
    needed = sum(s.num_devices for s in stage_submeshes)
    shapes = ", ".join(str(s) for s in stage_submeshes)
    return (
        f"submeshes [{shapes}] ({needed} devices) cannot be packed onto {num_hosts} hosts x "
        f"{devices_per_host} devices without a host-local submesh straddling two hosts; "
        "use fewer or smaller submeshes (with devices_per_host a power of two, submeshes "
        "from submesh_shapes() that add up to at most the cluster always fit)"
    )
