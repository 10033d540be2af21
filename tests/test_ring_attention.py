"""Ring attention (shard_map, ppermute, online softmax, zig-zag chunks) computes causal
attention and its gradients like one device, with the ring's collective-permutes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from autopar.lower import count_collectives
from autopar.lower._ring_attention import ring_attention, zigzag_order

CP = 4
SEQ = 64


def _inputs():
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, SEQ, 4, 8))
    k = jax.random.normal(kk, (2, SEQ, 2, 8))
    v = jax.random.normal(kv, (2, SEQ, 2, 8))
    w = jax.random.normal(kw, (2, SEQ, 4, 8))
    return q, k, v, w


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, CP), ("data", "cp"))


def _dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _ring(q, k, v, mesh):
    order = zigzag_order(SEQ, CP)
    back = np.argsort(order)
    out = ring_attention(q[:, order], k[:, order], v[:, order], mesh, "cp", ("data",))
    return out[:, back]


def test_ring_attention_matches_dense_causal_attention_and_its_gradients():
    q, k, v, w = _inputs()
    mesh = _mesh()
    ring = jax.jit(lambda q, k, v: _ring(q, k, v, mesh))
    np.testing.assert_allclose(ring(q, k, v), _dense(q, k, v), rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    grads = jax.jit(jax.grad(loss(lambda *a: _ring(*a, mesh)), argnums=(0, 1, 2)))(q, k, v)
    expected = jax.grad(loss(_dense), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # forward: K and V passed on CP - 1 times each; the backward sends them back
    hlo = ring.lower(q, k, v).compile().as_text()
    assert count_collectives(hlo)["send_recv"][0] == 2 * (CP - 1)


def test_zigzag_order_balances_and_checks_the_sequence():
    order = zigzag_order(16, 2)
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="divisible by 8"):
        zigzag_order(20, 4)
