"""Pipelined plans without running them: the stage options checked before planning, one
data-parallel stage where that is fastest, and the layer cost table the stage DP reads
(memory levels, footprints, stitched stages, leaner plans where a stage does not fit).

The table's tests share one trace of the tiny GPT (AdamW, 16 rows): `adamw_graph`."""

from __future__ import annotations

import dataclasses

import optax
import pytest
from helpers import GPT, cluster, tiny_gpt_step

import autopar
from autopar.report import matmul_weight_splits
from examples import gpt

LR = 1e-2


@pytest.fixture(scope="module")
def adamw_graph():
    """(graph, its layers, tied state) of the tiny GPT's AdamW step on 16 rows, traced once
    for the module (the tables below only read it)."""
    from autopar.graph import tied_state
    from autopar.inter.passes._layers import assign_layers

    step, args = tiny_gpt_step(GPT, optax.adamw(LR), 16)
    graph = autopar.graph.trace(step, *args, batch_argnums=(1,))
    return graph, assign_layers(graph), tied_state(graph, (0,))


def test_stage_options_that_cannot_cover_the_devices():
    opt = optax.sgd(LR)
    args = (gpt.abstract_state(GPT, opt), gpt.abstract_batch(GPT, 8))
    step = gpt.make_train_step(GPT, opt)
    with pytest.raises(ValueError, match="stage"):
        autopar.plan(step, *args, cluster=cluster(), num_stages=3, submeshes=[(1, 4)],
                     logical_shapes=[(4,)], num_microbatches=2)
    with pytest.raises(ValueError, match="layers"):
        autopar.plan(step, *args, cluster=cluster(), num_stages=6, submeshes=[(1, 1)],
                     logical_shapes=[(1,)], num_microbatches=2)


def test_small_model_large_batch_on_one_host_is_one_data_parallel_stage():
    cfg = dataclasses.replace(GPT, hidden=128, num_layers=2)
    opt = optax.sgd(LR)
    step = gpt.make_train_step(cfg, opt)
    args = (gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, 4096))
    plan = autopar.plan(step, *args, cluster=cluster("dgx-a100-80g"), num_microbatches=1)
    assert plan.num_stages == 1
    mesh = plan.stages[0].mesh
    assert mesh.num_devices == 8
    # Every matmul reads its weight whole (no tensor parallelism). Weights may be stored
    # split and gathered once per step (ZeRO-style), which moves the same bytes as
    # all-reducing their gradients: the cost model rates the two alike.
    graph = autopar.graph.trace(step, *args, batch_argnums=(1,))
    splits = matmul_weight_splits(plan, graph)
    assert len(splits) >= 8
    for _, path, axes in splits:
        assert not axes, f"{path} is split over {axes} where a matmul reads it"
    # (On a 2-D mesh the ILP may still re-lay activations out, batch <-> heads, with
    # all-to-alls: the cost model rates that about 10% faster than pure data parallelism
    # here. Weights are never split, and there is one stage.)


@pytest.mark.parametrize("levels", ["price", "limit"])
def test_layer_footprint_is_what_the_stage_memory_counts(levels, adamw_graph):
    """The footprint the leaner memory levels price (or limit) in a layer's ILP is exactly
    what `stage_memory` counts of that layer: state + accumulated gradients + the kept
    activations of every microbatch in flight. Priced levels are ever leaner and never
    faster, down to about the least footprint; a limited level stays under its limit."""
    from autopar.inter._layer_table import LayerCostTable
    from autopar.inter._levels import LEVEL_FRACTIONS, NUM_LEVELS
    from autopar.intra._options import ShardOptions

    graph, layers, tied = adamw_graph
    table = LayerCostTable(graph, layers, cluster("dgx-a100-80g"), ShardOptions(), tied,
                           num_microbatches=4, in_flight=lambda shape: 3,
                           memory_levels=levels)

    def held(c):
        return c.state_memory + c.gradient_memory + 3 * c.activation_memory

    for layer in (0, 1, layers.num_layers - 1):
        fastest = table.cost(layer, (2, 4))
        least, at_fastest = table.footprint_span(layer, (2, 4))
        assert at_fastest == pytest.approx(held(fastest), rel=1e-9)
        assert 0 < least < at_fastest
        if levels == "limit":
            # Level 6 (30% of the way from the least footprint): on (2, 4) the limited
            # MIPs of level 5 took 27 s for these three layers, level 6's 9 s.
            level = 6
            lean = table.cost(layer, (2, 4), level)
            assert held(lean) <= least + LEVEL_FRACTIONS[level] * (at_fastest - least)
            assert lean.latency >= fastest.latency
            continue
        costs = [table.cost(layer, (2, 4), level) for level in range(NUM_LEVELS)]
        for leaner, c in zip(costs[1:], costs):
            assert held(leaner) <= held(c) * (1 + 1e-9)
            assert leaner.latency >= c.latency * (1 - 1e-9)
        assert held(costs[-1]) <= least + 0.2 * (at_fastest - least), (least, at_fastest)


def test_layer_that_cannot_get_leaner_keeps_its_plan(adamw_graph):
    """A leaner level a layer cannot reach (no footprint to give up, or a limit below what
    the peak memory allows) gives the layer's leanest feasible plan, never None: one such
    layer must not keep the rest of its stage from getting leaner."""
    from autopar.inter._layer_table import LayerCostTable
    from autopar.intra._options import ShardOptions

    graph, layers, tied = adamw_graph
    table = LayerCostTable(graph, layers, cluster("dgx-a100-80g"), ShardOptions(), tied,
                           num_microbatches=4)
    fastest = table.cost(1, (8,))
    least, at_fastest = table.footprint_span(1, (8,))
    table.footprint_span = lambda layer, shape: (at_fastest, at_fastest)  # nothing to give
    assert table.cost(1, (8,), 3) is fastest and table.plan(1, (8,), 3) is table.plan(1, (8,))
    table._cache.clear()
    table.footprint_span = lambda layer, shape: (least / 100, at_fastest)  # below reach
    leanest = table.cost(1, (8,), 9)
    assert leanest is not None and leanest.latency >= fastest.latency


def test_stage_of_identical_layers_costs_the_sum_of_its_layers(adamw_graph):
    """A layer's ILP pays for handing its successor the activation in the layout it took
    its own in (`chain_ties`); the stitched stage must not charge that resharding again.
    Lean plans (level 8 on (2, 4)) hand on another layout than they take in: before this
    was fixed, the stitched stage of the tiny GPT's middle blocks cost 5.5% more."""
    from autopar.cluster import LogicalMesh
    from autopar.inter._layer_table import LayerCostTable
    from autopar.inter.passes._partition import partition
    from autopar.intra._options import ShardOptions

    graph, layers, tied = adamw_graph
    table = LayerCostTable(graph, layers, cluster("dgx-a100-80g"),
                           ShardOptions(), tied, num_microbatches=4, in_flight=lambda s: 2)
    last = layers.num_layers - 1
    stages = partition(graph, layers, [(0, 1), (1, last), (last, last + 1)])
    for level in (0, 8):
        # A layer's latency also has its backward's fused rerun, which the stage charges
        # apart (`Stage.recompute_time`), not in its stitched plan's cost.
        blocks = [table.cost(k, (2, 4), level).latency - table.fused_seconds(k, (2, 4), level)
                  for k in range(1, last)]
        plan = table.stage_plan(graph, stages, 1, (1, last), (2, 4),
                                LogicalMesh.create((2, 4)), tied, level)
        assert plan.cost.total == pytest.approx(sum(blocks), rel=1e-9)


def test_stage_that_does_not_fit_uses_leaner_layer_plans(adamw_graph):
    """The fastest plan of every layer fits alone, but a stage of all of them does not fit
    the budget: the stage DP takes leaner layer plans (a lower memory level) instead of
    giving up, and the stage then fits."""
    from autopar.inter import StageOptions
    from autopar.inter._choose import choose_stages
    from autopar.intra._options import ShardOptions

    graph, layers, tied = adamw_graph
    dgx = cluster("dgx-a100-80g")

    def one_stage(budget, remat="none"):
        choice = choose_stages(graph, layers, dgx, 4, tied, StageOptions(
            shard=ShardOptions(memory_budget=budget), num_stages=1, logical_shapes=[(8,)],
            remat=remat))
        return choice.dp.stage_costs[0]

    fastest = one_stage(None)
    assert fastest.detail == ((8,), 0, ("none",) * layers.num_layers)
    budget = 0.8 * fastest.memory
    lean = one_stage(budget)
    shape, level, _ = lean.detail
    assert shape == (8,) and level >= 1
    assert lean.memory <= budget
    assert lean.latency >= fastest.latency  # leaner costs time, never less
    # With remat searched too, the stage fits at least as fast (recompute or leaner plans).
    searched = one_stage(budget, "auto")
    assert searched.memory <= budget
    assert fastest.latency <= searched.latency <= lean.latency
