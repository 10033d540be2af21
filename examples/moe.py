"""GShard-style mixture-of-experts transformer language model, in plain JAX + optax.

Decoder layers alternate a dense MLP and a mixture-of-experts MLP (every other layer is MoE,
as in GShard, Lepikhin et al. 2020, arXiv 2006.16668). Attention is pre-LN and causal. The
MoE layer uses top-2 gating with a fixed expert capacity; tokens are split into groups of
`expert_group_size` and routed with one-hot dispatch / combine tensors and einsums, the
Mesh-TensorFlow / GShard formulation that auto-sharding sees as plain dot products:

```
gates    = softmax(x @ router)                    # [G, S, E]
dispatch = top2_gating(gates, capacity).dispatch  # [G, S, E, C] one-hot slots
expert_x = einsum("gsec,gsm->egcm", dispatch, x)
expert_y = relu(expert_x @ w1[e]) @ w2[e]         # einsums over the expert dim
y        = einsum("gsec,egcm->gsm", combine, expert_y)
```

The loss is the next-token cross-entropy plus `AUX_LOSS_WEIGHT` times the load-balancing
loss summed over the MoE layers. Layers are a Python list (not scanned) so each layer's
equations stay separate in the jaxpr; with `cfg.layer_markers` every layer output is wrapped
in `autopar.layer_boundary`.

Run `python examples/moe.py` for three single-device steps at the "tiny" size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from autopar import layer_boundary, value_and_grad

# Weights are drawn from N(0, INIT_STD²), the GPT-2 / BERT initialisation Alpa's Flax models
# use (initializer_range=0.02).
INIT_STD = 0.02
# Epsilon of every layer norm (a common transformer value).
LAYER_NORM_EPS = 1e-5
# Additive mask value for future positions in causal attention; finite so that fully masked
# rows cannot produce NaNs.
MASK_VALUE = -1e9
# Weight of the load-balancing loss; Switch Transformer (Fedus et al. 2021) uses 1e-2, as
# does GShard's reference implementation.
AUX_LOSS_WEIGHT = 1e-2
# Each token goes to its two highest-scoring experts (GShard's top-2 gating).
TOP_K = 2


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of a GShard-style MoE language model.

    **Arguments:**
    - `vocab_size`, `seq_len`, `hidden`, `num_layers`, `num_heads`: transformer sizes.
    - `num_experts`: experts per MoE layer (every other layer is MoE).
    - `mlp_ratio`: FFN width / hidden, for the dense MLPs and each expert. Alpa's MoE
      benchmark uses 8 ("intermediate_size=hidden_size * 8").
    - `expert_group_size`: tokens per routing group (GShard's S); capped at the number of
      tokens in the batch.
    - `capacity_factor`: expert capacity is ceil(capacity_factor · 2 · S / E) slots per group;
      1.0 gives GShard's 2S/E, which Alpa's `top2_gating` also uses.
    - `dtype`: parameter and activation dtype name.
    - `layer_markers`: wrap each layer output in `autopar.layer_boundary`.
    """

    vocab_size: int
    seq_len: int
    hidden: int
    num_layers: int
    num_heads: int
    num_experts: int
    mlp_ratio: int = 8
    expert_group_size: int = 2048
    capacity_factor: float = 1.0
    dtype: str = "float32"
    layer_markers: bool = False

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "attention splits the hidden size evenly across heads, so pick a num_heads "
                "that divides it."
            )
        if self.num_experts < TOP_K:
            raise ValueError(
                f"num_experts={self.num_experts} is less than {TOP_K}: top-2 gating needs at "
                "least two experts per MoE layer."
            )

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_ratio * self.hidden


def _alpa(hidden: int, num_layers: int, num_experts: int) -> MoEConfig:
    """A config of Alpa's MoE benchmark suite (`benchmark/alpa/suite_*moe*.py`): seq 1024,
    vocab 32000, 16 heads, expert group size 2048, FFN 8·hidden, tied output embedding."""
    return MoEConfig(
        vocab_size=32000,
        seq_len=1024,
        hidden=hidden,
        num_layers=num_layers,
        num_heads=16,
        num_experts=num_experts,
    )


# Full sizes: the `moe_specs` of Alpa's MoE benchmark suite (Zheng et al. 2022, Table 4 lists
# the subset 380M, 1.3B, 2.4B, 10B, 27B, 70B), with (hidden, layers, experts, heads, seq,
# vocab, group size) exactly as there. Parameter counts of this implementation (computed from
# `abstract_state`) agree with the names within 3%: 380M → 384M, 70B → 70.4B. Differences
# from Alpa's Flax model, none changing a count by more than a few parameters per layer:
# a causal pre-LN decoder instead of a post-LN BERT encoder, learned positions without
# token-type embeddings, no output bias.
CONFIGS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(
        vocab_size=128,
        seq_len=16,
        hidden=32,
        num_layers=4,
        num_heads=4,
        num_experts=4,
        mlp_ratio=4,
        expert_group_size=32,
        capacity_factor=2.0,
    ),
    "380M": _alpa(hidden=768, num_layers=8, num_experts=8),
    "690M": _alpa(hidden=768, num_layers=8, num_experts=16),
    "1.3B": _alpa(hidden=768, num_layers=16, num_experts=16),
    "2.4B": _alpa(hidden=1024, num_layers=16, num_experts=16),
    "7.1B": _alpa(hidden=1280, num_layers=16, num_experts=32),
    "10B": _alpa(hidden=1536, num_layers=16, num_experts=32),
    "27B": _alpa(hidden=2048, num_layers=16, num_experts=48),
    "70B": _alpa(hidden=2048, num_layers=32, num_experts=64),
    "140B": _alpa(hidden=2048, num_layers=32, num_experts=128),
}


def is_moe_layer(index: int) -> bool:
    """Whether layer `index` has an MoE MLP: every other layer, starting with the second."""
    return index % 2 == 1


# ----------------------------------------------------------------------------- parameters


class Normal(NamedTuple):
    """A weight to draw from N(0, std²): a leaf of the parameter spec tree."""

    shape: tuple[int, ...]
    std: float = INIT_STD


def draw_normals(spec: Any, key: jax.Array, dtype: str) -> Any:
    """Replace every `Normal` leaf of `spec` by a random array; other leaves stay.

    All weights come from a single `jax.random.normal` call, sliced and reshaped: XLA
    compiles one RNG kernel per call, and on CPU a few dozen separate calls cost seconds of
    compile time. The flat draw holds every weight once more, transiently.
    """
    leaves, tree = jax.tree.flatten(spec, is_leaf=lambda leaf: isinstance(leaf, Normal))
    sizes = [math.prod(leaf.shape) for leaf in leaves if isinstance(leaf, Normal)]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, offset = [], 0
    for leaf in leaves:
        if isinstance(leaf, Normal):
            size = math.prod(leaf.shape)
            values = leaf.std * flat[offset : offset + size].reshape(leaf.shape)
            out.append(values.astype(dtype))
            offset += size
        else:
            out.append(leaf)
    return jax.tree.unflatten(tree, out)


def _layer_norm_params(hidden: int, dtype: str) -> dict:
    return {"scale": jnp.ones((hidden,), dtype), "bias": jnp.zeros((hidden,), dtype)}


def _attention_spec(cfg: MoEConfig) -> dict:
    h, dt = cfg.hidden, cfg.dtype
    spec = {}
    for name in ("q", "k", "v", "o"):
        spec[f"w{name}"] = Normal((h, h))
        spec[f"b{name}"] = jnp.zeros((h,), dt)
    return spec


def _dense_mlp_spec(cfg: MoEConfig) -> dict:
    h, f, dt = cfg.hidden, cfg.ffn_hidden, cfg.dtype
    return {
        "w1": Normal((h, f)),
        "b1": jnp.zeros((f,), dt),
        "w2": Normal((f, h)),
        "b2": jnp.zeros((h,), dt),
    }


def _moe_spec(cfg: MoEConfig) -> dict:
    h, f, e = cfg.hidden, cfg.ffn_hidden, cfg.num_experts
    return {"router": Normal((h, e)), "w1": Normal((e, h, f)), "w2": Normal((e, f, h))}


def init_params(cfg: MoEConfig, key: jax.Array) -> dict:
    """Random parameters.

    **Arguments:**
    - `cfg`: the model sizes.
    - `key`: a PRNG key.

    **Returns:** ``{"wte", "wpe", "layers": [{"ln1", "attn", "ln2", "mlp" | "moe"}, ...],
    "ln_f"}``; dense layers hold ``mlp/{w1,b1,w2,b2}``, MoE layers ``moe/{router,w1,w2}``
    with expert weights w1 [E, h, f] and w2 [E, f, h]. The output layer reuses `wte`.
    """
    layers = []
    for index in range(cfg.num_layers):
        layer = {
            "ln1": _layer_norm_params(cfg.hidden, cfg.dtype),
            "attn": _attention_spec(cfg),
            "ln2": _layer_norm_params(cfg.hidden, cfg.dtype),
        }
        if is_moe_layer(index):
            layer["moe"] = _moe_spec(cfg)
        else:
            layer["mlp"] = _dense_mlp_spec(cfg)
        layers.append(layer)
    spec = {
        "wte": Normal((cfg.vocab_size, cfg.hidden)),
        "wpe": Normal((cfg.seq_len, cfg.hidden)),
        "layers": layers,
        "ln_f": _layer_norm_params(cfg.hidden, cfg.dtype),
    }
    return draw_normals(spec, key, cfg.dtype)


# ----------------------------------------------------------------------------- layers


def _layer_norm(params: dict, x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * params["scale"] + params["bias"]


def causal_attention(params: dict, x: jax.Array, num_heads: int) -> jax.Array:
    """Multi-head causal self-attention of `x` [batch, seq, hidden] (no layer norm)."""
    batch, seq, hidden = x.shape
    head_dim = hidden // num_heads

    def heads(w, b):  # [batch, seq, hidden] -> [batch, heads, seq, head_dim]
        y = x @ w + b
        return y.reshape(batch, seq, num_heads, head_dim).transpose(0, 2, 1, 3)

    q = heads(params["wq"], params["bq"])
    k = heads(params["wk"], params["bk"])
    v = heads(params["wv"], params["bv"])
    scores = jnp.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    context = jnp.einsum("bnqk,bnkd->bnqd", probs, v)
    context = context.transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
    return context @ params["wo"] + params["bo"]


def dense_mlp(params: dict, x: jax.Array) -> jax.Array:
    """The dense feed-forward block: gelu(x @ w1 + b1) @ w2 + b2."""
    return jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


class Gating(NamedTuple):
    """What top-2 gating decides for one batch of token groups.

    - `combine`: [G, S, E, C] weight of expert e's capacity slot c in token s's output.
    - `dispatch`: [G, S, E, C] bool, token s occupies slot c of expert e.
    - `aux_loss`: scalar load-balancing loss (1.0 when routing is uniform).
    """

    combine: jax.Array
    dispatch: jax.Array
    aux_loss: jax.Array


def expert_capacity(group_size: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert per group: ceil(capacity_factor · 2 · group_size / num_experts)."""
    return max(1, math.ceil(capacity_factor * TOP_K * group_size / num_experts))


def top2_gating(gates: jax.Array, capacity: int) -> Gating:
    """GShard top-2 gating (Lepikhin et al. 2020, Algorithm 2, without random routing).

    Every token picks its two highest-gated experts. Slots are filled in token order:
    first choices of the whole group, then second choices behind them; a choice that finds
    its expert full is dropped. The two gate values are normalised to sum to one before
    dropping, so a dropped choice just loses its share.

    **Arguments:**
    - `gates`: [G, S, E] softmax router probabilities.
    - `capacity`: slots per expert per group (C).

    **Returns:** a `Gating` with [G, S, E, C] combine / dispatch tensors and the
    load-balancing loss E² · mean_(g,e)(fraction of tokens whose first choice is e ·
    mean gate of e).
    """
    num_experts = gates.shape[-1]
    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, num_experts, dtype=jnp.int32)  # [G, S, E]
    index_2 = jnp.argmax(jnp.where(mask_1 > 0, -jnp.inf, gates), axis=-1)
    mask_2 = jax.nn.one_hot(index_2, num_experts, dtype=jnp.int32)

    density = jnp.mean(mask_1.astype(gates.dtype), axis=1)  # [G, E]
    density_proxy = jnp.mean(gates, axis=1)
    aux_loss = jnp.mean(density * density_proxy) * num_experts**2

    gate_1 = jnp.sum(gates * mask_1.astype(gates.dtype), axis=-1)  # [G, S]
    gate_2 = jnp.sum(gates * mask_2.astype(gates.dtype), axis=-1)
    denom = gate_1 + gate_2
    gate_1, gate_2 = gate_1 / denom, gate_2 / denom

    # Position of each token in its expert's buffer: tokens before it that chose the expert;
    # second choices queue behind all first choices.
    position_1 = jnp.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (position_1 < capacity).astype(jnp.int32)
    first_count = jnp.sum(mask_1, axis=1, keepdims=True)  # [G, 1, E]
    position_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + first_count
    mask_2 = mask_2 * (position_2 < capacity).astype(jnp.int32)

    def slots(mask, position):  # [G, S, E, C] one-hot of the kept choice's slot
        slot = jax.nn.one_hot(jnp.sum(position * mask, axis=-1), capacity, dtype=gates.dtype)
        return mask.astype(gates.dtype)[..., None] * slot[:, :, None, :]

    slots_1, slots_2 = slots(mask_1, position_1), slots(mask_2, position_2)
    combine = gate_1[..., None, None] * slots_1 + gate_2[..., None, None] * slots_2
    dispatch = (slots_1 + slots_2) > 0
    return Gating(combine=combine, dispatch=dispatch, aux_loss=aux_loss)


def moe_layer(params: dict, x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Mixture-of-experts feed-forward block (no layer norm, no residual).

    **Arguments:**
    - `params`: ``{"router": [h, E], "w1": [E, h, f], "w2": [E, f, h]}``.
    - `x`: [..., h] activations; all leading dims are tokens.
    - `cfg`: supplies `expert_group_size` and `capacity_factor`.

    **Returns:** `(y, aux_loss)`, `y` shaped like `x`.
    """
    hidden = x.shape[-1]
    num_tokens = math.prod(x.shape[:-1])
    group_size = min(cfg.expert_group_size, num_tokens)
    if num_tokens % group_size:
        raise ValueError(
            f"{num_tokens} tokens cannot be split into routing groups of "
            f"expert_group_size={cfg.expert_group_size}; use a batch whose token count "
            "(batch × seq_len) is a multiple of it, or change expert_group_size."
        )
    num_experts = params["router"].shape[-1]
    capacity = expert_capacity(group_size, num_experts, cfg.capacity_factor)

    tokens = x.reshape(num_tokens // group_size, group_size, hidden)
    logits = jnp.einsum("gsm,me->gse", tokens, params["router"]).astype(jnp.float32)
    gating = top2_gating(jax.nn.softmax(logits, axis=-1), capacity)

    expert_in = jnp.einsum("gsec,gsm->egcm", gating.dispatch.astype(x.dtype), tokens)
    expert_hidden = jax.nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, params["w1"]))
    expert_out = jnp.einsum("egcf,efm->egcm", expert_hidden, params["w2"])
    y = jnp.einsum("gsec,egcm->gsm", gating.combine.astype(x.dtype), expert_out)
    return y.reshape(x.shape), gating.aux_loss


def block(layer: dict, x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """One pre-LN decoder layer; returns `(x, aux_loss)` (aux_loss is 0 for dense layers)."""
    x = x + causal_attention(layer["attn"], _layer_norm(layer["ln1"], x), cfg.num_heads)
    normed = _layer_norm(layer["ln2"], x)
    if "moe" in layer:
        y, aux_loss = moe_layer(layer["moe"], normed, cfg)
    else:
        y, aux_loss = dense_mlp(layer["mlp"], normed), jnp.zeros((), jnp.float32)
    return x + y, aux_loss


def forward(params: dict, tokens: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Logits [batch, seq, vocab] (float32) and the summed load-balancing loss."""
    seq = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:seq]
    aux_total = jnp.zeros((), jnp.float32)
    for layer in params["layers"]:
        x, aux_loss = block(layer, x, cfg)
        if cfg.layer_markers:
            x = layer_boundary(x)
        aux_total = aux_total + aux_loss
    x = _layer_norm(params["ln_f"], x)
    logits = jnp.einsum("bsh,vh->bsv", x, params["wte"]).astype(jnp.float32)
    return logits, aux_total


def loss_fn(params: dict, batch: dict, cfg: MoEConfig) -> jax.Array:
    """Mean next-token cross-entropy + AUX_LOSS_WEIGHT · load-balancing loss."""
    logits, aux_loss = forward(params, batch["tokens"], cfg)
    lm_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.mean(lm_loss) + AUX_LOSS_WEIGHT * aux_loss


# ----------------------------------------------------------------------------- training


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


def init_state(
    cfg: MoEConfig, optimizer: optax.GradientTransformation, key: jax.Array
) -> TrainState:
    """Parameters from `init_params` and the optimizer state built on them (both jitted:
    one compilation instead of one per initialiser op)."""
    params = jax.jit(init_params, static_argnums=0)(cfg, key)
    return TrainState(params=params, opt_state=jax.jit(optimizer.init)(params))


def abstract_state(cfg: MoEConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """`init_state` as `jax.ShapeDtypeStruct`s (`jax.eval_shape`): nothing is allocated."""
    return jax.eval_shape(lambda key: init_state(cfg, optimizer, key), jax.random.key(0))


@partial(jax.jit, static_argnums=(0, 1))
def make_batch(cfg: MoEConfig, batch_size: int, key: jax.Array) -> dict:
    """Random token sequences: ``{"tokens": int32[B, S], "targets": int32[B, S]}``, targets
    being the tokens shifted left by one."""
    sequence = jax.random.randint(key, (batch_size, cfg.seq_len + 1), 0, cfg.vocab_size)
    sequence = sequence.astype(jnp.int32)
    return {"tokens": sequence[:, :-1], "targets": sequence[:, 1:]}


def abstract_batch(cfg: MoEConfig, batch_size: int) -> dict:
    """The shapes and dtypes of `make_batch`."""
    spec = jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)
    return {"tokens": spec, "targets": spec}


def make_train_step(cfg: MoEConfig, optimizer: optax.GradientTransformation):
    """A train step `(state, batch) -> (new_state, {"loss": loss})`."""

    def train_step(state: TrainState, batch: dict):
        loss, grads = value_and_grad(loss_fn)(state.params, batch, cfg)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params=params, opt_state=opt_state), {"loss": loss}

    return train_step


def main() -> None:
    """Three single-device train steps at the "tiny" size, printing the loss."""
    cfg = CONFIGS["tiny"]
    optimizer = optax.adamw(1e-2)
    key_state, key_batch = jax.random.split(jax.random.key(0))
    state = init_state(cfg, optimizer, key_state)
    batch = make_batch(cfg, batch_size=8, key=key_batch)
    train_step = jax.jit(make_train_step(cfg, optimizer))
    for step in range(3):
        state, metrics = train_step(state, batch)
        print(f"step {step}: loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
