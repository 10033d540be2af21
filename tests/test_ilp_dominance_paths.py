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


def _hub_graph(seed: int) -> reduce.CostGraph:
    """A hub of 12 strategies and its 40 neighbours (3-9 strategies each, columns drawn
    from a few patterns, so that neighbours hold equal strategies to drop and the hub is
    checked again after each of them shrinks), plus a chain among the neighbours."""
    rng = np.random.default_rng(seed)
    hub_size, count = 12, 40
    graph = reduce.CostGraph({0: rng.integers(0, 6, hub_size).astype(float),
                              **{w: rng.integers(0, 3, int(rng.integers(3, 10))).astype(float)
                                 for w in range(1, count + 1)}})
    patterns = rng.integers(0, 4, size=(hub_size, 5)).astype(float)
    for w in range(1, count + 1):
        columns = rng.integers(0, 5, len(graph.node_cost[w]))
        rows = rng.integers(0, hub_size, hub_size)  # hub strategies repeat: some dominated
        graph.add_edge(0, w, patterns[rows][:, columns] * rng.choice([0.5, 1.0, 2.0]))
        if w > 1 and w % 3 == 0:
            graph.add_edge(w - 1, w, rng.integers(0, 2, size=(len(graph.node_cost[w - 1]),
                                                              len(graph.node_cost[w])))
                           .astype(float))
    return graph


@pytest.mark.parametrize("chunk_columns", [reduce._EXACT_CHUNK_COLUMNS, 16])
@pytest.mark.parametrize("seed", range(3))
def test_checks_reusing_the_last_ones_drop_what_fresh_checks_drop(seed, chunk_columns,
                                                                  monkeypatch):
    """`_prune_dominated` hands each node's last check to its next (`_dominance`): the
    row bounds and exact terms of unchanged neighbours are reused, including the partial
    rows of pairs `_exact_in_chunks` dropped part way (`chunk_columns` 16: the hub's
    ~240 columns go in chunks). The strategies kept must be those of checking every
    node afresh each time, and the reuse must happen."""
    monkeypatch.setattr(reduce, "_EXACT_CHUNK_COLUMNS", chunk_columns)
    monkeypatch.setattr(reduce, "_ALL_PAIRS_EXACT", 0)  # every node on the bound path
    reused = []
    dominance = reduce._dominance

    def counted(cost, matrices, previous=None, neighbours=()):
        reused.append(previous is not None and previous.cost is cost)
        return dominance(cost, matrices, previous, neighbours)

    monkeypatch.setattr(reduce, "_dominance", counted)
    graph = _hub_graph(seed)
    reusing = graph.copy()
    kept = {v: np.arange(len(c)) for v, c in graph.node_cost.items()}
    reduce._prune_dominated(reusing, [], kept)

    undominated = reduce._undominated
    monkeypatch.setattr(reduce, "_undominated",
                        lambda g, v, memory, checked=None: undominated(g, v, memory))
    fresh = graph.copy()
    fresh_kept = {v: np.arange(len(c)) for v, c in graph.node_cost.items()}
    reduce._prune_dominated(fresh, [], fresh_kept)

    assert sum(reused) >= 5  # the hub was checked again with its last check at hand
    assert sum(len(graph.node_cost[v]) - len(k) for v, k in kept.items()) >= 10
    assert kept.keys() == fresh_kept.keys()
    for v in kept:
        np.testing.assert_array_equal(kept[v], fresh_kept[v])
        np.testing.assert_array_equal(reusing.node_cost[v], fresh.node_cost[v])


def test_a_check_after_a_neighbour_shrinks_equals_a_fresh_one(monkeypatch):
    """`_dominance` given the node's previous check, after one neighbour lost strategies
    (a new matrix object, the others the same), answers as `_dominates` from scratch,
    and so does a check whose previous state is stale (the node's own cost replaced)."""
    monkeypatch.setattr(reduce, "_ALL_PAIRS_EXACT", 0)  # the bound path
    rng = np.random.default_rng(5)
    found = 0
    for _ in range(30):
        size = int(rng.integers(6, 14))
        cost, matrices = _node(rng, size, int(rng.integers(8, 30)))
        matrices = [np.repeat(m, 8, axis=1) if k % 4 == 0 else m
                    for k, m in enumerate(matrices)]
        neighbours = tuple(range(len(matrices)))
        _, previous = reduce._dominance(cost, matrices, None, neighbours)
        assert previous is not None  # the bound path: enough columns
        k = int(rng.integers(0, len(matrices)))
        if matrices[k].shape[1] > 1:
            matrices = list(matrices)
            matrices[k] = matrices[k][:, 1:]
        again, _ = reduce._dominance(cost, matrices, previous, neighbours)
        np.testing.assert_array_equal(again, reduce._dominates(cost, matrices))
        stale, _ = reduce._dominance(cost.copy(), matrices, previous, neighbours)
        np.testing.assert_array_equal(stale, again)
        found += int(again.sum())
    assert found > 0  # some strategies are dominated


def test_a_pair_dropped_part_way_is_checked_again_when_its_neighbour_shrinks(monkeypatch):
    """Strategies 0 and 1 of a node agree on every neighbour but the first, where each is
    dearer on one column: the bounds keep the pair, `_exact_in_chunks` drops it after its
    first chunk. Once that neighbour loses the column where 0 is dearer, 0 dominates 1;
    the check reusing the dropped pair's partial row must find it."""
    monkeypatch.setattr(reduce, "_EXACT_CHUNK_COLUMNS", 4)
    monkeypatch.setattr(reduce, "_ALL_PAIRS_EXACT", 0)  # the bound path
    rng = np.random.default_rng(2)
    cost = np.array([1.0, 1.0, 0.0, 3.0])
    first = np.array([[5.0, 0.0, 1.0], [0.0, 5.0, 1.0], [2.0, 2.0, 2.0], [9.0, 9.0, 9.0]])
    others = [rng.integers(0, 3, size=(4, 4)).astype(float) for _ in range(30)]
    for m in others:
        m[1] = m[0]
    neighbours = tuple(range(31))
    before, previous = reduce._dominance(cost, [first, *others], None, neighbours)
    assert not before[0, 1] and not before[1, 0]
    assert not previous.exact[previous.row_of[0, 1]]  # dropped part way: a partial row
    after, _ = reduce._dominance(cost, [first[:, 1:], *others], previous, neighbours)
    assert after[0, 1]
    np.testing.assert_array_equal(after, reduce._dominates(cost, [first[:, 1:], *others]))
