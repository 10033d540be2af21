"""Why a one-host (2, 4) mesh and its transpose (4, 2) are each solved (issue 45 asked for
the pair to be solved once and the plan relabelled; `logical_mesh_shapes` says why not).

On one host the collectives see group sizes only (`autopar.cost.collective_time`), and the
reshardings between specs that give each tensor dimension at most one mesh axis are
relabelled with the axes: the same seconds, bit for bit. But a dimension split by both
axes takes them in mesh order only (`enumerate_assignments`): on (2, 4) the axis of 2 is
its major digit, on (4, 2) the axis of 4. Those are different tile orders, and a
resharding into or out of one is priced differently (XLA's routes,
`autopar.intra._reshard`), so the two ILPs are different problems: their optima differ
(the tiny Llama's first layer on the `cpu-local` profile below; the demo's first two layers are
cheaper on (4, 2), and its plan is on (4, 2)), and a plan of one relabelled is not in the
other's strategy space."""

from __future__ import annotations

import dataclasses
import itertools

import optax
import pytest

import autopar
from autopar.cluster import LogicalMesh
from autopar.intra._reshard import reshard_time
from autopar.intra._signature import Signature, enumerate_assignments
from examples import llama

SWAP = {"x": "y", "y": "x"}
WIDE, TALL = LogicalMesh.create((2, 4)), LogicalMesh.create((4, 2))


def _swapped(spec):
    """`spec` with the mesh axes x and y exchanged (the twin's name for each split)."""
    return tuple(tuple(SWAP[a] for a in dim) for dim in spec)


def _specs(ndim: int, combined: bool) -> list:
    """Every spec of an `ndim`-D tensor on a 2-D mesh, each axis used once; with
    `combined`, also a dimension split by both axes (in mesh order, as the ILP has it)."""
    splits = [(), ("x",), ("y",)] + ([("x", "y")] if combined else [])
    return [s for s in itertools.product(splits, repeat=ndim)
            if len([a for d in s for a in d]) == len({a for d in s for a in d})]


@pytest.mark.parametrize("profile", ["dgx-h100", "cpu-local"])
def test_single_axis_reshardings_are_the_twins_relabelled(profile):
    """Every resharding between specs with one axis per dimension (1-D to 3-D tensors)
    costs on (2, 4) what its relabelling costs on (4, 2), to the last bit."""
    cluster = autopar.Cluster.from_profile(profile)
    for ndim in (1, 2, 3):
        shape = (64, 128, 256)[:ndim]
        pairs = list(itertools.product(_specs(ndim, combined=False), repeat=2))
        assert len(pairs) == (9, 49, 169)[ndim - 1]
        for src, dst in pairs:
            assert (reshard_time(shape, "float32", src, dst, WIDE, cluster)
                    == reshard_time(shape, "float32", _swapped(src), _swapped(dst), TALL,
                                    cluster)), (src, dst)


def test_a_split_by_both_axes_is_not_relabelled():
    """A dimension split by both axes comes in mesh order only, on either mesh: the
    relabelling of (2, 4)'s ("x", "y") would be (4, 2)'s ("y", "x"), which no strategy
    has. And the routes differ: on (2, 4) going from the axis of 2 to both axes slices
    the axis of 4 locally (free, the axis of 2 being the major digit); on (4, 2) the same
    step from its axis of 2 is a collective-permute (that axis is the minor digit)."""
    sig = Signature((("a",),), (("a",),))
    for mesh in (WIDE, TALL):
        both = [a["a"] for a in enumerate_assignments(sig, [(64,)], [(64,)], mesh)
                if len(a.get("a", ())) == 2]
        assert both == [("x", "y")]
    cluster = autopar.Cluster.from_profile("dgx-h100")
    assert reshard_time((64,), "float32", (("x",),), (("x", "y"),), WIDE, cluster) == 0.0
    assert reshard_time((64,), "float32", (("y",),), (("x", "y"),), TALL, cluster) > 0.0


def test_the_twin_layer_ilps_have_different_optima():
    """The tiny Llama's first layer (one microbatch of 8 rows) on `cpu-local`: its
    fastest plan on (4, 2) is cheaper than on (2, 4), and (2, 4)'s layout relabelled is
    no layout of (4, 2)'s problem (it splits by ("y", "x")): relabelling would move the
    cost, so the search solves both."""
    from autopar.graph import tied_state
    from autopar.inter import StageOptions, layer_cost_table
    from autopar.inter.passes._layers import assign_layers
    from autopar.intra._planner import price_layout

    cfg = dataclasses.replace(llama.CONFIGS["tiny"], layer_markers=True)
    opt = optax.adamw(1e-2)
    graph = autopar.graph.trace(llama.make_train_step(cfg, opt),
                                llama.abstract_state(cfg, opt),
                                llama.abstract_batch(cfg, 8), batch_argnums=(1,))
    cluster = autopar.Cluster.from_profile("cpu-local")
    table = layer_cost_table(graph, assign_layers(graph), cluster, 1, StageOptions(),
                             tied_state(graph, (0,)), keep_layouts=True)
    wide, tall = table.cost(0, (2, 4)), table.cost(0, (4, 2))
    assert tall.latency < wide.latency
    plan = table.plan(0, (2, 4))
    layout = table._layouts[id(plan)][1]
    swapped = tuple((kind, (tuple(s and _swapped(s) for s in ins),
                            tuple(s and _swapped(s) for s in outs)))
                    for kind, (ins, outs) in layout)
    assert any(("y", "x") in s for _, (ins, outs) in swapped for s in (*ins, *outs) if s)
    sub = table.per_layer.stage_graphs[0]
    assert price_layout(sub, cluster, TALL, swapped, table.options) is None
