"""Models written with other libraries keep matching one device on 8 devices: a flax linen
model with a mutable collection (BatchNorm statistics carried in the state), a flax
encoder-decoder, an equinox model trained through eqx.partition / eqx.combine, and
transformers' Flax GPT-J, whose rotary embedding traces `stack` / `unstack`
(`autopar.intra._rules_stack`). The user guide shows each step (docs/user_guide.md,
"Models from other libraries")."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar

RTOL = 1e-5


def fresh(tree):
    return jax.tree.map(jnp.copy, tree)


def check_parity(step, state, batch, **options):
    """One autoparallel step against one jitted step on one device: equal losses and
    states; no primitive planned without a rule. Returns the plan."""
    fn = autopar.autoparallel(**options)(step)
    new_state, metrics = fn(fresh(state), batch)
    ref_state, ref = jax.jit(step)(fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref["loss"]), rtol=RTOL)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert not [w for w in fn.plan.warnings if "no sharding rule" in w], fn.plan.warnings
    return fn.plan


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(4)(nn.relu(x))


def test_linen_batch_norm_statistics_in_the_state():
    model = BatchNormNet()
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y = jax.random.normal(jax.random.key(1), (16, 4))
    variables = model.init(jax.random.key(2), x, train=False)
    state = {"params": variables["params"], "batch_stats": variables["batch_stats"]}

    def loss_fn(params, batch_stats, batch):
        out, updates = model.apply({"params": params, "batch_stats": batch_stats},
                                   batch["x"], train=True, mutable=["batch_stats"])
        return ((out - batch["y"]) ** 2).mean(), updates["batch_stats"]

    def step(state, batch):
        (loss, stats), grads = autopar.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["batch_stats"], batch)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
        return {"params": params, "batch_stats": stats}, {"loss": loss}

    check_parity(step, state, {"x": x, "y": y}, method="shard")


class EncoderDecoder(nn.Module):
    vocab: int = 32
    dim: int = 16

    @nn.compact
    def __call__(self, src, tgt):
        embed = nn.Embed(self.vocab, self.dim)
        enc = embed(src)
        enc = nn.LayerNorm()(enc + nn.MultiHeadDotProductAttention(num_heads=2)(enc))
        dec = embed(tgt)
        dec = nn.LayerNorm()(dec + nn.MultiHeadDotProductAttention(num_heads=2)(
            dec, mask=nn.make_causal_mask(tgt)))
        dec = nn.LayerNorm()(dec + nn.MultiHeadDotProductAttention(num_heads=2)(dec, enc))
        return embed.attend(dec)


@pytest.mark.extended  # about 25 s of CPU: planning and compiling two attention blocks
def test_flax_encoder_decoder():
    model = EncoderDecoder()
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"src": jax.random.randint(k[0], (8, 12), 0, 32),
             "tgt": jax.random.randint(k[1], (8, 10), 0, 32)}
    params = model.init(k[2], batch["src"], batch["tgt"])["params"]
    optimizer = optax.sgd(0.1)
    state = (params, optimizer.init(params))

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p, b):
            logits = model.apply({"params": p}, b["src"], b["tgt"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, b["tgt"][:, 1:]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    check_parity(step, state, batch, method="shard")


def test_equinox_partition_combine():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 4, 32, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    batch = {"x": jax.random.normal(jax.random.key(1), (16, 8)),
             "y": jax.random.normal(jax.random.key(2), (16, 4))}

    def loss_fn(params, batch):
        mlp = eqx.combine(params, static)
        return ((jax.vmap(mlp)(batch["x"]) - batch["y"]) ** 2).mean()

    def step(params, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss}

    check_parity(step, params, batch, method="shard")


def gptj_step():
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = transformers.GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1,
                                     n_head=4, rotary_dim=8)
    module = transformers.FlaxGPTJForCausalLM(config, _do_init=False).module
    ids = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(16), ids.shape)
    params = module.init(jax.random.key(1), ids, jnp.ones_like(ids), positions)["params"]

    def step(params, batch):
        def loss_fn(p, b):
            logits = module.apply({"params": p}, b["ids"], jnp.ones_like(b["ids"]),
                                  positions).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], b["ids"][:, 1:]).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss}

    return step, params, {"ids": ids}


def test_gptj_stack_unstack_have_rules():
    step, params, batch = gptj_step()
    graph = autopar.graph.trace(step, params, batch)
    assert {"stack", "unstack"} <= {n.primitive for n in graph.nodes}
    plan = autopar.plan(step, params, batch, method="shard", mesh_shape=(8,))
    assert not [w for w in plan.warnings if "no sharding rule" in w], plan.warnings


@pytest.mark.extended  # about 20 s of CPU: compiling GPT-J's step twice
def test_gptj_parity():
    check_parity(*gptj_step(), method="shard")
