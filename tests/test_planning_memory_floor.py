"""Memory floors before any ILP (issue 45, `autopar.inter._memory_bound`): a layer's floor
is no more than the memory of any plan the table returns for it (every level, remat and
mesh of that many devices), and a microbatch count with a layer no mesh can hold is
refused with no layer ILP solved."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import optax
import pytest

import autopar
from examples import gpt

LR = 1e-2
MARKED = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head
SCANNED = dataclasses.replace(gpt.CONFIGS["tiny"], scan_layers=True, remat_layers=True)


@functools.cache
def _traced(cfg, rows: int, num_microbatches: int):
    """`cfg`'s step traced at one of `num_microbatches` microbatches of `rows` rows, as the
    pipeline search traces it (a scanned stack one layer per iteration): (graph, layers,
    tied), traced once per module."""
    from autopar.graph import tied_state
    from autopar.inter import layer_scan
    from autopar.inter.passes import per_iteration
    from autopar.inter.passes._layers import assign_layers
    from autopar.search._options import PlanOptions
    from autopar.search._pipeline import _trace_microbatch

    opt = optax.adamw(LR)
    step = gpt.make_train_step(cfg, opt)
    args = (gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, rows))
    full = autopar.graph.trace(step, *args, batch_argnums=(1,))
    stack = layer_scan(full)
    ranges = None if stack is None else per_iteration(stack.params["length"])
    graph = _trace_microbatch(step, args, PlanOptions(), num_microbatches, None, ranges)
    return graph, assign_layers(graph), tied_state(graph, (0,))


def _table(cfg, rows: int, num_microbatches: int = 2, budget=None):
    """(graph, layers, cluster, stage options, tied, a fresh layer cost table)."""
    from autopar.inter import StageOptions, layer_cost_table
    from autopar.intra._options import ShardOptions

    graph, layers, tied = _traced(cfg, rows, num_microbatches)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    options = StageOptions(shard=ShardOptions(memory_budget=budget))
    return graph, layers, cluster, options, tied, layer_cost_table(
        graph, layers, cluster, num_microbatches, options, tied)


def _check_floors(cfg, shapes, levels):
    """For every layer structure of `cfg` on each of `shapes`: the floor (the smaller of
    the liveness walk's and the ILP model's, less shared state) is at most the memory the
    table prices for the layer at each of `levels` and with each recompute; the liveness
    floor is at most the plan's own liveness peak."""
    from autopar.inter._memory_bound import (
        ilp_floor_on_mesh,
        layer_liveness_floor,
        shared_state_full,
    )
    from autopar.intra._liveness import split_peak_live_bytes

    _, _, _, _, _, table = _table(cfg, 16)
    structures = sorted(set(table._representative.values()))
    assert len(structures) >= 3  # embedding, a block, the head at least
    for shape in shapes:
        for k in structures:
            live = layer_liveness_floor(table, k, math.prod(shape))
            floor = min(live, ilp_floor_on_mesh(table, k, shape)) - shared_state_full(table, k)
            assert floor > 0
            for level in levels:
                cost = table.cost(k, shape, level)
                assert cost is not None
                assert floor <= cost.memory * (1 + 1e-12), (shape, k, level)
                for remat in ("selective", "full"):
                    assert floor <= table.remat_cost(k, shape, level, remat).memory * (1 + 1e-12)
                plan, sub = table.solved_plan(k, shape, level)
                peak, _ = split_peak_live_bytes(
                    sub, plan.var_specs, plan.mesh, table._update_start(k, sub),
                    operand_specs=plan.operand_specs, free=table._attention_core(sub))
                assert live <= peak * (1 + 1e-12), (shape, k, level)


@pytest.mark.parametrize("cfg", [MARKED, SCANNED], ids=["marked", "scanned"])
def test_floor_is_below_every_plans_memory(cfg):
    """Level 0 on meshes of 2 and 8 devices (the extended test below: leaner levels and
    more meshes)."""
    _check_floors(cfg, [(2,), (2, 4)], (0,))


@pytest.mark.extended  # a minute: leaner levels' ILPs; the test above covers level 0
@pytest.mark.parametrize("cfg", [MARKED, SCANNED], ids=["marked", "scanned"])
def test_floor_is_below_every_plans_memory_at_leaner_levels(cfg):
    _check_floors(cfg, [(2,), (4,), (2, 4), (4, 2)], (0, 1, 4))


def test_floor_halves_with_the_devices():
    """Every value at its whole size over the devices (scalars whole): the liveness floor
    on 8 devices is close to an eighth of the floor on one, never below."""
    from autopar.inter._memory_bound import layer_liveness_floor

    _, _, _, _, _, table = _table(MARKED, 16)
    one, eight = layer_liveness_floor(table, 1, 1), layer_liveness_floor(table, 1, 8)
    assert one / 8 <= eight <= one / 8 * 1.01


def test_a_count_no_mesh_holds_is_refused_without_an_ilp(caplog):
    """A budget under the heaviest layer's floor on every mesh: `choose_stages` raises
    `NoStageHoldsLayer` naming the layer, the floor and the budget, logs it, and has solved
    no layer ILP (only built the problems of the layer it refuses)."""
    from autopar.inter import choose_stages
    from autopar.inter._choose import NoStageHoldsLayer
    from autopar.inter._memory_bound import (
        ilp_floor_on_mesh,
        layer_liveness_floor,
        shared_state_full,
    )
    from autopar.inter._submesh import SubmeshShape, logical_mesh_shapes

    graph, layers, cluster, options, tied, table = _table(MARKED, 16)
    submeshes = [SubmeshShape(1, 2), SubmeshShape(1, 8)]
    shapes = [s for sub in submeshes for s in logical_mesh_shapes(sub)]
    heaviest = max(range(layers.num_layers), key=lambda k: layer_liveness_floor(table, k, 8)
                   - shared_state_full(table, k))
    budget = 0.99 * (min(min(layer_liveness_floor(table, heaviest, math.prod(s)),
                             ilp_floor_on_mesh(table, heaviest, s)) for s in shapes)
                     - shared_state_full(table, heaviest))
    options = dataclasses.replace(options, submeshes=submeshes, shard=dataclasses.replace(
        options.shard, memory_budget=budget))
    with caplog.at_level(logging.INFO, logger="autopar"):
        with pytest.raises(NoStageHoldsLayer, match=r"no pipeline plan of 2 microbatch\(es\): "
                                                    r"pipeline layer \d+ needs at least"):
            choose_stages(graph, layers, cluster, 2, tied, options, table=table)
    assert table.num_ilps == 0
    assert any("refused before any ILP" in r.getMessage() for r in caplog.records)


def test_a_count_that_fits_somewhere_is_not_refused():
    """Floors under the budget on the largest mesh: nothing refused, nothing built."""
    from autopar.inter._memory_bound import hopeless_layer

    _, _, _, _, _, table = _table(MARKED, 16)
    assert hopeless_layer(table, [(8,), (2, 4), (4,)], 80e9) is None
    assert not any(key[0] == "ilp floor" for key in table.range_cache if isinstance(key, tuple))
