"""Layer clustering: cheap cuts, FLOPs balance, the exact optimum on small cases, speed."""

import itertools
import random
import time

import numpy as np
import pytest

from autopar.inter.passes._clustering import cluster_layers, cluster_layers_detailed, cut_bytes


def naive_cut_bytes(num_equations, edges):
    """Per cut, every producer before it adds its largest edge that crosses it."""
    cross = np.zeros(num_equations + 1)
    for cut in range(1, num_equations):
        largest = {}
        for producer, consumer, size in edges:
            if producer < cut <= consumer:
                largest[producer] = max(largest.get(producer, 0.0), size)
        cross[cut] = sum(largest.values())
    return cross


def objective(flops, edges, cuts, num_layers):
    """(largest cut bytes, total cut bytes, distance of cuts from balanced positions)."""
    cross = cut_bytes(len(flops), edges)
    prefix = np.concatenate(([0.0], np.cumsum(flops)))
    total = prefix[-1]
    values = [cross[c] for c in cuts]
    imbalance = sum(abs(prefix[c] - (r + 1) * total / num_layers) for r, c in enumerate(cuts))
    return (max(values, default=0.0), sum(values), imbalance)


def brute_force(flops, edges, num_layers, delta):
    """The best cuts over every slicing that meets the FLOPs cap."""
    prefix = np.concatenate(([0.0], np.cumsum(flops)))
    cap = (1 + delta) * prefix[-1] / num_layers * (1 + 1e-9)
    best = None
    for cuts in itertools.combinations(range(1, len(flops)), num_layers - 1):
        bounds = (0, *cuts, len(flops))
        if all(prefix[e] - prefix[s] <= cap for s, e in zip(bounds, bounds[1:])):
            key = objective(flops, edges, cuts, num_layers)
            if best is None or key < best:
                best = key
    return best


def transformer_like_chain(num_blocks, block_size, rng, block_flops=None):
    """Blocks of equations: big values inside a block, a cheap residual between blocks.

    Inside a block every equation feeds the next with 1000 bytes and the block input is
    reused by the block's last equation (a residual add); the last equation of a block
    feeds the next block with 100 bytes. The only cheap cuts are the block edges."""
    num_equations = num_blocks * block_size
    flops = [rng.uniform(1.0, 3.0) for _ in range(num_equations)]
    if block_flops is not None:
        for b, target in enumerate(block_flops):
            block = flops[b * block_size : (b + 1) * block_size]
            scale = target / sum(block)
            flops[b * block_size : (b + 1) * block_size] = [f * scale for f in block]
    edges = []
    for e in range(num_equations - 1):
        at_block_end = (e + 1) % block_size == 0
        edges.append((e, e + 1, 100.0 if at_block_end else 1000.0))
    for b in range(num_blocks):
        first, last = b * block_size, (b + 1) * block_size - 1
        if last > first + 1:
            edges.append((first, last, 100.0))
    return flops, edges


def test_cut_bytes_matches_the_definition():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 12)
        edges = [
            (u, v, float(rng.randint(0, 9)))
            for u in range(n)
            for v in range(u + 1, n)
            if rng.random() < 0.35
        ]
        np.testing.assert_allclose(cut_bytes(n, edges), naive_cut_bytes(n, edges))


def test_a_value_read_by_many_later_equations_counts_once_per_cut():
    cross = cut_bytes(5, [(0, 2, 8.0), (0, 4, 8.0), (0, 1, 8.0), (1, 2, 3.0)])
    assert cross.tolist() == [0.0, 8.0, 11.0, 8.0, 8.0, 0.0]


def test_cuts_land_on_the_cheap_block_edges():
    rng = random.Random(1)
    flops, edges = transformer_like_chain(num_blocks=8, block_size=12, rng=rng)
    result = cluster_layers_detailed(flops, edges, num_layers=8)
    assert result.boundaries == tuple((12 * b, 12 * (b + 1)) for b in range(8))
    assert result.max_cut_bytes == 100.0 and result.total_cut_bytes == 700.0
    # Four layers of two blocks: still the block edges, and the balanced ones.
    assert cluster_layers(flops, edges, 4) == [(0, 24), (24, 48), (48, 72), (72, 96)]


def test_uneven_blocks_are_kept_whole_when_within_delta():
    """Blocks of 0.8, 1.2, 1.0, 1.0 x the mean stay whole with delta = 0.5."""
    rng = random.Random(2)
    flops, edges = transformer_like_chain(4, 10, rng, block_flops=[80.0, 120.0, 100.0, 100.0])
    assert cluster_layers(flops, edges, 4, delta=0.5) == [(0, 10), (10, 20), (20, 30), (30, 40)]


def test_balance_wins_over_cheap_cuts_when_they_are_too_uneven():
    """Block 0 holds 3/4 of the FLOPs; with 2 layers and delta = 0.2 (cap 0.6 of the total)
    the cut must fall inside block 0, at a 1000-byte edge, and the cap must hold."""
    rng = random.Random(3)
    flops, edges = transformer_like_chain(2, 10, rng, block_flops=[300.0, 100.0])
    result = cluster_layers_detailed(flops, edges, 2, delta=0.2)
    (_, cut), _ = result.boundaries
    assert 0 < cut < 10 and result.max_cut_bytes >= 1000.0
    assert max(result.layer_flops) <= 1.2 * 400.0 / 2 + 1e-9


@pytest.mark.parametrize("seed", range(40))
def test_optimum_and_balance_match_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    num_layers = rng.randint(1, n)
    flops = [float(rng.choice([0, 1, 2, 3, 8])) for _ in range(n)]
    edges = [
        (u, v, float(rng.randint(0, 6)))
        for u in range(n)
        for v in range(u + 1, n)
        if rng.random() < 0.3
    ]
    delta = rng.choice([0.0, 0.25, 0.5])
    result = cluster_layers_detailed(flops, edges, num_layers, delta)
    bounds = result.boundaries
    assert len(bounds) == num_layers and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(s < e for s, e in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    total = sum(flops)
    assert max(result.layer_flops) <= (1 + result.delta) * total / num_layers + 1e-9
    assert result.delta == delta or brute_force(flops, edges, num_layers, delta) is None
    cuts = [s for s, _ in bounds[1:]]
    expected = brute_force(flops, edges, num_layers, result.delta)
    np.testing.assert_allclose(objective(flops, edges, cuts, num_layers), expected)


def test_delta_is_relaxed_when_one_equation_is_too_big():
    flops = [1.0, 1.0, 20.0, 1.0, 1.0, 1.0]  # 20 > 1.5 x 25 / 3
    result = cluster_layers_detailed(flops, [], 3, delta=0.5)
    assert result.delta > 0.5
    assert max(result.layer_flops) <= (1 + result.delta) * 25.0 / 3
    assert len(result.boundaries) == 3


def test_input_errors():
    with pytest.raises(ValueError, match="cannot group 3 equations into 4 layers"):
        cluster_layers([1.0, 1.0, 1.0], [], 4)
    with pytest.raises(ValueError, match=r"edge \(2, 1\) is not a forward dataflow edge"):
        cluster_layers([1.0, 1.0, 1.0], [(2, 1, 4.0)], 2)
    with pytest.raises(ValueError, match="flops must be finite and >= 0"):
        cluster_layers([1.0, -1.0], [], 1)
    with pytest.raises(ValueError, match="delta must be a finite number >= 0"):
        cluster_layers([1.0, 1.0], [], 1, delta=-0.1)


def test_twenty_thousand_equations_in_well_under_a_second():
    rng = np.random.default_rng(0)
    n, num_layers = 20_000, 24
    flops = rng.uniform(0.0, 100.0, n)
    chain = np.stack([np.arange(n - 1), np.arange(1, n), rng.integers(1, 1000, n - 1)], 1)
    skips = np.arange(0, n - 60, 3)
    reach = skips + rng.integers(2, 50, len(skips))
    skip = np.stack([skips, reach, rng.integers(1, 999, len(skips))], 1)
    edges = np.concatenate([chain, skip]).astype(float)
    started = time.perf_counter()
    result = cluster_layers_detailed(flops, edges, num_layers)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"clustering 20k equations took {elapsed:.2f} s"
    assert len(result.boundaries) == num_layers
    assert max(result.layer_flops) <= 1.5 * flops.sum() / num_layers * (1 + 1e-9)
