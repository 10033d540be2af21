"""The GPT and MLP examples train on one device: three steps, the loss goes down."""

import math

import jax
import optax
import pytest

from examples import gpt, mlp


def test_gpt_tiny_loss_decreases():
    losses = gpt.main("tiny", num_steps=3, batch_size=8)
    assert len(losses) == 3
    # Random init predicts roughly uniformly over the vocabulary at first.
    assert abs(losses[0] - math.log(gpt.CONFIGS["tiny"].vocab_size)) < 0.2
    assert losses[0] > losses[1] > losses[2]


def test_mlp_tiny_loss_decreases():
    losses = mlp.main("tiny", num_steps=3, batch_size=8)
    assert len(losses) == 3
    assert losses[0] > losses[1] > losses[2]


def _shapes(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize("module", [gpt, mlp], ids=["gpt", "mlp"])
def test_abstract_state_and_batch_match_the_real_ones(module):
    cfg = module.CONFIGS["tiny"]
    optimizer = optax.adam(1e-3)
    real = jax.jit(lambda key: module.init_state(cfg, optimizer, key))(jax.random.key(0))
    assert _shapes(real) == _shapes(module.abstract_state(cfg, optimizer))
    batch = module.make_batch(cfg, 4, jax.random.key(1))
    assert _shapes(batch) == _shapes(module.abstract_batch(cfg, 4))


def test_gpt_param_count_matches_config_and_gpt3_sizes():
    cfg = gpt.CONFIGS["tiny"]
    params = jax.eval_shape(lambda key: gpt.init_params(cfg, key), jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
    # GPT-3 paper sizes (Brown et al. 2020), within 5% (vocabulary padding, rounding).
    for name, billions in [("125M", 0.125), ("1.3B", 1.3), ("13B", 13), ("175B", 175)]:
        assert abs(gpt.CONFIGS[name].num_params / (billions * 1e9) - 1) < 0.05, name
