"""The optimizer update's working memory never adds to the kept activations, and Megatron's
distributed optimizer splits the master weights (issue 44, item 3).

- `split_peak_live_bytes` walks a program once and gives the peak before a node and from it
  on, by hand on a three-op graph;
- `StageMemory.total` is state + gradient sums + the larger of (kept activations + working
  memory) and the update's working memory: the update runs after the last microbatch's
  backward has freed every activation;
- `distributed_optimizer_param_bytes` is Megatron-LM's 6 + 12/d bytes per bf16 parameter
  (with the fp32 gradient and the moments) against 8 + 8/d as traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autopar.cluster import LogicalMesh
from autopar.cost import (
    StageMemory,
    device_group_memory,
    distributed_optimizer_param_bytes,
)
from autopar.graph import trace
from autopar.intra._liveness import peak_live_bytes, split_peak_live_bytes

N = 1024  # float32 elements per vector: 4 KiB


def _forward_then_update(w, x):
    """A 'forward' (x * w, then its sum with x) and an 'update' (w - 0.1 * a, then * 2)."""
    a = x * w
    b = a + x
    u = (w - 0.1 * a) * 2.0
    return b, u


def test_split_peak_by_hand():
    vec = jax.ShapeDtypeStruct((N,), jnp.float32)
    graph = trace(_forward_then_update, vec, vec)
    mesh = LogicalMesh.create((1,))
    specs = [None] * len(graph.vars)
    prims = [n.primitive for n in graph.nodes]
    split = prims.index("sub")  # the update's first op (after the forward's mul and add)
    before, after = split_peak_live_bytes(graph, specs, mesh, split)
    kib = 4 * N
    # Inputs w and x live all step (2 vectors); the forward holds a (read by the update
    # later) and then b (returned): 4 at most. The update holds w, x, a, b and its own
    # results (the scaled a, w - 0.1 a, u): the returned b and u stay.
    assert before == pytest.approx(4 * kib)
    assert after >= before
    assert max(before, after) == pytest.approx(peak_live_bytes(graph, specs, mesh))


def test_update_working_never_adds_to_activations():
    gib = 2**30
    parts = StageMemory(state=10 * gib, gradients=10 * gib, activations=16 * gib,
                        working=3 * gib, in_flight=4, update=25 * gib)
    assert parts.total == pytest.approx(45 * gib)  # 10 + 10 + max(16 + 3, 25)
    small = StageMemory(10 * gib, 10 * gib, 16 * gib, 3 * gib, 4, update=5 * gib)
    assert small.total == pytest.approx(39 * gib)  # 10 + 10 + 16 + 3
    group = device_group_memory([parts, small])
    assert group.update == pytest.approx(25 * gib)
    assert group.total == pytest.approx(40 * gib + max(32 * gib + 3 * gib, 25 * gib))
    assert StageMemory.from_json(parts.to_json()) == parts
    assert StageMemory.from_json({**small.to_json(), "update": 0.0}).update == 0.0


def test_distributed_optimizer_bytes_are_megatrons():
    params, d = 1_000_000, 64
    master = 4.0 * params  # fp32 master weights, whole, as the traced step holds them
    held = distributed_optimizer_param_bytes(master, 2, 4, d)
    assert held == pytest.approx(2 * params + 4 * params / d)
    # with the fp32 gradient (4) and Adam's fp32 moments over d (8 / d): 6 + 12 / d
    assert (held + 4 * params + 8 * params / d) / params == pytest.approx(6 + 12 / d)
    with pytest.raises(ValueError, match="shards"):
        distributed_optimizer_param_bytes(master, 2, 4, 0)
