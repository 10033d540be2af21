"""The reference's layouts carried onto a layer traced at one-row microbatches
(`autopar.inter._one_row`): the tiny GPT's layers at 1 row have other operations than at
2 rows (JAX's gradients of broadcasts sum, reshape and expand the unit batch dimension
differently), so no layout applied there and the one-row count solved its own ILPs. Now
each layer's graph pairs with the reference's, the carried layout is a layout of the
one-row graph's own problem (pricing it alone is pricing it on the whole problem), and
the table prices it instead of solving: each cost a feasible plan's, no less than the
one-row ILP's optimum."""

from __future__ import annotations

import dataclasses

import optax
import pytest

import autopar
from examples import gpt

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head
SHAPES = [(2,), (8,), (2, 4)]


def _layers(rows: int):
    """(graph, layers, ties) of the tiny GPT's step at `rows` rows."""
    from autopar.graph import tied_state
    from autopar.inter.passes._layers import assign_layers

    opt = optax.adamw(1e-2)
    graph = autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                                gpt.abstract_batch(GPT, rows), batch_argnums=(1,))
    return graph, assign_layers(graph), tied_state(graph, (0,))


@pytest.fixture(scope="module")
def tables():
    """(reference table at 2 rows, one-row table on it, one-row table of its own)."""
    from autopar.inter import StageOptions, layer_cost_table

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    options = StageOptions()
    two, one = _layers(2), _layers(1)
    reference = layer_cost_table(two[0], two[1], cluster, 16, options, two[2],
                                 keep_layouts=True)
    shared = layer_cost_table(one[0], one[1], cluster, 32, options, one[2],
                              reference=reference)
    own = layer_cost_table(one[0], one[1], cluster, 32, options, one[2])
    for layer in range(two[1].num_layers):
        for shape in SHAPES:
            reference.cost(layer, shape)
    return reference, shared, own


def test_one_row_layers_pair_with_the_reference_and_not_by_their_operations(tables):
    """Every layer's one-row graph differs from the reference's (other operations) and
    pairs with it (`row_map`), its extra or missing nodes all unit reshapes, sums and
    broadcasts."""
    from autopar.inter._one_row import RowMap
    from autopar.inter._repricing import _matches_reference

    _, shared, _ = tables
    graphs = shared.per_layer.stage_graphs
    theirs = shared.reference.per_layer.stage_graphs
    for layer in range(len(graphs)):
        assert [n.primitive for n in graphs[layer].nodes] != \
            [n.primitive for n in theirs[layer].nodes]
        assert isinstance(_matches_reference(shared, layer), RowMap)


def test_a_carried_layout_is_a_layout_of_the_one_row_problem(tables):
    """The reference's layout of each layer on (2, 4), carried onto the one-row graph and
    priced alone, is the plan pricing it on the one-row graph's whole problem gives (the
    same cost and specs: each entry is a strategy of that problem)."""
    from autopar.inter._repricing import _matches_reference
    from autopar.intra._planner import price_layout

    reference, shared, _ = tables
    cluster = shared.cluster
    mesh = autopar.cluster.LogicalMesh.create((2, 4))
    for layer in range(len(shared.per_layer.stage_graphs)):
        plan = reference.solved_plan(layer, (2, 4), 0)[0]
        layout = _matches_reference(shared, layer).layout(reference._layouts[id(plan)][1])
        graph = shared.per_layer.stage_graphs[layer]
        alone = price_layout(graph, cluster, mesh, layout)
        whole = price_layout(graph, cluster, mesh, layout, whole=True)
        assert alone is not None and whole is not None
        assert alone.cost == whole.cost and alone.var_specs == whole.var_specs


def test_the_one_row_table_prices_instead_of_solving(tables):
    """On the shapes the reference solved, the one-row table solves no ILP: every cost is
    a carried layout priced, no less than the one-row ILP's optimum, and equal to it where
    the rows were not split (the 8-way mesh: tensor parallel at 2 rows already)."""
    _, shared, own = tables
    equal = 0
    for layer in range(len(shared.per_layer.stage_graphs)):
        for shape in SHAPES:
            priced, solved = shared.cost(layer, shape), own.cost(layer, shape)
            assert priced.latency >= solved.latency * (1 - 1e-9)
            equal += priced.latency == pytest.approx(solved.latency, rel=1e-9)
    assert shared.num_ilps == 0 and shared.num_priced > 0
    assert equal >= len(shared.per_layer.stage_graphs)
    shared.forget_priced()  # then it answers as a table of its own
    for layer in range(len(shared.per_layer.stage_graphs)):
        for shape in SHAPES:
            assert shared.cost(layer, shape).latency == own.cost(layer, shape).latency


def test_the_row_map_walks_the_ilp_nodes_in_the_problems_order(tables):
    """`_one_row`'s walk over a layer graph (`ilp_inputs`, then `_ilp_operators`) names
    the ILP nodes `build_problem` makes, in its order: the inputs' vars, then the graph
    nodes (the identity markers with every result sourced left out, `passed_on`)."""
    from autopar.cluster import LogicalMesh
    from autopar.inter._one_row import _ilp_operators
    from autopar.intra import ShardOptions
    from autopar.intra._problem import build_problem, ilp_inputs

    _, shared, _ = tables
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    for graph in shared.per_layer.stage_graphs:
        built = build_problem(graph, LogicalMesh.create((2, 4)), cluster, ShardOptions())
        inputs, operators = ilp_inputs(graph), _ilp_operators(graph)
        assert [n.var for n in built.ilp_nodes[:len(inputs)]] == inputs
        assert [n.node for n in built.ilp_nodes[len(inputs):]] == \
            [graph.nodes[i].id for i in operators]
