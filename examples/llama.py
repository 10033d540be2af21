"""Llama: a decoder-only transformer in the Llama 2/3 style, plain JAX, optax train step.

Differences from `examples/gpt.py`: RMSNorm instead of layer norm, rotary position
embeddings (rotate-half form) instead of learned ones, grouped-query attention (fewer key/
value heads than query heads, each shared by a group of query heads), a SwiGLU MLP, no
biases, and an output layer (``lm_head``) separate from the token embedding. No dropout.

These options change how the layers are written, not what they compute:

- ``scan_layers=True`` stacks the layers' parameters (a leading layer dimension) and runs
  them with `jax.lax.scan`: one traced layer instead of ``num_layers``. It goes with
  ``layer_markers=False``: the pipeline planner takes its layers from the scan's
  iterations. ``remat_layers=True`` wraps the scanned layer in `jax.checkpoint`, so its
  backward recomputes the layer from its input (MaxText's default ``remat_policy:
  full``).
- ``embedding_marker=True`` (with ``layer_markers=True``) also marks the boundary after
  the token embedding, so a pipeline chunk can hold the embedding alone, as Llama 3 405B's
  first chunk did.
- ``attention="dot_product_attention"`` uses `jax.nn.dot_product_attention` (which does
  grouped-query attention itself) instead of the einsum written out here.

Run ``python examples/llama.py`` for three single-device steps at the "tiny" size.

**Example:**

```python
cfg = CONFIGS["tiny"]
optimizer = optax.adamw(1e-3)
state = init_state(cfg, optimizer, jax.random.key(0))
batch = make_batch(cfg, batch_size=8, key=jax.random.key(1))
state, metrics = jax.jit(make_train_step(cfg, optimizer))(state, batch)
```
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from autopar import layer_boundary, value_and_grad

# Standard deviation of the normal initialisation of every weight matrix.
INIT_STD = 0.02
# Llama 3's tokenizer (128,000 tokens plus 256 special ones); Llama 2's had 32,000.
LLAMA3_VOCAB = 128256
LLAMA2_VOCAB = 32000

Attention = Literal["einsum", "dot_product_attention"]


@dataclass(frozen=True)
class LlamaConfig:
    """Model size and options. `dtype` is the parameter and activation dtype name."""

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    # Mixed precision: fp32 master weights and moments, compute in `dtype` (see
    # `examples.gpt.GPTConfig.master_dtype`). None: parameters stored in `dtype`.
    master_dtype: str | None = None
    layer_markers: bool = False
    # With `layer_markers`, a boundary after the token embedding too, so that a pipeline
    # can give the embedding a chunk of its own (Llama 3 405B: "the first model chunk on
    # the first stage has only the embedding", Dubey et al. 2024, sec. 3.3.2). Off: the
    # embedding rides with the first layer.
    embedding_marker: bool = False
    scan_layers: bool = False
    remat_layers: bool = False  # jax.checkpoint around each scanned layer
    attention: Attention = "einsum"

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "choose a head count that divides the hidden size."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}: each key/value head serves a whole group of query heads."
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.scan_layers and self.layer_markers:
            raise ValueError(
                "scan_layers=True runs every layer inside one jax.lax.scan, where no layer "
                "boundary can be marked; set layer_markers=False (or scan_layers=False)."
            )
        if self.embedding_marker and not self.layer_markers:
            raise ValueError(
                "embedding_marker=True marks the boundary after the embedding among the "
                "layer boundaries; set layer_markers=True too."
            )
        if self.remat_layers and not self.scan_layers:
            raise ValueError(
                "remat_layers=True checkpoints the scanned layer; set scan_layers=True too "
                "(a loop of layers is recomputed by the planner's remat option instead)."
            )
        if self.attention not in ("einsum", "dot_product_attention"):
            raise ValueError(
                f"attention={self.attention!r}: choose 'einsum' or 'dot_product_attention'"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count: attention, SwiGLU and two norms per layer, embedding, head."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn_hidden
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


# Shapes of Meta's Llama models (the published configs); "tiny" and "small-test" are for
# tests, "mid-test" has real widths and few layers for quick dry-run plans.
CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=128,
        seq_len=16,
        hidden=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden=64,
    ),
    "small-test": LlamaConfig(
        vocab_size=512,
        seq_len=64,
        hidden=128,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        ffn_hidden=352,
    ),
    # Context-parallel tests: a sequence long next to the widths, and query and key/value
    # head counts that split 4 ways (Ulysses on 8 devices with the batch split in two).
    "cp-test": LlamaConfig(
        vocab_size=128,
        seq_len=128,
        hidden=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden=128,
    ),
    "mid-test": LlamaConfig(
        vocab_size=LLAMA2_VOCAB,
        seq_len=1024,
        hidden=4096,
        num_layers=2,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden=14336,
        rope_theta=500000.0,
    ),
    # Llama 2 7B: multi-head attention (as many key/value heads as query heads).
    "7B": LlamaConfig(LLAMA2_VOCAB, 4096, 4096, 32, 32, 32, 11008),
    # Llama 3.2 1B (untied here), Llama 3 / 3.1 8B and 70B.
    "1B": LlamaConfig(LLAMA3_VOCAB, 8192, 2048, 16, 32, 8, 8192, rope_theta=500000.0),
    "8B": LlamaConfig(LLAMA3_VOCAB, 8192, 4096, 32, 32, 8, 14336, rope_theta=500000.0),
    "70B": LlamaConfig(LLAMA3_VOCAB, 8192, 8192, 80, 64, 8, 28672, rope_theta=500000.0),
}


# ---- parameters ---------------------------------------------------------------------


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return (INIT_STD * jax.random.normal(key, shape)).astype(dtype)


def _init_layer(cfg: LlamaConfig, key: jax.Array) -> dict:
    h, kv, f, dt = cfg.hidden, cfg.kv_dim, cfg.ffn_hidden, cfg.dtype
    k_q, k_k, k_v, k_o, k_gate, k_up, k_down = jax.random.split(key, 7)
    return {
        "attn_norm": jnp.ones((h,), dt),
        "attn": {
            "wq": _normal(k_q, (h, h), dt),
            "wk": _normal(k_k, (h, kv), dt),
            "wv": _normal(k_v, (h, kv), dt),
            "wo": _normal(k_o, (h, h), dt),
        },
        "mlp_norm": jnp.ones((h,), dt),
        "mlp": {
            "w_gate": _normal(k_gate, (h, f), dt),
            "w_up": _normal(k_up, (h, f), dt),
            "w_down": _normal(k_down, (f, h), dt),
        },
    }


def init_params(cfg: LlamaConfig, key: jax.Array) -> dict:
    """Random parameters.

    **Returns:** ``{"embed": [V, h], "layers": ..., "final_norm": [h], "lm_head": [h, V]}``;
    each layer ``{"attn_norm", "attn": {"wq", "wk", "wv", "wo"}, "mlp_norm",
    "mlp": {"w_gate", "w_up", "w_down"}}``. ``layers`` is a list of layers, or with
    ``scan_layers`` one such dict whose leaves have a leading ``num_layers`` dimension.
    """
    k_embed, k_head, *k_layers = jax.random.split(key, 2 + cfg.num_layers)
    layers = [_init_layer(cfg, k) for k in k_layers]
    if cfg.scan_layers:
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {
        "embed": _normal(k_embed, (cfg.vocab_size, cfg.hidden), cfg.dtype),
        "layers": layers,
        "final_norm": jnp.ones((cfg.hidden,), cfg.dtype),
        "lm_head": _normal(k_head, (cfg.hidden, cfg.vocab_size), cfg.dtype),
    }


# ---- model --------------------------------------------------------------------------


def rms_norm(scale: jax.Array, x: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last axis, computed in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * scale


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[S, head_dim]`` of rotary embeddings: frequency ``theta^(-2i/d)``
    for the pair (i, i + d/2), the rotate-half layout of Llama's Hugging Face port."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x: [B, S, heads, head_dim]`` by position: ``x·cos + rotate_half(x)·sin``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x * cos + rotated * sin).astype(x.dtype)


def attention(p: dict, x: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Causal grouped-query self-attention of ``x: [B, S, h]``."""
    b, s, _ = x.shape
    n, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rotary_tables(s, d, cfg.rope_theta)
    q = apply_rotary((x @ p["wq"]).reshape(b, s, n, d), cos, sin)
    k = apply_rotary((x @ p["wk"]).reshape(b, s, nkv, d), cos, sin)
    v = (x @ p["wv"]).reshape(b, s, nkv, d)
    if cfg.attention == "dot_product_attention":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
        # Query heads in groups: head j uses key/value head j // (n // nkv).
        q = q.reshape(b, s, nkv, n // nkv, d)
        scores = jnp.einsum("bqngd,bknd->bngqk", q, k) / math.sqrt(d)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        # The most negative finite value: exp() of it is 0 and it never overflows to nan.
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("bngqk,bknd->bqngd", weights, v)
    return out.reshape(b, s, cfg.hidden) @ p["wo"]


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: ``(silu(x W_gate) * x W_up) W_down``."""
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def block(layer_params: dict, h: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """One pre-norm layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""
    h = h + attention(
        layer_params["attn"], rms_norm(layer_params["attn_norm"], h, cfg.norm_eps), cfg
    )
    return h + mlp(layer_params["mlp"], rms_norm(layer_params["mlp_norm"], h, cfg.norm_eps))


def forward(params: dict, tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Logits ``[B, S, V]`` for ``tokens: int32[B, S]``."""
    h = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embedding_marker:
        h = layer_boundary(h)
    if cfg.scan_layers:
        def layer(h, p):
            return block(p, h, cfg), None

        h, _ = jax.lax.scan(jax.checkpoint(layer) if cfg.remat_layers else layer, h,
                            params["layers"])
    else:
        for layer_params in params["layers"]:
            h = block(layer_params, h, cfg)
            if cfg.layer_markers:
                h = layer_boundary(h)
    h = rms_norm(params["final_norm"], h, cfg.norm_eps)
    return h @ params["lm_head"]


def loss_fn(params: dict, batch: dict, cfg: LlamaConfig) -> jax.Array:
    """Mean next-token cross-entropy; ``batch = {"tokens", "targets"}``, int32[B, S]."""
    if cfg.master_dtype is not None:  # compute on a `dtype` copy of the master weights
        params = jax.tree.map(lambda p: p.astype(cfg.dtype), params)
    logits = forward(params, batch["tokens"], cfg).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)
    return -jnp.mean(target_log_probs)


# ---- training -----------------------------------------------------------------------


class TrainState(NamedTuple):
    """Parameters and optimizer state; a pytree with paths ``params/...``, ``opt_state/...``."""

    params: Any
    opt_state: Any


def init_state(cfg: LlamaConfig, optimizer: optax.GradientTransformation, key) -> TrainState:
    """Random parameters and a fresh optimizer state (both in `master_dtype` if set)."""
    params = init_params(cfg, key)
    if cfg.master_dtype is not None:
        params = jax.tree.map(lambda p: p.astype(cfg.master_dtype), params)
    return TrainState(params, optimizer.init(params))


def abstract_state(cfg: LlamaConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """`init_state`'s shapes and dtypes as `jax.ShapeDtypeStruct`s; allocates nothing."""
    return jax.eval_shape(lambda key: init_state(cfg, optimizer, key), jax.random.key(0))


def make_batch(cfg: LlamaConfig, batch_size: int, key: jax.Array) -> dict:
    """Random tokens; the targets are the tokens shifted left by one (last one wraps)."""
    tokens = jax.random.randint(key, (batch_size, cfg.seq_len), 0, cfg.vocab_size, jnp.int32)
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1)}


def abstract_batch(cfg: LlamaConfig, batch_size: int) -> dict:
    """`make_batch`'s shapes and dtypes as `jax.ShapeDtypeStruct`s."""
    spec = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    return {"tokens": spec, "targets": spec}


def make_train_step(cfg: LlamaConfig, optimizer: optax.GradientTransformation):
    """``train_step(state, batch) -> (new_state, {"loss": loss})``: one optimizer step."""
    loss = functools.partial(loss_fn, cfg=cfg)

    def train_step(state: TrainState, batch: dict):
        value, grads = value_and_grad(loss)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state), {"loss": value}

    return train_step


def main(config: str = "tiny", num_steps: int = 3, batch_size: int = 8) -> list[float]:
    """Run a few single-device steps on one fixed batch; returns the losses."""
    cfg = CONFIGS[config]
    optimizer = optax.adamw(1e-2)
    state = jax.jit(lambda key: init_state(cfg, optimizer, key))(jax.random.key(0))
    batch = jax.jit(lambda key: make_batch(cfg, batch_size, key))(jax.random.key(1))
    train_step = jax.jit(make_train_step(cfg, optimizer))
    losses = []
    for step in range(num_steps):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
        print(f"step {step}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
