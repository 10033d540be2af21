"""A layout priced without the graph's whole problem (`autopar.intra._price_layout`,
issue 45) is the plan pricing it on the whole problem gives (`price_layout(...,
whole=True)`): the same cost, peak, footprint and per-node choices, bit for bit, and None
in the same cases (a layout the shapes do not divide, another graph, over the budget)."""

from __future__ import annotations

import dataclasses
import functools

import optax
import pytest

import autopar
from examples import gpt, llama

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)
GPT_SCAN = dataclasses.replace(gpt.CONFIGS["tiny"], scan_layers=True)  # opened by the ILP
LLAMA = dataclasses.replace(llama.CONFIGS["tiny"], layer_markers=True)
CLUSTER = "dgx-a100-80g"


@functools.cache
def _step(model, cfg, rows: int):
    opt = optax.adamw(1e-2)
    return autopar.graph.trace(model.make_train_step(cfg, opt), model.abstract_state(cfg, opt),
                               model.abstract_batch(cfg, rows), batch_argnums=(1,))


def _assert_same_plan(new, whole):
    """Every field of the two plans equal (`==`), the stats but their build times too."""
    assert (new is None) == (whole is None)
    if new is None:
        return
    for f in dataclasses.fields(whole):
        if f.name != "stats":
            assert getattr(new, f.name) == getattr(whole, f.name), f.name
    drop = ("build_time",)
    assert ({k: v for k, v in new.stats.items() if k not in drop}
            == {k: v for k, v in whole.stats.items() if k not in drop})


def _both(*args, **kwargs):
    from autopar.intra._planner import price_layout

    new = price_layout(*args, **kwargs)  # first: nothing of the whole problem memoised
    whole = price_layout(*args, whole=True, **kwargs)
    _assert_same_plan(new, whole)
    return new


@pytest.mark.parametrize("cfg, shape", [(GPT, (2, 4)), (GPT, (8,)), (GPT_SCAN, (2, 4))])
def test_a_layout_priced_alone_is_the_whole_problems_plan(cfg, shape):
    """The tiny GPT's step at 8 rows (its layers marked, or scanned) solved on `shape`;
    its layout priced on the step at 16 rows and at 4 rows (on (8,) the 8-way batch split
    does not divide 4 rows: None), on a graph of another structure (None), and under a
    budget below its peak (None)."""
    from autopar.intra._ilp import solve
    from autopar.intra._options import ShardOptions
    from autopar.intra._planner import prepare_on_mesh
    from autopar.intra._price_layout import layout_problem
    from autopar.intra._problem import chosen_layout

    cluster = autopar.Cluster.from_profile(CLUSTER)
    mesh = autopar.cluster.LogicalMesh.create(shape)
    prepared = prepare_on_mesh(_step(gpt, cfg, 8), cluster, mesh)
    layout = chosen_layout(prepared.built, solve(prepared.problem, **prepared.solve_args).choices)
    large = _both(_step(gpt, cfg, 16), cluster, mesh, layout)
    assert large is not None and large.stats["solver"] == "none (a layout priced)"
    small = _both(_step(gpt, cfg, 4), cluster, mesh, layout)
    assert small is None or shape != (8,)
    assert _both(_step(gpt, cfg, 16), cluster, mesh, layout[:-1]) is None
    tight = ShardOptions(memory_budget=large.cost.memory_per_device / 2)
    assert _both(_step(gpt, cfg, 16), cluster, mesh, layout, tight) is None
    # Every node's first strategy (replicated): read from the whole problem itself there
    # (each follower at its leader's index), where the layout above is read from a
    # problem built for it.
    first = chosen_layout(prepared.built, (0,) * len(prepared.built.ilp_nodes))
    assert _both(_step(gpt, cfg, 16), cluster, mesh, first) is not None
    agree = [layout_problem(_step(gpt, cfg, 16), mesh, cluster, ShardOptions(), (), None,
                            None, chosen)[1] for chosen in (first, layout)]
    assert agree == [True, False]


def test_the_search_prices_each_layout_as_the_whole_problem_does(monkeypatch):
    """The tiny Llama's layer cost tables at 1 and 2 microbatches (a reference and the
    table that prices its layouts: layer graphs with their ties, per-microbatch weights
    and footprints at every memory level) on a 1-D and a 2-D mesh: every layout priced
    both ways gives the same plan, and some are priced (not all None): layouts whose
    followers take their leaders' strategies in the whole problem and layouts priced on
    a problem of their own there."""
    from autopar.graph import tied_state
    from autopar.inter import StageOptions, _repricing, layer_cost_table
    from autopar.inter.passes._layers import assign_layers
    from autopar.intra import _planner, _price_layout

    calls, costed = [], []
    own = _price_layout._own

    def counted(*args, **kwargs):  # a node costed on the layout's assignments only
        costed.append(1)
        return own(*args, **kwargs)

    monkeypatch.setattr(_price_layout, "_own", counted)
    agreed = []
    layout_problem = _price_layout.layout_problem

    def noted(*args, **kwargs):  # whether every follower took its leader's index
        built, agree = layout_problem(*args, **kwargs)
        agreed.append(agree)
        return built, agree

    monkeypatch.setattr(_planner, "layout_problem", noted)

    def compared(*args, **kwargs):
        plan = _both(*args, **kwargs)
        calls.append(plan is not None)
        return plan

    monkeypatch.setattr(_repricing, "price_layout", compared)
    cluster = autopar.Cluster.from_profile(CLUSTER)
    tables = {}
    for microbatches, rows in ((1, 16), (2, 8)):
        graph = _step(llama, LLAMA, rows)
        layers = assign_layers(graph)
        tables[microbatches] = layer_cost_table(
            graph, layers, cluster, microbatches, StageOptions(), tied_state(graph, (0,)),
            keep_layouts=microbatches == 1, reference=tables.get(1))
    reference, shared = tables[1], tables[2]
    asked = [(layer, shape, level) for level in (0, 1) for shape in ((8,), (2, 4))
             for layer in range(layers.num_layers)]
    for table in (reference, shared):
        for layer, shape, level in asked:
            table.cost(layer, shape, level)
    assert shared.num_priced > 0 and any(calls) and costed
    # layouts read from a problem of their own in the whole-problem way (a follower's
    # first strategy of its specs off its leader's index); the other way: the direct test
    assert False in agreed
