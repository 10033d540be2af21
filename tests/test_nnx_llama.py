"""The flax NNX Llama (grouped-query attention, `nnx.Optimizer`) trains under
`autopar.autoparallel` on 8 devices like one device: the model and optimizer state go in
and out of the step as a pytree (`nnx.split` outside, `nnx.merge` inside)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import run_steps

import autopar
from examples import nnx_llama

TINY = nnx_llama.CONFIGS["tiny"]


def _check(cfg, **options):
    graphdefs, state = nnx_llama.init_state(cfg, optax.adamw(1e-2, eps=1e-6), jax.random.key(0))
    batch = nnx_llama.make_batch(cfg, 8, jax.random.key(1))
    step = nnx_llama.make_train_step(graphdefs)
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), donate_argnums=(), **options
    )
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert not [w for w in par.plan.warnings if "no sharding rule" in w], par.plan.warnings
    # The returned state is an nnx.State again: merge it back into a model.
    model, optimizer = nnx_llama.merge_train_state(graphdefs, par_state)
    assert int(optimizer.step[...]) == 3
    return par.plan, model


@pytest.mark.parametrize(
    "scan_layers",
    [pytest.param(False, marks=pytest.mark.extended), True],
    ids=["layers", "nnx_scan"],
)
def test_nnx_llama_shard_matches_one_device(scan_layers):
    plan, model = _check(
        dataclasses.replace(TINY, scan_layers=scan_layers), method="shard", mesh_shape=(2, 4)
    )
    paths = plan.specs_by_path()
    assert any(p.startswith("params/") and p.endswith("wq/kernel/value") for p in paths), paths
    assert any(p.startswith("opt_state/") for p in paths)


@pytest.mark.extended
def test_nnx_llama_pipelined_matches_one_device():
    plan, _ = _check(TINY, method="auto", num_stages=2, num_microbatches=2)
    assert plan.num_stages == 2


def _mid_size_plan(scan_layers):
    # Real widths (h=4096, 32 query / 8 key-value heads, SwiGLU 14336), 2 layers, 2 sequences
    # of 1024 tokens: weights outweigh activations, so tensor parallelism pays on an A100 node
    # (as for the functional Llama in tests/test_llama.py). Abstract state: nothing allocated.
    cfg = dataclasses.replace(nnx_llama.CONFIGS["mid-test"], scan_layers=scan_layers)
    graphdefs, state = nnx_llama.abstract_state(cfg, optax.adamw(1e-2))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    plan = autopar.plan(
        nnx_llama.make_train_step(graphdefs),
        state,
        nnx_llama.abstract_batch(cfg, batch_size=2),
        cluster=autopar.Cluster.from_profile("dgx-a100-80g"),
        method="shard",
        cache=False,
    )
    return cfg, plan.specs_by_path()


_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def _matmul_kernels(specs):
    return {
        p: s
        for p, s in specs.items()
        if p.startswith("params/") and p.endswith("/kernel/value") and p.split("/")[-3] in _MATMULS
    }


def test_nnx_scan_mid_size_plan_on_an_a100_node_shards_every_matmul_kernel():
    _, specs = _mid_size_plan(scan_layers=True)
    kernels = _matmul_kernels(specs)
    assert len(kernels) == 7 + 1, sorted(kernels)  # stacked layer kernels, and the head
    for path, spec in kernels.items():
        if "/layers/" in path:  # [num_layers, d_in, d_out]: the layer dim stays whole
            assert len(spec) == 3 and spec[0] == (), (path, spec)
        assert any(spec), f"{path} replicated: {spec}"
    # Megatron's MLP: w_gate and w_up split by columns over the mesh axis w_down's rows use.
    mlp = {k: specs[f"params/layers/mlp/{k}/kernel/value"] for k in ("w_gate", "w_up", "w_down")}
    assert mlp["w_gate"][2] and mlp["w_gate"][2] == mlp["w_up"][2] == mlp["w_down"][1], mlp


@pytest.mark.extended  # 30 s on 2 cores; the nnx.scan form above is the default-tier twin
def test_nnx_layers_mid_size_plan_on_an_a100_node_shards_every_matmul_kernel():
    cfg, specs = _mid_size_plan(scan_layers=False)
    kernels = _matmul_kernels(specs)
    assert len(kernels) == 7 * cfg.num_layers + 1, sorted(kernels)
    replicated = [p for p, s in kernels.items() if not any(s)]
    assert not replicated, f"replicated matmul kernels: {replicated}"
    for layer in range(cfg.num_layers):
        mlp = {
            k: specs[f"params/layers/{layer}/mlp/{k}/kernel/value"]
            for k in ("w_gate", "w_up", "w_down")
        }
        assert mlp["w_gate"][1] and mlp["w_gate"][1] == mlp["w_up"][1] == mlp["w_down"][0], mlp
