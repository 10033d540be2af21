"""The MoE and Wide-ResNet examples: training, abstract sizes, top-2 gating, markers."""

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def _load_example(name: str):
    """Import `examples/<name>.py` by path (the examples folder is not a package)."""
    module_name = f"autopar_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
    return sys.modules[module_name]


moe = _load_example("moe")
wide_resnet = _load_example("wide_resnet")
EXAMPLES = {"moe": moe, "wide_resnet": wide_resnet}


def _nominal_params(config_name: str) -> float:
    """The size a config is named after: "380M" -> 380e6, "1.3B" -> 1.3e9."""
    scale = {"M": 1e6, "B": 1e9}[config_name[-1]]
    return float(config_name[:-1]) * scale


def _param_count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _live_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", ["moe", "wide_resnet"])
def test_tiny_train_step_loss_decreases(name):
    example = EXAMPLES[name]
    cfg = example.CONFIGS["tiny"]
    optimizer = optax.adamw(1e-2)
    key_state, key_batch = jax.random.split(jax.random.key(0))
    state = example.init_state(cfg, optimizer, key_state)
    batch = example.make_batch(cfg, 8, key_batch)
    train_step = jax.jit(example.make_train_step(cfg, optimizer))
    losses = []
    for _ in range(3):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[0] > losses[1] > losses[2], losses
    chance = math.log(cfg.vocab_size if name == "moe" else cfg.num_classes)
    assert abs(losses[0] - chance) < 0.5, (losses[0], chance)  # starts near chance level


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "name, config_name",
    [(n, c) for n, ex in EXAMPLES.items() for c in ex.CONFIGS if c != "tiny"],
)
def test_parameter_count_matches_nominal_size(name, config_name):
    example = EXAMPLES[name]
    state = example.abstract_state(example.CONFIGS[config_name], optax.sgd(0.1))
    count = _param_count(state.params)
    nominal = _nominal_params(config_name)
    assert abs(count - nominal) / nominal < 0.10, (config_name, count, nominal)


@pytest.mark.parametrize("name", ["moe", "wide_resnet"])
def test_abstract_state_and_batch_of_largest_config_allocate_nothing(name):
    example = EXAMPLES[name]
    largest = max((c for c in example.CONFIGS if c != "tiny"), key=_nominal_params)
    cfg = example.CONFIGS[largest]
    before = _live_bytes()
    state = example.abstract_state(cfg, optax.adamw(1e-3))
    batch = example.abstract_batch(cfg, 16)
    assert _live_bytes() - before < 2**20, "abstract_state allocated device memory"
    leaves = jax.tree.leaves((state, batch))
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    # adamw keeps two moments per parameter, plus step counters
    assert _param_count(state.opt_state) >= 2 * _param_count(state.params)
    assert _param_count(state.params) > 0.9 * _nominal_params(largest)
    # the abstract batch fits the model: the loss traces to a float32 scalar
    loss = jax.eval_shape(lambda p, b: example.loss_fn(p, b, cfg), state.params, batch)
    assert loss.shape == () and loss.dtype == jnp.float32


def test_abstract_batch_matches_make_batch():
    for example in EXAMPLES.values():
        cfg = example.CONFIGS["tiny"]
        made = jax.eval_shape(lambda key, ex=example, cfg=cfg: ex.make_batch(cfg, 4, key),
                              jax.random.key(1))
        assert made == example.abstract_batch(cfg, 4)


def test_full_size_shapes_follow_alpa_tables():
    cfg = moe.CONFIGS["1.3B"]
    state = moe.abstract_state(cfg, optax.sgd(0.1))
    layers = state.params["layers"]
    assert len(layers) == 16 and sum("moe" in layer for layer in layers) == 8
    assert layers[1]["moe"]["w1"].shape == (16, 768, 8 * 768)
    assert layers[1]["moe"]["w2"].shape == (16, 8 * 768, 768)
    wrn = wide_resnet.CONFIGS["250M"]
    params = wide_resnet.abstract_state(wrn, optax.sgd(0.1)).params
    assert len(params["blocks"]) == 16  # ResNet-50: 3 + 4 + 6 + 3 bottleneck blocks
    assert params["blocks"][0]["conv2"].shape == (3, 3, 160, 320)  # width 160, factor 2
    logits = jax.eval_shape(
        lambda p, x: wide_resnet.forward(p, x, wrn),
        params,
        wide_resnet.abstract_batch(wrn, 2)["images"],
    )
    assert logits.shape == (2, 1024)


# ----------------------------------------------------------------------------- gating


def _reference_top2(gates: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Slow GShard top-2 routing: first choices claim slots in token order, then second
    choices; returns dispatch [G, S, E, C] and combine weights."""
    num_groups, group_size, num_experts = gates.shape
    dispatch = np.zeros((num_groups, group_size, num_experts, capacity), bool)
    combine = np.zeros(dispatch.shape, np.float32)
    for g in range(num_groups):
        order = np.argsort(-gates[g], axis=-1, kind="stable")
        top2 = gates[g, np.arange(group_size)[:, None], order[:, :2]]
        weights = top2 / top2.sum(axis=-1, keepdims=True)
        filled = np.zeros(num_experts, int)
        for choice in range(2):
            for s in range(group_size):
                expert = order[s, choice]
                if filled[expert] < capacity:
                    dispatch[g, s, expert, filled[expert]] = True
                    combine[g, s, expert, filled[expert]] = weights[s, choice]
                    filled[expert] += 1
    return dispatch, combine


def _skewed_gates(seed: int, num_groups=2, group_size=16, num_experts=4) -> np.ndarray:
    """Router probabilities where expert 0 is most tokens' favourite, so capacity binds."""
    logits = np.random.default_rng(seed).normal(size=(num_groups, group_size, num_experts))
    logits[..., 0] += 1.5
    gates = np.exp(logits)
    return (gates / gates.sum(axis=-1, keepdims=True)).astype(np.float32)


def test_top2_gating_routes_each_token_to_at_most_two_experts_within_capacity():
    gates = _skewed_gates(seed=2)
    capacity = moe.expert_capacity(16, 4, capacity_factor=0.75)
    assert capacity == 6
    gating = jax.jit(moe.top2_gating, static_argnums=1)(gates, capacity)
    dispatch = np.asarray(gating.dispatch)
    assert dispatch.shape == (2, 16, 4, capacity) and dispatch.dtype == bool

    assert dispatch.sum(axis=(2, 3)).max() <= 2  # at most two experts per token
    assert dispatch.sum(axis=3).max() <= 1  # at most one slot per (token, expert)
    assert dispatch.sum(axis=1).max() <= 1  # a slot holds at most one token
    per_expert = dispatch.sum(axis=(1, 3))
    assert per_expert.max() <= capacity
    assert (per_expert == capacity).any(), "test gates should overflow some expert"
    assert (dispatch.sum(axis=(2, 3)) < 2).any(), "some choice should have been dropped"

    top2 = np.argsort(-gates, axis=-1)[..., :2]
    routed = dispatch.any(axis=3)
    chosen = np.zeros_like(routed)
    np.put_along_axis(chosen, top2, True, axis=-1)
    assert not (routed & ~chosen).any(), "a token went to an expert outside its top 2"

    want_dispatch, want_combine = _reference_top2(gates, capacity)
    np.testing.assert_array_equal(dispatch, want_dispatch)
    np.testing.assert_allclose(np.asarray(gating.combine), want_combine, rtol=1e-6, atol=1e-7)


def test_top2_gating_aux_loss_is_one_when_balanced_and_grows_when_collapsed():
    num_experts = 4
    balanced = jax.nn.one_hot(jnp.arange(16) % num_experts, num_experts)[None]
    balanced = 0.9 * balanced + 0.1 / num_experts
    collapsed = jnp.broadcast_to(jnp.array([0.97, 0.01, 0.01, 0.01]), (1, 16, num_experts))
    aux_loss = jax.jit(lambda gates: moe.top2_gating(gates, capacity=8).aux_loss)
    loss_balanced, loss_collapsed = float(aux_loss(balanced)), float(aux_loss(collapsed))
    assert loss_balanced == pytest.approx(1.0, rel=1e-5)
    assert loss_collapsed == pytest.approx(0.97 * num_experts, rel=1e-5)


def _dense_top2_mixture(params: dict, tokens: jax.Array) -> jax.Array:
    """Each token through its two best experts, weighted by renormalised gates, directly."""
    gates = jax.nn.softmax(tokens @ params["router"], axis=-1)
    top_values, top_experts = jax.lax.top_k(gates, 2)
    weights = top_values / top_values.sum(axis=-1, keepdims=True)
    out = jnp.zeros_like(tokens)
    for choice in range(2):
        w1 = params["w1"][top_experts[:, choice]]  # [tokens, h, f]
        w2 = params["w2"][top_experts[:, choice]]
        expert_out = jnp.einsum(
            "tf,tfh->th", jax.nn.relu(jnp.einsum("th,thf->tf", tokens, w1)), w2
        )
        out = out + weights[:, choice : choice + 1] * expert_out
    return out


def test_moe_layer_equals_per_token_top2_mixture_when_nothing_is_dropped():
    cfg = moe.MoEConfig(
        vocab_size=16, seq_len=8, hidden=8, num_layers=2, num_heads=2, num_experts=4,
        mlp_ratio=2, expert_group_size=8, capacity_factor=2.0,  # capacity = all tokens
    )

    @jax.jit
    def run(key_params, key_x):
        params = moe.init_params(cfg, key_params)["layers"][1]["moe"]
        params = jax.tree.map(lambda w: w * 25.0, params)  # larger weights: larger outputs
        x = jax.random.normal(key_x, (2, 8, 8))
        y, aux_loss = moe.moe_layer(params, x, cfg)
        return y.reshape(-1, 8), aux_loss, _dense_top2_mixture(params, x.reshape(-1, 8))

    y, aux_loss, want = run(jax.random.key(3), jax.random.key(4))
    assert np.isfinite(float(aux_loss))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(want).max()) > 1e-2


def test_moe_layer_rejects_tokens_that_do_not_fill_whole_groups():
    cfg = moe.CONFIGS["tiny"]  # expert_group_size 32
    params = moe.abstract_state(cfg, optax.sgd(0.1)).params["layers"][1]["moe"]
    x = jax.ShapeDtypeStruct((3, 16, cfg.hidden), jnp.float32)
    with pytest.raises(ValueError, match="routing groups of expert_group_size=32"):
        jax.eval_shape(lambda p, x: moe.moe_layer(p, x, cfg), params, x)


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        moe.MoEConfig(vocab_size=8, seq_len=4, hidden=10, num_layers=2, num_heads=4,
                      num_experts=4)
    with pytest.raises(ValueError, match="one width and one block count per stage"):
        wide_resnet.WideResNetConfig(image_size=8, stage_widths=(4, 8), blocks_per_stage=(1,),
                                     width_factor=1, num_classes=2)


# ----------------------------------------------------------------------------- markers


def _count_primitive(jaxpr, name: str) -> int:
    return sum(eqn.primitive.name == name for eqn in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("name", ["moe", "wide_resnet"])
def test_layer_markers_wrap_every_layer(name):
    example = EXAMPLES[name]
    tiny = example.CONFIGS["tiny"]
    params = example.abstract_state(tiny, optax.sgd(0.1)).params
    batch = example.abstract_batch(tiny, 2)
    num_layers = len(params["layers"] if name == "moe" else params["blocks"])
    for markers, expected in ((False, 0), (True, num_layers)):
        cfg = dataclasses.replace(tiny, layer_markers=markers)
        jaxpr = jax.make_jaxpr(lambda p, b, cfg=cfg: example.loss_fn(p, b, cfg))(params, batch)
        assert _count_primitive(jaxpr, "layer_boundary") == expected
