"""Pipelined plans: stages on submeshes, GPipe and 1F1B, microbatches; matches one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, run_steps

import autopar
from autopar.report import matmul_weight_splits
from autopar.runtime import overlap_fraction
from examples import gpt, mlp

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head = 5 layers
LR = 1e-2


def _cluster():
    return autopar.Cluster.from_profile("cpu-local")


def _run(module, cfg, optimizer, batch_size, atol, reference=None, **pipeline):
    """3 steps under `autoparallel(**pipeline)` from the state of key 0 on the batch of key
    1 give one device's losses and state (`reference`: one device's 3 steps, when the
    caller has them already)."""
    state = module.init_state(cfg, optimizer, jax.random.key(0))
    batch = module.make_batch(cfg, batch_size, jax.random.key(1))
    step = module.make_train_step(cfg, optimizer)
    ref_losses, ref_state = reference or run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, cluster=_cluster(), donate_argnums=(), **pipeline)
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state, ref_state, atol)
    return par


@pytest.fixture(scope="module")
def gpt_sgd_reference():
    """`_run`'s reference for the tiny GPT with SGD on batch 8, computed once for the
    pipelined plans below (the same state, batch and steps each time)."""
    optimizer = optax.sgd(LR)
    state = gpt.init_state(GPT, optimizer, jax.random.key(0))
    batch = gpt.make_batch(GPT, 8, jax.random.key(1))
    return run_steps(jax.jit(gpt.make_train_step(GPT, optimizer)), state, batch)


@pytest.mark.parametrize(
    "num_stages, schedule, num_microbatches, submeshes, logical_shapes",
    [
        (2, "1f1b", 2, [(1, 4)], None),  # 2-D logical meshes allowed
        (4, "gpipe", 4, [(1, 2)], [(2,)]),
        # The rest in the `extended` tier (CI time): the two above run both schedules, the
        # multi-host tests two stages across processes, test_pipeline_schedules the rest.
        pytest.param(4, "1f1b", 2, [(1, 2)], [(2,)], marks=pytest.mark.extended),
        pytest.param(3, "1f1b", 2, [(1, 2), (1, 4)], [(2,), (4,)],  # unequal submeshes
                     marks=pytest.mark.extended),
        pytest.param(2, "gpipe", 1, [(1, 4)], [(4,)], marks=pytest.mark.extended),
    ],
)
def test_gpt_pipeline_sgd(num_stages, schedule, num_microbatches, submeshes, logical_shapes,
                          gpt_sgd_reference):
    par = _run(
        gpt, GPT, optax.sgd(LR), 8, 1e-5, reference=gpt_sgd_reference,
        num_stages=num_stages, schedule=schedule, num_microbatches=num_microbatches,
        submeshes=submeshes, logical_shapes=logical_shapes,
    )
    plan = par.plan
    assert plan.num_stages == num_stages
    assert plan.num_microbatches == num_microbatches and plan.schedule == schedule
    sizes = sorted(len(s.mesh.device_ids) for s in plan.stages)
    assert sum(sizes) == 8
    if len(submeshes) == 2:
        assert sizes == [2, 2, 4], sizes
    used = [d for s in plan.stages for d in s.mesh.device_ids]
    assert sorted(used) == list(range(8)), "stages must use disjoint devices covering all"


def test_gpt_pipeline_adamw():
    _run(
        gpt, GPT, optax.adamw(LR, eps=1e-6), 8, 0.1 * LR,
        num_stages=2, num_microbatches=4, submeshes=[(1, 4)], logical_shapes=[(4,)],
    )


def test_mlp_manual_layer_boundaries():
    cfg = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=4, layer_markers=True)
    par = _run(
        mlp, cfg, optax.sgd(LR), 16, 1e-5,
        num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(4,)],
    )
    assert par.plan.stages[0].layers[0] == 0 and par.plan.stages[-1].layers[1] == 5


def test_automatic_layers_without_marks():
    cfg = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=4)
    par = _run(
        mlp, cfg, optax.sgd(LR), 16, 1e-5,
        num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(4,)],
    )
    assert par.plan.auto_layers == 8
    assert par.plan.stages[-1].layers[1] > 2


def test_four_stage_1f1b_timeline_overlaps():
    cfg = dataclasses.replace(GPT, hidden=64, seq_len=32)
    opt = optax.sgd(LR)
    state = gpt.init_state(cfg, opt, jax.random.key(0))
    batch = gpt.make_batch(cfg, 16, jax.random.key(1))
    par = autopar.autoparallel(
        gpt.make_train_step(cfg, opt), cluster=_cluster(), donate_argnums=(), num_stages=4,
        num_microbatches=8, schedule="1f1b", submeshes=[(1, 2)], logical_shapes=[(2,)],
    )
    par(state, batch)  # compile
    best = 0.0
    for _ in range(3):
        _, timeline = par.record_timeline(state, batch)
        assert {t.stage for t in timeline} == {0, 1, 2, 3}
        assert len([t for t in timeline if t.kind == "forward"]) == 4 * 8
        best = max(best, overlap_fraction(timeline))
    print(f"fraction of the step with >= 2 stages busy: {best:.2f}")
    assert best > 0.1, f"stages did not overlap (fraction {best:.2f})"


def test_batch_not_divisible_by_microbatches():
    opt = optax.sgd(LR)
    state = gpt.init_state(GPT, opt, jax.random.key(0))
    batch = gpt.make_batch(GPT, 6, jax.random.key(1))
    par = autopar.autoparallel(
        gpt.make_train_step(GPT, opt), cluster=_cluster(), num_microbatches=4, donate_argnums=()
    )
    with pytest.raises(ValueError, match="not divisible by num_microbatches=4"):
        par(state, batch)


def test_stage_options_that_cannot_cover_the_devices():
    opt = optax.sgd(LR)
    args = (gpt.abstract_state(GPT, opt), gpt.abstract_batch(GPT, 8))
    step = gpt.make_train_step(GPT, opt)
    with pytest.raises(ValueError, match="stage"):
        autopar.plan(step, *args, cluster=_cluster(), num_stages=3, submeshes=[(1, 4)],
                     logical_shapes=[(4,)], num_microbatches=2)
    with pytest.raises(ValueError, match="layers"):
        autopar.plan(step, *args, cluster=_cluster(), num_stages=6, submeshes=[(1, 1)],
                     logical_shapes=[(1,)], num_microbatches=2)


def test_small_model_large_batch_on_one_host_is_one_data_parallel_stage():
    cfg = dataclasses.replace(GPT, hidden=128, num_layers=2)
    opt = optax.sgd(LR)
    step = gpt.make_train_step(cfg, opt)
    args = (gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, 4096))
    plan = autopar.plan(
        step, *args, cluster=autopar.Cluster.from_profile("dgx-a100-80g"), num_microbatches=1,
    )
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
def test_layer_footprint_is_what_the_stage_memory_counts(levels):
    """The footprint the leaner memory levels price (or limit) in a layer's ILP is exactly
    what `stage_memory` counts of that layer: state + accumulated gradients + the kept
    activations of every microbatch in flight. Priced levels are ever leaner and never
    faster, down to about the least footprint; a limited level stays under its limit."""
    from autopar.graph import tied_state
    from autopar.inter._layer_table import LayerCostTable
    from autopar.inter._levels import LEVEL_FRACTIONS, NUM_LEVELS
    from autopar.inter.passes._layers import assign_layers
    from autopar.intra._options import ShardOptions

    opt = optax.adamw(LR)
    graph = autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                          gpt.abstract_batch(GPT, 16), batch_argnums=(1,))
    layers = assign_layers(graph)
    table = LayerCostTable(graph, layers, autopar.Cluster.from_profile("dgx-a100-80g"),
                           ShardOptions(), tied_state(graph, (0,)), num_microbatches=4,
                           in_flight=lambda shape: 3, memory_levels=levels)

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


def test_layer_that_cannot_get_leaner_keeps_its_plan():
    """A leaner level a layer cannot reach (no footprint to give up, or a limit below what
    the peak memory allows) gives the layer's leanest feasible plan, never None: one such
    layer must not keep the rest of its stage from getting leaner."""
    from autopar.graph import tied_state
    from autopar.inter._layer_table import LayerCostTable
    from autopar.inter.passes._layers import assign_layers
    from autopar.intra._options import ShardOptions

    opt = optax.adamw(LR)
    graph = autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                          gpt.abstract_batch(GPT, 16), batch_argnums=(1,))
    table = LayerCostTable(graph, assign_layers(graph),
                           autopar.Cluster.from_profile("dgx-a100-80g"), ShardOptions(),
                           tied_state(graph, (0,)), num_microbatches=4)
    fastest = table.cost(1, (8,))
    least, at_fastest = table.footprint_span(1, (8,))
    table.footprint_span = lambda layer, shape: (at_fastest, at_fastest)  # nothing to give
    assert table.cost(1, (8,), 3) is fastest and table.plan(1, (8,), 3) is table.plan(1, (8,))
    table._cache.clear()
    table.footprint_span = lambda layer, shape: (least / 100, at_fastest)  # below reach
    leanest = table.cost(1, (8,), 9)
    assert leanest is not None and leanest.latency >= fastest.latency


def test_stage_of_identical_layers_costs_the_sum_of_its_layers():
    """A layer's ILP pays for handing its successor the activation in the layout it took
    its own in (`chain_ties`); the stitched stage must not charge that resharding again.
    Lean plans (level 8 on (2, 4)) hand on another layout than they take in: before this
    was fixed, the stitched stage of the tiny GPT's middle blocks cost 5.5% more."""
    from autopar.cluster import LogicalMesh
    from autopar.graph import tied_state
    from autopar.inter._layer_table import LayerCostTable
    from autopar.inter.passes._layers import assign_layers
    from autopar.inter.passes._partition import partition
    from autopar.intra._options import ShardOptions

    opt = optax.adamw(LR)
    graph = autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                          gpt.abstract_batch(GPT, 16), batch_argnums=(1,))
    layers = assign_layers(graph)
    tied = tied_state(graph, (0,))
    table = LayerCostTable(graph, layers, autopar.Cluster.from_profile("dgx-a100-80g"),
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


def test_stage_that_does_not_fit_uses_leaner_layer_plans():
    """The fastest plan of every layer fits alone, but a stage of all of them does not fit
    the budget: the stage DP takes leaner layer plans (a lower memory level) instead of
    giving up, and the stage then fits."""
    from autopar.graph import tied_state
    from autopar.inter import StageOptions
    from autopar.inter._choose import choose_stages
    from autopar.inter.passes._layers import assign_layers
    from autopar.intra._options import ShardOptions

    opt = optax.adamw(LR)
    graph = autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                          gpt.abstract_batch(GPT, 16), batch_argnums=(1,))
    layers = assign_layers(graph)
    tied = tied_state(graph, (0,))
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")

    def one_stage(budget, remat="none"):
        choice = choose_stages(graph, layers, cluster, 4, tied, StageOptions(
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
