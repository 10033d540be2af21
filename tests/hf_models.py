"""Tiny Hugging Face Flax decoders for the tests: Llama (grouped-query attention), Mistral
and Gemma, each trained by one step function. Needs transformers 4.x (its `test` extra
pin); callers skip without it."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import optax

import autopar

BATCH, SEQ, VOCAB = 8, 16, 128
MODELS = ("llama", "mistral", "gemma")
_CLASSES = {
    "llama": ("LlamaConfig", "FlaxLlamaForCausalLM"),
    "mistral": ("MistralConfig", "FlaxMistralForCausalLM"),
    "gemma": ("GemmaConfig", "FlaxGemmaForCausalLM"),
}


def _config(name):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=2 * SEQ,
    )
    extra = {
        "llama": dict(num_key_value_heads=2),  # 2 key/value heads for 4 query heads
        "mistral": dict(num_key_value_heads=2, sliding_window=SEQ),
        "gemma": dict(num_key_value_heads=1, head_dim=8),  # multi-query attention
    }[name]
    return getattr(transformers, _CLASSES[name][0])(**extra, **common)


def make_model(name, optimizer):
    """(train step, initial state, batch) of model `name` trained by `optimizer`.

    The step uses `autopar.value_and_grad`, so method="auto" can search pipeline stages.
    """
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)  # "Flax is deprecated"
    model = getattr(transformers, _CLASSES[name][1])(_config(name), _do_init=False)
    module = model.module

    def step(state, batch):
        params, opt_state = state

        def loss(p, b):
            ids = b["input_ids"]
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            logits = module.apply({"params": p}, ids, jnp.ones_like(ids), positions).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

        value, grads = autopar.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    params = model.init_weights(jax.random.key(0), (1, SEQ))
    state = (params, optimizer.init(params))
    k1, k2 = jax.random.split(jax.random.key(1))
    batch = {
        "input_ids": jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB),
        "labels": jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB),
    }
    return step, state, batch
