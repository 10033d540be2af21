"""A stage's memory floor in the stage DP (issue 45, `autopar.inter._memory_bound.
stage_memory_floor`): no more than the memory of any fit of its layers the DP can price
(any level, any recompute), and the pairs (layer range, logical mesh) over the budget are
skipped without changing the plan, with fewer layer ILPs solved."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest

from tests.test_planning_memory_floor import MARKED, _table


def test_stage_floor_is_below_every_fit():
    """Ranges of the tiny GPT's layers on meshes of 2 and 8 devices: the floor from the
    liveness walks (a budget it stays under) and the one refined by the ILP model's floors
    (a budget of 0) are at most the memory of the fit at level 0 with each recompute
    choice, whatever the microbatches in flight."""
    from autopar.inter._memory_bound import stage_memory_floor
    from autopar.inter._stage_fit import _choose_remat

    _, layers, _, _, _, table = _table(MARKED, 16)
    num_layers = layers.num_layers
    ranges = [range(0, 1), range(1, 3), range(0, num_layers), range(num_layers - 1, num_layers)]
    for shape in [(2,), (2, 4)]:
        for layer_range in ranges:
            live = stage_memory_floor(table, layer_range, shape, math.inf)
            refined = stage_memory_floor(table, layer_range, shape, 0.0)
            assert 0 < refined <= live * (1 + 1e-12)
            for remat in ("none", "selective", "full"):
                fit = _choose_remat(table, layer_range, shape, 0, 1, math.inf, remat)
                assert live <= fit.memory * (1 + 1e-12), (shape, layer_range, remat)
