"""Ring context parallelism planned end to end: `context_parallel="ring"` plans the
all-gather layouts and the lowering runs each traced attention's forward and backward
with the ring kernel and its VJP (`autopar.lower._ring_lowering`). A small Llama trains
like one device; the compiled HLO has the ring's collective-permutes and no all-gather
of K/V; a sequence that does not split into 2·cp chunks is refused before any state is
used; "auto" takes the ring where the cost model says it pays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compiled_hlo, run_steps
from test_context_parallel import CFG, _cpu, _run, _setup

import autopar
from autopar.lower import count_collectives
from examples import llama


def ring_permutes_per_layer(cp: int) -> int:
    """Collective-permutes of one layer's ring attention in the compiled step: forward,
    2·(cp − 1) K/V hops, two per tensor to swap Q, K and V into zig-zag order and two to
    swap the output back; the backward transposes each of them once (its recomputed
    forward is the forward's, merged by XLA)."""
    forward = 2 * (cp - 1) + 3 * 2 + 2
    return 2 * forward


def test_ring_forced_matches_one_device_and_counts_its_permutes(reference):
    par, losses, state, batch = _run(CFG, "ring")
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    context = par.plan.stages[0].sharding.context_parallel
    assert context.algorithm == "ring" and context.degree > 1, context
    assert f"context parallel: ring, degree {context.degree}" in par.plan.explain()
    counts = count_collectives(compiled_hlo(par, state, batch))
    assert counts["send_recv"][0] == CFG.num_layers * ring_permutes_per_layer(
        context.degree), counts


@pytest.fixture(scope="module")
def reference():
    step, state, batch = _setup(CFG)
    losses, _ = run_steps(jax.jit(step), state, batch)
    return losses


def test_a_sequence_not_in_2cp_chunks_is_refused_before_state_is_used():
    # 66 tokens: 2·cp divides it for no cp of 2, 4 or 8 (all-gather could split it by 2)
    cfg = dataclasses.replace(CFG, seq_len=66)
    step, state, batch = _setup(cfg)
    par = autopar.autoparallel(step, cluster=_cpu(), method="shard", mesh_shape=(2, 4),
                               context_parallel="ring")  # donates the state
    with pytest.raises(ValueError, match=r"context_parallel='ring' cannot split attention "
                                         r"tensor .*sequence 66 in 2·cp equal chunks"):
        par(state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.extended  # scanned remat layers, one more compile: ~50 s on 2 loaded cores;
# the default suite covers the ring's lowering with test_ring_forced_matches_one_device...
def test_scanned_remat_dot_product_attention_ring_matches_one_device():
    cfg = dataclasses.replace(CFG, attention="dot_product_attention", num_layers=2,
                              scan_layers=True, remat_layers=True)
    step, state, batch = _setup(cfg)
    ref, _ = run_steps(jax.jit(step), state, batch)
    par, losses, _, _ = _run(cfg, "ring")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert par.plan.stages[0].sharding.context_parallel.algorithm == "ring"


def test_auto_takes_the_ring_where_it_pays():
    """One wide-ish layer at 32,768 tokens on two DGX H100 hosts (plan only): the ring's
    hops hide behind its blocks and it skips the masked half of the scores, so "auto"
    plans the forced ring's plan, faster than the all-gather's."""
    cfg = dataclasses.replace(CFG, num_layers=1, seq_len=32768, hidden=512, num_heads=8,
                              num_kv_heads=8, ffn_hidden=1024)
    optimizer = optax.adamw(1e-2, eps=1e-6)
    args = (llama.make_train_step(cfg, optimizer), llama.abstract_state(cfg, optimizer),
            llama.abstract_batch(cfg, 1))
    cluster = autopar.Cluster.from_profile("dgx-h100", num_hosts=2)
    plans = {mode: autopar.plan(*args, cluster=cluster, method="shard", mesh_shape=(2, 8),
                                context_parallel=mode)
             for mode in ("auto", "ring", "allgather")}
    auto = plans["auto"]
    assert auto.stages[0].sharding.context_parallel.algorithm == "ring"
    assert auto.predicted_step_time == plans["ring"].predicted_step_time
    assert auto.predicted_step_time < plans["allgather"].predicted_step_time
    # The plan's peak is the liveness walk's with the ring's buffers in it
    # (`ring_buffer_temporaries`; by hand in tests/test_ring_memory.py), not without.
    from autopar.graph import tied_state, trace
    from autopar.intra._liveness import peak_live_bytes
    from autopar.intra._ring_strategies import ring_buffer_temporaries

    graph = trace(*args, batch_argnums=(1,))
    ring = plans["ring"].stages[0].sharding
    buffers = ring_buffer_temporaries(graph, ring.var_specs, ring.node_strategies, ring.mesh)
    assert len(buffers) == 2  # the forward's and the backward's, one attention
    walk = dict(donated=[u for _, u in tied_state(graph, (0,))],
                operand_specs=ring.operand_specs, fused_attention=cluster.fused_attention)
    peak = peak_live_bytes(graph, ring.var_specs, ring.mesh, extra=buffers, **walk)
    assert plans["ring"].stages[0].memory_per_device == peak
    assert peak > peak_live_bytes(graph, ring.var_specs, ring.mesh, **walk)


@pytest.mark.extended  # two pipeline stages, full remat: ~150 s on 2 loaded cores; the
# default suite covers the ring's lowering in one program (test_ring_forced_matches...)
def test_ring_under_pipelining_and_remat_matches_one_device():
    cfg = dataclasses.replace(CFG, num_layers=2, layer_markers=True)
    step, state, batch = _setup(cfg)
    ref, _ = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, cluster=_cpu(), donate_argnums=(), method="auto",
                               num_stages=2, num_microbatches=2, remat="full",
                               context_parallel="ring")
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert par.plan.runtime == "pipeline" and par.plan.num_stages == 2
    for stage in par.plan.stages:
        assert stage.sharding.context_parallel.algorithm == "ring"


def test_attention_the_ring_cannot_run_is_named():
    """Attention without a causal mask is not what the ring computes: the roles refuse it,
    naming the node and the fix (so "auto" offers no ring, and a forced ring fails at
    compile time, before the step runs)."""
    from autopar.graph import trace
    from autopar.intra._attention_roles import AttentionRoles, attention_components
    from autopar.intra._context import sequence_length

    def loss(w, x):
        q, k, v = (jnp.einsum("bsh,hnd->bsnd", x, w[i]) for i in range(3))
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / 2.0  # head size 4, no mask
        return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores), v).sum()

    w, x = jnp.ones((3, 8, 2, 4)), jnp.ones((1, 16, 8))
    graph = trace(jax.grad(loss), w, x)
    seq_len = sequence_length(graph)
    (component,) = attention_components(graph, seq_len)
    with pytest.raises(ValueError, match=r"context_parallel='ring' cannot run the attention "
                                         r"at .* no mask between Q K\^T and the softmax.*"
                                         r"use context_parallel='allgather'"):
        AttentionRoles(graph, component, seq_len)
