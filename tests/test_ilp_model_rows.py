"""The sharding ILP's rows, built as whole-array blocks (issue 45), are the rows a loop over
each edge's strategy classes makes: the same columns, coefficients, senses and right-hand
sides in the same order, so HiGHS is passed the same model and searches the same way."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.intra._ilp_model import (
    _EQ,
    _all_classes,
    _class_sums,
    _classes,
    _compressed_edge,
    _HighsBuilt,
    _normalised_costs,
    plans_within,
    sharding_model,
)
from autopar.intra._ilp_reduce import CostGraph, MemoryGroup


def _graph(seed: int) -> tuple[CostGraph, list[MemoryGroup]]:
    """A random graph whose edge matrices repeat rows and columns (strategy classes)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 7, size=9)
    graph = CostGraph({v: rng.random(int(n)) for v, n in enumerate(sizes)})
    for v in range(9):
        for w in range(v + 1, 9):
            if rng.random() < 0.4:
                base = rng.integers(0, 3, size=(3, 4)).astype(float)
                rows = rng.integers(0, 3, size=int(sizes[v]))
                cols = rng.integers(0, 4, size=int(sizes[w]))
                graph.add_edge(v, w, base[np.ix_(rows, cols)])
    terms = tuple((v, rng.random(int(sizes[v]))) for v in (0, 3, 5))
    return graph, [MemoryGroup(0.5, terms)]


def _rows_by_loop(graph: CostGraph, groups, budget: float):
    """The rows as issue 18's loop appended them, one per class of each edge's ends."""
    node_cost, edges, scale = _normalised_costs(graph)
    columns, start = {}, 0
    rows = []
    for v in sorted(node_cost):
        columns[v] = np.arange(start, start + len(node_cost[v]))
        start += len(node_cost[v])
        rows.append((columns[v], np.ones(len(columns[v])), _EQ, 1.0))
    for v, w, matrix in edges:
        row_class, col_class, classes = _compressed_edge(matrix / scale)
        count, width = classes.shape
        e = np.arange(start, start + count * width).reshape(count, width)
        start += count * width
        s_v = _class_sums(columns[v], row_class, count)
        s_w = _class_sums(columns[w], col_class, width)
        for a in range(count):
            rows.append((np.concatenate([e[a], s_v[a]]),
                         np.concatenate([np.ones(width), -np.ones(len(s_v[a]))]), _EQ, 0.0))
        for b in range(width - 1):
            rows.append((np.concatenate([e[:, b], s_w[b]]),
                         np.concatenate([np.ones(count), -np.ones(len(s_w[b]))]), _EQ, 0.0))
    for group in groups:
        rows.append((np.concatenate([columns[v] for v, _ in group.terms]),
                     np.concatenate([t for _, t in group.terms]) / budget, -1,
                     (budget - group.constant) / budget))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_rows_built_as_blocks_are_the_loops_rows(seed):
    graph, groups = _graph(seed)
    model = sharding_model(graph, groups, 2.0, "marginal")
    expected = _rows_by_loop(graph, groups, 2.0)
    assert model.num_rows == len(expected) == len(model.rows)
    for (columns, coefficients, sense, rhs), (c, a, s, b) in zip(model.rows, expected):
        assert columns.tolist() == c.tolist() and columns.dtype == np.int64
        assert coefficients.tolist() == a.tolist()
        assert (sense, rhs) == (s, b)
    # HiGHS's row-wise matrix: row starts, then the nonzeros row by row
    built = _HighsBuilt(model)
    nonzero = [(c[a != 0], a[a != 0]) for c, a, _, _ in expected]
    assert built.starts.tolist() == np.cumsum([0] + [len(c) for c, _ in nonzero]).tolist()
    assert built.index.tolist() == np.concatenate([c for c, _ in nonzero]).tolist()
    assert built.value.tolist() == np.concatenate([a for _, a in nonzero]).tolist()
    # reduced-cost fixing reads the same rows: every strategy is kept with zero duals and
    # a bound above the largest cost, none with a bound below the least
    keep = plans_within(model, np.zeros(model.num_rows), float(len(graph.node_cost)) + 1.0)
    assert all(len(k) == len(model.node_columns[v]) for v, k in keep.items())
    below = plans_within(model, np.zeros(model.num_rows), -1.0)
    assert all(len(k) == 0 for k in below.values())


def test_classes_found_together_are_each_matrix_own():
    rng = np.random.default_rng(0)
    matrices = []
    for _ in range(40):
        base = rng.integers(-1, 2, size=(int(rng.integers(1, 5)), int(rng.integers(1, 6))))
        matrix = base[rng.integers(0, len(base), int(rng.integers(1, 9)))].astype(float)
        matrix[matrix == 0] *= np.where(rng.random(matrix[matrix == 0].shape) < 0.5, -1, 1)
        matrices.append(matrix)  # -0.0 and 0.0 mixed: one value
    together = _all_classes(matrices + [m.T for m in matrices])
    for matrix, (first, classes) in zip(matrices + [m.T for m in matrices], together):
        alone = _classes(matrix)
        assert first.tolist() == alone[0].tolist() and classes.tolist() == alone[1].tolist()
        assert len(set(map(tuple, (matrix + 0.0)[first].tolist()))) == len(first)
