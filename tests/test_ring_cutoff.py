"""The exact ring's ILP solved with the auto plan's objective as its `cutoff`
(`autopar.intra._planner.exact_ring_problem`, `solve`'s `cutoff`): where no ring plan is
cheaper, the tie-break is skipped and the plan returned is still an optimum; where one
is, the plan is the canonical one, the same as without the cutoff. Oracle: the same ILPs
solved without a cutoff, on the layer of a small Llama at long context."""

from __future__ import annotations

import dataclasses

import optax
import pytest

import autopar
from autopar.cluster import LogicalMesh
from autopar.graph import trace
from autopar.intra import solve
from autopar.intra._ilp import CUTOFF_MARGIN
from autopar.intra._options import ShardOptions
from autopar.intra._planner import (
    exact_ring_problem,
    finish_on_mesh,
    plan_on_mesh,
    prepare_on_mesh,
)
from examples import llama

# test_ring_planned.py's "auto takes the ring where it pays": one layer, 32,768 tokens
CFG = dataclasses.replace(llama.CONFIGS["cp-test"], num_layers=1, seq_len=32768, hidden=512,
                          num_heads=8, num_kv_heads=8, ffn_hidden=1024)


@pytest.fixture(scope="module")
def layer():
    optimizer = optax.adamw(1e-2, eps=1e-6)
    args = (llama.make_train_step(CFG, optimizer), llama.abstract_state(CFG, optimizer),
            llama.abstract_batch(CFG, 1))
    graph = trace(*args, batch_argnums=(1,))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_hosts=2)
    return graph, cluster, LogicalMesh.create((2, 8))


@pytest.fixture(scope="module")
def solved(layer):
    """The auto ILP's plan, the exact ring's ILP and its canonical solution (no cutoff)."""
    graph, cluster, mesh = layer
    prepared = prepare_on_mesh(graph, cluster, mesh, ShardOptions())
    auto = finish_on_mesh(prepared, solve(prepared.problem, **prepared.solve_args))
    ring = exact_ring_problem(prepared, auto)
    assert ring is not None  # the auto plan split the sequence: the ring is tried
    args = {k: v for k, v in ring.solve_args.items() if k != "cutoff"}
    return auto, ring, args, solve(ring.problem, **args)


def test_the_ring_problem_carries_the_auto_objective_as_cutoff(solved):
    auto, ring, _, canonical = solved
    assert ring.solve_args["cutoff"] == auto.stats["objective"]
    assert canonical.stats.tie_break == "canonical"
    # here the ring wins (7-18% on the CLI row's layers): its solve is the canonical one
    assert canonical.objective < auto.stats["objective"]
    with_cutoff = solve(ring.problem, **ring.solve_args)
    assert with_cutoff.choices == canonical.choices
    assert with_cutoff.stats.tie_break == "canonical"


def test_no_plan_under_the_cutoff_skips_the_tie_break_and_keeps_an_optimum(solved):
    _, ring, args, canonical = solved
    # cutoffs below the optimum: no plan undercuts them, the caller would discard any
    for cutoff in (canonical.objective * (1 - 2 * CUTOFF_MARGIN), canonical.objective * 0.9):
        cut = solve(ring.problem, **args, cutoff=cutoff)
        assert cut.stats.tie_break == "cutoff"
        assert cut.objective >= cutoff
        assert abs(cut.objective - canonical.objective) <= 1e-9 * canonical.objective
    # at the optimum or above it, the margin leaves the tie-break to run: canonical
    for cutoff in (canonical.objective, canonical.objective * (1 + CUTOFF_MARGIN / 2)):
        near = solve(ring.problem, **args, cutoff=cutoff)
        assert near.stats.tie_break == "canonical" and near.choices == canonical.choices


def test_plan_on_mesh_is_the_cheaper_of_the_two_canonical_plans(layer, solved):
    graph, cluster, mesh = layer
    auto, ring, _, canonical = solved
    best = (finish_on_mesh(ring, canonical)
            if canonical.objective < auto.stats["objective"] else auto)
    plan = plan_on_mesh(graph, cluster, mesh)
    assert plan.node_strategies == best.node_strategies
    assert plan.stats["objective"] == best.stats["objective"]
    assert plan.context_parallel == best.context_parallel
