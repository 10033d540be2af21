"""Stages on no plan within the memory floors (issue 45, `autopar.inter._floor_reach`):
the reach agrees with every slicing enumerated by hand, a count with no such plan is
refused before any layer ILP, and where it rules stages out the stage DP's plan is the
one it finds with the rule off."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from tests.test_planning_memory_floor import MARKED, _table

MIB = 2**20


def _options(options, budget, submeshes, num_stages):
    return dataclasses.replace(options, submeshes=submeshes, num_stages=num_stages,
                               shard=dataclasses.replace(options.shard, memory_budget=budget))


def _on_plan_by_hand(table, num_layers, submeshes, budget, num_stages):
    """Every (start, end, submesh index) of some slicing of the layers into stages whose
    memory floors (`stage_memory_floor`, on some logical mesh of the submesh) are within
    `budget` and whose devices add up to the cluster's, enumerated."""
    from autopar.inter._memory_bound import stage_memory_floor
    from autopar.inter._submesh import logical_mesh_shapes

    def fits(start, end, index):
        return any(stage_memory_floor(table, range(start, end), s, budget) <= budget
                   for s in logical_mesh_shapes(submeshes[index]))

    found = set()
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [num_layers]
        stages = list(zip(bounds, bounds[1:]))
        if num_stages is not None and len(stages) != num_stages:
            continue
        for subs in itertools.product(range(len(submeshes)), repeat=len(stages)):
            if sum(submeshes[i].num_devices for i in subs) != table.cluster.num_devices:
                continue
            if all(fits(s, e, i) for (s, e), i in zip(stages, subs)):
                found.update((s, e, i) for (s, e), i in zip(stages, subs))
    return found


@pytest.mark.parametrize("budget_mib, sizes, num_stages", [
    (0.4, (1, 2, 4, 8), None),  # the embedding needs 4 devices or more
    (2.0, (2, 4), 3),  # every stage fits: only the device and stage counts rule out
    (0.35, (2, 4), 3),  # no plan at all
])
def test_reach_matches_every_slicing(budget_mib, sizes, num_stages):
    """`FloorReach.on_plan` is true exactly for the stages of some slicing whose floors
    fit, enumerated by hand; `exists` when there is one. No layer ILP solved."""
    from autopar.inter._floor_reach import FloorReach
    from autopar.inter._submesh import SubmeshShape

    _, layers, _, _, _, table = _table(MARKED, 16)
    submeshes = [SubmeshShape(1, d) for d in sizes]
    budget = budget_mib * MIB
    reach = FloorReach(table, layers.num_layers, submeshes, None, budget,
                       num_stages=num_stages)
    by_hand = _on_plan_by_hand(table, layers.num_layers, submeshes, budget, num_stages)
    every = {(s, e, i) for s in range(layers.num_layers)
             for e in range(s + 1, layers.num_layers + 1) for i in range(len(submeshes))}
    assert {key for key in every if reach.on_plan(*key)} == by_hand
    assert reach.exists == bool(by_hand)
    assert table.num_ilps == 0


def test_a_count_with_no_plan_within_the_floors_is_refused_without_an_ilp(caplog):
    """3 stages on 2 + 2 + 4 devices: the embedding and each block need 4 devices by
    their floors, no layer is over the budget on every mesh (`hopeless_layer` lets it
    through), yet no slicing fits: refused by the reach with no layer ILP."""
    import logging

    from autopar.inter import choose_stages
    from autopar.inter._choose import NoPlanWithinFloors
    from autopar.inter._memory_bound import hopeless_layer
    from autopar.inter._submesh import SubmeshShape

    graph, layers, cluster, options, tied, table = _table(MARKED, 16)
    budget = 0.35 * MIB
    assert hopeless_layer(table, [(2,), (4,), (2, 2)], budget) is None
    options = _options(options, budget, [SubmeshShape(1, 2), SubmeshShape(1, 4)], 3)
    with caplog.at_level(logging.INFO, logger="autopar"):
        with pytest.raises(NoPlanWithinFloors, match=r"no pipeline plan of 2 microbatch\(es\)"
                           r": no slicing of the 5 pipeline layers into stages \(3\)"):
            choose_stages(graph, layers, cluster, 2, tied, options, table=table)
    assert table.num_ilps == 0
    assert any("refused before any ILP" in r.getMessage() for r in caplog.records)


def test_the_plan_is_the_one_found_with_the_reach_off(monkeypatch, caplog):
    """Where the reach rules stages out, the DP's plan and predicted latency are those of
    the DP without it (`MAX_PAIRS = 0`), bit for bit, with no more layer ILPs."""
    import logging

    import autopar.inter._floor_reach as floor_reach
    from autopar.inter import choose_stages, layer_cost_table
    from autopar.inter._submesh import SubmeshShape

    graph, layers, cluster, options, tied, _ = _table(MARKED, 16)
    options = _options(options, 2.0 * MIB, [SubmeshShape(1, 2), SubmeshShape(1, 4)], 3)
    choices = []
    for cap in (floor_reach.MAX_PAIRS, 0):
        monkeypatch.setattr(floor_reach, "MAX_PAIRS", cap)
        table = layer_cost_table(graph, layers, cluster, 2, options, tied)
        with caplog.at_level(logging.INFO, logger="autopar"):
            choices.append(choose_stages(graph, layers, cluster, 2, tied, options,
                                         table=table))
    ruled = [r.getMessage() for r in caplog.records if "on no plan within" in r.getMessage()]
    assert len(ruled) == 1 and not ruled[0].startswith("stage DP: 0 ")
    with_reach, without = choices
    assert with_reach.stage_layers == without.stage_layers
    assert with_reach.logical_shapes == without.logical_shapes
    assert with_reach.latency == without.latency
    assert math.isfinite(with_reach.latency)
    assert with_reach.num_layer_ilps <= without.num_layer_ilps


def test_the_no_plan_message_counts_the_pairs_off_plan():
    """A stage answered off plan (`OFF_PLAN`) is counted once per (layer range, submesh)
    in the no-plan message, which then does not claim that not even one layer fits."""
    from autopar.inter._stage_dp import StageCost, plan_stages
    from autopar.inter._stage_dp_messages import OFF_PLAN

    def cost(start, end, index):
        return StageCost(math.inf, False, math.inf, OFF_PLAN if index == 0 else None)

    with pytest.raises(ValueError, match=r"No stage could be costed within the memory "
                       r"budget of 0\.5 GiB per device\. 3 \(layer range, submesh\) pairs "
                       r"are on no slicing") as err:
        plan_stages(2, 1, 2, cost, 2, memory_budget=2**29)
    assert "not even one layer" not in str(err.value)
