"""Microbatching that changes the math says so (`autopar.search._microbatch_math`)."""

import dataclasses

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


def test_a_mean_loss_does_not_warn(cluster, caplog):
    with caplog.at_level("INFO", logger="autopar"):
        plan = autopar.plan(make_step(False), STATE, BATCH, cluster=cluster, **OPTIONS)
    assert plan.num_microbatches > 1
    assert not [w for w in plan.warnings if "math" in w], plan.warnings
    assert "proven statically" in caplog.text  # the numeric check compiled nothing


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


# ---- the static proof (`autopar.search._batch_linearity`) ------------------------------

def _prove(step, state, batch, m=2):
    from autopar.graph import trace
    from autopar.search._batch_linearity import prove_microbatch_mean
    from autopar.search._microbatch import microbatch_args

    full = trace(step, state, batch, batch_argnums=(1,))
    micro = trace(step, *microbatch_args((state, batch), (1,), m), batch_argnums=(1,))
    return prove_microbatch_mean(full, micro, m)


def _gpt(**fields):
    import optax

    from examples import gpt

    cfg = gpt.GPTConfig(**{**dataclasses.asdict(gpt.CONFIGS["tiny"]), **fields})
    optimizer = optax.adamw(1e-3)
    return (gpt.make_train_step(cfg, optimizer),
            (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 8)))


@pytest.fixture
def no_numeric_check(monkeypatch):
    """The numeric path (the only one that compiles) fails the test if it is taken."""
    from autopar.search import _microbatch_math as mm

    def refuse(*args, **kwargs):
        raise AssertionError("the numeric microbatch check ran (it compiles the step twice)")

    monkeypatch.setattr(mm, "numeric_change", refuse)


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scanned-remat-layers"])
def test_a_gpt_with_a_mean_loss_is_proven_statically_and_compiles_nothing(
        scan, no_numeric_check, caplog):
    """The README demo's model (examples/gpt.py, mean cross-entropy, AdamW), its layers
    unrolled or in one checkpointed `lax.scan`: proven, nothing compiled."""
    step, args = _gpt(scan_layers=scan, remat_layers=scan)
    with caplog.at_level("INFO", logger="autopar"):
        assert microbatch_change(step, args, (1,), 2) is None
    assert "proven statically" in caplog.text


def make_loss_step(loss):
    """`make_step`'s two layers with another loss of the last hidden state `h` (rows are
    examples) and the batch."""
    def loss_fn(params, batch):
        h = batch["x"]
        for w in params["layers"]:
            h = jnp.tanh(h @ w)
        return loss(h, batch)

    def step(state, batch):
        loss_value, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
        return {"params": params}, {"loss": loss_value}

    return step


def _contrastive(h, batch):
    """CLIP-style: each row's similarity to every other row, a softmax over the batch."""
    logits = h @ batch["y"].T
    return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=-1)))


def _load_balancing(h, batch, num_experts=8):
    """The mean squared error plus a Switch-style load-balancing term over a top-1 router
    (the first `num_experts` features as its logits): E * sum_e f_e * P_e, f_e the
    fraction of rows routed to expert e, P_e its mean router probability."""
    probs = jax.nn.softmax(h[:, :num_experts], axis=-1)
    fraction = jax.nn.one_hot(jnp.argmax(probs, axis=-1), num_experts).mean(0)
    aux = num_experts * jnp.sum(fraction * probs.mean(0))
    return ((h - batch["y"]) ** 2).mean() + 0.01 * aux


NOT_MEANS = {
    # microbatching averages m sums: the loss moves by a factor m
    "sum": (lambda h, b: ((h - b["y"]) ** 2).sum(), "a sum over the batch"),
    # the batch size written as a number is the same in the microbatch's trace
    "hard-coded-divisor": (lambda h, b: ((h - b["y"]) ** 2).sum() / (ROWS * HIDDEN),
                           "a sum over the batch"),
    "contrastive": (_contrastive, "not provably"),
    "moe-load-balancing": (_load_balancing, "not provably"),
}


@pytest.mark.parametrize("name", list(NOT_MEANS))
def test_a_loss_that_is_not_a_mean_is_not_proven_and_warns_numerically(name, caplog):
    loss, reason = NOT_MEANS[name]
    with caplog.at_level("INFO", logger="autopar"):
        change = microbatch_change(make_loss_step(loss), (STATE, BATCH), (1,), 4)
    assert "no static proof (the loss (shape ()) is " + reason in caplog.text
    assert change is not None and change.startswith(
        "4 microbatches change the step's math: the loss averaged over microbatches differs")


def test_batch_statistics_are_not_proven():
    """BatchNorm in training mode (the batch's mean and variance, `make_step(True)`):
    the first value not proven is the statistic used per example. (That it warns is
    test_the_check_names_the_value_and_is_silent_for_a_mean.)"""
    proof = _prove(make_step(True), STATE, BATCH)
    assert not proof.proven
    assert "the first value not proven is sub" in proof.reason, proof.reason
    assert _prove(make_step(False), STATE, BATCH).proven


def test_a_moe_model_is_not_proven():
    """examples/moe_dropless.py (top-k routing, tokens sorted by expert over the whole
    batch, the Switch load-balancing term): traced at both sizes only; its warning comes
    from the numeric path, as for the "moe-load-balancing" loss above."""
    import optax

    from examples import moe_dropless as moe

    cfg = dataclasses.replace(moe.CONFIGS["tiny"], num_layers=1, num_experts=4, top_k=2,
                              num_shared_experts=0)
    optimizer = optax.sgd(1e-2)
    proof = _prove(moe.make_train_step(cfg, optimizer), moe.abstract_state(cfg, optimizer),
                   moe.abstract_batch(cfg, 4))
    assert not proof.proven and "the first value not proven is" in proof.reason


def test_the_numeric_path_alone_is_silent_for_a_mean():
    """The numeric check, which the static proof now spares a mean loss, still agrees."""
    from autopar.search._microbatch_math import numeric_change

    assert numeric_change(make_step(False), (STATE, BATCH), (1,), 4) is None


def test_what_the_proof_takes_and_refuses():
    """Small steps traced only (nothing compiled): the divisor must scale with the batch;
    a weight-decay term is batch-free; aux values must be means too; random masks drawn
    at the batch's shape and a slice of the examples are refused."""
    def step_of(loss, has_aux=False):
        def step(state, batch):
            out = autopar.value_and_grad(loss, has_aux=has_aux)(state["params"], batch)
            return state, out

        return step

    def error(p, b):
        h = jnp.tanh(b["x"] @ p["layers"][0]) @ p["layers"][1]
        return (h - b["y"]) ** 2

    assert _prove(step_of(lambda p, b: error(p, b).sum(0).sum() / b["x"].shape[0]),
                  STATE, BATCH).proven
    assert _prove(step_of(lambda p, b: error(p, b).mean() + 1e-4 * (p["layers"][0] ** 2).sum()),
                  STATE, BATCH).proven
    assert _prove(step_of(lambda p, b: (error(p, b).mean(), error(p, b).max()), True),
                  STATE, BATCH).reason.startswith("output 1 of value_and_grad")
    per_example = _prove(step_of(lambda p, b: (error(p, b).mean(), error(p, b).sum(1)), True),
                         STATE, BATCH)
    assert not per_example.proven and "per-example along dim 0" in per_example.reason

    def dropout(p, b):
        keep = jax.random.bernoulli(jax.random.key(0), 0.9, b["x"].shape)
        return error({"layers": p["layers"]}, {**b, "x": b["x"] * keep}).mean()

    assert not _prove(step_of(dropout), STATE, BATCH).proven
    assert not _prove(step_of(lambda p, b: error(p, b)[:8].mean()), STATE, BATCH).proven
    for across_examples in (jnp.cumsum, jnp.sort, jax.nn.logsumexp):  # along the batch dim
        assert not _prove(step_of(lambda p, b, f=across_examples: f(error(p, b), 0).mean()),
                          STATE, BATCH).proven
    assert _prove(step_of(lambda p, b: jnp.sort(error(p, b), 1).mean()), STATE, BATCH).proven

    # integer division by the batch size rounds differently in the two traces
    def rows_from(divisor):
        return lambda p, b: (error(p, b).mean(1) * (b["id"] // divisor(b) > 0)).mean()

    with_ids = {**BATCH, "id": S((ROWS,), jnp.int32)}
    assert _prove(step_of(rows_from(lambda b: 2)), STATE, with_ids).proven
    assert not _prove(step_of(rows_from(lambda b: b["id"].shape[0])), STATE, with_ids).proven
