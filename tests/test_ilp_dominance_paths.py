"""Dominated strategies found with or without the per-row bounds first (issue 45): small
nodes get `extra` exactly for every pair (`_ALL_PAIRS_EXACT`), larger ones only for the
pairs the bounds leave. The bounds drop only pairs far from dominated, so both ways must
find the same dominated pairs."""

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
