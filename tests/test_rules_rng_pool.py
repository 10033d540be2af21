"""Sharding rules for random numbers (dropout) and windows (pooling).

Every split a rule allows must give what one device gives with the same key: each
strategy of `random_bits`, `random_split`, `reduce_window_max` and `select_and_scatter_add`
is run as its specs say on 8 devices and compared bit for bit. Then a dropout MLP and a
tiny conv net with max and average pooling plan with no primitive left to replicate for
lack of a rule, and train like one device under ``method="shard"``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cluster as _cluster
from helpers import run_steps
from jax import lax
from jax.sharding import NamedSharding

import autopar
from autopar.cluster import LogicalMesh
from autopar.cluster._mesh import to_partition_spec
from autopar.graph import trace
from autopar.intra._strategies import CostContext, node_signature, node_strategies
from autopar.lower import jax_mesh

RNG_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
MESH_SHAPE = (2, 4)


def _strategies(fn, *args, primitive):
    """The graph of `fn(*args)`, and every strategy of its (first) `primitive` node."""
    graph = trace(fn, *args, batch_argnums=())
    node = next(n for n in graph.nodes if n.primitive == primitive)
    sig = node_signature(node, graph)
    assert sig is not None, f"no sharding rule for {primitive}"
    mesh = LogicalMesh.create(MESH_SHAPE, range(8))
    return node, node_strategies(node, graph, sig, CostContext(_cluster(), mesh)), mesh


def _run_split(fn, args, in_specs, out_spec, mesh):
    """`fn(*args)` jitted with its operands and result placed as the specs say."""
    jmesh = jax_mesh(mesh)

    def sharding(spec, ndim):
        return NamedSharding(jmesh, to_partition_spec(spec or ((),) * ndim))

    placed = [jax.device_put(a, sharding(s, a.ndim)) for a, s in zip(args, in_specs)]

    def pinned(*xs):
        y = fn(*xs)
        return lax.with_sharding_constraint(y, sharding(out_spec, y.ndim))

    return jax.jit(pinned, out_shardings=sharding(out_spec, len(out_spec)))(*placed)


@pytest.mark.parametrize("impl", RNG_IMPLS)
def test_every_random_bits_split_draws_the_same_bits(impl):
    keys = jax.random.split(jax.random.key(7, impl=impl), 4)  # a batch of keys, [4]

    def bits(keys):
        return jax.vmap(lambda k: jax.random.bits(k, (8, 16)))(keys)  # uint32[4, 8, 16]

    node, strategies, mesh = _strategies(bits, keys, primitive="random_bits")
    expected = np.asarray(jax.jit(bits)(keys))
    split = [s for s in strategies if any(s.out_specs[0])]
    assert len(split) >= 6, [s.name for s in strategies]
    for s in strategies:
        got = _run_split(bits, [keys], s.in_specs, s.out_specs[0], mesh)
        np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"{impl}: {s.name}")


@pytest.mark.parametrize("impl", RNG_IMPLS)
def test_every_random_split_split_derives_the_same_keys(impl):
    key = jax.random.key(3, impl=impl)

    def split(key):
        return jax.random.key_data(jax.random.split(key, (8, 4)))

    _, strategies, mesh = _strategies(split, key, primitive="random_split")
    expected = np.asarray(jax.jit(split)(key))
    assert any(any(s.out_specs[0]) for s in strategies)
    for s in strategies:
        # Pin the split keys, then compare their data.
        def pinned(key, spec=s.out_specs[0]):
            keys = jax.random.split(key, (8, 4))
            keys = lax.with_sharding_constraint(
                keys, NamedSharding(jax_mesh(mesh), to_partition_spec(spec))
            )
            return jax.random.key_data(keys)

        np.testing.assert_array_equal(np.asarray(jax.jit(pinned)(key)), expected, err_msg=s.name)


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def test_every_pooling_split_computes_the_same():
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 4))
    node, strategies, mesh = _strategies(_max_pool, x, primitive="reduce_window_max")
    # Batch and channels split; the pooled height and width do not.
    assert {tuple(bool(a) for a in s.in_specs[0])[1:3] for s in strategies} == {(False, False)}
    assert any(s.in_specs[0][0] for s in strategies) and any(s.in_specs[0][3] for s in strategies)
    expected = np.asarray(jax.jit(_max_pool)(x))
    for s in strategies:
        got = _run_split(_max_pool, [x], s.in_specs, s.out_specs[0], mesh)
        np.testing.assert_array_equal(np.asarray(got), expected, err_msg=s.name)


def test_every_max_pool_gradient_split_computes_the_same():
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 4))
    g = jax.random.normal(jax.random.key(1), (8, 4, 4, 4))

    def pool_grad(g, x):
        return jax.vjp(_max_pool, x)[1](g)[0]

    _, strategies, mesh = _strategies(pool_grad, g, x, primitive="select_and_scatter_add")
    expected = np.asarray(jax.jit(pool_grad)(g, x))
    assert any(any(s.out_specs[0]) for s in strategies)
    for s in strategies:
        got = _run_split(pool_grad, [g, x], s.in_specs, s.out_specs[0], mesh)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, err_msg=s.name)


# ---- models: dropout, pooling ---------------------------------------------------------


class State(NamedTuple):
    params: Any
    opt_state: Any
    rng: jax.Array  # a typed key, split every step


def _dropout(key, x, rate):
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def _mlp_loss(params, batch, key):
    h = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    h = _dropout(key, h, 0.1)
    return jnp.mean(jnp.square(h @ params["w2"] - batch["y"]))


def _convnet_loss(params, batch, key):
    conv = functools.partial(
        lax.conv_general_dilated,
        window_strides=(1, 1),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    h = jax.nn.relu(conv(batch["x"], params["conv1"]))
    h = _max_pool(h)  # [B, 8, 8, C]
    h = jax.nn.relu(conv(h, params["conv2"]))
    h = lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
    h = _dropout(key, h.reshape(h.shape[0], -1), 0.2)
    logits = h @ params["dense"]
    labels = jax.nn.one_hot(batch["y"], logits.shape[-1])
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def _make_step(loss_fn, optimizer):
    def train_step(state, batch):
        rng, key = jax.random.split(state.rng)
        loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return State(optax.apply_updates(state.params, updates), opt_state, rng), {"loss": loss}

    return train_step


def _mlp_setup():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": 0.1 * jax.random.normal(k[0], (64, 256)),
        "b1": jnp.zeros((256,)),
        "w2": 0.1 * jax.random.normal(k[1], (256, 32)),
    }
    batch = {"x": jax.random.normal(k[2], (32, 64)), "y": jax.random.normal(k[3], (32, 32))}
    return _mlp_loss, params, batch


def _convnet_setup():
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "conv1": 0.2 * jax.random.normal(k[0], (3, 3, 3, 16)),
        "conv2": 0.1 * jax.random.normal(k[1], (3, 3, 16, 32)),
        "dense": 0.05 * jax.random.normal(k[2], (4 * 4 * 32, 10)),
    }
    batch = {
        "x": jax.random.normal(k[3], (16, 16, 16, 3)),
        "y": jax.random.randint(k[4], (16,), 0, 10),
    }
    return _convnet_loss, params, batch


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("setup", [_mlp_setup, _convnet_setup], ids=["dropout_mlp", "convnet"])
def test_dropout_and_pooling_models_match_one_device(setup, impl):
    loss_fn, params, batch = setup()
    optimizer = optax.adam(1e-2)
    state = State(params, optimizer.init(params), jax.random.key(42, impl=impl))
    step = _make_step(loss_fn, optimizer)
    ref_losses, _ = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, cluster=_cluster(), method="shard", donate_argnums=())
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    missing = [w for w in par.plan.warnings if "no sharding rule" in w]
    assert not missing, missing
