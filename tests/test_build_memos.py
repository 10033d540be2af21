"""The memos that make a sharding problem cheaper to build give the numbers a fresh
computation gives, bit for bit (issue 45).

- `reshard_matrix` prices an edge's spec pairs from a table of their routes, shared by
  tensors of every shape: its matrix equals `reshard_time` pair by pair.
- A follower's strategies are memoised per leader spec (`follow_strategies`' `cache`),
  and an operator node's unweighted strategies per node key and context (`_context_key`):
  a hit reuses what was computed, another context misses.
- A graph's scans are opened once per weights and ties (`_problem._expanded`).
"""

from __future__ import annotations

import dataclasses
import functools
from itertools import permutations, product

import numpy as np
import pytest
from helpers import cluster as _cluster
from helpers import tiny_gpt_graph

from autopar.cluster import Cluster, LogicalMesh
from autopar.graph import tied_state, trace
from autopar.intra import _problem, _reshard, _strategies
from autopar.intra._options import ShardOptions
from autopar.intra._problem import build_problem
from autopar.intra._strategies import (
    CostContext,
    follow_strategies,
    node_signature,
    replicated_signature,
    step_effects,
)


def _gpt():
    return tiny_gpt_graph()


def _specs(ndim: int, axes) -> list:
    """Every spec of an `ndim`-dimensional tensor on mesh axes `axes`."""
    specs = set()
    for choice in product([None, *range(ndim)], repeat=len(axes)):
        dims = [[a for a, c in zip(axes, choice) if c == d] for d in range(ndim)]
        for orders in product(*[list(permutations(d)) for d in dims]):
            specs.add(tuple(tuple(order) for order in orders))
    return sorted(specs)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (2, 2, 2)])
def test_reshard_matrix_is_reshard_time_pair_by_pair(mesh_shape):
    """Every pair of specs of a 3-d tensor, with dimensions split evenly and unevenly, in
    two dtypes: the matrix equals `reshard_time`'s seconds bit for bit, and its route
    table, memoised under the pair's key, prices a tensor of another shape as
    `reshard_time` does; another key builds another table."""
    mesh, cluster = LogicalMesh.create(mesh_shape), _cluster()
    axes = [a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1]
    specs = _specs(3, axes)
    srcs, dsts = specs[::2], specs[1::3] + specs[:1]  # includes equal pairs
    cache = {}
    for shape, dtype in (((8, 6, 16), "float32"), ((24, 10, 5), "bfloat16")):
        got = _reshard.reshard_matrix(shape, dtype, srcs, dsts, mesh, cluster, cache,
                                      pair_key="k")
        want = np.array([[_reshard.reshard_time(shape, dtype, a, b, mesh, cluster)
                          for b in dsts] for a in srcs])
        assert got.tobytes() == want.tobytes(), (shape, dtype)
        assert got.any() and not got.all()
    table = cache["routes", "k"]
    _reshard.reshard_matrix((8, 6, 16), "float32", srcs, dsts, mesh, cluster, cache, "k")
    assert cache["routes", "k"] is table  # reused for another shape and again
    _reshard.reshard_matrix((8, 6, 16), "float32", dsts, srcs, mesh, cluster, cache, "other")
    assert cache["routes", "other"] is not table


def _follower(graph):
    """A node that follows its operand, with the operand index and the specs it takes."""
    for node in graph.nodes:
        if node.primitive in ("add", "mul") and len(graph.vars[node.inputs[0]].shape) == 3:
            sig = node_signature(node, graph) or replicated_signature(node, graph)
            candidates = _strategies.follower_candidates(node, graph, sig)
            if candidates:
                return node, sig, candidates[0]
    raise AssertionError("no follower in the tiny GPT")


def test_follower_strategies_are_memoised_per_leader_spec():
    """Strategies computed for one leader spec list serve another list that shares its
    specs (the same objects) and equal a fresh computation; a spec that cannot be
    followed is remembered as None."""
    graph, cluster = _gpt(), _cluster()
    mesh = LogicalMesh.create((2, 4))
    effects = step_effects(graph)
    ctx = CostContext(cluster, mesh, effects.combinable, effects.in_place)
    node, sig, main = _follower(graph)
    ndim = len(graph.vars[node.inputs[main]].shape)
    whole, batch = ((),) * ndim, (("x",),) + ((),) * (ndim - 1)
    model = ((),) * (ndim - 1) + (("y",),)
    cache = {}
    first = follow_strategies(node, graph, sig, main, [whole, batch], ctx, cache)
    second = follow_strategies(node, graph, sig, main, [model, batch, whole], ctx, cache)
    assert second[1] is first[1] and second[2] is first[0]
    assert second == follow_strategies(node, graph, sig, main, [model, batch, whole], ctx)
    assert set(cache) == {whole, batch, model}
    # on 3 devices no dimension of (8, 16, 32) splits evenly
    assert graph.vars[node.inputs[main]].shape == (8, 16, 32)
    three = CostContext(cluster, LogicalMesh.create((3,)))
    odd, cache = (("x",),) + ((),) * (ndim - 1), {}
    assert follow_strategies(node, graph, sig, main, [whole, odd], three, cache) is None
    assert cache[odd] is None and cache[whole] is not None
    assert follow_strategies(node, graph, sig, main, [odd], three, cache) is None


def test_unweighted_strategies_are_shared_by_weights_and_keyed_by_context(monkeypatch):
    """A problem built under other weights enumerates no strategies anew (the memo keeps
    them unweighted) and equals one built from empty memos; a node that writes donated
    state in place has another context key than the same node that does not."""
    graph, cluster = _gpt(), _cluster()
    mesh = LogicalMesh.create((2, 4))
    _reshard._SHARED.clear()
    build_problem(graph, mesh, cluster, ShardOptions())
    calls = []
    real = _problem.node_strategies
    monkeypatch.setattr(_problem, "node_strategies",
                        lambda *a: calls.append(a) or real(*a))
    heavy = {node.id: (0.5, 1.0) for node in graph.nodes}
    warm = build_problem(graph, mesh, cluster, ShardOptions(), weights=heavy)
    assert calls == []
    _reshard._SHARED.clear()
    cold = build_problem(graph, mesh, cluster, ShardOptions(), weights=heavy)
    assert calls  # (the check above is meant to count enumerations)
    assert [n.strategies for n in warm.ilp_nodes] == [n.strategies for n in cold.ilp_nodes]
    node = graph.nodes[0]
    plain = CostContext(cluster, mesh)
    in_place = CostContext(cluster, mesh, in_place=frozenset({node.id}))
    assert _problem._context_key(node, graph, plain) != \
        _problem._context_key(node, graph, in_place)


@functools.cache
def _scanned_llama():
    import optax

    from examples import llama

    cfg = dataclasses.replace(llama.CONFIGS["tiny"], scan_layers=True)
    optimizer = optax.sgd(0.1)
    return trace(llama.make_train_step(cfg, optimizer), llama.abstract_state(cfg, optimizer),
                 llama.abstract_batch(cfg, 16))


def test_scans_are_opened_once_per_graph_weights_and_ties():
    """A scanned model built on two meshes plans one planning graph (so its per-graph
    memos serve both), and that problem equals one built from empty memos; other weights
    open the scans again."""
    graph, cluster = _scanned_llama(), _cluster()
    _problem._EXPANSIONS.clear()
    first = build_problem(graph, LogicalMesh.create((2, 4)), cluster, ShardOptions())
    second = build_problem(graph, LogicalMesh.create((4, 2)), cluster, ShardOptions())
    assert first.expansion is not None and second.expansion is first.expansion
    _problem._EXPANSIONS.clear()
    _problem._NODE_FACTS.clear()
    _reshard._SHARED.clear()
    fresh = build_problem(graph, LogicalMesh.create((4, 2)), cluster, ShardOptions())
    assert fresh.expansion is not first.expansion
    assert [n.strategies for n in fresh.ilp_nodes] == [n.strategies for n in second.ilp_nodes]
    for a, b in zip(fresh.problem.edge_costs, second.problem.edge_costs, strict=True):
        assert a.tobytes() == b.tobytes()
    heavy = {node.id: (0.5, 1.0) for node in graph.nodes}
    weighted = build_problem(graph, LogicalMesh.create((4, 2)), cluster, ShardOptions(),
                             weights=heavy)
    assert weighted.expansion is not fresh.expansion


@functools.cache
def _gpt_adamw():
    import optax

    from examples import gpt

    cfg = dataclasses.replace(gpt.CONFIGS["small-test"], layer_markers=True)
    optimizer = optax.adamw(1e-3)
    return trace(gpt.make_train_step(cfg, optimizer), gpt.abstract_state(cfg, optimizer),
                 gpt.abstract_batch(cfg, 16))


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_nodes_share_strategies_only_within_one_context(monkeypatch, mesh_shape):
    """The mesh memo shares a node's strategies with the nodes of the same shapes and
    context only (`own_key`, `follow_key`): the problem equals one built with no entry
    shared between nodes. (Keyed by shapes alone, a reduction that launches a kernel of
    its own and the same reduction fused into its consumer's took one entry, as did an
    add whose reductions combine with others' and one whose do not: on the CPU profile,
    which prices kernel launches, plans moved by up to 2 %.)"""
    graph = _gpt_adamw()
    cluster = Cluster.from_profile("cpu-local-measured")
    mesh = LogicalMesh.create(mesh_shape)
    tied = tied_state(graph, (0,))
    _reshard._SHARED.clear()
    shared = build_problem(graph, mesh, cluster, ShardOptions(), tied)
    monkeypatch.setattr(_problem, "shared_reshard_cache", lambda mesh, cluster: _NoSharing())
    alone = build_problem(graph, mesh, cluster, ShardOptions(), tied)
    assert [n.strategies for n in shared.ilp_nodes] == [n.strategies for n in alone.ilp_nodes]


class _NoSharing(dict):
    """A mesh memo that keeps no node's strategies: every node enumerates its own."""

    _NODE_KEYS = ("own", "own raw", "follow", "follow spec")

    def __setitem__(self, key, value):
        if not (isinstance(key, tuple) and key and key[0] in self._NODE_KEYS):
            super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if isinstance(key, tuple) and key and key[0] in self._NODE_KEYS:
            return default
        return super().setdefault(key, default)
