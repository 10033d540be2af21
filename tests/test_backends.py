"""The seam per backend (`autopar.cost.backends`): which backend a cluster gets, and that
XLA:CPU's fields price nothing on another backend."""

import dataclasses

import pytest

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import backends, collective_time, combined_collective_time, pipelined_step_time
from autopar.cost.backends import XLA_CPU, XLA_GPU, Backend, backend_for, register_backend

MiB = 2**20


def test_backend_by_device_kind_of_a_cluster_or_its_json():
    cpu = Cluster.from_profile("cpu-local-measured")
    h100 = Cluster.from_profile("dgx-h100")
    assert backend_for(cpu) is XLA_CPU and backend_for(cpu.to_json()) is XLA_CPU
    assert backend_for(h100) is XLA_GPU and backend_for(h100.to_json()) is XLA_GPU
    assert backend_for(Cluster.from_profile("p3.16xlarge-v100")) is XLA_GPU
    assert backend_for({}) is backends.DEFAULT_BACKEND is XLA_GPU


def test_a_new_accelerator_registers_one_backend():
    class Tpu(type(XLA_GPU)):
        name = "xla:tpu"

    tpu = Tpu()
    register_backend("TPU", tpu)
    try:
        kind = dataclasses.replace(Cluster.from_profile("dgx-h100"), device_kind="TPU v4")
        assert backend_for(kind) is tpu
        assert backend_for({"device_kind": "cpu"}) is XLA_CPU
    finally:
        del backends._BACKENDS["tpu"]
        backends._lookup.cache_clear()
    assert backend_for(kind) is XLA_GPU
    with pytest.raises(TypeError, match="needs a Backend instance"):
        register_backend("tpu", object())
    with pytest.raises(TypeError):
        type("Half", (Backend,), {})()  # every behaviour must be answered


def test_xla_cpu_fields_price_nothing_on_a_gpu():
    """A GPU profile carrying XLA:CPU's figures prices none of XLA:CPU's behaviours."""
    h100 = Cluster.from_profile("dgx-h100", num_hosts=1)
    cpu_only = dataclasses.replace(
        h100, transpose_bandwidth=((2.0**18, 1e9), (2.0**23, 5e8)), host_cores=2,
        task_device_overhead=1e-3, collective_latency_by_group=((2, 1e-3), (8, 2e-3)),
        combined_operand_latency=1.0)
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    assert collective_time("all_reduce", MiB, cpu_only, mesh, "x") == (
        collective_time("all_reduce", MiB, h100, mesh, "x"))
    assert combined_collective_time("all_reduce", MiB, cpu_only, mesh, "x") == (
        combined_collective_time("all_reduce", MiB, h100, mesh, "x"))
    pipeline = dict(group_devices=[4, 4], returned_bytes=[MiB, MiB])
    assert pipelined_step_time([0.02, 0.03], cpu_only, 4, **pipeline) == (
        pipelined_step_time([0.02, 0.03], h100, 4, **pipeline))
    assert not XLA_GPU.prices_layout_copies(cpu_only)
    # the same figures on a CPU cluster do price
    cpu = dataclasses.replace(cpu_only, device_kind="cpu")
    assert XLA_CPU.prices_layout_copies(cpu)
    assert pipelined_step_time([0.02, 0.03], cpu, 4, **pipeline) != (
        pipelined_step_time([0.02, 0.03], h100, 4, **pipeline))
    assert collective_time("all_reduce", MiB, cpu, mesh, "x") != (
        collective_time("all_reduce", MiB, h100, mesh, "x"))
