"""A mesh of three axes is planned over the strategies of its two-axis views (issue 18)."""

from __future__ import annotations

import jax
import optax

import autopar
from autopar.cluster import LogicalMesh
from autopar.intra._signature import Signature, enumerate_assignments
from examples import mlp

MATMUL = Signature(inputs=(("m", "k"), ("k", "n")), outputs=(("m", "n"),),
                   reductions={"k": "sum"})
SHAPES = dict(in_shapes=((8, 8), (8, 8)), out_shapes=((8, 8),))


def _runs(assignment, axes) -> int:
    owner = [next((label for label, ax in assignment.items() if a in ax), None) for a in axes]
    return 1 + sum(a != b for a, b in zip(owner, owner[1:]))


def test_three_axes_give_the_two_axis_views():
    """3 labels + unused on 3 axes: 64 ways in all; the views (x*y, z) and (x, y*z) take
    those where x and y, or y and z, go the same way: 16 + 16 - 4 (all three alike)."""
    mesh = LogicalMesh.create((2, 2, 2))
    found = enumerate_assignments(MATMUL, SHAPES["in_shapes"], SHAPES["out_shapes"], mesh)
    assert len(found) == 28
    assert all(_runs(a, mesh.axis_names) <= 2 for a in found)
    x, y, z = mesh.axis_names
    assert {"m": (x, y), "n": (z,)} in found  # data over x*y, tensor over z
    assert {"m": (x,), "k": (y, z)} in found
    assert {"m": (x,), "k": (y,), "n": (z,)} not in found  # three labels in one node
    # two axes are left alone
    flat = enumerate_assignments(MATMUL, SHAPES["in_shapes"], SHAPES["out_shapes"],
                                 LogicalMesh.create((2, 4)))
    assert len(flat) == 16


def _plan(shape) -> autopar.Plan:
    cfg = mlp.MLPConfig(in_dim=16, hidden=64, out_dim=8, num_layers=2)
    opt = optax.adam(1e-3)
    state = jax.eval_shape(lambda: mlp.init_state(cfg, opt, jax.random.key(0)))
    batch = jax.eval_shape(lambda: mlp.make_batch(cfg, 16, jax.random.key(1)))
    return autopar.plan(mlp.make_train_step(cfg, opt), state, batch, cluster="cpu-local",
                        method="shard", mesh_shape=shape, cache=False)


def test_three_axis_plan_is_no_slower_than_its_views():
    """Every plan of (4, 2) and (2, 4) is a plan of (2, 2, 2) (a label on x*y or y*z),
    so the three-axis plan predicts no more time than either."""
    plan = _plan((2, 2, 2))
    assert tuple(plan.stages[0].mesh.shape) == (2, 2, 2)
    cube = plan.predicted_step_time
    views = min(_plan(shape).predicted_step_time for shape in ((4, 2), (2, 4)))
    assert cube <= views * (1 + 1e-9)

