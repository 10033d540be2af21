"""Layer time floors in the stage DP (issue 45, `autopar.inter._memory_bound.
layer_time_floor`): a bound on a layer's latency on a mesh from its ILP built, not solved,
no more than any plan the table prices for it; the stage DP that bounds stages and the
least work by them before solving their fastest plans keeps the plan of the search that
solves every fastest plan first, from fewer layer ILPs."""

from __future__ import annotations

import dataclasses

from autopar.inter._stage_dp import StageCost, plan_stages
from autopar.inter._stage_dp_messages import MemoryFloor
from tests.test_planning_memory_floor import MARKED, _table


def test_time_floor_is_below_every_level():
    """Every layer structure of the tiny GPT on meshes of 2 and 8 devices: the floor is
    positive and at most the latency of its plan at two memory levels, with each remat."""
    from autopar.inter._memory_bound import layer_time_floor

    _, _, _, _, _, table = _table(MARKED, 16)
    structures = sorted(set(table._representative.values()))
    for shape in [(2,), (2, 4)]:
        for k in structures:
            floor = layer_time_floor(table, k, shape)
            assert floor > 0
            for level in (0, 2):
                cost = table.cost(k, shape, level)
                assert floor <= cost.latency, (k, shape, level, floor, cost.latency)
                for remat in ("selective", "full"):
                    priced = table.remat_cost(k, shape, level, remat)
                    assert floor <= priced.latency


def test_floors_keep_the_plan_and_solve_fewer_ilps(monkeypatch):
    """The tiny GPT on one 8-device host, 2 microbatches: with the time floors the same
    stages, meshes, memory levels and predicted time as the search that solves every
    layer's fastest plan on every mesh first, from fewer layer ILPs."""
    from autopar.inter import _stage_costs, choose_stages

    results = {}
    for on in (False, True):
        monkeypatch.setattr(_stage_costs, "TIME_FLOORS", on)
        graph, layers, cluster, options, tied, table = _table(MARKED, 16)
        choice = choose_stages(graph, layers, cluster, 2, tied, options, table=table)
        results[on] = (choice, table.num_ilps)
    (full, full_ilps), (cut, cut_ilps) = results[False], results[True]
    assert cut.latency == full.latency
    assert cut.dp.stages == full.dp.stages
    assert cut.logical_shapes == full.logical_shapes
    assert [c.detail for c in cut.dp.stage_costs] == [c.detail for c in full.dp.stage_costs]
    assert cut_ilps < full_ilps, (cut_ilps, full_ilps)


def test_a_floor_skipped_stage_needs_at_least_its_floor():
    """A stage whose memory is a floor (`MemoryFloor`), not a fit's peak, is said to need
    at least it; a fit's peak is said to be needed."""
    def floors(start, end, index):
        return StageCost(1.0, False, memory=(end - start) * 3e9 / 2**index,
                         detail=MemoryFloor())

    def peaks(start, end, index):
        return dataclasses.replace(floors(start, end, index), detail=None)

    import pytest

    with pytest.raises(ValueError, match=r"shortfall is at least 0\.198 GiB per device: "
                       r"pipeline layers \[0, 1\) on submesh 1x4 needs at least 0\.698 GiB"):
        plan_stages(3, 1, 4, floors, 2, memory_budget=2**29)
    with pytest.raises(ValueError, match=r"shortfall is 0\.198 GiB per device: pipeline "
                       r"layers \[0, 1\) on submesh 1x4 needs 0\.698 GiB"):
        plan_stages(3, 1, 4, peaks, 2, memory_budget=2**29)
