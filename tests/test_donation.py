"""Donation is opt-in: a step donates its state only when asked (`donate=True` or
`donate_argnums=`), and reusing a donated state raises autopar's error naming the option
before anything runs, not JAX's "Array has been deleted"."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import optax
import pytest

import autopar
from examples import mlp

CFG = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
OPT = optax.sgd(0.1)


def _setup():
    state = mlp.init_state(CFG, OPT, jax.random.key(0))
    batch = mlp.make_batch(CFG, 16, jax.random.key(1))
    return mlp.make_train_step(CFG, OPT), state, batch


def _par(step, **options):
    return autopar.autoparallel(step, cluster=autopar.Cluster.from_profile("cpu-local"),
                                method="shard", mesh_shape=(8,), cache=False, **options)


def test_a_state_not_donated_can_be_passed_again():
    step, state, batch = _setup()
    par = _par(step)
    first, metrics = par(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    again, metrics_again = par(state, batch)  # the same state once more: the same step
    np.testing.assert_allclose(float(metrics_again["loss"]), float(metrics["loss"]),
                               rtol=1e-6)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert inspect.signature(autopar.autoparallel).parameters["donate"].default is False
    assert inspect.signature(autopar.autoparallel).parameters["donate_argnums"].default == ()


@pytest.mark.parametrize("asked", [dict(donate=True), dict(donate_argnums=(0,))])
def test_reusing_a_donated_state_raises_autopars_error(asked):
    step, state, batch = _setup()
    par = _par(step, **asked)
    new_state, _ = par(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state)), "donation was asked for"
    with pytest.raises(ValueError, match=r"donate=True.*donate_argnums.*Pass the state the "
                                         r"step returned") as err:
        par(state, batch)
    assert "params" in str(err.value)  # names a consumed leaf by its path
    par(new_state, batch)  # the returned state runs


def test_donate_true_with_no_arguments_to_donate_is_refused():
    step, _, _ = _setup()
    with pytest.raises(ValueError, match="donates nothing"):
        _par(step, donate=True, donate_argnums=())
