"""A node replicated for lack of a sharding rule is named in the plan's warnings with its
size per device when that exceeds 1 MiB; smaller ones are only counted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import autopar
from autopar.graph import trace
from autopar.intra._planner import LARGE_REPLICATED_BYTES, large_replicated_warnings


def _step(state, batch):
    # cholesky has no sharding rule: its 1024 x 1024 float32 result (4 MiB) is replicated,
    # and so is the 64 x 64 one (16 KiB), which stays below the threshold.
    big = lax.linalg.cholesky(batch["x"].T @ batch["x"] + 1024.0 * jnp.eye(1024))
    small = lax.linalg.cholesky(state["w"].T @ state["w"] + 64.0 * jnp.eye(64))
    return state, {"loss": jnp.sum(big) + jnp.sum(small)}


def _args():
    state = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((2048, 1024), jnp.float32)}
    return state, batch


def test_large_replicated_node_is_named_with_its_bytes():
    plan = autopar.plan(
        _step,
        *_args(),
        cluster=autopar.Cluster.from_profile("cpu-local"),
        method="shard",
        cache=False,
    )
    named = [w for w in plan.warnings if "MiB per device" in w]
    assert len(named) == 1, plan.warnings
    assert "'cholesky'" in named[0] and "float32[1024,1024]" in named[0], named[0]
    assert "4.0 MiB per device" in named[0], named[0]
    # The count of every such node stays, small ones included.
    assert any("'cholesky' (2 node(s))" in w for w in plan.warnings), plan.warnings


def test_threshold_is_bytes_per_device():
    graph = trace(_step, *_args())
    assert len(large_replicated_warnings(graph)) == 1
    assert len(large_replicated_warnings(graph, threshold=8 * 1024)) == 2
    assert large_replicated_warnings(graph, threshold=4 * LARGE_REPLICATED_BYTES) == ()
