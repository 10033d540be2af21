"""Planning speed (issue 18): what makes the search faster must not change what it finds,
and the search says where its time went."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import optax
import pytest

import autopar
from examples import gpt
from tests.helpers import MadeUpTable

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head
LR = 1e-2


def _tiny_gpt_graph():
    from autopar.graph import tied_state
    from autopar.inter.passes._layers import assign_layers

    opt = optax.adamw(LR)
    graph = autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                          gpt.abstract_batch(GPT, 16), batch_argnums=(1,))
    return graph, assign_layers(graph), tied_state(graph, (0,))


def _search(graph, layers, tied, budget, monkeypatch, prune: bool, devices=(4, 8),
            logical_shapes=None):
    """The stage choice on one host's submeshes of `devices` GPUs each (on
    `logical_shapes`, default every shape of each), and its table; undoes `monkeypatch`
    after."""
    from autopar.inter import StageOptions, choose_stages, layer_cost_table
    from autopar.intra._options import ShardOptions

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    # Without `lower_bounds` no shape or level is known to lose: every one is solved.
    options = StageOptions(shard=ShardOptions(memory_budget=budget),
                           submeshes=[autopar.inter.SubmeshShape(1, d) for d in devices],
                           logical_shapes=logical_shapes, lower_bounds=prune)
    table = layer_cost_table(graph, layers, cluster, 4, options, tied)
    choice = choose_stages(graph, layers, cluster, 4, tied, options, table=table)
    monkeypatch.undo()
    return choice, table


@pytest.mark.extended  # minutes: the leaner levels' MIPs; the made-up tables below are its twin
def test_pruned_shapes_give_the_same_plan_with_fewer_ilps(monkeypatch):
    """The stage DP skips the leaner memory levels of a mesh shape whose fastest layer
    plans already lose to a shape that fits (`_fitting_level`'s cutoff): under a budget
    that needs leaner levels, the choice (stages, shapes, levels, remat, latency, every
    stage's specs) is the one the unpruned search makes, from no more ILPs."""
    graph, layers, tied = _tiny_gpt_graph()
    unlimited, _ = _search(graph, layers, tied, None, monkeypatch, prune=True)
    budget = 0.7 * max(c.memory for c in unlimited.dp.stage_costs)
    full, table = _search(graph, layers, tied, budget, monkeypatch, prune=False)
    pruned, _ = _search(graph, layers, tied, budget, monkeypatch, prune=True)
    # Leaner levels in play: the full search solved some (its plan, since the memory levels
    # are priced, may need none: a faster layout of another stage cut fits at level 0).
    assert any(key[2] > 0 for key in table._cache)
    assert pruned.stage_layers == full.stage_layers
    assert [c.detail for c in pruned.dp.stage_costs] == [c.detail for c in full.dp.stage_costs]
    assert pruned.latency == full.latency
    assert [p.var_specs for p in pruned.stage_plans] == [p.var_specs for p in full.stage_plans]
    # Since the levels are priced (the leanest solved first, then a bisection), this GPT's
    # search solves 169 ILPs either way: nothing is left here for the cutoff to skip. The
    # made-up tables below still show it skipping levels.
    assert pruned.num_layer_ilps <= full.num_layer_ilps


def _bound_search(graph, layers, tied, budget, monkeypatch, prune: bool, table=None,
                  logical_shapes=None):
    """The stage choice with or without cutting stages off by a known plan
    (`StageOptions.prune_by_bound`), and its table; undoes `monkeypatch` after."""
    from autopar.inter import StageOptions, choose_stages, layer_cost_table
    from autopar.intra._options import ShardOptions

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    options = StageOptions(shard=ShardOptions(memory_budget=budget),
                           logical_shapes=logical_shapes, prune_by_bound=prune)
    if table is None:
        table = layer_cost_table(graph, layers, cluster, 4, options, tied)
    choice = choose_stages(graph, layers, cluster, 4, tied, options, table=table)
    monkeypatch.undo()
    return choice, table


def _same_choice(a, b):
    assert a.stage_layers == b.stage_layers
    assert a.submeshes == b.submeshes
    assert [c.detail for c in a.dp.stage_costs] == [c.detail for c in b.dp.stage_costs]
    assert a.latency == b.latency
    assert [p.var_specs for p in a.stage_plans] == [p.var_specs for p in b.stage_plans]


def test_bound_pruning_keeps_the_tiny_gpt_plan(monkeypatch):
    """`choose_stages` with stages cut off by the best even plan (`prune_by_bound`) makes
    the choice of the full search on every submesh of a dgx-a100-80g host with 1-D
    meshes (the layer ILPs shared: the same costs in both), and asks the DP's cost
    function about fewer shapes. (The extended test below: 2-D meshes too, under a
    tight budget.)"""
    from autopar.inter import _stage_fit

    graph, layers, tied = _tiny_gpt_graph()
    original = _stage_fit._fitting_level
    asked = {True: 0, False: 0}
    choices, table = {}, None
    for prune in (False, True):
        def counted(*args, prune=prune, **kwargs):
            asked[prune] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(_stage_fit, "_fitting_level", counted)
        choices[prune], table = _bound_search(graph, layers, tied, None, monkeypatch,
                                              prune=prune, table=table,
                                              logical_shapes=[(1,), (2,), (4,), (8,)])
    _same_choice(choices[True], choices[False])
    assert 0 < asked[True] < asked[False]


@pytest.mark.extended  # minutes: the leaner levels' MIPs; the made-up tables are its twin
def test_bound_pruning_keeps_the_plan_under_a_tight_budget(monkeypatch):
    """As above under a budget that needs leaner memory levels, each search with a table
    of its own: the same choice from fewer layer ILPs."""
    graph, layers, tied = _tiny_gpt_graph()
    unlimited, _ = _bound_search(graph, layers, tied, None, monkeypatch, prune=True)
    budget = 0.7 * max(c.memory for c in unlimited.dp.stage_costs)
    full, table = _bound_search(graph, layers, tied, budget, monkeypatch, prune=False)
    pruned, _ = _bound_search(graph, layers, tied, budget, monkeypatch, prune=True)
    assert any(key[2] > 0 for key in table._cache)  # the full search solved leaner levels
    _same_choice(pruned, full)
    assert pruned.num_layer_ilps < full.num_layer_ilps


def test_search_reports_its_parts():
    """A pipelined plan's timings hold the search's parts (seconds) and how many layer
    ILPs it solved; explain() prints both."""
    from autopar.inter import PLANNING_PHASES

    opt = optax.adamw(LR)
    plan = autopar.plan(
        gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt), gpt.abstract_batch(GPT, 16),
        cluster=autopar.Cluster.from_profile("dgx-a100-80g"), num_microbatches=2,
        submeshes=[(1, 8)], logical_shapes=[(8,)], cache=False,
    )
    assert plan.runtime == "pipeline"
    for name in ("trace", *PLANNING_PHASES):
        assert plan.timings[name] >= 0.0
    parts = sum(plan.timings[name] for name in PLANNING_PHASES)
    assert parts <= plan.timings["stage_dp_and_ilps"] * (1 + 1e-6)
    solved = plan.timings["layer ILPs solved"]
    assert solved == 3  # embedding + block, block, head on (8,): blocks share one ILP
    text = plan.explain()
    assert "planning time: " in text and "sharding each layer (integer programs) " in text
    assert f"planning work: {solved} layer sharding problems solved," in text
    assert "stage_dp_and_ilps" not in text  # a total overlapping its parts is not shown


def test_a_fixed_microbatch_count_traces_the_step_once(monkeypatch):
    """A pipeline search of a fixed count traces one microbatch of a step with its own
    layer marks, once (not the whole step too), and finds the plan the search from the
    whole step's trace finds; the batch rows still count whole (a count that does not
    divide them is refused as before)."""
    from autopar.search import _api, _pipeline

    opt = optax.adamw(LR)
    step = gpt.make_train_step(GPT, opt)
    args = (gpt.abstract_state(GPT, opt), gpt.abstract_batch(GPT, 16))
    cluster = autopar.Cluster.from_profile("cpu-local")
    shapes = []
    for module in (_api, _pipeline):
        traced = module.trace

        def spy(fn, *a, traced=traced, **k):
            graph = traced(fn, *a, **k)
            shapes.append(graph.vars[graph.invars[-1]].shape)
            return graph

        monkeypatch.setattr(module, "trace", spy)
    # Two stages of four devices: the stage DP picks the layer split and each stage's
    # layouts, what the two traces must agree on (every stage count and submesh, before:
    # 10.7 CPU s for the test in the test process against 6.1 now, `pytest -n 0` of this
    # test alone, a loaded machine; the solver workers' CPU apart).
    options = dict(cluster=cluster, num_microbatches=2, num_stages=2, submeshes=[(1, 4)],
                   cache=False)
    once = autopar.plan(step, *args, **options)
    assert shapes == [(8, GPT.seq_len)]  # one trace, of one 8-row microbatch
    monkeypatch.setattr(_api, "_search_graph", lambda fn, a, c, o, *_: (
        _api.trace(fn, *a, batch_argnums=o.batch_argnums), 1))
    shapes.clear()
    both = autopar.plan(step, *args, **options)
    assert shapes == [(16, GPT.seq_len), (8, GPT.seq_len)]  # as before: whole, then one
    assert once.predicted_step_time == both.predicted_step_time
    assert [(s.layers, s.mesh.shape, s.sharding.var_specs) for s in once.stages] == [
        (s.layers, s.mesh.shape, s.sharding.var_specs) for s in both.stages]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not divisible by num_microbatches=3"):
        autopar.plan(step, *args, cluster=cluster, num_microbatches=3, cache=False)


def _FakeTable(rng, num_layers, shapes):
    """Made-up costs of `num_layers` layers of their own structures (`MadeUpTable`)."""
    return MadeUpTable(rng, num_layers, shapes, num_layers)


@pytest.mark.parametrize("seed", range(6))
def test_pruning_keeps_every_stage_cost_on_made_up_tables(seed):
    """Every (layers, submesh, position) the stage DP asks about gets the same answer with
    and without the dominance pruning, on tables whose numbers are drawn at random and
    budgets tight enough to need leaner levels and recompute; the pruned walk asks for
    fewer of the leaner levels (the ILPs that cost most)."""
    import numpy as np

    from autopar.inter import SubmeshShape, _stage_costs

    rng = np.random.default_rng(seed)
    shapes = [(8,), (2, 4), (4, 2)]
    answers, solved = [], []
    budget = float(rng.uniform(8, 20))
    for prune in (True, False):
        table = _FakeTable(np.random.default_rng(seed), 6, shapes)
        table.lower_bounds = prune  # False: no bound at all (`StageOptions.lower_bounds`)
        # made-up costs have no graphs to take memory floors from (tested on real tables
        # in test_planning_stage_floor.py)
        stage_cost = _stage_costs._StageCosts(table, [SubmeshShape(1, 8)], shapes, "1f1b",
                                              4, budget, "auto", floors=False)
        answers.append([stage_cost(a, b, 0, p) for a in range(6) for b in range(a + 1, 7)
                        for p in (1, 2, 4)])
        solved.append(table.solved)
    assert answers[0] == answers[1]
    assert any(c.detail and c.detail[1] > 0 for c in answers[1])  # leaner levels in play
    assert solved[0] <= solved[1] and len(solved[0]) < len(solved[1])


@pytest.mark.parametrize("seed", range(6))
def test_bound_pruning_keeps_the_dp_plan_on_made_up_tables(seed, monkeypatch):
    """The stage DP with stages cut off by a known plan (`prune_by_bound`: the best even
    plan's latency and the least work of the other layers, `_StageCosts.latency_cutoff`)
    finds the plan of the full search -- stages, submeshes, shapes, levels, remat and
    latency -- on made-up tables of 8 layers on 2 hosts of 4 devices with positions and
    budgets that need leaner levels, and asks for fewer leaner levels."""
    import numpy as np

    from autopar.inter import _stage_costs, plan_stages, submesh_shapes
    from autopar.inter._submesh import logical_mesh_shapes

    rng = np.random.default_rng(seed)
    submeshes = submesh_shapes(2, 4)
    shapes = sorted({tuple(s) for sub in submeshes for s in logical_mesh_shapes(sub)})
    budget = float(rng.uniform(10, 24))
    plans, solved = [], []
    for prune in (True, False):
        table = _FakeTable(np.random.default_rng(seed), 8, shapes)
        table.cluster = SimpleNamespace(num_devices=8)
        inner = _stage_costs._StageCosts(table, submeshes, None, "1f1b", 4, budget, "auto",
                                         floors=False)  # made-up costs: no graphs to floor
        if prune:
            inner.work = _stage_costs._least_work(table, submeshes, None)
            _stage_costs._bound_by_even_plans(inner, inner, 8, 2, 4, submeshes, None)
            assert math.isfinite(inner.bound)
        plan = plan_stages(8, 2, 4, inner, 4, submeshes=submeshes,
                           num_positions=inner.num_positions)
        plans.append((plan.stages, plan.latency, [c.detail for c in plan.stage_costs]))
        solved.append({key for key in table.solved if key[2] > 0})
    assert plans[0] == plans[1]
    assert solved[1], "the budget should need leaner levels"
    assert solved[0] <= solved[1] and len(solved[0]) < len(solved[1])


def test_even_plans_prefetch_every_fastest_plan_they_read():
    """`_bound_by_even_plans` hands the fastest plans (level 0) its lower bounds read to
    `prefetch` (solved side by side in the solver pool) before it reads them one at a
    time: every level-0 cost it asks was prefetched first, and the bound is the one
    found without the prefetch."""
    import numpy as np

    from autopar.inter import _stage_costs, submesh_shapes
    from autopar.inter._submesh import logical_mesh_shapes

    submeshes = submesh_shapes(2, 4)
    shapes = sorted({tuple(s) for sub in submeshes for s in logical_mesh_shapes(sub)})
    bounds = []
    for with_prefetch in (True, False):
        table = _FakeTable(np.random.default_rng(3), 8, shapes)
        table.cluster = SimpleNamespace(num_devices=8)
        prefetched, early = set(), []
        if with_prefetch:
            def prefetch(requests, table=table, prefetched=prefetched):
                prefetched.update(requests)
            table.prefetch = prefetch
            cost = table.cost

            def asked(k, shape, level=0, cost=cost, prefetched=prefetched, early=early):
                if level == 0 and (k, shape, 0) not in prefetched:
                    early.append((k, shape))
                return cost(k, shape, level)
            table.cost = asked
        inner = _stage_costs._StageCosts(table, submeshes, None, "1f1b", 4, 30.0, "auto",
                                         floors=False)
        _stage_costs._bound_by_even_plans(inner, inner, 8, 2, 4, submeshes, None)
        bounds.append(inner.bound)
        if with_prefetch:
            assert prefetched and not early, early
    assert math.isfinite(bounds[0]) and bounds[0] == bounds[1]


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8,)])
def test_bytes_per_device_memo_matches_the_formula(mesh_shape):
    """`bytes_per_device` answers repeated questions from a memo: the same figure as the
    formula, and a bad spec is still refused the second time it is asked."""
    from autopar.cluster import LogicalMesh
    from autopar.cost import bytes_per_device
    from autopar.cost._compute import _bytes_per_device

    mesh = LogicalMesh.create(mesh_shape)
    spec = (("x",), ()) if len(mesh_shape) == 1 else (("x",), ("y",))
    for _ in range(2):
        assert bytes_per_device((6, 8), "bfloat16", spec, mesh) == \
            _bytes_per_device((6, 8), "bfloat16", spec, mesh)
        with pytest.raises(ValueError, match="at most once"):
            bytes_per_device((6, 8), "float32", (("x",), ("x",)), mesh)


def test_ranges_of_equal_content_share_their_fits():
    """`range_key` is equal exactly for layer ranges of the same layer structures in the
    same order, with the same state shared at the same places (the tied embedding: only
    ranges holding both its readers); `choose_remat` and `_lower_bound` computed once per
    key give what each range computes on its own, under a budget that needs recompute."""
    from autopar.inter import StageOptions, _stage_fit, layer_cost_table

    graph, layers, tied = _tiny_gpt_graph()
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    table = layer_cost_table(graph, layers, cluster, 4, StageOptions(), tied)
    n = layers.num_layers
    ranges = [range(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    for r in ranges:
        for q in ranges:
            same = [table.fingerprints[k] for k in r] == [table.fingerprints[k] for k in q]
            tied_both = {0, n - 1} <= set(r), {0, n - 1} <= set(q)
            expected = same and tied_both[0] == tied_both[1]
            assert (table.range_key(r) == table.range_key(q)) == expected, (r, q)
    assert table.range_key([0, 2]) is None  # not contiguous: not shared
    shape = (2, 4)
    full = _stage_fit.choose_remat(table, range(n), shape, 0, 4, math.inf)
    budget = 0.8 * full.memory
    table.range_cache.clear()
    for r in ranges:
        for in_flight in (1, 3):
            cached = _stage_fit.choose_remat(table, r, shape, 0, in_flight, budget)
            alone = _stage_fit._choose_remat(table, r, shape, 0, in_flight, budget)
            assert cached == alone, (r, in_flight)
        assert (_stage_fit._lower_bound(table, r, shape, 0)
                == _stage_fit._layers_lower_bound(table, r, shape, 0))
    assert len({key[1] for key in table.range_cache}) < len(ranges)  # some were shared
    assert any(f.remat != ("none",) * len(f.remat) for f in table.range_cache.values()
               if isinstance(f, _stage_fit._Fit))


def test_layer_plans_keep_compact_specs_that_read_as_the_tuple():
    """The table keeps each layer plan's specs only for the variables its layer graph
    touches (`_CompactSpecs`); they read as the full tuple `plan_on_mesh` returns:
    indexing (negative too), slicing, iteration, length, equality."""
    from autopar.inter import StageOptions, layer_cost_table
    from autopar.inter._compact_specs import _CompactSpecs
    from autopar.inter._layer_graphs import _tied_in
    from autopar.intra import plan_on_mesh
    from autopar.intra._options import ShardOptions

    graph, layers, tied = _tiny_gpt_graph()
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    table = layer_cost_table(graph, layers, cluster, 4, StageOptions(), tied)
    layer, shape = 1, (2, 2)
    kept = table.plan(layer, shape)
    assert isinstance(kept.var_specs, _CompactSpecs)
    sub = table.per_layer.stage_graphs[layer]
    fresh = plan_on_mesh(
        sub, cluster, autopar.cluster.LogicalMesh.create(shape), ShardOptions(),
        _tied_in(sub, tied) + table.chain_ties(layer), weights=table.weights[layer],
    ).var_specs
    assert isinstance(fresh, tuple) and len(kept.var_specs) == len(fresh) == len(sub.vars)
    assert kept.var_specs == fresh and tuple(kept.var_specs) == fresh
    assert sum(s is not None for s in fresh) > 0
    assert all(kept.var_specs[v] == fresh[v] for v in range(-len(fresh), len(fresh)))
    assert kept.var_specs[3:40:3] == fresh[3:40:3]
    with pytest.raises(IndexError):
        kept.var_specs[len(fresh)]


def test_a_search_hands_the_frozen_heap_back(monkeypatch):
    """The search leaves pre-existing objects out of the collector's scans while it runs
    and hands them back after, also when it fails; a caller's own freeze stays as it was."""
    import gc

    from autopar.search import _api

    seen = []
    search_plan = _api.search_plan

    def spy(*a, **k):
        seen.append(gc.get_freeze_count() > 0)
        return search_plan(*a, **k)

    monkeypatch.setattr(_api, "search_plan", spy)
    opt = optax.adamw(LR)
    step = gpt.make_train_step(GPT, opt)
    args = (gpt.abstract_state(GPT, opt), gpt.abstract_batch(GPT, 16))
    cluster = autopar.Cluster.from_profile("cpu-local")
    assert gc.get_freeze_count() == 0
    # One stage: the heap's handling does not depend on how wide the search is.
    autopar.plan(step, *args, cluster=cluster, num_microbatches=2, num_stages=1, cache=False)
    assert seen == [True] and gc.get_freeze_count() == 0
    with pytest.raises(ValueError):
        autopar.plan(step, *args, cluster=cluster, num_microbatches=2, num_stages=9,
                     cache=False)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's
    try:
        autopar.plan(step, *args, cluster=cluster, num_microbatches=2, num_stages=1,
                     cache=False)
        assert gc.get_freeze_count() > 0  # not handed back by the search
    finally:
        gc.unfreeze()


def test_lower_bounds_off_reaches_the_stage_fit():
    """`PlanOptions(lower_bounds=False)` reaches the stage DP's options and the layer cost
    table, where the layers' lower bound is then -inf (no shape or level skipped) and the
    least work is unknown; the default keeps both. No ILP is solved."""
    from autopar.inter import _stage_costs, _stage_fit, layer_cost_table
    from autopar.search._pipeline import _PipelineSearch

    graph, layers, tied = _tiny_gpt_graph()
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    for flag in (True, False):
        search = _PipelineSearch(None, (), cluster, autopar.PlanOptions(lower_bounds=flag), {})
        assert search.stage_options.lower_bounds is flag
        table = layer_cost_table(graph, layers, cluster, 4, search.stage_options, tied)
        assert table.lower_bounds is flag
        assert table.num_ilps == 0
    # Off: answered before any cost is asked for (an ILP would be solved otherwise).
    assert _stage_fit._lower_bound(table, range(2), (8,), 0) == -math.inf
    assert _stage_costs._least_work(table, [autopar.inter.SubmeshShape(1, 8)], None) == []
    assert table.num_ilps == 0
