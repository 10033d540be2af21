"""What XLA:CPU's virtual devices cost beyond the roofline (issue 14): layout copies (which
dot operands XLA:CPU copies into another memory order, checked against the optimized HLO
it compiles, and their price), a pipeline's returned weight gradients, and devices sharing
the host's cores; each against hand computation."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost.backends._xla_cpu import layout_copies, layout_copy_time, transpose_bandwidth
from autopar.graph import trace
from autopar.intra._strategies import CostContext, node_signature, node_strategies

MiB = 2**20

# einsum, operand shapes: the dots of a transformer's forward and backward and a few more.
DOTS = {
    "bsh,ho->bso": ((2, 64, 128), (128, 384)),  # forward
    "bso,ho->bsh": ((2, 64, 384), (128, 384)),  # input gradient
    "bsh,bso->ho": ((2, 64, 128), (2, 64, 384)),  # weight gradient
    "bso,bsh->oh": ((2, 64, 512), (2, 64, 128)),
    "bqhd,bkhd->bhqk": ((2, 64, 4, 32), (2, 64, 4, 32)),  # attention scores
    "bhqk,bkhd->bhqd": ((2, 4, 64, 64), (2, 64, 4, 32)),  # attention output
    "bqd,bkd->bqk": ((4, 64, 32), (4, 64, 32)),
    "bqk,bkd->bqd": ((4, 64, 64), (4, 64, 32)),
    "dbq,dbk->bqk": ((32, 4, 64), (32, 4, 64)),
    "sh,so->ho": ((128, 128), (128, 384)),  # rank 2: Eigen's GEMM, no copy
}


def _copied_in_hlo(fn, *args) -> int:
    """Copies of a dot operand in XLA:CPU's optimized HLO: loop fusions or copies that
    change the memory order of a parameter before the dot."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return sum(1 for line in entry.splitlines()
               if re.search(r"= \S+ (fusion|copy|transpose)\(%\w+\.?\d*\)", line)
               and ("copy" in line or "transpose" in line) and "ynn" not in line)


@pytest.mark.parametrize("spec", sorted(DOTS))
def test_layout_rule_matches_xla_cpu_hlo(spec):
    """`layout_copies` names as many copied operands as XLA:CPU makes for the dot alone."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the rule describes XLA:CPU")
    shapes = DOTS[spec]
    args = [jnp.ones(s, jnp.float32) for s in shapes]

    def fn(x, y):
        return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)

    graph = trace(fn, *args)
    dots = [n for n in graph.nodes if n.primitive == "dot_general"]
    transposes = [n for n in graph.nodes if n.primitive == "transpose"]
    assert len(dots) == 1
    predicted = len(layout_copies(graph, dots[0])) + sum(
        len(layout_copies(graph, t)) for t in transposes)
    assert predicted == _copied_in_hlo(fn, *args), spec


@pytest.fixture
def cpu():
    table = ((256 * 1024, 1.5e9), (1 * MiB, 0.75e9), (8 * MiB, 0.6e9))
    return dataclasses.replace(Cluster.local(), transpose_bandwidth=table)


def test_transpose_bandwidth_interpolates_in_log_bytes(cpu):
    assert transpose_bandwidth(cpu, 256 * 1024) == pytest.approx(1.5e9)
    assert transpose_bandwidth(cpu, 512 * 1024) == pytest.approx((1.5e9 + 0.75e9) / 2)
    assert transpose_bandwidth(cpu, 64 * MiB) == pytest.approx(0.6e9)  # held at the end
    assert transpose_bandwidth(Cluster.local(), MiB) == Cluster.local().hbm_bandwidth


def test_layout_copy_time_by_hand(cpu):
    # A 1 MiB operand copied alone: 2 MiB moved at the 1 MiB rate.
    assert layout_copy_time(MiB, cpu) == pytest.approx(2 * MiB / 0.75e9)
    # Inside the fusion that makes it from 8 MiB of inputs: 9 MiB at the 8 MiB rate, less
    # the straight loop the roofline already charges at hbm_bandwidth.
    expected = 9 * MiB / 0.6e9 - 9 * MiB / cpu.hbm_bandwidth
    assert layout_copy_time(MiB, cpu, fan_in=8, fused=True) == pytest.approx(expected)
    # GPU profiles (no table) charge nothing.
    assert layout_copy_time(MiB, Cluster.from_profile("dgx-a100-80g")) == 0.0
    with pytest.raises(ValueError, match="fan_in >= 1"):
        layout_copy_time(MiB, cpu, fan_in=0.5)


def test_weight_gradient_dot_pays_its_copy_in_the_ilp(cpu):
    """The weight-gradient dot's strategy costs its roofline plus one copy of its left
    operand, per device, on a profile with `transpose_bandwidth`; on one without, none."""
    x, dy = jnp.ones((16, 64, 128)), jnp.ones((16, 64, 512))
    graph = trace(lambda x, dy: jnp.einsum("bsh,bso->ho", x, dy), x, dy)
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    (copy,) = layout_copies(graph, dot)
    assert (copy.operand, copy.fan_in, copy.fused) == (0, 1.0, False)  # a graph input
    mesh = LogicalMesh.create((8,), axis_names=("x",))

    def batch_split(cluster):
        strategies = node_strategies(dot, graph, node_signature(dot, graph),
                                     CostContext(cluster, mesh))
        return next(s for s in strategies if s.in_specs[0] == (("x",), (), ()))

    with_copy, without = batch_split(cpu), batch_split(Cluster.local())
    per_device = 16 * 64 * 128 * 4 / 8
    assert with_copy.compute_cost - without.compute_cost == pytest.approx(
        layout_copy_time(per_device, cpu))


def test_copy_runs_inside_the_elementwise_fusion_that_makes_its_operand():
    """A copied operand made by elementwise ops: the copy's loop recomputes it from the
    values written to memory, which XLA:CPU duplicates into it even where other dots read
    the operand or the values on the way; an expensive op (tanh) is written instead of
    duplicated once its chain is read elsewhere. The model's fan-in (here every input has
    the operand's size, so it counts them) equals the operands of XLA's copy fusion."""
    a = b = c = jnp.ones((2, 64, 128))
    w, v = jnp.ones((2, 64, 384)), jnp.ones((128, 384))

    def weight_grad(g):
        return jnp.einsum("bsh,bso->ho", g, w)  # copies g: its contracting dims lead

    def alone(a, b, c):
        return weight_grad(a * b + c)

    def shared(a, b, c):  # another dot reads g: recomputed in the copy all the same
        g = a * b + c
        return weight_grad(g), g @ v

    def chained(a, b, c):  # g2's copy recomputes g1 too, though dots read g1
        g1 = a * b + c
        g2 = g1 * c + a
        return weight_grad(g1), g1 @ v, weight_grad(g2), g2 @ v

    def tanh_alone(a, b, c):  # read by the copy alone: the tanh runs inside it
        return weight_grad(jnp.tanh(a * b) * b + c)

    def tanh_shared(a, b, c):  # duplicated into two loops: the tanh is written once
        g = jnp.tanh(a) * b + c
        h = g * c + a
        return weight_grad(h), h @ v, g @ v

    for fn, inputs in ((alone, 3), (shared, 3), (chained, 3), (tanh_alone, 3),
                       (tanh_shared, 4)):
        graph = trace(fn, a, b, c)
        copies = [copy for n in graph.nodes if n.primitive == "dot_general"
                  for copy in layout_copies(graph, n)]
        assert copies and all(copy.fused for copy in copies), fn.__name__
        assert max(copy.fan_in for copy in copies) == pytest.approx(inputs), fn.__name__
        hlo = jax.jit(fn).lower(a, b, c).compile().as_text()
        fusions = re.findall(r"= f32\[128,128\]\S* fusion\((.*?)\), kind=kLoop", hlo)
        copy_inputs = [len(args.split(",")) for args in fusions]
        assert max(copy_inputs) == inputs, (fn.__name__, fusions)


# ---- devices sharing the host's cores; the gradients a pipeline's backward returns ------


def test_shared_cores_simulation_by_hand():
    from autopar.cost._schedule import simulate, simulate_shared

    # Two stages of 4 of 8 devices on 2 cores, F = 1 and B = 2 s: one microbatch runs
    # each task alone at twice its speed (3 s against 6); with 4 the bubble is gone: the
    # 8 devices' work over the cores, 2 stages x 4 devices x 4 x 3 s / 8 = 12 s.
    assert simulate_shared([1.0, 1.0], [2.0, 2.0], 1, [4, 4], 2, 8) == pytest.approx(3.0)
    assert max(simulate([1.0, 1.0], [2.0, 2.0], 1)[1]) == pytest.approx(6.0)
    assert simulate_shared([1.0] * 2, [2.0] * 2, 4, [4, 4], 2, 8) == pytest.approx(12.0)
    # a device thread uses one core at most: 2 stages of 1 device on 8 devices, 2 cores,
    # run at one core each (4x): 1 microbatch, (1 + 1 + 2 + 2) / 4
    assert simulate_shared([1.0] * 2, [2.0] * 2, 1, [1, 1], 2, 8) == pytest.approx(1.5)
    # the host's launches on the same cores
    assert simulate_shared([1.0] * 2, [2.0] * 2, 4, [4, 4], 2, 8, host_work=2.0) == (
        pytest.approx(13.0))
    with pytest.raises(ValueError, match="a device count >= 1 per stage"):
        simulate_shared([1.0] * 2, [2.0] * 2, 4, [4], 2, 8)


def test_pipelined_step_time_on_shared_cores_and_with_returned_gradients(cpu):
    from autopar.cost import pipelined_step_time
    from autopar.cost._schedule import simulate_shared
    from autopar.cost.backends._xla_cpu import host_work_per_step, returned_gradient_time

    shared = dataclasses.replace(cpu, host_cores=2, dispatch_overhead=1e-3,
                                 task_device_overhead=2e-4)
    shares = (0.4, 0.3, 0.3)
    times, grads = [0.02, 0.03], [MiB, 2 * MiB]
    extra = [returned_gradient_time(b, shared) for b in grads]
    # returning a weight gradient: a transposing pass and a copy, by hand
    assert extra[0] == pytest.approx(layout_copy_time(MiB, cpu) + 2 * MiB / cpu.hbm_bandwidth)
    assert returned_gradient_time(MiB, Cluster.from_profile("dgx-h100")) == 0.0
    forward = [t * 0.4 for t in times]
    backward = [t * 0.6 + e for t, e in zip(times, extra)]
    # 9 tasks per stage (4 forwards, 4 backwards, the update), each 1 ms of the host
    # thread and 0.2 ms of each of its 4 devices' threads
    host = 2 * 9 * (1e-3 + 4 * 2e-4)
    assert host_work_per_step(shared, [4, 4], 4) == pytest.approx(host)
    assert host_work_per_step(dataclasses.replace(shared, task_device_overhead=0.0),
                              [4, 4], 4) == pytest.approx(1e-3 * 2 * 9)
    expected = simulate_shared(forward, backward, 4, [4, 4], 2, 8, host_work=host)
    assert pipelined_step_time(times, shared, 4, phase_shares=shares, group_devices=[4, 4],
                               returned_bytes=grads) == pytest.approx(expected)
    # without `host_cores` (or without the devices per stage): Alpa's latency as before;
    # one stage returns nothing (its update reads the gradients in one program)
    plain = dataclasses.replace(shared, host_cores=None)
    assert pipelined_step_time(times, plain, 4, phase_shares=shares, group_devices=[4, 4]) == (
        pytest.approx(pipelined_step_time(times, plain, 4, phase_shares=shares)))
    assert pipelined_step_time([0.02], shared, 4, group_devices=[8], returned_bytes=[MiB]) == (
        pytest.approx(pipelined_step_time([0.02], shared, 4)))
