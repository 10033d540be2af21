"""Problem building's memos give what a fresh computation gives (issue 18).

`build_problem` memoises operator strategies per mesh by a key of everything they depend
on (`_node_facts`), and resharding routes leave out the dimensions split on neither side.
Here every ILP node of a tiny GPT's problem is checked against strategies enumerated
afresh for that node, the memo is checked to hold across graphs and weights, and the
shortened routes against the route of every dimension.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import permutations, product

import numpy as np
import pytest
from helpers import cluster as _cluster
from helpers import tiny_gpt_graph

from autopar.app._examples import named_model
from autopar.cluster import LogicalMesh
from autopar.graph import trace
from autopar.intra import _problem, _reshard
from autopar.intra._context import sequence_length
from autopar.intra._options import ShardOptions
from autopar.intra._problem import build_problem
from autopar.intra._ring_strategies import ring_dots, ring_strategies
from autopar.intra._scan import SCAN_MARKERS
from autopar.intra._strategies import (
    CostContext,
    follow_strategies,
    node_signature,
    node_strategies,
    replicated_signature,
    step_effects,
)


def _gpt():
    return tiny_gpt_graph()


def _fresh_problem(graph, mesh, cluster, weights=None):
    """`build_problem` with every memo emptied first."""
    _reshard._SHARED.clear()
    _problem._NODE_FACTS.clear()
    return build_problem(graph, mesh, cluster, ShardOptions(), weights=weights)


def _arrays(problem):
    return (problem.node_costs, problem.edge_costs, problem.node_memory, problem.edges,
            problem.memory_groups, sorted((v, u, tuple(m)) for v, (u, m) in
                                          problem.followers.items()))


def _assert_same(a, b):
    for x, y in zip(_arrays(a.problem), _arrays(b.problem), strict=True):
        if isinstance(x, tuple) and x and isinstance(x[0], np.ndarray):
            assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y))
        else:
            assert x == y
    assert [n.strategies for n in a.ilp_nodes] == [n.strategies for n in b.ilp_nodes]


def test_memoised_strategies_are_those_enumerated_afresh(mesh_shape=(2, 4)):
    """Every operator node's strategies, taken from the memo (many nodes share a key: the
    same elementwise op forward and backward), equal `node_strategies` or, for a follower,
    `follow_strategies` of its leader's specs, computed for that node alone."""
    graph, cluster = _gpt(), _cluster()
    mesh = LogicalMesh.create(mesh_shape)
    built = _fresh_problem(graph, mesh, cluster)
    effects = step_effects(graph)  # what build_problem's context knows (no tied state here)
    ctx = CostContext(cluster, mesh, effects.combinable, effects.in_place)
    followers = built.problem.followers
    ring = ring_dots(graph, sequence_length(graph))
    shared = 0
    keys = set()
    for index, ilp_node in enumerate(built.ilp_nodes):
        if ilp_node.node is None:
            continue
        node = graph.nodes[ilp_node.node]
        key = _problem._NODE_FACTS[graph][next(iter(_problem._NODE_FACTS[graph]))][node.id][1]
        shared += key in keys
        keys.add(key)
        sig = node_signature(node, graph) or replicated_signature(node, graph)
        assert node.primitive not in SCAN_MARKERS
        if index in followers:
            leader, _ = followers[index]
            # the operand it follows is the one its leader produces
            main = next(p for p, v in enumerate(node.inputs)
                        if built.source_of.get(v, (None,))[0] == leader)
            k = built.source_of[node.inputs[main]][1]
            specs = [s.out_specs[k] for s in built.ilp_nodes[leader].strategies]
            expected = follow_strategies(node, graph, sig, main, specs, ctx)
        else:
            expected = node_strategies(node, graph, sig, ctx)
        if node.id in ring:  # attention's score dot also offers its ring twins ("auto")
            role, roles = ring[node.id]
            expected = ring_strategies(node, graph, role, roles, list(expected), ctx,
                                       forced=False)
        assert ilp_node.strategies == expected, f"{ilp_node.name} on {mesh_shape}"
    assert shared > 100, "the check is meant to cover nodes that share a memo entry"


def test_memo_holds_across_graphs_and_weights():
    """A problem built from a warm memo (another graph on the same mesh, and the same
    graph with other weights, built first) equals one built from empty memos; weights
    are part of the key (a node weighted by 1/2 gets half the compute time)."""
    graph, cluster = _gpt(), _cluster()
    mesh = LogicalMesh.create((2, 4))
    fresh = _fresh_problem(graph, mesh, cluster)
    heavy = {node.id: (0.5, 1.0) for node in graph.nodes}
    weighted = build_problem(graph, mesh, cluster, ShardOptions(), weights=heavy)
    for a, b in zip(fresh.ilp_nodes, weighted.ilp_nodes):
        if a.node is not None:
            assert [0.5 * s.compute_cost for s in a.strategies] == \
                [s.compute_cost for s in b.strategies], a.name
    named = named_model("gpt-tiny", batch_size=16)  # other shapes, the same operations
    other = trace(named.train_step, named.abstract_state, named.abstract_batch)
    build_problem(other, mesh, cluster, ShardOptions())
    _assert_same(build_problem(graph, mesh, cluster, ShardOptions()), fresh)


def _specs(ndim: int, axes) -> list:
    """Every spec of an `ndim`-dimensional tensor on mesh axes `axes`."""
    specs = set()
    for choice in product([None, *range(ndim)], repeat=len(axes)):
        dims = [[a for a, c in zip(axes, choice) if c == d] for d in range(ndim)]
        for orders in product(*[list(permutations(d)) for d in dims]):
            specs.add(tuple(tuple(order) for order in orders))
    return sorted(specs)


def _full_route_collectives(shape, dtype_bytes, src, dst, mesh):
    """The collectives from the route over every dimension (no dimension left out)."""
    route = _reshard._Route(len(shape), _reshard._layout(src, mesh),
                            _reshard._layout(dst, mesh), mesh).run()

    def per_device(tiles):
        return float(dtype_bytes * math.prod(math.ceil(n / t) for n, t in zip(shape, tiles)))

    return tuple(
        (kind, axes, per_device(tiles) if tiles is not None
         else min(per_device(t) for t in states))
        for kind, axes, tiles, states in route
    )


@pytest.mark.parametrize("mesh_shape,ndim", [((2, 4), 3), ((4, 2), 3), ((3, 2), 3),
                                             ((2, 2, 2), 2), ((8,), 4)])
def test_route_leaves_out_unsplit_dimensions(mesh_shape, ndim):
    """`reshard_collectives` routes only the dimensions split on some side; for every
    spec pair it equals the route over all dimensions (kinds, axes and bytes)."""
    mesh = LogicalMesh.create(mesh_shape)
    axes = [a for a, n in zip(mesh.axis_names, mesh.shape) if n > 1]
    shape = (24, 10, 6, 5)[:ndim]  # some dimensions split unevenly
    specs = _specs(ndim, axes)
    for src, dst in product(specs, specs):
        if src == dst:
            continue
        got = tuple(dataclasses.astuple(c)[:3] for c in
                    _reshard.reshard_collectives(shape, "float32", src, dst, mesh))
        assert got == _full_route_collectives(shape, 4, src, dst, mesh), (src, dst)


def test_built_problems_are_dropped_least_recently_used_first():
    """Past the cache's limit (its constructor's argument) the least recently used problem
    is dropped (a look-up counts as a use) and counted out; a dropped problem, looked up
    again, is built again, equal to the one built before. The cache is passed whole to
    `_built_problem`, which builds its key (the search's own cache is `_planner._BUILT`)."""
    from autopar.intra import _planner

    graph, cluster = _gpt(), _cluster()
    meshes = [LogicalMesh.create(shape) for shape in ((2,), (4,), (8,))]
    last = LogicalMesh.create((2, 4))

    def built(mesh, cache):
        return _planner._built_problem(graph, mesh, cluster, ShardOptions(), (), None, None,
                                       None, cache=cache)

    unbounded = _planner._BuiltProblems(float("inf"))
    first = [built(mesh, unbounded) for mesh in (*meshes, last)]
    held = list(unbounded.order.values())  # (graph ref, key, bytes) in the order kept
    sizes = [size for _, _, size in held]
    assert len(sizes) == 4 and unbounded.bytes == sum(sizes)
    assert [_planner._problem_bytes(b) for b in first] == sizes
    assert [key[0] for _, key, _ in held] == [*meshes, last]
    assert all(built(mesh, unbounded) is b for mesh, b in zip(meshes, first))  # hits

    budget = sum(sizes[:3])  # the three fit; the fourth drops the oldest
    cache = _planner._BuiltProblems(budget)
    for (_, key, _), problem in zip(held[:3], first):
        cache.keep(graph, key, problem)
    assert len(cache) == 3 and cache.bytes == budget
    assert built(meshes[0], cache) is first[0]  # (2,) used again: (4,) is the oldest
    cache.keep(graph, held[3][1], first[3])
    kept = [key[0] for _, key, _ in cache.order.values()]
    assert kept[-1] == last
    lru = [meshes[1], meshes[2], meshes[0]]  # least recently used first
    dropped = [m for m in lru if m not in kept]
    assert dropped and dropped == lru[:len(dropped)]
    assert set(kept[:-1]) == set(lru[len(dropped):])
    assert {key[0] for key in cache.by_graph[graph]} == set(kept)
    assert cache.bytes == sum(size for _, _, size in cache.order.values())
    assert cache.bytes <= budget or len(kept) == 1
    rebuilt = built(meshes[1], cache)  # dropped: built again, the same problem
    assert rebuilt is not first[1]
    _assert_same(rebuilt, first[1])
    assert cache.order[next(reversed(cache.order))][1][0] == meshes[1]


def test_a_freed_graph_is_counted_out_without_hashing_its_keys(monkeypatch):
    """A graph's built problems leave the count when the graph is freed, and the weak
    reference's callback hashes no key: at interpreter exit a key's `Cluster` may no
    longer hash (its modules cleared), and Python printed "Exception ignored" there."""
    import gc
    import sys
    from types import SimpleNamespace

    from autopar.intra import _planner

    class Graph:
        pass

    class Key:
        poisoned = False

        def __hash__(self):
            if Key.poisoned:
                raise TypeError("'NoneType' object is not callable")
            return 1

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    problem = SimpleNamespace(node_costs=(np.zeros(10),), edge_costs=(), node_memory=(),
                              footprint=())
    cache = _planner._BuiltProblems(float("inf"))
    graph, other = Graph(), Graph()
    built = SimpleNamespace(problem=problem, ilp_nodes=())
    cache.keep(graph, Key(), built)
    cache.keep(graph, Key(), built)
    cache.keep(other, Key(), built)
    assert cache.bytes == 3 * 80 and len(cache.order) == 3
    Key.poisoned = True
    try:
        del graph
        gc.collect()
    finally:
        Key.poisoned = False
    assert not raised, [r.exc_value for r in raised]
    assert len(cache.order) == 1 and cache.bytes == 80
    assert list(cache.by_graph) == [other]
