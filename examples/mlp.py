"""MLP: a stack of dense layers with a mean-squared-error loss, in plain JAX.

The same API shape as `examples/gpt.py`. Run ``python examples/mlp.py`` for three
single-device steps at the "tiny" size.

**Example:**

```python
cfg = CONFIGS["tiny"]
optimizer = optax.adam(1e-3)
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


@dataclass(frozen=True)
class MLPConfig:
    """`num_layers` dense layers: in_dim → hidden → ... → hidden → out_dim, tanh between."""

    in_dim: int
    hidden: int
    out_dim: int
    num_layers: int
    layer_markers: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers}: an MLP needs at least one layer.")

    @property
    def dims(self) -> list[int]:
        return [self.in_dim] + [self.hidden] * (self.num_layers - 1) + [self.out_dim]


CONFIGS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3),
    # Wide enough that operator parallelism pays off at a batch of 8.
    "wide": MLPConfig(in_dim=8192, hidden=8192, out_dim=8192, num_layers=4),
}

# Batch size the "wide" configuration is meant to be run with.
WIDE_BATCH_SIZE = 8


def init_params(cfg: MLPConfig, key: jax.Array) -> dict:
    """``{"layers": [{"w": [d_in, d_out], "b": [d_out]}, ...]}``, LeCun-normal weights."""
    keys = jax.random.split(key, cfg.num_layers)
    layers = []
    for k, d_in, d_out in zip(keys, cfg.dims[:-1], cfg.dims[1:]):
        w = jax.random.normal(k, (d_in, d_out), jnp.float32) / math.sqrt(d_in)
        layers.append({"w": w, "b": jnp.zeros((d_out,), jnp.float32)})
    return {"layers": layers}


def forward(params: dict, x: jax.Array, cfg: MLPConfig) -> jax.Array:
    """The network's output for ``x: [B, in_dim]``; no activation after the last layer."""
    h = x
    last = len(params["layers"]) - 1
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i < last:
            h = jnp.tanh(h)
        if cfg.layer_markers:
            h = layer_boundary(h)
    return h


def loss_fn(params: dict, batch: dict, cfg: MLPConfig) -> jax.Array:
    """Mean squared error between ``forward(params, batch["x"])`` and ``batch["y"]``."""
    return jnp.mean(jnp.square(forward(params, batch["x"], cfg) - batch["y"]))


class TrainState(NamedTuple):
    """Parameters and optimizer state; a pytree with paths ``params/...``, ``opt_state/...``."""

    params: Any
    opt_state: Any


def init_state(cfg: MLPConfig, optimizer: optax.GradientTransformation, key) -> TrainState:
    """Random parameters and a fresh optimizer state."""
    params = init_params(cfg, key)
    return TrainState(params, optimizer.init(params))


def abstract_state(cfg: MLPConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """`init_state`'s shapes and dtypes as `jax.ShapeDtypeStruct`s; allocates nothing."""
    return jax.eval_shape(lambda key: init_state(cfg, optimizer, key), jax.random.key(0))


def make_batch(cfg: MLPConfig, batch_size: int, key: jax.Array) -> dict:
    """Random inputs ``x`` and targets ``y`` from a fixed random linear map plus a sine."""
    k_x, k_map = jax.random.split(key)
    x = jax.random.normal(k_x, (batch_size, cfg.in_dim), jnp.float32)
    teacher = jax.random.normal(k_map, (cfg.in_dim, cfg.out_dim), jnp.float32)
    return {"x": x, "y": jnp.sin(x @ teacher / math.sqrt(cfg.in_dim))}


def abstract_batch(cfg: MLPConfig, batch_size: int) -> dict:
    """`make_batch`'s shapes and dtypes as `jax.ShapeDtypeStruct`s."""
    return {
        "x": jax.ShapeDtypeStruct((batch_size, cfg.in_dim), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch_size, cfg.out_dim), jnp.float32),
    }


def make_train_step(cfg: MLPConfig, optimizer: optax.GradientTransformation):
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
    optimizer = optax.adam(1e-2)
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
