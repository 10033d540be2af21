"""Microbatching that changes the math says so (`autopar.search._microbatch_math`)."""

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.search._microbatch_math import microbatch_change

S = jax.ShapeDtypeStruct
HIDDEN, ROWS = 128, 512
STATE = {"params": {"layers": [S((HIDDEN, HIDDEN), jnp.float32) for _ in range(2)]}}
BATCH = {"x": S((ROWS, HIDDEN), jnp.float32), "y": S((ROWS, HIDDEN), jnp.float32)}
# Two pipeline stages on one dgx-a100-80g host with 0.4 MB per device: the whole batch's
# activations do not fit, so num_microbatches="auto" picks more than one microbatch.
OPTIONS = dict(num_stages=2, memory_budget=4e5, num_microbatches="auto", cache=False)


def make_step(batch_statistics: bool):
    def loss_fn(params, batch):
        h = batch["x"]
        for w in params["layers"]:
            h = autopar.layer_boundary(jnp.tanh(h @ w))
        if batch_statistics:  # normalised over the batch, as BatchNorm in training
            h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        return ((h - batch["y"]) ** 2).mean()

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
        return {"params": params}, {"loss": loss}

    return step


@pytest.fixture(scope="module")
def cluster():
    return autopar.Cluster.from_profile("dgx-a100-80g")


def test_batch_statistics_under_auto_microbatches_warn(cluster):
    plan = autopar.plan(make_step(True), STATE, BATCH, cluster=cluster, **OPTIONS)
    assert plan.num_microbatches > 1
    (warning,) = [w for w in plan.warnings if "change the step's math" in w]
    assert warning.startswith(f"{plan.num_microbatches} microbatches change the step's math: "
                              "the loss averaged over microbatches differs")


def test_a_mean_loss_does_not_warn(cluster):
    plan = autopar.plan(make_step(False), STATE, BATCH, cluster=cluster, **OPTIONS)
    assert plan.num_microbatches > 1
    assert not [w for w in plan.warnings if "math" in w], plan.warnings


def test_the_check_names_the_value_and_is_silent_for_a_mean():
    change = microbatch_change(make_step(True), (STATE, BATCH), (1,), 4)
    assert change is not None and "4 microbatches change the step's math" in change
    assert microbatch_change(make_step(False), (STATE, BATCH), (1,), 4) is None


def test_strict_refuses(cluster):
    with pytest.raises(ValueError, match=r"change the step's math.*microbatch_check='strict'"):
        autopar.plan(make_step(True), STATE, BATCH, cluster=cluster, microbatch_check="strict",
                     **OPTIONS)
