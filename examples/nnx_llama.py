"""The Llama of `examples/llama.py` written as flax NNX modules, trained with `nnx.Optimizer`
under `autopar.autoparallel`.

autopar plans a function of pytrees; an NNX model is a graph of Python objects. The step
therefore takes the *state* of the model and of the optimizer as a pytree argument and
rebuilds the objects inside, the pattern `nnx.jit` uses underneath:

```python
graphdefs, state = split_train_state(model, optimizer)   # once, outside the step

@autopar.autoparallel
def train_step(state, batch):
    model, optimizer = nnx.merge(*graphdefs, ...)       # objects from the state pytree
    loss, grads = autopar.value_and_grad(loss_fn)(params_of(model), ...)
    optimizer.update(model, grads)                      # mutates model and optimizer
    return split_state(model, optimizer), {"loss": loss}  # their new state, a pytree
```

The state is ``{"params": nnx.State, "opt_state": nnx.State}`` so that reports name its
leaves ``params/layers/0/attn/wq/kernel/value``; `merge_model` rebuilds the trained model
after the run. ``scan_layers=True`` stacks the layers with `nnx.vmap` and runs them with
`nnx.scan`. Run ``python examples/nnx_llama.py`` for three single-device steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from autopar import value_and_grad
from examples.llama import (
    CONFIGS,
    INIT_STD,
    LlamaConfig,
    abstract_batch,
    apply_rotary,
    make_batch,
    rotary_tables,
)

__all__ = ["CONFIGS", "LlamaConfig", "abstract_batch", "make_batch"]


def _linear(d_in: int, d_out: int, cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        kernel_init=nnx.initializers.normal(INIT_STD),
        dtype=cfg.dtype,
        param_dtype=cfg.dtype,
        rngs=rngs,
    )


def _rms_norm(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(
        cfg.hidden, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs
    )


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wq = _linear(cfg.hidden, cfg.hidden, cfg, rngs)
        self.wk = _linear(cfg.hidden, cfg.kv_dim, cfg, rngs)
        self.wv = _linear(cfg.hidden, cfg.kv_dim, cfg, rngs)
        self.wo = _linear(cfg.hidden, cfg.hidden, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s, _ = x.shape
        n, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = rotary_tables(s, d, cfg.rope_theta)
        q = apply_rotary(self.wq(x).reshape(b, s, n, d), cos, sin)
        k = apply_rotary(self.wk(x).reshape(b, s, nkv, d), cos, sin)
        v = self.wv(x).reshape(b, s, nkv, d)
        q = q.reshape(b, s, nkv, n // nkv, d)  # query heads in groups sharing a kv head
        scores = jnp.einsum("bqngd,bknd->bngqk", q, k) / math.sqrt(d)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bngqk,bknd->bqngd", weights, v)
        return self.wo(out.reshape(b, s, cfg.hidden))


class MLP(nnx.Module):
    """SwiGLU: ``(silu(x W_gate) * x W_up) W_down``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.w_gate = _linear(cfg.hidden, cfg.ffn_hidden, cfg, rngs)
        self.w_up = _linear(cfg.hidden, cfg.ffn_hidden, cfg, rngs)
        self.w_down = _linear(cfg.ffn_hidden, cfg.hidden, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))


class Block(nnx.Module):
    """One pre-norm layer."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class Llama(nnx.Module):
    """Token embedding, layers, final RMSNorm and an untied output layer."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        if cfg.layer_markers:
            raise ValueError("the NNX Llama places no layer markers; set layer_markers=False")
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden,
            embedding_init=nnx.initializers.normal(INIT_STD),
            dtype=cfg.dtype,
            param_dtype=cfg.dtype,
            rngs=rngs,
        )
        if cfg.scan_layers:
            # One Block whose parameters have a leading layer dimension.
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _rms_norm(cfg, rngs)
        self.lm_head = _linear(cfg.hidden, cfg.vocab_size, cfg, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h: jax.Array, block: Block) -> jax.Array:
                return block(h)

            h = run(h, self.layers)
        else:
            for block in self.layers:
                h = block(h)
        return self.lm_head(self.final_norm(h))


def loss_fn(model: Llama, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy; ``batch = {"tokens", "targets"}``, int32[B, S]."""
    logits = model(batch["tokens"]).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)
    return -jnp.mean(target_log_probs)


# ---- state as a pytree: split outside the step, merge inside ---------------------------


@dataclasses.dataclass(frozen=True)
class GraphDefs:
    """The static structure of the model and the optimizer (`nnx.split`'s graphdefs)."""

    model: Any
    optimizer: Any


def create(cfg: LlamaConfig, tx: optax.GradientTransformation, key: jax.Array):
    """A model and its `nnx.Optimizer` over the model's `nnx.Param`s."""
    model = Llama(cfg, nnx.Rngs(params=key))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def split_train_state(model: Llama, optimizer: nnx.Optimizer) -> tuple[GraphDefs, dict]:
    """``(graphdefs, {"params": model state, "opt_state": optimizer state})``.

    The optimizer's state holds only its step and optax state (`nnx.Optimizer` takes the
    model as an argument of `update` and keeps no reference to it), so each array appears
    once in the pytree.
    """
    model_def, params = nnx.split(model)
    optimizer_def, opt_state = nnx.split(optimizer)
    return GraphDefs(model_def, optimizer_def), {"params": params, "opt_state": opt_state}


def merge_train_state(graphdefs: GraphDefs, state: dict) -> tuple[Llama, nnx.Optimizer]:
    """The model and optimizer objects of a state pytree (`split_train_state`'s inverse)."""
    model = nnx.merge(graphdefs.model, state["params"])
    optimizer = nnx.merge(graphdefs.optimizer, state["opt_state"])
    return model, optimizer


def init_state(cfg: LlamaConfig, tx: optax.GradientTransformation, key: jax.Array):
    """``(graphdefs, state)`` of a fresh model and optimizer; `state` is a pytree."""
    return split_train_state(*create(cfg, tx, key))


def abstract_state(cfg: LlamaConfig, tx: optax.GradientTransformation):
    """`init_state`'s state as `jax.ShapeDtypeStruct`s (and its graphdefs); allocates
    nothing."""
    # nnx.eval_shape returns the objects with `jax.ShapeDtypeStruct` values; the graphdefs
    # are not JAX types, so split after, not inside.
    model, optimizer = nnx.eval_shape(lambda: create(cfg, tx, jax.random.key(0)))
    return split_train_state(model, optimizer)


def make_train_step(graphdefs: GraphDefs):
    """``train_step(state, batch) -> (new_state, {"loss": loss})`` on the state pytree."""

    def train_step(state: dict, batch: dict):
        model, optimizer = merge_train_state(graphdefs, state)
        model_def, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of_params(params):
            return loss_fn(nnx.merge(model_def, params, rest), batch)

        loss, grads = value_and_grad(loss_of_params)(params)
        optimizer.update(model, grads)
        return split_train_state(model, optimizer)[1], {"loss": loss}

    return train_step


def main(config: str = "tiny", num_steps: int = 3, batch_size: int = 8) -> list[float]:
    """Run a few single-device steps on one fixed batch; returns the losses."""
    cfg = CONFIGS[config]
    graphdefs, state = init_state(cfg, optax.adamw(1e-2), jax.random.key(0))
    batch = make_batch(cfg, batch_size, jax.random.key(1))
    train_step = jax.jit(make_train_step(graphdefs))
    losses = []
    for step in range(num_steps):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
        print(f"step {step}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
