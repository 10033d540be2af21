"""`_fitting_level`'s walks shared by the ranges of equal content and by the cutoffs that
compare alike (`autopar.inter._stage_fit._Cutoff`): each answer is the one a walk of its
own gives."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autopar.inter import _stage_fit
from tests.helpers import MadeUpTable


class _Table(MadeUpTable):
    """Made-up layer costs of two layer structures (even and odd layers) (`MadeUpTable`).
    `range_key` is the structures in order, so ranges of equal content share the range
    cache (None when `shared` is off)."""

    def __init__(self, seed: int, shapes, shared: bool):
        super().__init__(np.random.default_rng(seed), 2, shapes)
        self.shared = shared
        self.range_cache: dict = {}

    def kind(self, k: int) -> int:
        return k % 2

    def range_key(self, layer_range):
        layers = list(layer_range)
        return tuple(k % 2 for k in layers) if self.shared else None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("levels", ["price", "limit"])
def test_shared_walks_give_each_walks_own_answer(seed, levels):
    """On every range of 8 layers, 2 shapes, 3 in-flight counts and cutoffs around the
    ranges' own lower bounds (each walk's turning points), full walks and walks over the
    levels solved so far (`solved_only`) asked in a shuffled order: `_fitting_level`'s
    answer equals a walk of its own on a table sharing nothing, and fewer walks are taken
    than asked (ranges of equal content and cutoffs that compare alike share them)."""
    shapes = [(8,), (2, 4)]
    rng = np.random.default_rng(seed)
    budget = float(rng.uniform(8, 20))
    shared, alone = _Table(seed, shapes, True), _Table(seed, shapes, False)
    shared.memory_levels = alone.memory_levels = levels
    bounds_of = _Table(seed, shapes, False)  # asks leave the others' solved levels alone
    asks = []
    for a in range(8):
        for b in range(a + 1, 9):
            for shape in shapes:
                bounds = [_stage_fit._lower_bound(bounds_of, range(a, b), shape, level)
                          for level in (0, 3, 6, 9)]
                cutoffs = [math.inf, -math.inf, *bounds, *(x * (1 + 1e-9) for x in bounds),
                           *(float(rng.uniform(0, 2 * b - 2 * a)) for _ in range(3))]
                asks += [(a, b, shape, f, c, bool(rng.integers(2)))
                         for f in (1, 2, 4) for c in cutoffs]
    rng.shuffle(asks)
    fits = 0
    for a, b, shape, in_flight, cutoff, solved_only in asks:
        got = _stage_fit._fitting_level(shared, range(a, b), shape, in_flight, budget,
                                        cutoff=cutoff, solved_only=solved_only)
        own = _stage_fit._fitting_level(alone, range(a, b), shape, in_flight, budget,
                                        cutoff=cutoff, solved_only=solved_only)
        assert got == own, (a, b, shape, in_flight, cutoff, solved_only)
        fits += own is not None and own.level > 0
    assert fits, "the budget should need leaner levels"
    walks = sum(len(v) for k, v in shared.range_cache.items() if k[0] == "walk")
    assert 0 < walks < len(asks) / 4
    assert shared.solved == alone.solved  # the same levels solved


def test_a_cutoff_records_the_interval_that_compares_alike():
    """`_Cutoff.reached` is ``x >= cutoff``, and every cutoff in (low, high] gives the
    comparisons made the same outcomes."""
    probe = _stage_fit._Cutoff(5.0)
    outcomes = [(x, probe.reached(x)) for x in (1.0, 7.0, 5.0, -math.inf, 3.0, 9.0)]
    assert [o for _, o in outcomes] == [False, True, True, False, False, True]
    assert (probe.low, probe.high) == (3.0, 5.0)
    for c in (3.0 + 1e-12, 4.0, 5.0):
        assert all((x >= c) == o for x, o in outcomes)
    for c in (3.0, 5.0 + 1e-12):
        assert not all((x >= c) == o for x, o in outcomes)
