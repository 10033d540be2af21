"""GPT: a decoder-only transformer in plain JAX, with an optax train step.

Pre-layer-norm blocks, causal multi-head attention, a GELU (tanh approximation) MLP, learned
position embeddings and an output layer tied to the token embedding; no dropout. Layers are
a Python list, so every layer's equations appear separately in a trace, or, with
`GPTConfig.scan_layers`, one stack of parameters (a leading layer axis) run by
`jax.lax.scan`, as MaxText, levanter and flax's `nn.scan` write them. Run
``python examples/gpt.py`` for three single-device steps at the "tiny" size.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from autopar import layer_boundary, value_and_grad

# Standard deviation of the normal initialisation of every weight matrix (GPT-2/GPT-3).
INIT_STD = 0.02
# Layer-norm epsilon (GPT-2/GPT-3).
LAYER_NORM_EPS = 1e-5
# Megatron and Alpa pad GPT-2's 50,257-token vocabulary to 51,200 (a multiple of 1024).
PADDED_VOCAB = 51200


@dataclass(frozen=True)
class GPTConfig:
    """Model size. `dtype` is the parameter and activation dtype name."""

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    mlp_ratio: int = 4
    dtype: str = "float32"
    # Mixed precision as users train large models: with ``master_dtype="float32"`` and
    # ``dtype="bfloat16"`` the state keeps fp32 master weights (so AdamW's moments are fp32
    # too: 12 bytes per parameter, plus the fp32 gradient and the bf16 copy during the
    # step), and the forward and backward compute on a bf16 cast of them. None: the
    # parameters are stored in `dtype` (the default; the small tests use it).
    master_dtype: str | None = None
    layer_markers: bool = False
    # Stack the layers' parameters on a leading layer axis and run them with
    # `jax.lax.scan` (MaxText's scan_layers); `remat_layers` wraps each layer in
    # `jax.checkpoint`. Parameters are initialised as in the Python loop, then stacked.
    scan_layers: bool = False
    remat_layers: bool = False

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "choose a head count that divides the hidden size."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameter count: 12h² + 13h per layer, embeddings and the final layer norm."""
        h, f = self.hidden, self.mlp_ratio * self.hidden
        per_layer = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.num_layers * per_layer + (self.vocab_size + self.seq_len) * h + 2 * h


# Sizes from the GPT-3 paper (Brown et al. 2020, Table 2.1) as benchmarked by Alpa
# (benchmark/alpa/suite_manual_gpt.py: seq 1024, vocab 51200); 13B and 175B keep GPT-3's
# sequence length of 2048, with 13B at Megatron's h=5120 (40 heads of 128).
CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=128, seq_len=16, hidden=32, num_layers=4, num_heads=4),
    "wide-test": GPTConfig(vocab_size=256, seq_len=16, hidden=256, num_layers=4, num_heads=4),
    "small-test": GPTConfig(vocab_size=512, seq_len=64, hidden=128, num_layers=4, num_heads=4),
    "125M": GPTConfig(PADDED_VOCAB, 1024, 768, 12, 12),
    "350M": GPTConfig(PADDED_VOCAB, 1024, 1024, 24, 16),
    "760M": GPTConfig(PADDED_VOCAB, 1024, 1536, 24, 16),
    "1.3B": GPTConfig(PADDED_VOCAB, 1024, 2048, 24, 32),
    "2.6B": GPTConfig(PADDED_VOCAB, 1024, 2560, 32, 32),
    "6.7B": GPTConfig(PADDED_VOCAB, 1024, 4096, 32, 32),
    "13B": GPTConfig(PADDED_VOCAB, 2048, 5120, 40, 40),
    "39B": GPTConfig(PADDED_VOCAB, 1024, 8192, 48, 64),
    "76B": GPTConfig(PADDED_VOCAB, 1024, 10240, 60, 80),
    "175B": GPTConfig(PADDED_VOCAB, 2048, 12288, 96, 96),
}


# ---- parameters ---------------------------------------------------------------------


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return (INIT_STD * jax.random.normal(key, shape)).astype(dtype)


def _layer_norm_params(hidden: int, dtype: str) -> dict:
    return {"scale": jnp.ones((hidden,), dtype), "bias": jnp.zeros((hidden,), dtype)}


def _init_layer(cfg: GPTConfig, key: jax.Array) -> dict:
    h, f, dt = cfg.hidden, cfg.mlp_ratio * cfg.hidden, cfg.dtype
    k_qkv, k_o, k_1, k_2 = jax.random.split(key, 4)
    # GPT-2 scales the residual projections by 1/sqrt(2·layers).
    residual_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    return {
        "ln1": _layer_norm_params(h, dt),
        "attn": {
            "wqkv": _normal(k_qkv, (h, 3 * h), dt),
            "bqkv": jnp.zeros((3 * h,), dt),
            "wo": (_normal(k_o, (h, h), dt) * residual_scale).astype(dt),
            "bo": jnp.zeros((h,), dt),
        },
        "ln2": _layer_norm_params(h, dt),
        "mlp": {
            "w1": _normal(k_1, (h, f), dt),
            "b1": jnp.zeros((f,), dt),
            "w2": (_normal(k_2, (f, h), dt) * residual_scale).astype(dt),
            "b2": jnp.zeros((h,), dt),
        },
    }


def init_params(cfg: GPTConfig, key: jax.Array) -> dict:
    """Random parameters.

    **Returns:** ``{"wte": [V, h], "wpe": [S, h], "layers": [layer, ...], "ln_f": {...}}``,
    each layer ``{"ln1", "attn": {"wqkv", "bqkv", "wo", "bo"}, "ln2",
    "mlp": {"w1", "b1", "w2", "b2"}}``. The output layer reuses ``wte``. With
    `cfg.scan_layers`, ``"layers"`` is one such dict whose leaves have a leading layer axis.
    """
    k_te, k_pe, *k_layers = jax.random.split(key, 2 + cfg.num_layers)
    layers = [_init_layer(cfg, k) for k in k_layers]
    if cfg.scan_layers:  # the same values as the loop, stacked: the two models compare
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {
        "wte": _normal(k_te, (cfg.vocab_size, cfg.hidden), cfg.dtype),
        "wpe": _normal(k_pe, (cfg.seq_len, cfg.hidden), cfg.dtype),
        "layers": layers,
        "ln_f": _layer_norm_params(cfg.hidden, cfg.dtype),
    }


# ---- model --------------------------------------------------------------------------


def layer_norm(p: dict, x: jax.Array) -> jax.Array:
    """Layer norm over the last axis with a learned scale and bias."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * p["scale"] + p["bias"]


def gelu(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (as in GPT-2)."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def attention(p: dict, x: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Causal multi-head self-attention of ``x: [B, S, h]``."""
    b, s, _ = x.shape
    qkv = x @ p["wqkv"] + p["bqkv"]  # [B, S, 3h]
    qkv = qkv.reshape(b, s, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, S, heads, head_dim]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(cfg.head_dim)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    # The most negative finite value: exp() of it is 0 and it never overflows to nan.
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bnqk,bknd->bqnd", weights, v).reshape(b, s, cfg.hidden)
    return out @ p["wo"] + p["bo"]


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """The position-wise feed-forward network h → 4h → h."""
    return gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def block(layer_params: dict, h: jax.Array, cfg: GPTConfig) -> jax.Array:
    """One pre-LN transformer layer: ``h + attn(ln1(h))``, then ``h + mlp(ln2(h))``."""
    h = h + attention(layer_params["attn"], layer_norm(layer_params["ln1"], h), cfg)
    return h + mlp(layer_params["mlp"], layer_norm(layer_params["ln2"], h))


def forward(params: dict, tokens: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Logits ``[B, S, V]`` for ``tokens: int32[B, S]``."""
    s = tokens.shape[1]
    h = jnp.take(params["wte"], tokens, axis=0) + params["wpe"][:s]
    layer = functools.partial(block, cfg=cfg)
    if cfg.remat_layers:
        layer = jax.checkpoint(layer)
    if cfg.scan_layers:

        def scanned(h, layer_params):
            h = layer(layer_params, h)
            return (layer_boundary(h) if cfg.layer_markers else h), None

        h, _ = jax.lax.scan(scanned, h, params["layers"])
    else:
        for layer_params in params["layers"]:
            h = layer(layer_params, h)
            if cfg.layer_markers:
                h = layer_boundary(h)
    h = layer_norm(params["ln_f"], h)
    return h @ params["wte"].T


def loss_fn(params: dict, batch: dict, cfg: GPTConfig) -> jax.Array:
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


def init_state(cfg: GPTConfig, optimizer: optax.GradientTransformation, key) -> TrainState:
    """Random parameters and a fresh optimizer state (both in `master_dtype` if set)."""
    params = init_params(cfg, key)
    if cfg.master_dtype is not None:
        params = jax.tree.map(lambda p: p.astype(cfg.master_dtype), params)
    return TrainState(params, optimizer.init(params))


def abstract_state(cfg: GPTConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """`init_state`'s shapes and dtypes as `jax.ShapeDtypeStruct`s; allocates nothing."""
    return jax.eval_shape(lambda key: init_state(cfg, optimizer, key), jax.random.key(0))


def make_batch(cfg: GPTConfig, batch_size: int, key: jax.Array) -> dict:
    """Random tokens; the targets are the tokens shifted left by one (last one wraps)."""
    tokens = jax.random.randint(key, (batch_size, cfg.seq_len), 0, cfg.vocab_size, jnp.int32)
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1)}


def abstract_batch(cfg: GPTConfig, batch_size: int) -> dict:
    """`make_batch`'s shapes and dtypes as `jax.ShapeDtypeStruct`s."""
    spec = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    return {"tokens": spec, "targets": spec}


def make_train_step(cfg: GPTConfig, optimizer: optax.GradientTransformation):
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
    # Jitted: one compilation instead of one per random op.
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
