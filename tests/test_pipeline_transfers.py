"""Stage-to-stage transfers go device to device: a plan whose neighbouring stages have
meshes of different shapes (4 devices, then 2, then 2) moves its activations and gradients
without reading them back to the host, and matches one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import run_steps
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


def test_stages_of_different_mesh_shapes_transfer_device_to_device(host_reads):
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = gpt.make_train_step(GPT, optimizer)
    state = gpt.init_state(GPT, optimizer, jax.random.key(0))
    batch = gpt.make_batch(GPT, 8, jax.random.key(1))
    ref_losses, _ = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), donate_argnums=(),
        num_stages=3, num_microbatches=2, submeshes=[(1, 2), (1, 4)],
        logical_shapes=[(2,), (4,)],
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
