"""Dropless mixture-of-experts language model (DeepSeek-V3 / Mixtral style), plain JAX + optax.

The MoE as it is trained now, unlike `examples/moe.py`'s GShard form (fixed capacity,
one-hot dispatch einsums): every layer's MLP is a mixture of many fine-grained routed
experts plus shared experts that see every token, each token goes to its top-k experts,
and no token is dropped. Tokens are sorted by expert and run through grouped GEMMs
(`jax.lax.ragged_dot`, MaxText's "megablox" path):

```
scores        = softmax(x @ router)  (or sigmoid, DeepSeek-V3)      # [T, E]
gates, ids    = top_k(scores, k)                                      # [T, k]
order         = argsort(ids.ravel())        # routed tokens grouped by expert
xs            = x[order // k]                                         # [T·k, h]
group_sizes   = bincount(ids.ravel(), E)                              # [E]
ys            = swiglu_ragged(xs, w_gate, w_up, w_down, group_sizes)  # [T·k, h]
y             = zeros[T, h].at[order // k].add(ys * gates.ravel()[order, None])
y            += swiglu(x, shared)                                     # the shared expert
```

The loss is the next-token cross-entropy plus `aux_loss_weight` times the Switch/GShard
load-balancing loss ``E · Σ_e f_e · P_e`` (f_e the fraction of routed tokens sent to
expert e, P_e its mean router probability), averaged over the layers. Attention is plain
causal multi-head attention with rotary embeddings (DeepSeek-V3's MLA is not modelled;
its attention parameter count differs). The layers are scanned (`jax.lax.scan` over
stacked parameters, as `examples/llama.py` with ``scan_layers``); DeepSeek-V3's first three
dense layers are MoE layers here.

Run ``python examples/moe_dropless.py`` for three single-device steps at the "tiny" size.

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

from autopar import value_and_grad

# Standard deviation of the normal initialisation of every weight matrix.
INIT_STD = 0.02

Gate = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class DroplessMoEConfig:
    """Sizes of a dropless MoE language model.

    **Arguments:**
    - `vocab_size`, `seq_len`, `hidden`, `num_layers`, `num_heads`: transformer sizes.
    - `num_experts`: routed experts per layer; `top_k`: experts per token.
    - `expert_hidden`: each routed expert's SwiGLU width (fine-grained: small).
    - `num_shared_experts`: shared SwiGLU experts of width `expert_hidden` each, applied
      to every token (one fused SwiGLU of width ``num_shared_experts * expert_hidden``).
    - `gate`: "softmax" (Mixtral: top-k of the softmax, renormalised) or "sigmoid"
      (DeepSeek-V3: top-k of per-expert sigmoids, normalised over the chosen k).
    - `aux_loss_weight`: weight of the load-balancing loss.
    """

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    num_experts: int
    top_k: int
    expert_hidden: int
    num_shared_experts: int = 1
    gate: Gate = "softmax"
    aux_loss_weight: float = 1e-2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "choose a head count that divides the hidden size."
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}"
            )
        if self.gate not in ("softmax", "sigmoid"):
            raise ValueError(f"gate={self.gate!r}: choose 'softmax' or 'sigmoid'")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameter count: attention, router, routed and shared experts, norms, embeddings."""
        h, f, e = self.hidden, self.expert_hidden, self.num_experts
        per_layer = 4 * h * h + h * e + 3 * e * h * f + 3 * h * f * self.num_shared_experts
        return self.num_layers * (per_layer + 2 * h) + 2 * self.vocab_size * h + h


# Published shapes. Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088, Table 1: dim 4096,
# 32 layers, 32 heads, hidden_dim 14336, 8 experts, top-2, vocab 32000) has no shared
# expert and grouped-query attention (8 kv heads; here full MHA). DeepSeek-V3 (DeepSeek-AI
# 2024, arXiv 2412.19437, sec. 4.2: 61 layers, hidden 7168, 1 shared + 256 routed experts
# of width 2048, 8 activated, sigmoid gating, vocab 129280; MLA with 128 heads here plain
# MHA). "tiny" is for tests: 16 experts, top-4, one shared expert.
CONFIGS: dict[str, DroplessMoEConfig] = {
    "tiny": DroplessMoEConfig(
        vocab_size=128, seq_len=16, hidden=32, num_layers=2, num_heads=4,
        num_experts=16, top_k=4, expert_hidden=16, num_shared_experts=1,
    ),
    "tiny-sigmoid": DroplessMoEConfig(
        vocab_size=128, seq_len=16, hidden=32, num_layers=2, num_heads=4,
        num_experts=16, top_k=4, expert_hidden=16, num_shared_experts=1, gate="sigmoid",
    ),
    # Wide experts and few routed tokens: the expert weights outweigh the tokens, so
    # splitting the experts (expert parallelism) beats replicating them (tests).
    "ep-test": DroplessMoEConfig(
        vocab_size=128, seq_len=16, hidden=64, num_layers=2, num_heads=4,
        num_experts=16, top_k=2, expert_hidden=256, num_shared_experts=1,
    ),
    "mixtral-8x7B": DroplessMoEConfig(
        vocab_size=32000, seq_len=4096, hidden=4096, num_layers=32, num_heads=32,
        num_experts=8, top_k=2, expert_hidden=14336, num_shared_experts=0,
        rope_theta=1e6, norm_eps=1e-5,
    ),
    "deepseek-v3": DroplessMoEConfig(
        vocab_size=129280, seq_len=4096, hidden=7168, num_layers=61, num_heads=128,
        num_experts=256, top_k=8, expert_hidden=2048, num_shared_experts=1,
        gate="sigmoid", aux_loss_weight=1e-4,
    ),
}


# ---- parameters ---------------------------------------------------------------------


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return (INIT_STD * jax.random.normal(key, shape)).astype(dtype)


def _init_layer(cfg: DroplessMoEConfig, key: jax.Array) -> dict:
    h, f, e, dt = cfg.hidden, cfg.expert_hidden, cfg.num_experts, cfg.dtype
    keys = jax.random.split(key, 8)
    layer = {
        "attn_norm": jnp.ones((h,), dt),
        "attn": {name: _normal(k, (h, h), dt) for name, k in zip(("wq", "wk", "wv", "wo"), keys)},
        "mlp_norm": jnp.ones((h,), dt),
        "router": _normal(keys[4], (h, e), dt),
        "experts": {
            "w_gate": _normal(keys[5], (e, h, f), dt),
            "w_up": _normal(keys[6], (e, h, f), dt),
            "w_down": _normal(keys[7], (e, f, h), dt),
        },
    }
    if cfg.num_shared_experts:
        fs = f * cfg.num_shared_experts
        k_gate, k_up, k_down = jax.random.split(keys[7], 3)
        layer["shared"] = {
            "w_gate": _normal(k_gate, (h, fs), dt),
            "w_up": _normal(k_up, (h, fs), dt),
            "w_down": _normal(k_down, (fs, h), dt),
        }
    return layer


def init_params(cfg: DroplessMoEConfig, key: jax.Array) -> dict:
    """Random parameters: ``{"embed": [V, h], "layers": ..., "final_norm", "lm_head"}``;
    ``layers`` is one layer dict whose leaves have a leading ``num_layers`` dimension;
    ``layers["experts"]["w_gate"]`` is ``[L, E, h, f]``."""
    k_embed, k_head, *k_layers = jax.random.split(key, 2 + cfg.num_layers)
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *[_init_layer(cfg, k) for k in k_layers])
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


def _rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of ``x: [B, S, heads, d]`` (rotate-half form)."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    half = d // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def attention(p: dict, x: jax.Array, cfg: DroplessMoEConfig) -> jax.Array:
    """Causal multi-head self-attention of ``x: [B, S, h]``."""
    b, s, _ = x.shape
    n, d = cfg.num_heads, cfg.head_dim
    q = _rotary((x @ p["wq"]).reshape(b, s, n, d), cfg.rope_theta)
    k = _rotary((x @ p["wk"]).reshape(b, s, n, d), cfg.rope_theta)
    v = (x @ p["wv"]).reshape(b, s, n, d)
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bnqk,bknd->bqnd", weights, v).reshape(b, s, cfg.hidden) @ p["wo"]


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """``(silu(x W_gate) * x W_up) W_down``."""
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def route(router: jax.Array, x: jax.Array, cfg: DroplessMoEConfig):
    """Router scores ``[T, E]`` (probabilities for the aux loss), top-k gates and ids ``[T, k]``."""
    logits = (x @ router).astype(jnp.float32)
    if cfg.gate == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        gates, ids = jax.lax.top_k(probs, cfg.top_k)
    else:
        scores = jax.nn.sigmoid(logits)
        gates, ids = jax.lax.top_k(scores, cfg.top_k)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return probs, gates, ids


def moe(p: dict, x: jax.Array, cfg: DroplessMoEConfig) -> tuple[jax.Array, jax.Array]:
    """Dropless MoE of ``x: [B, S, h]``: routed experts (sorted, grouped GEMMs) plus the
    shared experts. Returns the output and the layer's load-balancing loss."""
    b, s, h = x.shape
    e, k = cfg.num_experts, cfg.top_k
    tokens = x.reshape(b * s, h)
    probs, gates, ids = route(p["router"], tokens, cfg)
    flat_ids = ids.reshape(-1)                          # [T·k] expert of each routed copy
    order = jnp.argsort(flat_ids, stable=True)          # routed copies grouped by expert
    token_of = order // k                               # the token each sorted copy is of
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)  # [E]
    xs = tokens[token_of]                               # dispatch: [T·k, h]
    w = p["experts"]
    hidden = jax.nn.silu(jax.lax.ragged_dot(xs, w["w_gate"], group_sizes)) * (
        jax.lax.ragged_dot(xs, w["w_up"], group_sizes)
    )
    ys = jax.lax.ragged_dot(hidden, w["w_down"], group_sizes)  # [T·k, h]
    ys = ys * gates.reshape(-1)[order][:, None].astype(ys.dtype)
    routed = jnp.zeros_like(tokens).at[token_of].add(ys)       # combine
    out = routed + swiglu(p["shared"], tokens) if "shared" in p else routed
    # Switch / GShard load balancing: E · Σ_e (fraction routed to e) · (mean prob of e).
    fraction = group_sizes.astype(jnp.float32) / (b * s * k)
    aux = e * jnp.sum(fraction * jnp.mean(probs, axis=0))
    return out.reshape(b, s, h), aux


def block(p: dict, h: jax.Array, cfg: DroplessMoEConfig) -> tuple[jax.Array, jax.Array]:
    """One pre-norm layer: attention, then the MoE; returns the output and the aux loss."""
    h = h + attention(p["attn"], rms_norm(p["attn_norm"], h, cfg.norm_eps), cfg)
    out, aux = moe(p, rms_norm(p["mlp_norm"], h, cfg.norm_eps), cfg)
    return h + out, aux


def forward(params: dict, tokens: jax.Array, cfg: DroplessMoEConfig):
    """Logits ``[B, S, V]`` for ``tokens: int32[B, S]`` and the mean aux loss of the layers."""
    h = jnp.take(params["embed"], tokens, axis=0)

    def layer(h, p):
        h, aux = block(p, h, cfg)
        return h, aux

    h, aux = jax.lax.scan(layer, h, params["layers"])
    h = rms_norm(params["final_norm"], h, cfg.norm_eps)
    return h @ params["lm_head"], jnp.mean(aux)


def loss_fn(params: dict, batch: dict, cfg: DroplessMoEConfig) -> jax.Array:
    """Mean next-token cross-entropy plus ``aux_loss_weight`` × the load-balancing loss."""
    logits, aux = forward(params, batch["tokens"], cfg)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)
    return -jnp.mean(target_log_probs) + cfg.aux_loss_weight * aux


# ---- training -----------------------------------------------------------------------


class TrainState(NamedTuple):
    """Parameters and optimizer state; a pytree with paths ``params/...``, ``opt_state/...``."""

    params: Any
    opt_state: Any


def init_state(cfg: DroplessMoEConfig, optimizer: optax.GradientTransformation, key) -> TrainState:
    """Random parameters and a fresh optimizer state."""
    params = init_params(cfg, key)
    return TrainState(params, optimizer.init(params))


def abstract_state(cfg: DroplessMoEConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """`init_state`'s shapes and dtypes as `jax.ShapeDtypeStruct`s; allocates nothing."""
    return jax.eval_shape(lambda key: init_state(cfg, optimizer, key), jax.random.key(0))


def make_batch(cfg: DroplessMoEConfig, batch_size: int, key: jax.Array) -> dict:
    """Random tokens; the targets are the tokens shifted left by one (last one wraps)."""
    tokens = jax.random.randint(key, (batch_size, cfg.seq_len), 0, cfg.vocab_size, jnp.int32)
    return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1)}


def abstract_batch(cfg: DroplessMoEConfig, batch_size: int) -> dict:
    """`make_batch`'s shapes and dtypes as `jax.ShapeDtypeStruct`s."""
    spec = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    return {"tokens": spec, "targets": spec}


def make_train_step(cfg: DroplessMoEConfig, optimizer: optax.GradientTransformation):
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
