"""Cutting a step into stages from its once-computed `Skeleton` (what the explored space's
~30 stage-count rows each ask of `partition`) gives what the per-split rule gives.

One trace of the tiny GPT's AdamW step (its update has scalar-only nodes, the step
count, placed by their consumers: the rule's least-stage case)."""

from __future__ import annotations

import copy
import itertools

import optax
import pytest
from helpers import tiny_gpt_step

import autopar
from autopar.cluster import LogicalMesh
from autopar.graph import tied_state
from autopar.inter import LayerCostTable
from autopar.inter.passes import _partition as partition_module
from autopar.inter.passes._layers import assign_layers
from autopar.inter.passes._partition_skeleton import skeleton
from autopar.intra import ShardOptions

CPU = autopar.Cluster.from_profile("cpu-local")


@pytest.fixture(scope="module")
def adamw_graph():
    step, args = tiny_gpt_step(optimizer=optax.adamw(1e-2), batch_size=8)
    graph = autopar.graph.trace(step, *args, batch_argnums=(1,))
    return graph, assign_layers(graph)


def _splits(num_layers: int):
    """Every split into 1, 2 and 3 stages, and each layer a stage of its own."""
    for cuts in itertools.chain.from_iterable(
            itertools.combinations(range(1, num_layers), k) for k in range(3)):
        bounds = (0, *cuts, num_layers)
        yield list(zip(bounds, bounds[1:]))
    yield [(k, k + 1) for k in range(num_layers)]


def _fields(part):
    """A `Partition` as plain comparable data (sub-graph nodes by their fields)."""
    graphs = [(g.name, g.invars, g.outvars, [n.__dict__ for n in g.nodes])
              for g in part.stage_graphs]
    return (part.num_stages, part.node_stage, part.alias, part.grad_vars, part.forward,
            part.backward, part.apply, list(part.home.items()),
            [list(d.items()) for d in part.node_index], part.deferrable, graphs)


def test_a_cut_from_the_skeleton_equals_the_per_split_rule(adamw_graph, monkeypatch):
    graph, layers = adamw_graph
    sk = skeleton(graph, layers)
    scalar_only = [n for n in sk.apply if not any(
        partition_module._is_array(graph, v)
        for v in (*graph.nodes[n].inputs, *graph.nodes[n].outputs))]
    assert scalar_only, "the AdamW step has scalar-only update nodes (its count)"
    splits = list(_splits(layers.num_layers))
    assert len(splits) > 10
    fast = [_fields(partition_module._partition(graph, layers, s)) for s in splits]
    # The same splits through the per-split rule (`node_stages_per_split`).
    monkeypatch.setattr(partition_module, "_ordered", lambda stage_layers: False)
    for split, got in zip(splits, fast):
        assert got == _fields(partition_module._partition(graph, layers, split)), split


def test_stages_out_of_layer_order_take_the_per_split_rule(adamw_graph):
    graph, layers = adamw_graph
    n = layers.num_layers
    backwards = [(1, n), (0, 1)]  # stage 0 holds the later layers
    assert not partition_module._ordered(backwards)
    assert partition_module._ordered([(0, 2), (2, 2), (2, n)])  # an empty stage keeps order
    part = partition_module.partition(graph, layers, backwards)
    layer_stage = {k: (1 if k == 0 else 0) for k in range(n)}
    assert part.node_stage == partition_module.node_stages_per_split(graph, layers,
                                                                     layer_stage)
    assert {part.node_stage[i] for i, k in enumerate(layers.layer)
            if k == 0 and layers.phase[i] != "dead" and i != layers.grad_boundary} == {1}


def test_a_stage_shared_by_two_splits_is_stitched_once(adamw_graph):
    """The explored space's stage counts share stages (same layers, mesh and layer plans):
    `LayerCostTable.stage_plan` stitches such a stage once, and that plan equals a fresh
    stitch of the other split's sub-graph; a stage of other layers is stitched anew."""
    graph, layers = adamw_graph
    last = layers.num_layers
    tied = tied_state(graph, (0,))
    table = LayerCostTable(graph, layers, CPU, ShardOptions(), tied)
    shape = (1, 2)
    mesh = LogicalMesh.create(shape, (0, 1))
    two = partition_module.partition(graph, layers, [(0, 1), (1, last)])
    three = partition_module.partition(graph, layers, [(0, 1), (1, 2), (2, last)])
    assert two.stage_graphs[0] is not three.stage_graphs[0]
    first = table.stage_plan(graph, two, 0, (0, 1), shape, mesh, tied)
    again = table.stage_plan(graph, three, 0, (0, 1), shape, mesh, tied)
    assert again is first
    table._stitched.clear()
    assert table.stage_plan(graph, three, 0, (0, 1), shape, mesh, tied) == first
    rest = table.stage_plan(graph, two, 1, (1, last), shape, mesh, tied)
    assert table.stage_plan(graph, three, 1, (1, 2), shape, mesh, tied) is not rest


def test_per_graph_memos_hit_on_the_graph_and_miss_on_another(adamw_graph):
    """The Megatron grid asks about one traced graph once per configuration, and the
    explored space's search about the grid's graphs: a graph's `assign_layers`, its
    layers' `structural_fingerprint`s and a graph's `fingerprint_of` are computed once per
    graph object (a hit: no new computation, the same value), and anew for another graph
    object of the same content (a miss: computed, equal to the first)."""
    from autopar import _memo
    from autopar.inter import _layer_graphs, _stitch
    from autopar.intra import graph_fingerprint

    graph, layers = adamw_graph

    def held(name):  # the entries of memo `name` (one per graph computed)
        return _memo.sizes()[name]

    other = copy.copy(graph)  # the same content, another graph object
    assert other is not graph
    before = held("inter.layer_assignments")
    assert assign_layers(other) == layers
    assert assign_layers(other) is assign_layers(other)  # a hit: the same object
    assert held("inter.layer_assignments") == before + 1
    third = copy.copy(graph)
    assert assign_layers(third) == layers and held("inter.layer_assignments") == before + 2

    part = partition_module.partition(graph, layers,
                                      [(k, k + 1) for k in range(layers.num_layers)])
    sub = copy.copy(part.stage_graphs[1])
    before = held("inter.structural_fingerprints")
    first = _layer_graphs.structural_fingerprint(sub)
    assert _layer_graphs.structural_fingerprint(sub) == first
    assert held("inter.structural_fingerprints") == before + 1
    sub_copy = copy.copy(sub)
    assert _layer_graphs.structural_fingerprint(sub_copy) == first
    assert held("inter.structural_fingerprints") == before + 2

    before = held("inter.graph_fingerprints")
    whole = _stitch.fingerprint_of(other)
    assert whole == graph_fingerprint(graph)
    assert _stitch.fingerprint_of(other) is whole
    assert held("inter.graph_fingerprints") == before + 1
    other_copy = copy.copy(other)
    assert _stitch.fingerprint_of(other_copy) == whole
    assert held("inter.graph_fingerprints") == before + 2
