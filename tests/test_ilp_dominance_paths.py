"""Dominated strategies found with or without the per-row bounds first (issue 45): small
nodes get `extra` exactly for every pair (`_ALL_PAIRS_EXACT`), larger ones only for the
pairs the bounds leave. The bounds drop only pairs far from dominated, so both ways must
find the same dominated pairs. And follower merging, which takes roots' arrays as they
are, must give the graph that gathering every array gives."""

from __future__ import annotations

import numpy as np
import pytest

import autopar.intra._ilp_reduce as reduce


def _node(rng, size: int, neighbours: int):
    cost = rng.integers(0, 4, size).astype(float)
    matrices = []
    for _ in range(neighbours):
        base = rng.integers(0, 3, size=(3, int(rng.integers(1, 6)))).astype(float)
        matrices.append(base[rng.integers(0, 3, size)] * rng.choice([0.5, 1.0, 2.0]))
    return cost, matrices


@pytest.mark.parametrize("seed", range(4))
def test_every_pair_exactly_finds_what_the_bounds_find(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    nodes = [_node(rng, int(rng.integers(2, 12)), int(rng.integers(0, 5))) for _ in range(60)]
    monkeypatch.setattr(reduce, "_ALL_PAIRS_EXACT", 0)
    bounded = [reduce._dominates(cost, matrices) for cost, matrices in nodes]
    monkeypatch.setattr(reduce, "_ALL_PAIRS_EXACT", 10**9)
    exact = [reduce._dominates(cost, matrices) for cost, matrices in nodes]
    assert sum(int(d.sum()) for d in exact) > 0  # some strategies are dominated
    for (cost, matrices), x, y in zip(nodes, bounded, exact):
        assert np.array_equal(x, y)
        # and each is the definition: c[a] - c[b] + sum_w max_j (R[a, j] - R[b, j]) <= 0
        extra = cost[:, None] - cost[None, :]
        for m in matrices:
            extra = extra + (m[:, None, :] - m[None, :, :]).max(axis=2)
        np.fill_diagonal(extra, 1.0)
        assert np.array_equal(y, extra <= 0)


def test_merging_takes_roots_arrays_as_gathering_them_would():
    from autopar.intra._ilp_problem import ShardingProblem, resolve_followers

    rng = np.random.default_rng(1)
    sizes = [3, 4, 3, 2, 4]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (1, 4)]
    problem = ShardingProblem(
        tuple(rng.random(n) for n in sizes), tuple(edges),
        tuple(rng.random((sizes[u], sizes[v])) if k != 4 else
              np.asfortranarray(rng.random((sizes[u], sizes[v])))
              for k, (u, v) in enumerate(edges)),
        followers={2: (0, np.array([2, 0, 1]))})
    root, strategy_of = resolve_followers(problem)
    graph = reduce.merge_followers(problem, root, strategy_of)
    expected = reduce.CostGraph({v: np.zeros(sizes[v]) for v in (0, 1, 3, 4)})
    for v, cost in enumerate(problem.node_costs):  # every array gathered, as before
        expected.add_node_cost(int(root[v]), cost[strategy_of[v]])
    for (u, v), matrix in zip(problem.edges, problem.edge_costs):
        ru, rv = int(root[u]), int(root[v])
        if ru == rv:
            expected.add_node_cost(ru, matrix[strategy_of[u], strategy_of[v]])
        else:
            expected.add_edge(ru, rv, matrix[np.ix_(strategy_of[u], strategy_of[v])])
    assert graph.node_cost.keys() == expected.node_cost.keys()
    assert all(np.array_equal(graph.node_cost[v], c) for v, c in expected.node_cost.items())
    for v, row in expected.adjacent.items():
        assert graph.adjacent[v].keys() == row.keys()
        for w, matrix in row.items():
            assert np.array_equal(graph.adjacent[v][w], matrix)
            assert graph.adjacent[v][w].strides == matrix.strides
    # an edge between two roots, C-ordered, is the problem's own array
    assert graph.adjacent[3][4] is problem.edge_costs[3]
