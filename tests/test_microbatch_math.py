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


def test_a_step_too_large_to_evaluate_once_more_is_not_checked(caplog):
    """The check evaluates the step once more on one device: a step whose evaluation
    would hold more than MAX_CHECK_LIVE_BYTES there (here a 16,384-token attention's
    score matrix, 1 GiB at a time, several at once in its backward) is skipped, with the
    bytes logged, before anything is compiled; its arguments are small."""
    from autopar.search import _microbatch_math as mm

    seq, width = 16384, 8
    state = {"params": {"wq": S((width, width), jnp.float32),
                        "wk": S((width, width), jnp.float32)}}
    batch = {"x": S((2, seq, width), jnp.float32)}

    def loss_fn(params, batch):
        q, k = batch["x"] @ params["wq"], batch["x"] @ params["wk"]
        scores = jnp.einsum("bsd,btd->bst", q, k)
        return jax.nn.softmax(scores, axis=-1).mean()

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        return state, {"loss": loss, "grads": grads}

    from autopar.graph import trace
    graph = trace(step, state, batch, batch_argnums=(1,))
    assert mm.evaluation_bytes(graph) > mm.MAX_CHECK_LIVE_BYTES  # 2 x 1 GiB scores
    with caplog.at_level("INFO", logger="autopar"):
        assert microbatch_change(step, (state, batch), (1,), 2, traced=(graph,)) is None
    assert "would hold" in caplog.text
    # the small steps above are well inside it
    small = trace(make_step(True), STATE, BATCH, batch_argnums=(1,))
    assert mm.evaluation_bytes(small) < 2**26
