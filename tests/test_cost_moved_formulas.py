"""The formulas moved into `autopar.cost` (issue 43), each against a hand computation."""

import pytest

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import (
    collective_time,
    collectives_seconds,
    core_share,
    fusion_boundary_bytes,
    repriced_copy_seconds,
    tasks_cpu_seconds,
)


def test_fusion_boundary_bytes_counts_what_crosses_the_fusion():
    # operands: read from memory, a constant (None), kept on chip; results: kept, written
    assert fusion_boundary_bytes([4, None, 8], [16, 32], (True, True, False),
                                 (False, True)) == 36.0


def test_collectives_seconds_sums_collective_time_and_memoises_each():
    cluster = Cluster.from_profile("dgx-a100-80g")
    mesh = LogicalMesh.create((2, 4))
    x, y = mesh.axis_names
    steps = [("all_gather", 1e6, (y,)), ("all_to_all", 2e6, (x,)), ("all_gather", 1e6, (y,))]
    by_hand = sum(collective_time(k, b, cluster, mesh, a) for k, b, a in steps)
    memo: dict = {}
    assert collectives_seconds(steps, cluster, mesh) == pytest.approx(by_hand, rel=1e-15)
    assert collectives_seconds(steps, cluster, mesh, memo) == pytest.approx(by_hand, rel=1e-15)
    assert set(memo) == {("collective", "all_gather", 1e6, (y,)),
                         ("collective", "all_to_all", 2e6, (x,))}


def test_repriced_copy_seconds_weighs_the_difference():
    # (weight, on the stage's graph, on the layer's graph)
    assert repriced_copy_seconds([(2.0, 3.0, 1.0), (0.5, 1.0, 1.0), (1.0, 0.5, 0.25)]) == 4.25


def test_task_work_at_each_devices_share_of_a_core():
    assert core_share(2, 8) == 0.25  # 8 virtual devices on 2 cores
    assert core_share(None, 8) == core_share(16, 8) == 1.0
    # two stages of 4 devices, 0.1 s and 0.2 s per microbatch, 3 microbatches
    assert tasks_cpu_seconds([(0.1, 4), (0.2, 4)], 3, 0.25) == pytest.approx(0.9, rel=1e-12)


def test_expert_formulas_by_hand():
    from autopar.cost import (
        compute_time,
        ep_exchange_bytes,
        ep_grouped_gemm_time,
        imbalance_compute_time,
        trained_param_bytes,
        weight_and_gradient_bytes,
    )

    # bf16 weight, fp32 gradient, fp32 master and moments split over 4 devices
    assert trained_param_bytes(2, 4) == 2 + 4 + 12 / 4
    assert weight_and_gradient_bytes(2) == 6
    # forward: dispatch the rows, combine the result, the weights read whole
    assert ep_exchange_bytes(1, 100.0, 40.0, 60.0, 1.5, 2) == ([75.0], [45.0], 120.0)
    # weight gradient: both row operands dispatched, the weight gradient written whole
    assert ep_exchange_bytes(2, 100.0, 40.0, 60.0, 1.5, 2) == ([75.0, 30.0], [], 130.0)
    cluster = Cluster.from_profile("dgx-h100")
    assert ep_grouped_gemm_time(8e9, 4, 1.5, 2, 10.0, 120.0, cluster, "bfloat16") == (
        compute_time(8e9 / 4 * 1.5 / 2, 130.0 * 1.5, cluster, "bfloat16", matmul=True))
    assert imbalance_compute_time(1e12, 1.25, cluster, "bfloat16") == pytest.approx(
        3 * compute_time(0.25e12, 0.0, cluster, "bfloat16", matmul=True), rel=1e-15)
