"""The Megatron baseline's context (cp) and expert (ep, etp) parallelism: Megatron's rules
as errors, the grid's cp/ep candidates, and the terms a plan adds against hand
computation on the DGX H100 profile (NVLink 450 GB/s, 5 us a step)."""

from __future__ import annotations

import optax
import pytest

from autopar.cluster import Cluster
from autopar.graph import trace
from autopar.manual import (
    AttentionShape,
    MegatronConfig,
    MoEShape,
    context_args,
    megatron_candidates,
    megatron_plan,
    megatron_plan_for_graph,
)
from autopar.manual._context_experts import local_attention_core
from examples import llama, moe

NVLINK_BW, NVLINK_LAT = 450e9, 5e-6
# 2 layers, hidden 128, 8 heads (head 16), 2 K/V heads, bf16, sequence 256
CFG = llama.LlamaConfig(512, 256, 128, 2, 8, 2, 352, dtype="bfloat16")
ATTENTION = AttentionShape(num_heads=8, num_kv_heads=2, head_dim=16, num_layers=2)


def _h100():
    return Cluster.from_profile("dgx-h100").with_shape(1, 8)


def _step(cfg=CFG, batch=8):
    opt = optax.adamw(1e-3)
    return (llama.make_train_step(cfg, opt), llama.abstract_state(cfg, opt),
            llama.abstract_batch(cfg, batch))


def test_config_rules_name_the_rule():
    rule = r"ep\*etp = 3\*2 = 6 must divide tp\*cp\*dp = 2\*1\*2 = 4"
    with pytest.raises(ValueError, match=rule):
        MegatronConfig(dp=2, tp=2, ep=3)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        MegatronConfig(dp=2, tp=2, cp=0)
    with pytest.raises(ValueError, match="unknown cp_algorithm 'zigzag'"):
        MegatronConfig(dp=2, tp=2, cp=2, cp_algorithm="zigzag")
    config = MegatronConfig(dp=2, tp=2, cp=2, ep=4, etp=1, cp_algorithm="all_gather")
    assert config.num_devices == 8
    assert config.name == "megatron(dp=2,tp=2,pp=1,cp=2(all_gather),ep=4,etp=1)"
    assert MegatronConfig(dp=2, tp=2, cp=2).name == "megatron(dp=2,tp=2,pp=1,cp=2)"


def test_bad_sequence_and_missing_shapes_fail_before_planning():
    step, state, batch = _step(llama.LlamaConfig(512, 204, 128, 2, 8, 2, 352))
    with pytest.raises(ValueError, match=r"2\*cp = 8 equal chunks.*seq_len=204"):
        megatron_plan(step, state, batch, cluster=_h100(), dp=2, tp=1, cp=4,
                      attention=ATTENTION)
    step, state, batch = _step()
    with pytest.raises(ValueError, match=r"pass attention=AttentionShape"):
        megatron_plan(step, state, batch, cluster=_h100(), dp=2, tp=2, cp=2)
    with pytest.raises(ValueError, match=r"3 query head\(s\) per tensor-parallel rank do "
                       r"not divide by 2"):
        megatron_plan(step, state, batch, cluster=_h100(), dp=2, tp=2, cp=2,
                      cp_algorithm="ulysses", attention=AttentionShape(6, 2, 16, 2))
    with pytest.raises(ValueError, match=r"ep=4 must divide the 6 routed experts"):
        megatron_plan(step, state, batch, cluster=_h100(), dp=4, tp=2, ep=4,
                      moe=MoEShape(6, 2, 64, 128, 2, 2))


def test_traced_experts_take_only_the_data_axis():
    cfg = moe.CONFIGS["tiny"]
    opt = optax.adamw(1e-3)
    step = moe.make_train_step(cfg, opt)
    state, batch = moe.abstract_state(cfg, opt), moe.abstract_batch(cfg, 8)
    with pytest.raises(ValueError, match=r"ep=2, etp=None cannot be laid out"):
        megatron_plan(step, state, batch, cluster=_h100(), dp=4, tp=2, ep=2)


def test_grid_has_cp_for_long_sequences_and_prunes_uneven_chunks():
    found = megatron_candidates(64, 8, 16, num_heads=64, cp_values=(1, 2, 4, 8, 16),
                                seq_len=131072)
    valid = [c for c, reason in found if not reason]
    assert {c.cp for c in valid} == {1, 2, 4, 8, 16}
    assert all(c.num_devices == 64 for c in valid)
    pruned = megatron_candidates(8, 8, 8, cp_values=(1, 4), seq_len=100)
    assert any(c.cp == 4 and "2*cp = 8 equal chunks" in reason for c, reason in pruned)
    experts = megatron_candidates(8, 8, 8, num_experts=8, ep_values=(1, 2, 4, 8, 3))
    eps = {(c.tp, c.ep, c.etp) for c, reason in experts if not reason}
    assert (1, 8, None) in eps and (2, 8, 1) in eps and (2, 8, None) not in eps  # 8*2 > 8
    assert not any(c.ep == 3 for c, _ in experts)  # 3 does not divide 8 experts


def _ring_terms(cluster, graph, mesh, micro_batch, cp, tp, layers):
    """Ring CP on a stage, per microbatch, by hand: the rank's attention core (dots and
    score-sized element-wise work) is cp x 3/4 (`ring_compute_fraction(2)`) the local
    piece the plan prices (`local_attention_core`), forward and backward, less the local
    piece; the ring's hops overlap the forward's dots at that price."""
    s, d = CFG.seq_len, CFG.head_dim
    kv_heads = max(1, CFG.num_kv_heads // tp)
    core = local_attention_core(graph, cluster, mesh, s // cp)
    factor = cp * (cp + 1) / (2 * cp)
    compute = (factor - 1) * (core.forward + core.backward)
    block = 2 * micro_batch * s / cp * kv_heads * d * 2
    hop = NVLINK_LAT + block / NVLINK_BW
    forward = factor * core.forward_dots
    step = forward / cp
    fwd = (cp - 1) * max(step, hop) + step - forward
    bwd = (cp - 1) * max(2 * step, 2 * hop) + 2 * step + hop - 2 * forward
    return layers * compute, layers * (fwd + bwd), 2 * block


def test_cp_terms_against_hand_computation():
    cluster = _h100()
    step, state, batch = _step()
    args = context_args((state, batch), (1,), 2)
    graph = trace(step, *args, batch_argnums=(1,))
    base = megatron_plan_for_graph(graph, cluster, MegatronConfig(dp=4, tp=2))
    plan = megatron_plan_for_graph(graph, cluster, MegatronConfig(dp=2, tp=2, cp=2),
                                   attention=ATTENTION)
    compute, comm, buffers = _ring_terms(cluster, graph, plan.stages[0].mesh,
                                         micro_batch=4, cp=2, tp=2, layers=2)
    assert compute > 0
    assert plan.stages[0].sharding.cost.compute == pytest.approx(
        base.stages[0].sharding.cost.compute + compute)
    assert plan.stages[0].sharding.cost.communication == pytest.approx(
        base.stages[0].sharding.cost.communication + comm)
    assert plan.stages[0].memory_per_device == pytest.approx(
        base.stages[0].memory_per_device + buffers)
    assert plan.method == "megatron(dp=2,tp=2,pp=1,cp=2)"
    assert any("priced, not run" in w for w in plan.warnings)


def test_ep_terms_against_hand_computation():
    # The MoE's dense proxy: 8 experts of width 176, top-2, so a SwiGLU of 352.
    shape = MoEShape(num_experts=8, top_k=2, expert_ffn=176, hidden=128, num_moe_layers=2,
                     num_layers=2)
    assert shape.proxy_ffn == CFG.ffn_hidden
    cluster = _h100()
    step, state, batch = _step()
    graph = trace(step, state, batch, batch_argnums=(1,))
    config = MegatronConfig(dp=4, tp=2, ep=4, etp=1)
    base = megatron_plan_for_graph(graph, cluster, MegatronConfig(dp=4, tp=2))
    plan = megatron_plan_for_graph(graph, cluster, config, moe=shape)
    # each device dispatches its 1/tp of 2 sequences of 256: 256 tokens, top-2, hidden 128
    nbytes = 256 * 2 * 128 * 2
    a2a = 3 * NVLINK_LAT + 3 / 4 * nbytes / NVLINK_BW  # ep 4 inside the host
    assert plan.stages[0].sharding.cost.communication == pytest.approx(
        base.stages[0].sharding.cost.communication + 2 * 4 * a2a)
    # state: 8/4 experts whole (etp 1) in place of 2 split tp=2 ways, per layer, in
    # bf16 weights + fp32 gradients + fp32 master and two moments
    params = (8 / 4 - 2 / 2) * 3 * 128 * 176
    state_bytes = 2 * params * (2 + 4 + 4 + 8)
    routed = 256 * 2 * (2 * 128 + 3 * 176) * 2
    assert plan.stages[0].memory_per_device == pytest.approx(
        base.stages[0].memory_per_device + state_bytes + 2 * routed)
    overlapped = megatron_plan_for_graph(
        graph, cluster, config, moe=MoEShape(8, 2, 176, 128, 2, 2, overlap=True))
    hidden = min(2 * 4 * a2a, base.stages[0].sharding.cost.compute)
    assert overlapped.stages[0].sharding.cost.communication == pytest.approx(
        plan.stages[0].sharding.cost.communication - hidden)


def test_cp_core_by_formula_is_named_in_the_warnings(monkeypatch):
    # a step whose attention's roles cannot be named falls back to the dots by formula
    # (`formula_core`): the plan says so instead of pricing it silently
    import autopar.manual._megatron as megatron

    cluster = _h100()
    step, state, batch = _step()
    graph = trace(step, *context_args((state, batch), (1,), 2), batch_argnums=(1,))
    config = MegatronConfig(dp=2, tp=2, cp=2)
    named = megatron_plan_for_graph(graph, cluster, config, attention=ATTENTION)
    assert not any("by formula" in w for w in named.warnings)
    monkeypatch.setattr(megatron, "local_attention_core", lambda *args, **kwargs: None)
    plan = megatron_plan_for_graph(graph, cluster, config, attention=ATTENTION)
    assert any("priced by formula (its dots only" in w for w in plan.warnings)
    # the fallback charges the dots alone, less than the named core's dots and more
    assert plan.stages[0].sharding.cost.compute < named.stages[0].sharding.cost.compute
