"""Wide-ResNet image classifier, in plain JAX + optax.

A ResNet v1 (He et al. 2016) widened as in Zagoruyko & Komodakis 2016 (arXiv 1605.07146),
shaped like Alpa's Wide-ResNet benchmark model (`alpa/model/wide_resnet.py`, derived from
Flax's ImageNet example): a stem, stages of residual blocks whose first block may halve the
resolution, global average pooling and a dense classifier trained with softmax
cross-entropy. Convolutions are NHWC `jax.lax.conv_general_dilated`.

Batch norm is replaced by a layer norm over channels at every pixel: deterministic,
differentiable, no running statistics, and each example is normalised on its own, so a
microbatched gradient equals the full-batch gradient (batch norm would couple the examples
of a batch and depend on how it is split).

Blocks are a Python list (not scanned); with `cfg.layer_markers` every block output is
wrapped in `autopar.layer_boundary` (Alpa clusters Wide-ResNet-50 into its 16 blocks).

Run `python examples/wide_resnet.py` for three single-device steps at the "tiny" size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from autopar import layer_boundary, value_and_grad

# Epsilon of the channel layer norm (Flax's BatchNorm in Alpa's model uses 1e-5).
NORM_EPS = 1e-5
# Output channels of a bottleneck block per unit of stage width (ResNet-50's expansion 4).
BOTTLENECK_EXPANSION = 4
# Stage sizes of the bottleneck ResNets (He et al. 2016, Table 1), keyed by depth.
BOTTLENECK_STAGE_SIZES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
# Classes of Alpa's Wide-ResNet benchmark (`benchmark_one_case_wresnet.py`: num_classes=1024).
ALPA_NUM_CLASSES = 1024

_DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")


@dataclass(frozen=True)
class WideResNetConfig:
    """Sizes of a Wide-ResNet.

    **Arguments:**
    - `image_size`: height and width of the square input images.
    - `stage_widths`: base channels of each stage (the stem has `stage_widths[0]`).
    - `blocks_per_stage`: residual blocks in each stage; stages after the first start with
      a stride-2 block.
    - `width_factor`: widening factor k. A "basic" block has two 3x3 convs of
      width·k channels; a "bottleneck" block (Alpa's) is 1x1 → width, 3x3 → width·k,
      1x1 → 4·width.
    - `num_classes`: classifier outputs.
    - `block`: "basic" or "bottleneck".
    - `imagenet_stem`: 7x7 stride-2 conv + 3x3 stride-2 max pool (ImageNet ResNets) if True;
      else one 3x3 stride-1 conv (CIFAR ResNets, for small images).
    - `in_channels`, `dtype`, `layer_markers`: input channels, parameter and activation dtype
      name, wrap each block output in `autopar.layer_boundary`.
    """

    image_size: int
    stage_widths: tuple[int, ...]
    blocks_per_stage: tuple[int, ...]
    width_factor: int
    num_classes: int
    block: Literal["basic", "bottleneck"] = "bottleneck"
    imagenet_stem: bool = True
    in_channels: int = 3
    dtype: str = "float32"
    layer_markers: bool = False

    def __post_init__(self):
        if len(self.stage_widths) != len(self.blocks_per_stage):
            raise ValueError(
                f"stage_widths has {len(self.stage_widths)} entries but blocks_per_stage has "
                f"{len(self.blocks_per_stage)}; give one width and one block count per stage."
            )
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f'block={self.block!r}: use "basic" or "bottleneck".')


@dataclass(frozen=True)
class BlockShape:
    """Static shape of one residual block: input channels, stage width, first-conv stride."""

    in_channels: int
    width: int
    stride: int


def block_shapes(cfg: WideResNetConfig) -> list[BlockShape]:
    """The blocks of `cfg` in order, with the channels each one sees."""
    shapes, channels = [], cfg.stage_widths[0]
    for stage, (width, num_blocks) in enumerate(zip(cfg.stage_widths, cfg.blocks_per_stage)):
        for index in range(num_blocks):
            stride = 2 if stage > 0 and index == 0 else 1
            shapes.append(BlockShape(in_channels=channels, width=width, stride=stride))
            channels = _block_out_channels(cfg, width)
    return shapes


def _block_out_channels(cfg: WideResNetConfig, width: int) -> int:
    if cfg.block == "basic":
        return width * cfg.width_factor
    return width * BOTTLENECK_EXPANSION


def _alpa(num_layers: int, base_channels: int, width_factor: int) -> WideResNetConfig:
    """A config of Alpa's Wide-ResNet suite (`wresnet_specs`: image 224, layers, base
    channels C, width factor W): bottleneck blocks, stage widths C·2^i, 1024 classes."""
    stage_sizes = BOTTLENECK_STAGE_SIZES[num_layers]
    return WideResNetConfig(
        image_size=224,
        stage_widths=tuple(base_channels * 2**i for i in range(len(stage_sizes))),
        blocks_per_stage=stage_sizes,
        width_factor=width_factor,
        num_classes=ALPA_NUM_CLASSES,
    )


# Full sizes: Alpa (Zheng et al. 2022, Table 4; benchmark `wresnet_specs`), with (layers,
# base channels, width factor) exactly as there; "500M" and "13B" are in the suite too.
# Parameter counts of this implementation (from `abstract_state`) agree with the names
# within 3% (the channel norm has as many parameters as Alpa's batch norm).
CONFIGS: dict[str, WideResNetConfig] = {
    "tiny": WideResNetConfig(
        image_size=16,
        stage_widths=(16, 32),
        blocks_per_stage=(1, 1),
        width_factor=2,
        num_classes=10,
        block="basic",
        imagenet_stem=False,
    ),
    "250M": _alpa(num_layers=50, base_channels=160, width_factor=2),
    "500M": _alpa(num_layers=50, base_channels=224, width_factor=2),
    "1B": _alpa(num_layers=50, base_channels=320, width_factor=2),
    "2B": _alpa(num_layers=50, base_channels=448, width_factor=2),
    "4B": _alpa(num_layers=50, base_channels=640, width_factor=2),
    "6.8B": _alpa(num_layers=50, base_channels=320, width_factor=16),
    "13B": _alpa(num_layers=101, base_channels=320, width_factor=16),
}


# ----------------------------------------------------------------------------- parameters


class Normal(NamedTuple):
    """A weight to draw from N(0, std²): a leaf of the parameter spec tree."""

    shape: tuple[int, ...]
    std: float


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


def _conv_kernel(size: int, c_in: int, c_out: int) -> Normal:
    """He-normal HWIO kernel: std sqrt(2 / fan_in), for convs followed by relu."""
    return Normal((size, size, c_in, c_out), std=math.sqrt(2.0 / (size * size * c_in)))


def _norm_params(channels: int, dtype: str, zero_scale: bool = False) -> dict:
    scale = jnp.zeros if zero_scale else jnp.ones
    return {"scale": scale((channels,), dtype), "bias": jnp.zeros((channels,), dtype)}


def _block_spec(cfg: WideResNetConfig, shape: BlockShape) -> dict:
    """Convs and norms of one block; the branch's last norm starts at scale 0 (as in Flax's
    ResNet), so every block starts as the identity on its shortcut."""
    dt, w, k = cfg.dtype, shape.width, cfg.width_factor
    if cfg.block == "basic":
        convs = [(3, shape.in_channels, w * k), (3, w * k, w * k)]
    else:
        convs = [(1, shape.in_channels, w), (3, w, w * k), (1, w * k, BOTTLENECK_EXPANSION * w)]
    spec = {}
    for i, (size, c_in, c_out) in enumerate(convs, start=1):
        spec[f"conv{i}"] = _conv_kernel(size, c_in, c_out)
        spec[f"norm{i}"] = _norm_params(c_out, dt, zero_scale=i == len(convs))
    out_channels = convs[-1][2]
    if shape.in_channels != out_channels or shape.stride != 1:
        spec["proj"] = {
            "conv": _conv_kernel(1, shape.in_channels, out_channels),
            "norm": _norm_params(out_channels, dt),
        }
    return spec


def init_params(cfg: WideResNetConfig, key: jax.Array) -> dict:
    """Random parameters.

    **Arguments:**
    - `cfg`: the model sizes.
    - `key`: a PRNG key.

    **Returns:** ``{"stem": {"conv", "norm"}, "blocks": [{"conv1", "norm1", ..., "proj"?},
    ...], "head": {"w", "b"}}``; kernels are HWIO, norms ``{"scale", "bias"}``.
    """
    stem_size = 7 if cfg.imagenet_stem else 3
    stem_width = cfg.stage_widths[0]
    final_channels = _block_out_channels(cfg, cfg.stage_widths[-1])
    spec = {
        "stem": {
            "conv": _conv_kernel(stem_size, cfg.in_channels, stem_width),
            "norm": _norm_params(stem_width, cfg.dtype),
        },
        "blocks": [_block_spec(cfg, shape) for shape in block_shapes(cfg)],
        "head": {
            # LeCun normal, Flax's Dense default
            "w": Normal((final_channels, cfg.num_classes), std=1.0 / math.sqrt(final_channels)),
            "b": jnp.zeros((cfg.num_classes,), cfg.dtype),
        },
    }
    return draw_normals(spec, key, cfg.dtype)


# ----------------------------------------------------------------------------- layers


def conv(x: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
    """NHWC convolution with an HWIO kernel and "SAME" padding."""
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), "SAME", dimension_numbers=_DIMENSION_NUMBERS
    )


def channel_norm(params: dict, x: jax.Array) -> jax.Array:
    """Layer norm over the channels of every pixel (the stand-in for batch norm)."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + NORM_EPS) * params["scale"] + params["bias"]


def _max_pool(x: jax.Array) -> jax.Array:
    """3x3 stride-2 max pool of the ImageNet stem."""
    window, strides = (1, 3, 3, 1), (1, 2, 2, 1)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, strides, "SAME")


def stem(params: dict, images: jax.Array, cfg: WideResNetConfig) -> jax.Array:
    """The input conv (+ max pool for the ImageNet stem)."""
    x = conv(images, params["conv"], stride=2 if cfg.imagenet_stem else 1)
    x = jax.nn.relu(channel_norm(params["norm"], x))
    return _max_pool(x) if cfg.imagenet_stem else x


def block(params: dict, x: jax.Array, stride: int) -> jax.Array:
    """One residual block, basic or bottleneck as `params` holds 2 or 3 convs:
    relu(shortcut + branch). The first 3x3 conv of the branch and the projection shortcut
    apply `stride`."""
    num_convs = sum(1 for name in params if name.startswith("conv"))
    strided = next(i for i in range(1, num_convs + 1) if params[f"conv{i}"].shape[0] == 3)
    y = x
    for i in range(1, num_convs + 1):
        y = conv(y, params[f"conv{i}"], stride if i == strided else 1)
        y = channel_norm(params[f"norm{i}"], y)
        if i < num_convs:
            y = jax.nn.relu(y)
    shortcut = x
    if "proj" in params:
        shortcut = channel_norm(params["proj"]["norm"], conv(x, params["proj"]["conv"], stride))
    return jax.nn.relu(shortcut + y)


def forward(params: dict, images: jax.Array, cfg: WideResNetConfig) -> jax.Array:
    """Class logits [batch, num_classes] (float32) of NHWC `images`."""
    x = stem(params["stem"], images, cfg)
    for shape, block_params in zip(block_shapes(cfg), params["blocks"]):
        x = block(block_params, x, shape.stride)
        if cfg.layer_markers:
            x = layer_boundary(x)
    pooled = jnp.mean(x, axis=(1, 2))
    logits = pooled @ params["head"]["w"] + params["head"]["b"]
    return logits.astype(jnp.float32)


def loss_fn(params: dict, batch: dict, cfg: WideResNetConfig) -> jax.Array:
    """Mean softmax cross-entropy of the logits against integer `batch["labels"]`."""
    logits = forward(params, batch["images"], cfg)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]))


# ----------------------------------------------------------------------------- training


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


def init_state(
    cfg: WideResNetConfig, optimizer: optax.GradientTransformation, key: jax.Array
) -> TrainState:
    """Parameters from `init_params` and the optimizer state built on them (both jitted:
    one compilation instead of one per initialiser op)."""
    params = jax.jit(init_params, static_argnums=0)(cfg, key)
    return TrainState(params=params, opt_state=jax.jit(optimizer.init)(params))


def abstract_state(cfg: WideResNetConfig, optimizer: optax.GradientTransformation) -> TrainState:
    """`init_state` as `jax.ShapeDtypeStruct`s (`jax.eval_shape`): nothing is allocated."""
    return jax.eval_shape(lambda key: init_state(cfg, optimizer, key), jax.random.key(0))


@partial(jax.jit, static_argnums=(0, 1))
def make_batch(cfg: WideResNetConfig, batch_size: int, key: jax.Array) -> dict:
    """Random images and labels: ``{"images": [B, H, W, C], "labels": int32[B]}``."""
    k_images, k_labels = jax.random.split(key)
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
    return {
        "images": jax.random.normal(k_images, shape).astype(cfg.dtype),
        "labels": jax.random.randint(k_labels, (batch_size,), 0, cfg.num_classes, jnp.int32),
    }


def abstract_batch(cfg: WideResNetConfig, batch_size: int) -> dict:
    """The shapes and dtypes of `make_batch`."""
    shape = (batch_size, cfg.image_size, cfg.image_size, cfg.in_channels)
    return {
        "images": jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype)),
        "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def make_train_step(cfg: WideResNetConfig, optimizer: optax.GradientTransformation):
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
