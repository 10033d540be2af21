"""Device memory of attention on a profile whose attention runs as one fused kernel
(`Cluster.fused_attention`; FlashAttention, Dao et al. 2022): the (..., s, s) scores and
probabilities stay on chip, only the fp32 softmax statistics per query row are held
(`autopar.cost.fused_attention_bytes`). Without fused attention, nothing changes: the
scores count whole (tests/test_memory_xla.py checks those against XLA)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import fused_attention_bytes
from autopar.graph import attention_core, trace
from autopar.intra._liveness import peak_live_bytes
from autopar.intra._options import ShardOptions
from autopar.intra._problem import build_problem

B, H, S, D = 2, 2, 128, 8  # S = MIN_FUSED_SEQUENCE: the shortest sequence a kernel fuses
QKV = jax.ShapeDtypeStruct((B, H, S, D), jnp.float32)


@pytest.fixture(scope="module")
def clusters():
    plain = Cluster.from_profile("cpu-local")
    assert not plain.fused_attention
    return plain, dataclasses.replace(plain, fused_attention=True)


def _row_max_of_scores(q, k):
    """One score tensor (b, h, s, s) read by one row reduction: the peak holds q, k, the
    scores and the (b, h, s) result at once."""
    return jnp.max(jnp.einsum("bhqd,bhkd->bhqk", q, k), axis=-1)


def test_statistics_bytes_by_hand():
    mesh = LogicalMesh.create((2, 4))
    # one fp32 per query row: (2, 4, 1024) of a (2, 4, 1024, 1024) value
    assert fused_attention_bytes((2, 4, 1024, 1024), None, mesh) == 2 * 4 * 1024 * 4
    # heads split 2 ways ("x", the first axis, has size 2): half per device
    spec = ((), ("x",), (), ())
    assert fused_attention_bytes((2, 4, 1024, 1024), spec, mesh) == 2 * 2 * 1024 * 4


def test_liveness_peak_by_hand(clusters):
    graph = trace(_row_max_of_scores, QKV, QKV, batch_argnums=())
    (scores,) = attention_core(graph)
    assert graph.vars[scores].shape == (B, H, S, S)
    mesh = LogicalMesh.create((1,))
    specs = [None] * len(graph.vars)
    inputs = 2 * B * H * S * D * 4
    result = B * H * S * 4
    whole = B * H * S * S * 4
    stats = B * H * S * 4
    assert peak_live_bytes(graph, specs, mesh) == inputs + whole + result
    assert peak_live_bytes(graph, specs, mesh, fused_attention=True) == inputs + stats + result


def test_ilp_node_memory_by_hand(clusters):
    """The sharding ILP's memory of the score node, under each of its layouts."""
    graph = trace(_row_max_of_scores, QKV, QKV, batch_argnums=())
    (scores,) = attention_core(graph)
    mesh = LogicalMesh.create((2,))
    for cluster, fused in zip(clusters, (False, True)):
        built = build_problem(graph, mesh, cluster, ShardOptions())
        index, _ = built.source_of[scores]
        strategies = built.ilp_nodes[index].strategies
        assert strategies
        for s, held in zip(strategies, built.problem.node_memory[index]):
            (spec,) = s.out_specs
            parts = 1
            for axes in spec[:-1]:
                parts *= 2 ** len(axes)
            if fused:
                assert held == B * H * S * 4 / parts
            else:
                parts *= 2 ** len(spec[-1])
                assert held == B * H * S * S * 4 / parts


def _attention_step():
    """A training step of one attention layer (projection in, softmax attention, loss)."""
    def loss_fn(params, batch):
        q = jnp.einsum("bhsd,de->bhse", batch["x"], params["wq"])
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, batch["x"]) / jnp.sqrt(D)
        out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), batch["x"])
        return jnp.mean(out ** 2)

    optimizer = optax.sgd(1e-2)

    def step(state, batch):
        params, opt = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt = optimizer.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    params = {"wq": jax.ShapeDtypeStruct((D, D), jnp.float32)}
    state = (params, jax.eval_shape(optimizer.init, params))
    return step, state, {"x": QKV}


def test_planned_step_drops_the_scores_keeps_the_statistics(clusters):
    """The same step planned on one device with and without fused attention: the fused
    plan's peak is lower by at least the (s x s) tensors live at the unfused plan's peak
    minus their statistics, and still holds more than the inputs alone."""
    plain, fused = clusters
    step, state, batch = _attention_step()
    peaks = []
    for cluster in (plain, fused):
        one = dataclasses.replace(cluster, num_hosts=1, devices_per_host=1) \
            if cluster.num_devices > 1 else cluster
        plan = autopar.plan(step, state, batch, cluster=one, method="shard")
        peaks.append(plan.stages[0].sharding.cost.memory_per_device)
    whole = B * H * S * S * 4
    stats = B * H * S * 4
    assert peaks[1] <= peaks[0] - (whole - stats)
    assert peaks[1] >= 2 * B * H * S * D * 4  # x and the projection at least
