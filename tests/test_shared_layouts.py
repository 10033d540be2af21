"""Layer costs shared across microbatch counts (issue 18, deliver 4): with
`num_microbatches="auto"` one count's layer ILPs are solved and their layouts priced on the
other counts' graphs. A priced layout costs what the full problem charges for the same
choice; a layout the shapes rule out is not priced; and the search keeps its plan."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import optax
import pytest
from helpers import NO_MICROBATCH_CHECK

import autopar
from examples import gpt

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head
LR = 1e-2


def _graph(rows: int):
    opt = optax.adamw(LR)
    return autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                         gpt.abstract_batch(GPT, rows), batch_argnums=(1,))


def _layer_graphs(rows: int):
    from autopar.graph import tied_state
    from autopar.inter.passes._layers import assign_layers

    graph = _graph(rows)
    return graph, assign_layers(graph), tied_state(graph, (0,))


def _solved(graph, cluster, shape):
    """(prepared problem, its solution, the plan) of `graph` on a mesh of `shape`."""
    from autopar.intra._ilp import solve
    from autopar.intra._planner import finish_on_mesh, prepare_on_mesh

    prepared = prepare_on_mesh(graph, cluster, autopar.cluster.LogicalMesh.create(shape))
    solution = solve(prepared.problem, **prepared.solve_args)
    return prepared, solution, finish_on_mesh(prepared, solution)


@pytest.mark.parametrize("shape", [(2, 4), (8,)])
def test_a_priced_layout_costs_what_the_full_problem_charges_for_it(shape):
    """The layout chosen on the step at 8 rows, priced on the step at 16 rows
    (`price_layout`), is the plan the 16-row problem's own accounting gives the same
    choice of strategies (`finish_on_mesh`): the same costs, collectives, memory and
    specs. Priced on its own graph it is the solved plan. It is no cheaper than the
    16-row ILP's optimum."""
    from autopar.intra._ilp import Solution
    from autopar.intra._planner import finish_on_mesh, price_layout
    from autopar.intra._problem import chosen_layout

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    mesh = autopar.cluster.LogicalMesh.create(shape)
    small, large = _graph(8), _graph(16)
    prepared, solution, plan = _solved(small, cluster, shape)
    layout = chosen_layout(prepared.built, solution.choices)

    again = price_layout(small, cluster, mesh, layout)
    assert again.cost == plan.cost and again.var_specs == plan.var_specs

    priced = price_layout(large, cluster, mesh, layout)
    assert priced is not None
    full, large_solution, optimum = _solved(large, cluster, shape)
    # The same choice in the full 16-row problem: per node, the strategy of those specs
    # (a follower's strategies are its leader's, in its leader's order).
    choices = [
        next(i for i, s in enumerate(node.strategies) if (s.in_specs, s.out_specs) == specs)
        for node, (_, specs) in zip(full.built.ilp_nodes, layout)
    ]
    for v, (u, mapping) in full.problem.followers.items():
        choices[v] = int(mapping[choices[u]])
    choices = tuple(choices)
    by_hand = finish_on_mesh(full, dataclasses.replace(large_solution, choices=choices))
    assert isinstance(large_solution, Solution)
    assert priced.cost.total == pytest.approx(by_hand.cost.total, rel=1e-12)
    assert priced.cost.compute == pytest.approx(by_hand.cost.compute, rel=1e-12)
    assert priced.cost.memory_per_device == by_hand.cost.memory_per_device
    assert priced.cost.collectives.keys() == by_hand.cost.collectives.keys()
    for kind, counted in by_hand.cost.collectives.items():
        assert priced.cost.collectives[kind] == pytest.approx(counted, rel=1e-12)
    assert priced.var_specs == by_hand.var_specs
    assert priced.cost.total >= optimum.cost.total * (1 - 1e-9)
    # Twice the rows: the compute of the same layout grows, less than 2x (launches).
    assert plan.cost.compute < priced.cost.compute < 2 * plan.cost.compute


def test_a_layout_the_rows_cannot_take_is_not_priced():
    """The 16-row step's layout on (8,) splits the batch 8 ways; a 4-row step cannot take
    it (None: the search solves that layer's ILP instead), and a graph of another
    structure does not match it."""
    from autopar.intra._planner import price_layout
    from autopar.intra._problem import chosen_layout

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    mesh = autopar.cluster.LogicalMesh.create((8,))
    graph = _graph(16)
    prepared, solution, plan = _solved(graph, cluster, (8,))
    layout = chosen_layout(prepared.built, solution.choices)
    batch = [v for v in graph.invars if graph.vars[v].role is autopar.graph.Role.BATCH]
    assert batch and all(plan.var_specs[v][0] == ("x",) for v in batch)
    assert price_layout(_graph(4), cluster, mesh, layout) is None
    assert price_layout(_graph(16), cluster, mesh, layout[:-1]) is None


def test_a_table_with_a_reference_prices_instead_of_solving():
    """The layer cost table of 2 microbatches (8 rows each) with the 1-microbatch table
    as its reference prices the layouts the reference has solved (no ILP of its own):
    each a feasible plan's cost, no less than its own ILP's and equal where both choose
    alike. What the reference has not solved it solves itself (as much work, and exact).
    Once it forgets the priced costs, it answers as a table of its own."""
    from autopar.inter import StageOptions, layer_cost_table

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    options = StageOptions()
    whole, whole_layers, whole_tied = _layer_graphs(16)
    half, layers, tied = _layer_graphs(8)
    reference = layer_cost_table(whole, whole_layers, cluster, 1, options,
                                 whole_tied, keep_layouts=True)
    shared = layer_cost_table(half, layers, cluster, 2, options, tied,
                              reference=reference)
    own = layer_cost_table(half, layers, cluster, 2, options, tied)
    shapes = [(2,), (2, 4), (8,)]
    for layer in range(layers.num_layers):
        for shape in shapes:
            reference.cost(layer, shape)
    solved_by_reference = reference.num_ilps
    equal = 0
    for layer in range(layers.num_layers):
        for shape in shapes:
            assert shared.is_solved(layer, shape, 0)
            priced, solved = shared.cost(layer, shape), own.cost(layer, shape)
            assert priced.latency >= solved.latency * (1 - 1e-9)
            equal += priced.latency == pytest.approx(solved.latency, rel=1e-9)
    assert shared.num_ilps == 0 and shared.num_priced > 0
    assert equal >= len(shapes)  # most layouts do not depend on the rows
    # A shape the reference has not solved: this table's own ILP, the exact cost.
    assert not shared.is_solved(1, (4, 2), 0)
    assert shared.cost(1, (4, 2)).latency == own.cost(1, (4, 2)).latency
    assert shared.num_ilps == 1 and reference.num_ilps == solved_by_reference
    shared.forget_priced()
    for layer in range(layers.num_layers):
        for shape in shapes:
            assert shared.cost(layer, shape).latency == own.cost(layer, shape).latency
    assert shared.num_ilps == own.num_ilps


def test_auto_microbatches_keeps_the_plan_and_solves_fewer_ilps(monkeypatch, caplog):
    """`num_microbatches="auto"` plans the tiny GPT (batch 32: 1, 16 and 32 microbatches)
    on one dgx-a100-80g host (1-D meshes) with and without sharing layouts: the same plan,
    from fewer layer ILPs. The one-row microbatches (32) are priced too, on the layouts
    carried onto their other operations (`autopar.inter._one_row`; before, that count
    solved its own ILPs). (With the 2-D meshes too: twice the time, 54 ILPs instead of
    27, for the same plan and the same 3 costs priced from shared layouts; shared layouts
    priced on a 2-D mesh: test_a_table_with_a_reference_prices_instead_of_solving.)
    The layers' time floors are off: with them this tiny search rules out the other
    counts' stages before any shared layout is priced (21 ILPs either way, the same plan;
    the floors' own on/off check is tests/test_planning_time_floor.py)."""
    from autopar.inter import _stage_costs

    monkeypatch.setattr(_stage_costs, "TIME_FLOORS", False)
    opt = optax.adamw(LR)
    args = (gpt.abstract_state(GPT, opt), gpt.abstract_batch(GPT, 32))
    plans = {}
    for share in (False, True):
        with caplog.at_level(logging.INFO, logger="autopar"):
            caplog.clear()
            plans[share] = autopar.plan(
                gpt.make_train_step(GPT, opt), *args,
                cluster=autopar.Cluster.from_profile("dgx-a100-80g"), num_microbatches="auto",
                submeshes=[(1, 2), (1, 4), (1, 8)], logical_shapes=[(2,), (4,), (8,)],
                share_layouts=share, cache=False, **NO_MICROBATCH_CHECK,
            )
    one_row = [m for m in (r.getMessage() for r in caplog.records)
               if m.startswith("32 microbatch(es): ") and "stage(s), predicted" in m]
    assert one_row and all("layouts of the 1-microbatch search, priced" in m for m in one_row)
    shared, full = plans[True], plans[False]
    assert shared.num_microbatches == full.num_microbatches
    assert [s.layers for s in shared.stages] == [s.layers for s in full.stages]
    assert [s.mesh.shape for s in shared.stages] == [s.mesh.shape for s in full.stages]
    assert shared.predicted_step_time == pytest.approx(full.predicted_step_time, rel=1e-9)
    assert shared.timings["layer costs priced"] > 0
    assert shared.timings["layer ILPs solved"] < full.timings["layer ILPs solved"]
    assert np.isfinite(shared.predicted_step_time)
