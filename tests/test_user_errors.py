"""Mistakes a new user makes: each raises (or warns) before anything of theirs is consumed,
with a message that names the fix, and the caller's arrays stay readable."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from examples import mlp

CFG = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=2)
OPT = optax.sgd(0.1)


def _state_and_batch(batch_size=8):
    state = mlp.init_state(CFG, OPT, jax.random.key(0))
    batch = mlp.make_batch(CFG, batch_size, jax.random.key(1))
    return state, batch


def _all_readable(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        np.asarray(leaf)  # raises if the buffer was donated or deleted


def _jax_grad_step(state, batch):
    """A step that uses jax.value_and_grad: autopar cannot see its gradient boundary."""
    loss = functools.partial(mlp.loss_fn, cfg=CFG)
    value, grads = jax.value_and_grad(loss)(state.params, batch)
    updates, opt_state = OPT.update(grads, state.opt_state, state.params)
    return mlp.TrainState(optax.apply_updates(state.params, updates), opt_state), {"loss": value}


def test_microbatches_without_autopar_gradients_raise():
    state, batch = _state_and_batch()
    step = autopar.autoparallel(_jax_grad_step, num_microbatches=2, cache=False)
    with pytest.raises(ValueError, match=r"num_microbatches=2.*autopar\.value_and_grad"):
        step(state, batch)
    _all_readable((state, batch))


def test_a_string_batch_names_the_argument():
    state, _ = _state_and_batch()
    step = autopar.autoparallel(mlp.make_train_step(CFG, OPT), method="data", cache=False)
    with pytest.raises(TypeError, match=r"leaf at 'batch' is a str, not an array"):
        step(state, "tokens.txt")
    _all_readable(state)


def test_mesh_shape_for_another_device_count_names_shapes_that_fit():
    state, batch = _state_and_batch()
    step = autopar.autoparallel(
        mlp.make_train_step(CFG, OPT), method="shard", mesh_shape=(3, 3), cache=False
    )
    with pytest.raises(ValueError, match=r"mesh_shape \(3, 3\) needs 9 devices but the cluster "
                       r"has 8; pass a shape whose product is 8.*\(2, 4\)"):
        step(state, batch)
    _all_readable((state, batch))


def test_other_pytree_than_the_plan_was_made_for():
    state, batch = _state_and_batch()
    plan = autopar.plan(mlp.make_train_step(CFG, OPT), state, batch, method="data", cache=False)
    reuse = autopar.autoparallel(mlp.make_train_step(CFG, OPT), plan=plan, cache=False)
    extra = dict(batch, mask=jnp.ones((8,)))
    with pytest.raises(ValueError, match=r"'batch/mask' is not an input of the plan.*Plan again"):
        reuse(state, extra)
    _all_readable((state, extra))


def test_other_dtype_than_the_plan_was_made_for():
    state, batch = _state_and_batch()
    plan = autopar.plan(mlp.make_train_step(CFG, OPT), state, batch, method="data", cache=False)
    reuse = autopar.autoparallel(mlp.make_train_step(CFG, OPT), plan=plan, cache=False)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), batch)
    with pytest.raises(ValueError, match=r"'batch/x' is bfloat16\[8, 16\], the plan has "
                       r"float32\[8, 16\].*Plan again"):
        reuse(state, half)
    _all_readable((state, half))


def test_batch_not_divisible_by_the_data_parallel_size():
    state, batch = _state_and_batch(batch_size=6)
    step = autopar.autoparallel(mlp.make_train_step(CFG, OPT), method="data", cache=False)
    with pytest.raises(ValueError, match=r"method='data' splits the batch over all 8 devices, "
                       r"but the batch has 6 rows; use a batch size divisible by 8"):
        step(state, batch)
    _all_readable((state, batch))


def test_mesh_shape_with_a_pipeline_search_warns():
    state, batch = _state_and_batch(batch_size=16)
    cfg = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=2, layer_markers=True)
    state = mlp.init_state(cfg, OPT, jax.random.key(0))
    with pytest.warns(UserWarning, match=r"mesh_shape=\(2, 4\) applies to one-mesh plans"):
        plan = autopar.plan(
            mlp.make_train_step(cfg, OPT), state, batch, mesh_shape=(2, 4), cache=False,
            num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(4,)],
        )
    assert any("logical_shapes" in w for w in plan.warnings)
