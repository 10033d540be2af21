"""Submeshes and layer ILPs cut before any solve (issue 45, `autopar.inter._submesh_cut`):
on a made-up cluster of 4 hosts x 2 devices, the submeshes whose every logical mesh holds
no layer within the memory budget and those whose device count no plan of the stage count
asked for can use are left out, exactly those; and the stage DP finds the same plan as
with every submesh and every layer ILP, with fewer ILPs (extended)."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest

import autopar
from tests.test_planning_memory_floor import MARKED, _traced

BUDGET = 0.2 * 2**20  # bytes per device: no layer of the tiny GPT alone fits on 1 device


def test_fillable_sizes_by_hand():
    """32 devices in submeshes of 4, 8, 16 and 32: with exactly one other stage only 16
    fills the rest; with none only 32; with 1 to 7 others every size but 32; 7 others of
    4 or 8 devices leave 28 or more, so only 4 (with 7 x 4) is used with exactly 7."""
    from autopar.inter._submesh_cut import fillable_sizes

    sizes = [4, 8, 16, 32]
    assert fillable_sizes(32, sizes, 1, 1) == {16}
    assert fillable_sizes(32, sizes, 0, 0) == {32}
    assert fillable_sizes(32, sizes, 0, 7) == {4, 8, 16, 32}
    assert fillable_sizes(32, sizes, 1, 7) == {4, 8, 16}
    assert fillable_sizes(32, [4], 0, 7) == {4}
    assert fillable_sizes(32, [4, 8], 7, 7) == {4}
    assert fillable_sizes(32, [4, 8], 0, 2) == set()  # two others cover 16 at most


def _setup(budget=BUDGET, num_stages=2):
    from autopar.inter import StageOptions, layer_cost_table
    from autopar.intra._options import ShardOptions

    graph, layers, tied = _traced(MARKED, 16, 2)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g").with_shape(4, 2)
    options = StageOptions(shard=ShardOptions(memory_budget=budget), num_stages=num_stages)
    table = layer_cost_table(graph, layers, cluster, 2, options, tied)
    return graph, layers, cluster, options, tied, table


def test_cut_removes_what_no_stage_can_use(caplog):
    """4 hosts x 2 devices, 2 stages, 0.2 MiB per device, no ILP solved: 1x1 goes by the
    memory floor (every layer alone over the budget there, by the floors the stage DP
    skips on), and of the rest (1x2, 2x2, 4x2: 3x2's 6 devices split no tensor) only 2x2
    leaves devices (8 - 4) that one kept submesh fills; the shapes kept are 2x2's."""
    from autopar.inter._choose import _splittable
    from autopar.inter._memory_bound import stage_memory_floor
    from autopar.inter._submesh import submesh_shapes
    from autopar.inter._submesh_cut import usable_submeshes

    _, layers, _, options, _, table = _setup()
    subs, shapes = _splittable(table, submesh_shapes(4, 2), options)
    assert [str(s) for s in subs] == ["1x1", "1x2", "2x2", "4x2"]
    for k in range(layers.num_layers):
        assert stage_memory_floor(table, range(k, k + 1), (1,), BUDGET) > BUDGET
    assert any(stage_memory_floor(table, range(k, k + 1), (2,), BUDGET) <= BUDGET
               for k in range(layers.num_layers))
    with caplog.at_level(logging.INFO, logger="autopar"):
        kept, kept_shapes = usable_submeshes(table, subs, shapes, options, BUDGET,
                                             layers.num_layers)
    assert [str(s) for s in kept] == ["2x2"]
    assert kept_shapes == ((4,), (2, 2))
    said = [r.getMessage() for r in caplog.records if "before any ILP" in r.getMessage()]
    assert said and "3 of 4 submeshes" in said[0] and ": 1 whose every" in said[0], said
    assert ", 2 whose device count" in said[0], said
    assert table.num_ilps == 0
    # Any stage count: every size is used by some plan (1x2 + 3 x 1x2, ...); the unpruned
    # reference (no lower bounds) cuts nothing.
    kept, _ = usable_submeshes(table, subs, shapes,
                               dataclasses.replace(options, num_stages=None), BUDGET,
                               layers.num_layers)
    assert [str(s) for s in kept] == ["1x2", "2x2", "4x2"]
    table.lower_bounds = False
    assert usable_submeshes(table, subs, shapes, options, BUDGET, layers.num_layers) == (
        subs, shapes)


# Two stage DPs of the tiny GPT under a tight budget: minutes on 2 loaded cores. In the
# default suite, `test_cut_removes_what_no_stage_can_use` checks what is cut and
# test_planning_stage_floor.py the floor it rests on (which the DP's own skip uses).
@pytest.mark.extended
def test_cut_keeps_the_plan(monkeypatch):
    """4 hosts x 2 devices, any stage count, a budget just under the least floor of a
    layer alone on one device (so 1x1 is left out; the whole model fits on 8 devices):
    with the cuts (1x1 left out, and each layer's level-0 ILP skipped on the meshes where
    it alone is over the budget), the same stages, submeshes, meshes, levels and predicted
    time as with neither, fewer ILPs."""
    from autopar.inter import _choose, choose_stages
    from autopar.inter._memory_bound import stage_memory_floor
    from autopar.inter._stage_costs import _StageCosts

    _, layers, *_, table = _setup()
    budget = min(stage_memory_floor(table, range(k, k + 1), (1,), 0.0)  # refined floors
                 for k in range(layers.num_layers)) * (1 - 1e-6)

    results = {}
    for cut in (True, False):
        if not cut:
            monkeypatch.setattr(_choose, "usable_submeshes",
                                lambda table, subs, shapes, *a: (subs, shapes))
            monkeypatch.setattr(_StageCosts, "holds", lambda self, k, shape: True)
        graph, layers, cluster, options, tied, table = _setup(budget, None)
        choice = choose_stages(graph, layers, cluster, 2, tied, options, table=table)
        results[cut] = (choice, table.num_ilps)
    (cut, cut_ilps), (full, full_ilps) = results[True], results[False]
    assert [str(s) for s in cut.submeshes] == [str(s) for s in full.submeshes]
    # (the submesh indices differ: they index each search's own submesh list)
    assert [s[:2] for s in cut.dp.stages] == [s[:2] for s in full.dp.stages]
    assert cut.latency == full.latency
    assert cut.logical_shapes == full.logical_shapes
    assert [c.detail for c in cut.dp.stage_costs] == [c.detail for c in full.dp.stage_costs]
    assert cut_ilps < full_ilps, (cut_ilps, full_ilps)
    assert sum(math.prod(s) for s in cut.logical_shapes) == 8
