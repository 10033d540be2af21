"""Stage-to-stage transfers go device to device: a plan whose neighbouring stages have
meshes of different shapes (4 devices, then 2, then 2) moves its activations and gradients
without reading them back to the host, and matches one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import NO_MICROBATCH_CHECK, run_steps
from jax._src import array as jax_array
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import autopar
from autopar.distributed import TRANSFER_PATHS, copy_to_devices
from examples import gpt

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every read of an array's value to the host (`ArrayImpl._value`, the path
    `jax.device_put` takes between meshes whose shards do not line up)."""
    count = [0]
    value = jax_array.ArrayImpl._value

    def counted(self):
        count[0] += 1
        return value.fget(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted))
    return count


@pytest.mark.parametrize(
    "target",
    [(("x",), (4,), ("x",)), (("x",), (2,), (None, "x")), (("p", "q"), (2, 2), ("q", "p")),
     (("p", "q"), (2, 3), ("p",))],
)
def test_copy_between_meshes_never_reads_to_host(host_reads, target):
    axes, shape, spec = target
    devices = jax.devices()
    source = NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b")),
                           PartitionSpec("a", "b"))
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    x = jax.device_put(value, source)
    size = int(np.prod(shape))
    mesh = Mesh(np.array(devices[8 - size:]).reshape(shape), axes)
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    host_reads[0] = 0
    y = copy_to_devices(x, sharding)
    assert host_reads[0] == 0
    assert y.sharding == sharding
    np.testing.assert_array_equal(np.asarray(y), value)


def test_repeated_copies_compile_once():
    # The runtime moves a stage's activations once per microbatch: the resharding program
    # on the source is compiled for the first and reused for the rest (a fresh jit of a
    # new lambda per call compiled every move, ~10 ms of CPU each on this machine).
    devices = jax.devices()
    source = NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b")),
                           PartitionSpec("a", "b"))
    target = NamedSharding(Mesh(np.array(devices[4:]), ("x",)), PartitionSpec(None, "x"))
    values = [np.full((8, 12), k, np.float32) for k in range(3)]
    copy_to_devices(jax.device_put(values[0], source), target)  # compiles
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiled.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    # (the suite's on-disk compilation cache, conftest: a program loaded from it instead of
    # compiled is a program obtained again all the same)
    jax.monitoring.register_event_listener(
        lambda event, **__: compiled.append(event)
        if event == "/jax/compilation_cache/cache_hits" else None
    )
    try:
        for value in values[1:]:
            y = copy_to_devices(jax.device_put(value, source), target)
            np.testing.assert_array_equal(np.asarray(y), value)
    finally:
        jax.monitoring.clear_event_listeners()  # no test registers any other
    assert compiled == []


def test_stages_of_different_mesh_shapes_transfer_device_to_device(host_reads):
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = gpt.make_train_step(GPT, optimizer)
    state = gpt.init_state(GPT, optimizer, jax.random.key(0))
    batch = gpt.make_batch(GPT, 8, jax.random.key(1))
    ref_losses, _ = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), donate_argnums=(),
        num_stages=3, num_microbatches=2, submeshes=[(1, 2), (1, 4)],
        logical_shapes=[(2,), (4,)], **NO_MICROBATCH_CHECK,
    )
    losses, moves, reads = [], [], []
    for _ in range(3):
        before, host_reads[0] = TRANSFER_PATHS["device_to_device"], 0
        state, metrics = par(state, batch)
        moves.append(TRANSFER_PATHS["device_to_device"] - before)
        reads.append(host_reads[0])
        losses.append(float(metrics["loss"]))
    shapes = [tuple(s.sharding.mesh.shape) for s in par.plan.stages]
    assert any(a != b for a, b in zip(shapes, shapes[1:])), shapes
    assert reads == [0, 0, 0], f"host reads per step: {reads}"
    assert min(moves) > 0, "no stage-to-stage move took the direct path"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_boundary_bytes_are_the_activations_crossing_each_cut():
    """An MLP of 4 dense layers (batch 8, hidden 32, out 8) and its loss: between dense
    layers a (8, 32) float32 activation crosses, before the loss the (8, 8) output; no
    parameter or batch input counts (they are not made by the forward)."""
    from autopar.graph import trace
    from autopar.inter import assign_layers
    from autopar.inter._layer_pricing import boundary_bytes
    from examples import mlp

    cfg = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=4, layer_markers=True)
    optimizer = optax.sgd(0.1)
    state = mlp.init_state(cfg, optimizer, jax.random.key(0))
    batch = mlp.make_batch(cfg, 8, jax.random.key(1))
    graph = trace(mlp.make_train_step(cfg, optimizer), state, batch, batch_argnums=(1,))
    hidden, out = 8 * 32 * 4, 8 * 8 * 4
    assert boundary_bytes(graph, assign_layers(graph)) == [0, hidden, hidden, hidden, out, 0]


def test_boundary_transfer_time_by_hand():
    from autopar.cost import boundary_transfer_time

    cluster = autopar.Cluster.from_profile("cpu-local")
    link = cluster.intra_host
    assert boundary_transfer_time(1e6, cluster, 4) == pytest.approx(
        2 * (link.latency + 1e6 / (4 * link.bandwidth))
    )
    assert boundary_transfer_time(0, cluster, 4) == 0.0
    two_hosts = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    slow = two_hosts.inter_host
    # 8 devices per host: a stage of 8 after a stage of 8 crosses hosts
    assert boundary_transfer_time(1e6, two_hosts, 8) == pytest.approx(
        2 * (slow.latency + 1e6 / (8 * slow.bandwidth))
    )
    with pytest.raises(ValueError, match="at least one device"):
        boundary_transfer_time(1e6, cluster, 0)
