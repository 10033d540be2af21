"""A one-stage pipelined plan runs as one compiled program per step (`FusedStep`): the
microbatches accumulate inside it (a `lax.scan`), and it matches the task runtime and one
device (3 AdamW steps, loss rtol 1e-5)."""

from __future__ import annotations

import jax
import numpy as np
import optax
from helpers import run_steps

import autopar
from examples import mlp

MLP = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=4, layer_markers=True)


def test_one_stage_is_one_program_with_the_accumulation_inside():
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = mlp.make_train_step(MLP, optimizer)
    state = mlp.init_state(MLP, optimizer, jax.random.key(0))
    batch = mlp.make_batch(MLP, 32, jax.random.key(1))
    ref, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), donate_argnums=(),
        num_stages=1, num_microbatches=4, submeshes=[(1, 8)], logical_shapes=[(4, 2)],
    )
    losses, new_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    # AdamW divides by the root of the second moment, which magnifies rounding where a
    # gradient is near 0: the state agrees to 1e-5 absolute (values of order 0.1-1).
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    assert par.plan.runtime == "pipeline" and par.plan.num_stages == 1

    executable = par.pipeline
    fused = executable.fused
    assert fused is not None
    flat = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves((state, batch)),
                                                  fused.in_shardings)]
    hlo = fused.fn.lower(*flat).compile().as_text()
    assert hlo.count("HloModule") == 1
    assert " while(" in hlo  # the microbatches 2..4 are a loop inside the program

    # The task runtime (a recorded step runs the tasks) gives the same step.
    (_, tasks_metrics), timeline = par.record_timeline(state, batch)
    (_, fused_metrics) = par(state, batch)
    assert {t.kind for t in timeline} == {"forward", "backward", "apply"}
    assert len([t for t in timeline if t.kind == "forward"]) == 4
    np.testing.assert_allclose(fused_metrics["loss"], tasks_metrics["loss"], rtol=1e-6)


def test_one_stage_step_donates_the_state_as_asked():
    """With `donate=True` (`donate_argnums=(0,)`) the one program reuses the state's buffers
    (as the SPMD runtime's jit does); the batch is kept."""
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = mlp.make_train_step(MLP, optimizer)
    state = mlp.init_state(MLP, optimizer, jax.random.key(0))
    batch = mlp.make_batch(MLP, 32, jax.random.key(1))
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), num_stages=1,
        num_microbatches=2, submeshes=[(1, 8)], logical_shapes=[(4, 2)], donate=True,
    )
    new_state, _ = par(state, batch)  # plans; `state` is donated from here on
    assert par.plan.runtime == "pipeline" and par.plan.num_stages == 1
    leaves = jax.tree.leaves(new_state)  # already in the plan's layout: passed as they are
    par(new_state, batch)
    assert all(x.is_deleted() for x in leaves)
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))
