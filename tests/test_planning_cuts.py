"""Planning-speed cuts of issue 45 that must not change plans: logical meshes whose axes
divide no tensor dimension left out of the stage DP (they can only replicate), a layout
priced on the problem built once per graph and mesh, and the layer ILPs of a structure
built on one layer's graph whatever layer the stage DP asks about."""

from __future__ import annotations

import dataclasses
import functools

import optax
import pytest

import autopar
from autopar.inter._submesh import SubmeshShape, logical_mesh_shapes, splittable_shapes
from examples import gpt

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head


def test_a_mesh_axis_that_divides_no_dimension_is_left_out():
    """5 hosts of 8 devices: 40 and 5 divide none of the dimensions, so no shape is left;
    3 hosts when a dimension is a multiple of 24 (Llama 3's vocabulary, 128,256 = 2^8 x 3
    x 167) keep every shape whose axes divide one; a host's own shapes all stay. With
    several layers' dimensions an axis must divide one of each layer's."""
    dims = {4096, 8192, 14336, 32, 8, 2}
    assert splittable_shapes(SubmeshShape(5, 8), dims) == []
    assert splittable_shapes(SubmeshShape(1, 8), dims) == logical_mesh_shapes(SubmeshShape(1, 8))
    assert splittable_shapes(SubmeshShape(3, 8), dims) == []
    assert splittable_shapes(SubmeshShape(3, 8), dims | {128256}) == [(24,), (3, 8), (6, 4),
                                                                       (12, 2)]
    assert splittable_shapes(SubmeshShape(7, 8), dims) == [(56,), (7, 8), (14, 4), (28, 2)]
    assert splittable_shapes(SubmeshShape(1, 1), set()) == [(1,)]
    # each layer's dimensions: 3 divides the head's vocabulary, none of a block's
    assert splittable_shapes(SubmeshShape(3, 8), dims, dims | {128256}) == []
    assert splittable_shapes(SubmeshShape(2, 8), dims, {128256}) == logical_mesh_shapes(
        SubmeshShape(2, 8))


@functools.cache  # traced once per module (a graph is not changed by planning it)
def _graph(rows: int):
    opt = optax.adamw(1e-2)
    return autopar.graph.trace(gpt.make_train_step(GPT, opt), gpt.abstract_state(GPT, opt),
                               gpt.abstract_batch(GPT, rows), batch_argnums=(1,))


@pytest.mark.parametrize("shape", [(2, 4)])
def test_a_layout_priced_on_the_shared_problem_is_the_cut_problems_plan(shape):
    """`price_layout` picks the layout's strategies in the problem built once for the
    graph and mesh (`layout_choices`); the plan is the one of the problem cut to the
    layout (`build_problem(..., layout=...)`): the same objective, cost, memory, specs."""
    from autopar.intra._ilp import Solution, SolveStats, evaluate, solve
    from autopar.intra._planner import (
        PreparedILP,
        finish_on_mesh,
        prepare_on_mesh,
        price_layout,
    )
    from autopar.intra._problem import build_problem, chosen_layout

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    mesh = autopar.cluster.LogicalMesh.create(shape)
    small, large = _graph(8), _graph(16)
    prepared = prepare_on_mesh(small, cluster, mesh)
    layout = chosen_layout(prepared.built, solve(prepared.problem).choices)
    priced = price_layout(large, cluster, mesh, layout)
    cut = build_problem(large, mesh, cluster, prepared.options, layout=layout)
    choices = (0,) * len(cut.ilp_nodes)
    stats = SolveStats(num_nodes=len(choices), num_nodes_after_merge=len(choices),
                       num_ilp_nodes=0, num_variables_before_merge=len(choices),
                       num_variables=0, num_constraints=0, build_time=0.0, solve_time=0.0,
                       solver="none", formulation="none", tie_break="none")
    again = finish_on_mesh(
        PreparedILP(cut.problem, {}, large, mesh, cluster, prepared.options, (), None, cut, 0.0),
        Solution(choices, evaluate(cut.problem, choices), "optimal", stats))
    assert priced is not None
    assert priced.stats["objective"] == again.stats["objective"]
    assert priced.cost == again.cost
    assert priced.var_specs == again.var_specs


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (3, 8), (24,), (2, 3, 4)])
def test_a_collective_is_timed_on_one_group_per_host_layout(shape):
    """`collective_time` and `combined_collective_time` time one group of each layout on
    the hosts (`_distinct_groups`): the same seconds as the slowest of every group, on a
    mesh whose groups span 3 hosts of 8 devices unevenly."""
    from autopar.cost._collective import (
        _group_time,
        collective_time,
        combined_collective_time,
    )

    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=3)
    names = ("a", "b", "c")[: len(shape)]
    mesh = autopar.cluster.LogicalMesh.create(shape, axis_names=names)
    for axes in [(n,) for n in names] + [names]:
        for kind in ("all_reduce", "all_gather", "all_to_all", "send_recv"):
            slowest = max(_group_time(kind, 3e6, cluster, g) for g in mesh.groups(axes))
            assert collective_time(kind, 3e6, cluster, mesh, axes) == (
                slowest if mesh.axis_size(axes) > 1 else 0.0)
        combined = combined_collective_time("all_reduce", 1e5, cluster, mesh, axes)
        if mesh.axis_size(axes) > 1:
            from autopar.cost.backends import backend_for
            share = backend_for(cluster).merged_latency_share(cluster, 1e5, 30 * 1024 * 1024)
            assert combined == max(_group_time("all_reduce", 1e5, cluster, g, share)
                                   for g in mesh.groups(axes))


def test_a_layer_without_parameters_cuts_no_mesh():
    """The rule asks each layer that holds parameters: a layer of scalars only (a loss cut
    out as a layer of its own) leaves every shape of one host in place, where the
    parameter layers split them all; a 3-host submesh goes (3 divides none of theirs)."""
    from types import SimpleNamespace

    from autopar.graph import Role
    from autopar.inter._choose import _splittable
    from autopar.inter._options import StageOptions
    from autopar.inter._submesh import submesh_shapes

    def var(shape, role=Role.ACTIVATION):
        return SimpleNamespace(shape=shape, role=role)

    variables = [var((64, 256), Role.PARAM), var((8, 64)), var((8, 256)), var(()),
                 var((), Role.PARAM)]
    block = SimpleNamespace(vars=variables, invars=(0, 1), outvars=(2,),
                            nodes=[SimpleNamespace(inputs=(0, 1), outputs=(2,))])
    loss = SimpleNamespace(vars=variables, invars=(3,), outvars=(3,), nodes=[])
    table = SimpleNamespace(per_layer=SimpleNamespace(stage_graphs=[block, loss]),
                            fingerprints=["block", "loss"])
    one_host = submesh_shapes(1, 8)
    assert _splittable(table, one_host, StageOptions()) == (one_host, None)
    kept, shapes = _splittable(table, submesh_shapes(3, 8), StageOptions())
    assert [s.num_hosts for s in kept] == [1, 1, 1, 1, 2]
    assert (3, 8) not in shapes and (2, 8) in shapes
    assert _splittable(table, submesh_shapes(3, 8), StageOptions(lower_bounds=False))[1] is None


def test_transposed_meshes_differ_only_in_splits_over_both_axes():
    """Why (2, 4) and (4, 2) are not collapsed into one (issue 45): with the axes swapped,
    their ILPs offer the same strategies at the same costs, except those that split one
    dimension over both axes, which for the graph inputs are always major in the first
    axis (``("x", "y")``): on (2, 4) the 2-way axis outside, on (4, 2) the 4-way one, so
    each mesh reaches layouts the other does not. The demo's embedding layer is 1.2% faster on
    (4, 2) (its one-stage plan 0.06%); collapsing would need both orders offered."""
    from autopar.cluster import LogicalMesh
    from autopar.intra._planner import prepare_on_mesh

    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    graph = _graph(8)
    names = LogicalMesh.create((2, 4)).axis_names
    swap = {names[0]: names[1], names[1]: names[0]}

    def swapped(spec):
        return None if spec is None else tuple(
            tuple(swap[a] for a in d) if isinstance(d, tuple) else d for d in spec)

    def both_axes(strategy):
        return any(isinstance(d, tuple) and len(d) > 1
                   for spec in (*strategy.in_specs, *strategy.out_specs) if spec for d in spec)

    wide = prepare_on_mesh(graph, cluster, LogicalMesh.create((2, 4))).built.ilp_nodes
    tall = prepare_on_mesh(graph, cluster, LogicalMesh.create((4, 2))).built.ilp_nodes
    assert len(wide) == len(tall)
    differ = 0
    for a, b in zip(wide, tall):
        left = {(tuple(map(swapped, s.in_specs)), tuple(map(swapped, s.out_specs))): s.cost
                for s in a.strategies if not both_axes(s)}
        right = {(s.in_specs, s.out_specs): s.cost for s in b.strategies if not both_axes(s)}
        assert left.keys() == right.keys(), a.name
        assert all(left[k] == pytest.approx(right[k], rel=1e-12, abs=1e-18) for k in left)
        over_both = [{(tuple(map(f, s.in_specs)), tuple(map(f, s.out_specs)))
                      for s in n.strategies if both_axes(s)}
                     for n, f in ((a, swapped), (b, lambda spec: spec))]
        differ += over_both[0] != over_both[1]
        if a.var is not None:  # a graph input splits a dimension over both axes x-major
            assert {d for s in a.strategies + b.strategies for spec in s.out_specs if spec
                    for d in spec if isinstance(d, tuple) and len(d) > 1} <= {tuple(names)}
    assert differ > 0
