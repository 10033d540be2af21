"""The cost model against hand computation on the DGX A100 profile."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from autopar.cluster import Cluster, Link, LogicalMesh, to_partition_spec
from autopar.cost import (
    CollectiveSample,
    alpha_beta_terms,
    batch_feed_seconds,
    bytes_per_device,
    collective_time,
    compute_time,
    fit_link,
    kernel_seconds,
    layout_copy_seconds,
    link_for,
    nearest_group_entry,
    node_compute_seconds,
    rail_share,
    reductions_seconds,
    transfer_time,
    unfused_bytes,
    write_bandwidth,
)
from autopar.cost.backends import backend_for

GiB = 2**30
NVLINK_BW, NVLINK_LAT = 300e9, 5e-6  # dgx-a100-80g.json intra_host
IB_BW, IB_LAT = 25e9, 10e-6  # dgx-a100-80g.json inter_host


@pytest.fixture(scope="module")
def a100():
    return Cluster.from_profile("dgx-a100-80g")


@pytest.fixture(scope="module")
def two_hosts(a100):
    return a100.with_shape(2, 8)


@pytest.fixture(scope="module")
def hosts_by_devices_mesh():
    """A (x=8, y=2) mesh on 2 hosts: x runs inside a host, y across the two hosts."""
    ids = [host * 8 + local for local in range(8) for host in range(2)]
    return LogicalMesh.create((8, 2), ids, ("x", "y"))


def test_all_reduce_one_host(a100):
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    expected = 2 * 7 / 8 * GiB / NVLINK_BW + 2 * 7 * NVLINK_LAT
    assert collective_time("all_reduce", GiB, a100, mesh, ("x",)) == pytest.approx(expected)
    assert expected == pytest.approx(6.33e-3, rel=1e-3)  # the docstring's example


def test_all_reduce_uses_the_link_of_its_group_size():
    """With `intra_host_by_group` a group of n devices pays the link measured for groups of
    n: on a (4, 2) mesh of 8 CPU devices, an all-reduce over y (4 pairs) rides the pair
    link, one over x (2 quads) the quad link, one over both the 8-device link."""
    pair, quad, eight = Link(1e9, 1e-4), Link(2e9, 3e-5), Link(3e9, 1e-5)
    cluster = dataclasses.replace(Cluster.from_profile("cpu-local"),
                                  intra_host_by_group=((2, pair), (4, quad), (8, eight)))
    mesh = LogicalMesh.create((4, 2), axis_names=("x", "y"))
    nbytes = 2**20
    assert collective_time("all_reduce", nbytes, cluster, mesh, "y") == pytest.approx(
        2 * 1 / 2 * nbytes / 1e9 + 2 * 1 * 1e-4)
    assert collective_time("all_reduce", nbytes, cluster, mesh, "x") == pytest.approx(
        2 * 3 / 4 * nbytes / 2e9 + 2 * 3 * 3e-5)
    assert collective_time("all_reduce", nbytes, cluster, mesh, ("x", "y")) == pytest.approx(
        2 * 7 / 8 * nbytes / 3e9 + 2 * 7 * 1e-5)


def test_all_reduce_one_gpu_per_host_uses_network(a100):
    cluster = a100.with_shape(8, 8)
    mesh = LogicalMesh.create((8,), [host * 8 for host in range(8)], ("x",))
    expected = 2 * 7 / 8 * GiB / IB_BW + 2 * 7 * IB_LAT
    assert collective_time("all_reduce", GiB, cluster, mesh, "x") == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_one_pass_collectives(a100, kind):
    mesh = LogicalMesh.create((4,), axis_names=("x",))
    expected = 3 / 4 * GiB / NVLINK_BW + 3 * NVLINK_LAT
    assert collective_time(kind, GiB, a100, mesh, ("x",)) == pytest.approx(expected)


def test_send_recv(a100):
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    expected = GiB / NVLINK_BW + NVLINK_LAT
    assert collective_time("send_recv", GiB, a100, mesh, ("x",)) == pytest.approx(expected)


def test_reduce_scatter_plus_all_gather_is_all_reduce(a100):
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    parts = sum(collective_time(k, GiB, a100, mesh, "x") for k in ("reduce_scatter",
                                                                    "all_gather"))
    assert parts == pytest.approx(collective_time("all_reduce", GiB, a100, mesh, "x"))


def test_two_dimensional_mesh_link_levels(two_hosts, hosts_by_devices_mesh):
    mesh = hosts_by_devices_mesh
    assert mesh.groups("x")[0] == tuple(range(8))
    inside = collective_time("all_reduce", GiB, two_hosts, mesh, ("x",))
    across = collective_time("all_reduce", GiB, two_hosts, mesh, ("y",))
    both = collective_time("all_reduce", GiB, two_hosts, mesh, ("x", "y"))
    assert inside == pytest.approx(2 * 7 / 8 * GiB / NVLINK_BW + 14 * NVLINK_LAT)
    assert across == pytest.approx(2 * 1 / 2 * GiB / IB_BW + 2 * IB_LAT)
    # 8 GPUs on each of 2 hosts: hierarchical (NCCL over 8 rails), not one ring at one
    # NIC's bandwidth (2·15/16·GiB/IB_BW = 80.5 ms): reduce-scatter + all-gather inside,
    # all-reduce of GiB/8 across hosts over every rail
    assert both == pytest.approx(
        2 * 7 / 8 * GiB / NVLINK_BW + 14 * NVLINK_LAT + 2 * 1 / 2 * GiB / 8 / IB_BW + 2 * IB_LAT
    )


def test_host_major_mesh_axis_inside_host(two_hosts):
    mesh = LogicalMesh.create((2, 8), axis_names=("y", "x"))  # devices 0..15 row-major
    assert collective_time("all_gather", GiB, two_hosts, mesh, "x") == pytest.approx(
        7 / 8 * GiB / NVLINK_BW + 7 * NVLINK_LAT
    )


def test_single_device_axis_costs_nothing(a100):
    mesh = LogicalMesh.create((1, 8), axis_names=("x", "y"))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        assert collective_time(kind, GiB, a100, mesh, ("x",)) == 0.0


def test_collective_errors(a100):
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'.*all_reduce"):
        collective_time("allreduce", GiB, a100, mesh, ("x",))
    with pytest.raises(ValueError, match=r"mesh axes \['z'\] are not in the mesh"):
        collective_time("all_reduce", GiB, a100, mesh, ("z",))
    with pytest.raises(ValueError, match="device id 9 is not in cluster"):
        collective_time("all_reduce", GiB, a100, LogicalMesh.create((2,), (0, 9)), "x")


def test_link_for(two_hosts):
    assert link_for(two_hosts, [0, 3, 7]) == Link(NVLINK_BW, NVLINK_LAT)
    assert link_for(two_hosts, [9]) == Link(NVLINK_BW, NVLINK_LAT)
    assert link_for(two_hosts, [7, 8]) == Link(IB_BW, IB_LAT)


def test_transfer_time(two_hosts):
    across = transfer_time(GiB, two_hosts, range(8), range(8, 16))
    assert across == pytest.approx(IB_LAT + GiB / (8 * IB_BW))
    inside = transfer_time(GiB, two_hosts, [0, 1], [2, 3, 4, 5])
    assert inside == pytest.approx(NVLINK_LAT + GiB / (2 * NVLINK_BW))
    assert transfer_time(GiB, two_hosts, [0, 1], [1, 0]) == 0.0
    with pytest.raises(ValueError, match="at least one source"):
        transfer_time(GiB, two_hosts, [], [1])


def test_bytes_per_device_even_matches_jax(devices):
    mesh = LogicalMesh.create((4, 2), axis_names=("x", "y"))
    jax_mesh = Mesh(np.array(devices).reshape(4, 2), ("x", "y"))
    for spec in [(("x",), ()), (("x", "y"), ()), (("y",), ("x",)), ((), ())]:
        shard = NamedSharding(jax_mesh, to_partition_spec(spec)).shard_shape((16, 8))
        expected = np.prod(shard) * 4
        assert bytes_per_device((16, 8), "float32", spec, mesh) == expected


def test_bytes_per_device_uneven_and_dtypes():
    mesh = LogicalMesh.create((2, 4), axis_names=("x", "y"))
    assert bytes_per_device((10, 7), "float32", ((), ("y",)), mesh) == 10 * 2 * 4
    assert bytes_per_device((10, 6), "bfloat16", (("x", "y"), ()), mesh) == 2 * 6 * 2
    assert bytes_per_device((3,), jax.numpy.int8, (("y",),), mesh) == 1
    assert bytes_per_device((), "float32", (), mesh) == 4
    with pytest.raises(ValueError, match="has 1 entries but the tensor has shape"):
        bytes_per_device((4, 4), "float32", (("x",),), mesh)
    with pytest.raises(ValueError, match="at most once"):
        bytes_per_device((4, 4), "float32", (("x",), ("x",)), mesh)


def test_compute_time_roofline_regimes(a100):
    matmul_flops = 2 * 8192**3
    compute_bound = compute_time(matmul_flops, 3 * 8192**2 * 2, a100, "bfloat16")
    assert compute_bound == pytest.approx(matmul_flops / (312e12 * 0.7))
    memory_bound = compute_time(1e6, 1e9, a100, "bfloat16")
    assert memory_bound == pytest.approx(1e9 / 2.0e12)
    assert compute_time(1e12, 0, a100) == pytest.approx(1e12 / (156e12 * 0.7))
    assert compute_time(1e12, 0, a100, jax.numpy.bfloat16) == pytest.approx(1e12 / (312e12 * 0.7))
    assert compute_time(1e12, 0, a100, "int32") == pytest.approx(1e12 / (156e12 * 0.7))
    with pytest.raises(ValueError, match="flops >= 0"):
        compute_time(-1, 0, a100)


def test_alpha_beta_terms_table():
    assert alpha_beta_terms("all_reduce", 800, 4).latency_steps == 6
    assert alpha_beta_terms("all_reduce", 800, 4).wire_bytes == 1200
    assert alpha_beta_terms("all_to_all", 800, 4).wire_bytes == 600
    assert alpha_beta_terms("send_recv", 800, 4).wire_bytes == 800
    assert alpha_beta_terms("all_gather", 800, 1).wire_bytes == 0


def test_fit_link_recovers_known_link():
    truth = Link(bandwidth=2e9, latency=30e-6)
    samples = [
        CollectiveSample(kind, n, size, 0)
        for kind in ("all_reduce", "all_gather", "send_recv")
        for n in (2, 8)
        for size in (1e4, 1e6, 1e8)
    ]
    samples = [CollectiveSample(s.kind, s.num_devices, s.nbytes, s.predicted(truth))
               for s in samples]
    fitted = fit_link(samples)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert fitted.latency == pytest.approx(truth.latency, rel=1e-6)


def test_fit_link_clamps_negative_latency():
    # Times that grow faster than linearly would need a negative latency: clamp to 0.
    samples = [CollectiveSample("send_recv", 2, 1e3, 1e-7),
               CollectiveSample("send_recv", 2, 1e6, 1e-3)]
    fitted = fit_link(samples)
    assert fitted.latency == 0.0
    assert 1e9 <= fitted.bandwidth <= 1e10
    with pytest.raises(ValueError, match="do not grow with the message size"):
        fit_link([CollectiveSample("send_recv", 2, 1e3, 1e-3),
                  CollectiveSample("send_recv", 2, 1e6, 1e-4)])


def test_link_choice_by_hand(a100):
    """The nearest measured group in log2, a tie to the larger; a host's rails shared by
    its devices; fresh and in-place writes at hbm_bandwidth without inplace_bandwidth."""
    table = ((2, "two"), (4, "four"), (8, "eight"))
    assert [nearest_group_entry(table, n) for n in (2, 3, 5, 6, 16)] == [
        "two", "four", "four", "eight", "eight"]
    assert nearest_group_entry(((2, "two"), (8, "eight")), 4) == "eight"  # a tie
    assert rail_share(1, 8) == 1 / 8 and rail_share(8, 8) == 1.0 and rail_share(16, 8) == 1.0
    assert write_bandwidth(a100) == write_bandwidth(a100, True) == a100.hbm_bandwidth == 2.0e12


def test_node_cost_by_hand(a100):
    """A node's compute is its roofline plus what it adds; its reductions sum their
    collectives; the batch a device holds is written at hbm_bandwidth."""
    assert node_compute_seconds(1e12, 0, a100, extra_seconds=1e-3) == pytest.approx(
        1e12 / (156e12 * 0.7) + 1e-3)
    assert node_compute_seconds(1e6, 1e9, a100, "bfloat16", extra_seconds=0.0) == \
        compute_time(1e6, 1e9, a100, "bfloat16")
    assert batch_feed_seconds(1e9, a100) == pytest.approx(1e9 / 2.0e12)
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    one = collective_time("all_reduce", 1e9, a100, mesh, "x")
    pair = [("all_reduce", 1e9, "x", False), ("all_gather", 1e9, "x", False)]
    assert reductions_seconds(pair, a100, mesh) == pytest.approx(
        one + collective_time("all_gather", 1e9, a100, mesh, "x"))
    assert reductions_seconds([], a100, mesh) == 0
    assert kernel_seconds(a100, False) == 0.0
    assert unfused_bytes([None, 4.0], [8.0, 2.0]) == 14.0
    cpu = Cluster.from_profile("cpu-local-measured")
    copies = [(1e6, 1, False, True), (4e6, 2, True, True), (2e6, 1, False, False)]
    backend = backend_for(cpu)
    seconds = layout_copy_seconds(cpu, copies)
    assert seconds > 0
    assert seconds == pytest.approx(sum(backend.layout_copy_seconds(cpu, *c) for c in copies))
    assert layout_copy_seconds(cpu, []) == 0.0
