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


# Two stage DPs with every stage costed: about 30 s on 2 quiet cores. In the default
# suite, `test_stage_floor_is_below_every_fit` checks the bound the cut rests on, and
# every stage-DP test runs with the cut on.
@pytest.mark.extended
def test_cut_keeps_the_plan_and_solves_fewer_ilps(caplog):
    """The tiny GPT on submeshes of 2 and 4 devices under 0.4 MiB per device (several
    blocks do not fit on 2 devices, whatever their level), every stage costed
    (`prune_by_bound=False`, so that only the floors cut): with the floors on, the same
    stages, meshes and predicted time as with them off, fewer layer ILPs, and the skipped
    pairs logged."""
    from autopar.inter import choose_stages
    from autopar.inter._submesh import SubmeshShape

    results = {}
    for on in (True, False):
        graph, layers, cluster, options, tied, table = _table(MARKED, 16)
        options = dataclasses.replace(
            options, memory_floors=on, prune_by_bound=False,
            submeshes=(SubmeshShape(1, 2), SubmeshShape(1, 4)),
            shard=dataclasses.replace(options.shard, memory_budget=0.4 * 2**20))
        with caplog.at_level(logging.INFO, logger="autopar"):
            caplog.clear()
            choice = choose_stages(graph, layers, cluster, 2, tied, options, table=table)
        skipped = [r.getMessage() for r in caplog.records if "memory floor" in r.getMessage()]
        results[on] = (choice, table.num_ilps, skipped)
    (cut, cut_ilps, cut_log), (full, full_ilps, full_log) = results[True], results[False]
    assert cut.latency == full.latency
    assert cut.dp.stages == full.dp.stages
    assert cut.logical_shapes == full.logical_shapes
    assert [c.detail for c in cut.dp.stage_costs] == [c.detail for c in full.dp.stage_costs]
    assert cut_ilps < full_ilps, (cut_ilps, full_ilps)
    # The floors cut pairs: those on no slicing within them (`_floor_reach`, logged
    # first) or, of the rest, those over the budget on every mesh (`_over_budget`).
    assert any(not line.startswith("stage DP: 0 ") for line in cut_log), cut_log
    assert full_log and full_log[0].startswith("stage DP: 0 of"), full_log
