"""The Llama example (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) trains
under autopar like one device, and its plan on an A100 node shards the matmul weights."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import run_steps

import autopar
from autopar.app._examples import model_names, named_model
from autopar.graph import trace
from autopar.intra._strategies import node_signature
from examples import llama

TINY = llama.CONFIGS["tiny"]


def _cpu():
    return autopar.Cluster.from_profile("cpu-local")


def _check(cfg, batch_size=8, **options):
    optimizer = optax.adamw(1e-2, eps=1e-6)
    state = llama.init_state(cfg, optimizer, jax.random.key(0))
    batch = llama.make_batch(cfg, batch_size, jax.random.key(1))
    step = llama.make_train_step(cfg, optimizer)
    ref_losses, _ = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, cluster=_cpu(), donate_argnums=(), **options)
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not [w for w in par.plan.warnings if "no sharding rule" in w], par.plan.warnings
    return par.plan


def test_tiny_llama_shard_on_2x4_matches_one_device():
    plan = _check(TINY, method="shard", mesh_shape=(2, 4))
    assert plan.stages[0].sharding.mesh.shape == (2, 4)


@pytest.mark.extended  # the pipeline path is covered by the transformers Llama (GQA) tests
def test_tiny_llama_auto_two_stages_matches_one_device():
    cfg = dataclasses.replace(TINY, layer_markers=True)
    plan = _check(cfg, method="auto", num_stages=2, num_microbatches=2)
    assert plan.num_stages == 2 and plan.num_microbatches == 2


def test_tiny_llama_scan_layers_shards_like_one_device():
    _check(dataclasses.replace(TINY, scan_layers=True), method="shard", mesh_shape=(2, 4))


def test_dot_product_attention_variant_has_a_rule_for_every_primitive():
    cfg = dataclasses.replace(TINY, attention="dot_product_attention")
    optimizer = optax.adamw(1e-2)
    graph = trace(
        llama.make_train_step(cfg, optimizer),
        llama.abstract_state(cfg, optimizer),
        llama.abstract_batch(cfg, 8),
    )
    assert not [n.primitive for n in graph.nodes if node_signature(n, graph) is None]


def test_variants_compute_the_same_loss():
    batch = llama.make_batch(TINY, 4, jax.random.key(1))
    params = llama.init_params(TINY, jax.random.key(0))
    stacked = dict(params, layers=jax.tree.map(lambda *xs: np.stack(xs), *params["layers"]))
    losses = []
    for options, p in [
        ({}, params),
        (dict(scan_layers=True), stacked),
        (dict(attention="dot_product_attention"), params),
    ]:
        cfg = dataclasses.replace(TINY, **options)
        losses.append(float(jax.jit(llama.loss_fn, static_argnums=2)(p, batch, cfg)))
    np.testing.assert_allclose(losses, losses[0], rtol=1e-5)


def test_param_counts_match_meta_llama_sizes():
    for name, billions in [("7B", 6.74), ("8B", 8.03), ("70B", 70.55)]:
        assert abs(llama.CONFIGS[name].num_params / (billions * 1e9) - 1) < 0.01, name
    params = jax.eval_shape(lambda k: llama.init_params(TINY, k), jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == TINY.num_params


@pytest.mark.parametrize(
    # The Python loop takes twice the planning time (13 s CPU against 7 s); the scanned form,
    # as MaxText writes it, is the default-tier twin.
    "scan_layers",
    [pytest.param(False, marks=pytest.mark.extended), True],
    ids=["layers", "scan_layers"],
)
def test_mid_size_plan_on_an_a100_node_shards_every_matmul_weight(scan_layers):
    # Real widths (h=4096, 32 query / 8 key-value heads, SwiGLU 14336), 2 layers, and few
    # tokens per step, where weights outweigh activations: tensor parallelism pays.
    cfg = dataclasses.replace(llama.CONFIGS["mid-test"], scan_layers=scan_layers)
    optimizer = optax.adamw(1e-2)
    plan = autopar.plan(
        llama.make_train_step(cfg, optimizer),
        llama.abstract_state(cfg, optimizer),
        llama.abstract_batch(cfg, batch_size=2),
        cluster=autopar.Cluster.from_profile("dgx-a100-80g"),
        method="shard",
        cache=False,
    )
    specs = plan.specs_by_path()
    matmul = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
    weights = {p: s for p, s in specs.items() if p.startswith("params/") and p.endswith(matmul)}
    assert len(weights) == (7 if scan_layers else 7 * cfg.num_layers) + 1, sorted(weights)
    replicated = [p for p, s in weights.items() if not any(s)]
    assert not replicated, f"replicated matmul weights: {replicated}"
    # Megatron's MLP: w_gate and w_up split by columns over the axis w_down's rows use.
    if scan_layers:  # stacked [num_layers, d_in, d_out]: the layer dim stays whole
        assert all(s[0] == () for p, s in weights.items() if "/layers/" in p), weights
        mlps = [{k: specs[f"params/layers/mlp/{k}"][1:] for k in ("w_gate", "w_up", "w_down")}]
    else:
        mlps = [
            {k: specs[f"params/layers/{layer}/mlp/{k}"] for k in ("w_gate", "w_up", "w_down")}
            for layer in range(cfg.num_layers)
        ]
    for mlp in mlps:
        assert mlp["w_gate"][1] and mlp["w_gate"][1] == mlp["w_up"][1] == mlp["w_down"][0], mlp


def test_llama_is_a_named_model_for_the_cli():
    model = named_model("llama-8B", batch_size=4)
    assert model.config == llama.CONFIGS["8B"]
    assert "llama-tiny" in model_names()


def test_remat_layers_checkpoints_the_scanned_layer_and_computes_the_same():
    cfg = dataclasses.replace(TINY, scan_layers=True)
    remat = dataclasses.replace(cfg, remat_layers=True)
    params = llama.init_params(cfg, jax.random.key(0))
    batch = llama.make_batch(cfg, 4, jax.random.key(1))
    grad = jax.value_and_grad(llama.loss_fn)
    (loss, grads), (loss_r, grads_r) = (
        jax.jit(grad, static_argnums=2)(params, batch, c) for c in (cfg, remat)
    )
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(lambda p: llama.loss_fn(p, batch, remat))(params))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    with pytest.raises(ValueError, match="scan_layers=True"):
        dataclasses.replace(TINY, remat_layers=True)


def test_embedding_marker_gives_the_embedding_a_layer_of_its_own():
    # Llama 3 405B's first pipeline chunk held only the embedding (Dubey et al. 2024,
    # sec. 3.3.2): with the mark after the embedding, the token gather is alone in layer 0
    # and the first transformer layer's matmuls start layer 1.
    from autopar.inter import assign_layers

    optimizer = optax.adamw(1e-2)
    cfg = dataclasses.replace(TINY, layer_markers=True, embedding_marker=True)
    graph = trace(llama.make_train_step(cfg, optimizer), llama.abstract_state(cfg, optimizer),
                  llama.abstract_batch(cfg, 4))
    layers = assign_layers(graph)
    # the embedding, the layers, and the head after the last layer's mark
    assert layers.num_layers == TINY.num_layers + 2
    first = {n.primitive for n in graph.nodes
             if layers.layer[n.id] == 0 and layers.phase[n.id] == "forward"}
    assert "dot_general" not in first and first, first
    with pytest.raises(ValueError, match="set layer_markers=True too"):
        dataclasses.replace(TINY, embedding_marker=True)
