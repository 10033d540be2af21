"""Context parallelism: a small Llama trains like one device with each CP algorithm forced
and with the search's own choice (einsum attention; `jax.nn.dot_product_attention` in
scanned, rematerialised layers); the compiled HLO has the algorithm's collective; the plan
names the CP it chose; a CP request that cannot hold errors before any state is used.
The ring's kernel has tests of its own (tests/test_ring_attention.py); the ring planned
and lowered in place of the traced attention is tested in tests/test_ring_planned.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from helpers import compiled_hlo, run_steps

import autopar
from autopar.graph import trace
from autopar.intra._context import is_sequence_dot, score_vars
from autopar.lower import count_collectives
from examples import llama

CFG = dataclasses.replace(llama.CONFIGS["cp-test"], num_layers=1, seq_len=64)
BATCH = 2


def _cpu():
    return autopar.Cluster.from_profile("cpu-local")


def _setup(cfg):
    optimizer = optax.adamw(1e-2, eps=1e-6)
    state = llama.init_state(cfg, optimizer, jax.random.key(0))
    batch = llama.make_batch(cfg, BATCH, jax.random.key(1))
    return llama.make_train_step(cfg, optimizer), state, batch


@pytest.fixture(scope="module")
def reference():
    """One device's three losses (einsum attention), shared by the tests."""
    step, state, batch = _setup(CFG)
    losses, _ = run_steps(jax.jit(step), state, batch)
    return losses


def _run(cfg, mode, mesh_shape=(2, 4), **options):
    step, state, batch = _setup(cfg)
    par = autopar.autoparallel(step, cluster=_cpu(), donate_argnums=(), method="shard",
                               context_parallel=mode, mesh_shape=mesh_shape, **options)
    losses, _ = run_steps(par, state, batch)
    return par, losses, state, batch


@pytest.mark.parametrize("mode, collective", [("allgather", "all_gather"),
                                              ("ulysses", "all_to_all")])
def test_forced_algorithm_matches_one_device_and_has_its_collective(reference, mode,
                                                                     collective):
    par, losses, state, batch = _run(CFG, mode)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    context = par.plan.stages[0].sharding.context_parallel
    assert context.algorithm == mode and context.degree > 1, context
    # the plan's JSON and explain() name it
    data = json.loads(json.dumps(par.plan.to_json()))
    assert data["stages"][0]["sharding"]["context_parallel"]["algorithm"] == mode
    assert autopar.Plan.from_json(data).stages[0].sharding.context_parallel == context
    assert f"context parallel: {mode}, degree {context.degree}" in par.plan.explain()
    counts = count_collectives(compiled_hlo(par, state, batch))
    assert counts.get(collective, (0, 0))[0] > 0, counts
    step = llama.make_train_step(CFG, optax.adamw(1e-2, eps=1e-6))
    _check_layouts(par.plan.stages[0].sharding, trace(step, state, batch), mode)


def _check_layouts(sharding, graph, mode):
    """The score tensors and sequence matmuls split as `mode` says (intra/_context.py)."""
    sharding.check_graph(graph)
    axes = set(sharding.context_parallel.axes)
    scores = score_vars(graph)
    assert scores and all(graph.vars[v].shape[-1] == CFG.seq_len for v in scores)
    for v in scores:
        spec = sharding.var_specs[v]
        assert not spec[-1], (graph.vars[v].shape, spec)  # the keys stay whole
        heads = {a for dim in spec[1:-2] for a in dim}
        assert (set(spec[-2]) == axes) if mode == "allgather" else (axes <= heads), spec
    dots = [n for n in graph.nodes if is_sequence_dot(n, graph, CFG.seq_len)]
    assert dots and all(sharding.var_specs[n.inputs[0]][1] for n in dots)


def test_search_choice_matches_one_device(reference):
    par, losses, _, _ = _run(CFG, "auto")
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert par.plan.stages[0].sharding.context_parallel.algorithm in (
        "none", "allgather", "ulysses", "ring")


def test_none_keeps_attention_whole():
    step, state, batch = _setup(CFG)
    plan = autopar.plan(step, state, batch, cluster=_cpu(), method="shard", mesh_shape=(2, 4),
                        context_parallel="none")
    assert plan.stages[0].sharding.context_parallel.algorithm == "none"
    assert "context_parallel" not in plan.to_json()["stages"][0]["sharding"]
    assert "context parallel:" not in plan.explain()


def test_scanned_remat_dot_product_attention_allgather_matches_one_device():
    cfg = dataclasses.replace(CFG, attention="dot_product_attention", num_layers=2,
                              scan_layers=True, remat_layers=True)
    step, state, batch = _setup(cfg)
    ref, _ = run_steps(jax.jit(step), state, batch)
    par, losses, _, _ = _run(cfg, "allgather")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert par.plan.stages[0].sharding.context_parallel.algorithm == "allgather"


def test_bad_requests_error_clearly_before_state_is_used():
    with pytest.raises(ValueError, match="unknown context_parallel 'zigzag'"):
        autopar.PlanOptions(context_parallel="zigzag")
    # 8 heads of 4 key/value heads, batch 2: on 8 devices no mesh splits the score tensor
    # [batch, kv heads, group, S, S] by heads over every axis the sequence uses.
    cfg = dataclasses.replace(CFG, num_heads=2, num_kv_heads=1, num_layers=1, seq_len=64,
                              hidden=32)
    step, state, batch = _setup(cfg)
    par = autopar.autoparallel(step, cluster=_cpu(), method="shard",
                               context_parallel="ulysses")  # donates the state
    with pytest.raises(ValueError, match=r"context_parallel='ulysses' cannot split "
                                         r"attention tensor \(2, 1, 2, 64, 64\)"):
        par(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    # a sequence no mesh axis divides
    cfg = dataclasses.replace(cfg, seq_len=63)
    step, state, batch = _setup(cfg)
    with pytest.raises(ValueError, match=r"context_parallel='allgather' cannot split "
                                         r"attention tensor .*sequence 63"):
        autopar.plan(step, state, batch, cluster=_cpu(), method="shard",
                     context_parallel="allgather")


@pytest.mark.extended  # two pipeline stages, remat: 175 s wall on 2 loaded cores
def test_allgather_under_pipelining_and_remat_matches_one_device():
    cfg = dataclasses.replace(CFG, num_layers=2, layer_markers=True)
    step, state, batch = _setup(cfg)
    ref, _ = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, cluster=_cpu(), donate_argnums=(), method="auto",
                               num_stages=2, num_microbatches=2, remat="full",
                               context_parallel="allgather")
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert par.plan.runtime == "pipeline" and par.plan.num_stages == 2
    for stage in par.plan.stages:
        assert stage.sharding.context_parallel.algorithm == "allgather"
        assert "full" in stage.remat
