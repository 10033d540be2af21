"""The published Megatron-LM plans of GPT-3 175B and MT-NLG 530B, as autopar scores them.

Korthikanti et al. 2022, table 3 (microbatch size 1, sequence 2048): GPT-3 175B (96
layers, hidden 12288) on 64 dgx-a100-80g GPUs with tp 8 x pp 8, and MT-NLG 530B (105
layers, hidden 20480, 128 heads) on 280 with tp 8 x pp 35, both with sequence parallelism.
Precision as Megatron-LM trains them: bfloat16 parameters, activations and gradients, and
fp32 optimizer state -- a master copy of the weights and Adam's two moments
(`mixed_precision_adamw`): 2 + 2 + 12 = 16 bytes per parameter.

`megatron_memory` traces the step abstractly (nothing runs) and plans it with
`autopar.manual.megatron_plan_for_graph`: does the plan fit 80 GB with a given recompute?
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from autopar.cluster import Cluster
from autopar.graph import trace
from autopar.manual import MegatronConfig, megatron_plan_for_graph
from autopar.search import microbatch_args
from examples import gpt

PROFILE = "dgx-a100-80g"

MODELS = {
    # name: (config, hosts, tp, pp); Korthikanti et al. 2022 table 3, microbatch size 1.
    "175B": (gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 12288, 96, 96), 8, 8, 8),
    "530B": (gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 20480, 105, 128), 35, 8, 35),
}


class MixedPrecisionState(NamedTuple):
    master: optax.Params  # fp32 copy of the weights
    mu: optax.Params  # fp32 first moment
    nu: optax.Params  # fp32 second moment
    count: jax.Array


def mixed_precision_adamw(learning_rate: float = 1e-4, b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1) -> optax.GradientTransformation:
    """AdamW on fp32 master weights and moments for bf16 parameters; its updates turn the
    bf16 parameters into the rounded new master weights."""

    def init(params):
        f32 = lambda p: p.astype(jnp.float32)  # noqa: E731
        zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
        return MixedPrecisionState(
            jax.tree.map(f32, params), jax.tree.map(zeros, params),
            jax.tree.map(zeros, params), jnp.zeros((), jnp.int32),
        )

    def update(grads, state, params):
        count = state.count + 1
        g = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu, g)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        master = jax.tree.map(
            lambda w, m, v: w - learning_rate * (m / c1 / (jnp.sqrt(v / c2) + eps)
                                                 + weight_decay * w),
            state.master, mu, nu,
        )
        updates = jax.tree.map(lambda w, p: w.astype(p.dtype) - p, master, params)
        return updates, MixedPrecisionState(master, mu, nu, count)

    return optax.GradientTransformation(init, update)


def model_step(cfg: gpt.GPTConfig, batch: int):
    """(step, abstract args) of `cfg` in bf16 with layer marks and fp32 optimizer state."""
    cfg = dataclasses.replace(cfg, layer_markers=True, dtype="bfloat16")
    optimizer = mixed_precision_adamw()
    step = gpt.make_train_step(cfg, optimizer)
    return step, (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, batch))


def megatron_memory(name: str, recompute: str, num_microbatches: int | None = None):
    """(plan or None, fits, plan or error message) of the Megatron plan of model `name`
    (a key of `MODELS`) with sequence parallelism and `recompute`, microbatch size 1 and
    as many microbatches as stages (1F1B's most in flight; default)."""
    cfg, hosts, tp, pp = MODELS[name]
    m = num_microbatches or pp
    step, args = model_step(cfg, m)
    cluster = Cluster.from_profile(PROFILE, num_hosts=hosts)
    graph = trace(step, *microbatch_args(args, (1,), m), batch_argnums=(1,))
    config = MegatronConfig(dp=1, tp=tp, pp=pp, sequence_parallel=True, num_microbatches=m,
                            recompute=recompute)
    try:
        plan = megatron_plan_for_graph(graph, cluster, config)
    except ValueError as err:
        return None, False, str(err)
    return plan, True, plan
