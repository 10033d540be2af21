"""Rematerialization as a searched choice (issue 15): what a layer drops and reruns, what it
costs, how the stage DP picks it, how it runs.

- cost: full recompute adds exactly one forward and keeps only the layer input (by hand);
  selective drops exactly the attention core's sequence x sequence tensors;
- lowering: the rewritten segments compute the same loss and gradients as the whole step
  (cheap: one device, no planning), and planned runs with selective and full recompute
  match one device for GPT and MoE, one stage and two (`extended`, except one);
- search: "auto" recomputes only where a stage would not fit; options are validated;
  the plan JSON round-trips; the Megatron layouts of GPT-3 175B and MT-NLG 530B fit
  80 GB with selective recompute (`extended`; figures in
  benchmarks/investigations/bench_remat_memory.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax
import pytest
from helpers import NO_MICROBATCH_CHECK

import autopar
from autopar.cost import (
    LayerCost,
    StageMemory,
    compute_time,
    device_flops,
    full_recompute_cost,
    fused_rerun_seconds,
    fusion_boundary_bytes,
    selective_recompute_cost,
    stage_memory,
    stage_memory_parts,
)
from autopar.graph import Role, trace
from autopar.inter import LayerCostTable, assign_layers, partition, with_remat
from autopar.inter._stage_fit import choose_remat
from autopar.inter.passes import attention_core, recompute
from autopar.intra._options import ShardOptions
from autopar.manual import MegatronConfig
from autopar.plan import Plan
from autopar.search import PlanOptions
from examples import gpt, moe

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)
MOE = dataclasses.replace(moe.CONFIGS["tiny"], layer_markers=True)


def _gpt_graph(rows=4, cfg=GPT, module=gpt):
    optimizer = optax.sgd(1e-2)
    step = module.make_train_step(cfg, optimizer)
    state = module.init_state(cfg, optimizer, jax.random.key(0))
    batch = module.make_batch(cfg, rows, jax.random.key(1))
    return step, state, batch, trace(step, state, batch)


# ---- cost formulas, by hand --------------------------------------------------------------


def test_full_recompute_adds_one_forward_and_keeps_the_input():
    base = LayerCost(latency=10e-3, memory=300.0, activation_memory=100.0, state_memory=150.0,
                     gradient_memory=30.0)  # transient 20
    full = full_recompute_cost(base, forward_seconds=3e-3, input_bytes=8.0)
    assert full.latency == pytest.approx(13e-3)
    assert full.activation_memory == 8.0
    assert full.transient_memory == pytest.approx(20.0 + 100.0)  # the layer's own, again
    assert full.state_memory == 150.0 and full.gradient_memory == 30.0
    # Four in flight: 150 + 30 + 4 x 8 + 120 instead of 150 + 30 + 4 x 100 + 20.
    assert stage_memory([full], 4) == pytest.approx(332.0)
    assert stage_memory([base], 4) == pytest.approx(600.0)


def test_stage_memory_by_part_by_hand():
    """Two layers (10 + 10 MB state, 10 + 10 MB gradients, 4 + 4 MB kept, 1 and 3 MB
    working), 2 microbatches in flight, 2 MB of the state a weight both read (a tied
    embedding): 18 + 20 + 16 + 3 = 57 MB."""
    mb = 1e6
    costs = [LayerCost(latency=1.0, memory=(10 + 10 + 4 + w) * mb, activation_memory=4 * mb,
                       state_memory=10 * mb, gradient_memory=10 * mb) for w in (1, 3)]
    parts = stage_memory_parts(costs, 2, shared_state=2 * mb)
    assert (parts.state, parts.gradients, parts.activations, parts.working) == pytest.approx(
        (18 * mb, 20 * mb, 16 * mb, 3 * mb))
    assert parts.total == pytest.approx(57 * mb)
    assert stage_memory(costs, 2) == pytest.approx(59 * mb)  # nothing shared
    assert StageMemory.from_json(parts.to_json()) == parts
    assert parts.scaled(2).total == pytest.approx(114 * mb)
    with pytest.raises(ValueError, match="shared_state"):
        stage_memory_parts(costs, 2, shared_state=-1.0)


def test_selective_recompute_drops_the_core_only():
    base = LayerCost(latency=10e-3, memory=300.0, activation_memory=100.0, state_memory=150.0,
                     gradient_memory=30.0)
    sel = selective_recompute_cost(base, core_seconds=0.5e-3, core_bytes=40.0)
    assert sel.latency == pytest.approx(10.5e-3)
    assert sel.activation_memory == 60.0
    assert sel.transient_memory == pytest.approx(60.0)
    with pytest.raises(ValueError, match="non-negative"):
        selective_recompute_cost(base, -1.0, 1.0)


def test_fused_rerun_costs_its_flops_by_hand():
    """`fused_rerun_seconds`: each rerun node's FLOPs per device at its dtype's rate, no
    bytes (it reads the stored value in place of the kept one). dgx-a100-80g: float32
    156 TFLOP/s and bfloat16 312 TFLOP/s peak, matmul_efficiency 0.7."""
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    work = [(4e6, "float32"), (2e6, "bfloat16"), (0.0, "float32")]
    by_hand = 4e6 / (156e12 * 0.7) + 2e6 / (312e12 * 0.7)  # 3.663e-8 + 9.16e-9 s
    assert fused_rerun_seconds(work, cluster) == pytest.approx(by_hand, rel=1e-12)
    assert fused_rerun_seconds([], cluster) == 0.0


def test_layer_table_prices_full_as_one_forward_and_the_input():
    """On one device the rerun of layer 1 (a transformer block) costs what its forward
    costs: the roofline time of every one of its forward nodes, each at the rate of its
    operand dtypes, GEMMs at the profile's efficiency by size, and only the bytes that
    cross its fusion's boundary (`fusion_traffic` of the layer); and it keeps only its
    input, the residual stream."""
    from autopar.cost import MATMUL_PRIMITIVES, rate_dtype
    from autopar.graph import fusion_traffic

    _, _, _, graph = _gpt_graph()
    layers = assign_layers(graph)
    cluster = autopar.Cluster.from_profile("cpu-local", num_hosts=1)
    table = LayerCostTable(graph, layers, cluster, ShardOptions(method="shard"), ())
    base = table.cost(1, (1,))
    full = table.remat_cost(1, (1,), 0, "full")
    sub = table.per_layer.stage_graphs[1]
    forward = table.per_layer.forward[1].nodes
    traffic = fusion_traffic(sub)
    by_hand = 0.0
    for n in forward:
        node = sub.nodes[n]
        if node.primitive == "layer_boundary":
            continue  # a marker: no work
        accessed = fusion_boundary_bytes([sub.vars[v].nbytes for v in node.inputs],
                                         [sub.vars[v].nbytes for v in node.outputs],
                                         traffic.reads[n], traffic.writes[n])
        dtype = rate_dtype(node.primitive, [sub.vars[v].dtype for v in node.inputs],
                           sub.vars[node.outputs[0]].dtype)
        by_hand += compute_time(node.flops, accessed, cluster, dtype,
                                matmul=node.primitive in MATMUL_PRIMITIVES)
    # The whole forward's rerun replaces the fused rerun `base` already has (below).
    fused = table.fused_seconds(1, (1,))
    # agrees to 0.007% (3.7e-8 s of 5.0e-4 s); the node behind the gap is not pinned down
    assert full.latency - base.latency + fused == pytest.approx(by_hand, rel=1e-3)
    # Without recompute the backward still reruns the kept values the forward made inside
    # its fusions (`with_remat`: GELU's tanh and powers, the layer norms' centred inputs),
    # at their FLOPs only (one device: all of them), on top of the layer's ILP cost.
    rerun = [sub.nodes[n] for n in table.fused_rerun(1).nodes]
    assert {"tanh", "integer_pow", "sub"} <= {node.primitive for node in rerun}
    fused_by_hand = sum(node.flops / device_flops(cluster, sub.vars[node.outputs[0]].dtype)
                        for node in rerun)
    assert fused == pytest.approx(fused_by_hand, rel=1e-12) and fused > 0
    assert base.latency == pytest.approx(table.plan(1, (1,)).cost.total + fused, rel=1e-12)
    rows, seq, hidden = 4, GPT.seq_len, GPT.hidden
    assert full.activation_memory == rows * seq * hidden * 4  # the block's float32 input
    assert full.transient_memory == pytest.approx(base.transient_memory + base.activation_memory)


def _first_block():
    """The GPT's first block cut out as its own layer: its graph, forward segment, the
    values its backward reads from the forward, and their attention core."""
    _, _, _, graph = _gpt_graph()
    layers = assign_layers(graph)
    part = partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)])
    sub, fwd, bwd = part.stage_graphs[1], part.forward[1], part.backward[1]
    kept = set(fwd.outputs) & set(bwd.inputs)
    return sub, fwd, kept, attention_core(sub, fwd.nodes, kept)


def test_selective_drops_exactly_the_attention_scores():
    sub, fwd, kept, core = _first_block()
    shape = (4, GPT.num_heads, GPT.seq_len, GPT.seq_len)
    assert core and all(sub.vars[v].shape == shape for v in core)
    assert not [v for v in kept - core if sub.vars[v].shape[-2:] == shape[-2:]]
    rerun = recompute(sub, fwd.nodes, kept, "selective")
    assert rerun.dropped == core
    assert not rerun.added  # query and key are kept anyway
    assert {sub.nodes[n].primitive for n in rerun.nodes} >= {"dot_general", "exp"}
    assert "dot_general" in {sub.nodes[n].primitive for n in rerun.nodes}
    # The rerun is the attention core only: no parameter-reading matmul (QKV, MLP).
    assert not any(
        sub.vars[v].role is Role.PARAM for n in rerun.nodes for v in sub.nodes[n].inputs
    )


def test_selective_leaves_a_score_shaped_value_the_layer_does_not_make():
    """A kept value shaped like the scores but made outside the layer's forward (a causal
    mask made once and read by every layer) is not dropped; it used to raise KeyError
    (llama-70B's Megatron grid)."""
    sub, fwd, kept, core = _first_block()
    made_elsewhere = min(core)
    forward = [n for n in fwd.nodes if made_elsewhere not in sub.nodes[n].outputs]
    rerun = recompute(sub, forward, kept, "selective")
    assert made_elsewhere not in rerun.dropped
    assert rerun.dropped == core - {made_elsewhere}


# ---- lowering ----------------------------------------------------------------------------


def _run_segments(graph, part, state, batch):
    """Run the partition's forward then backward segments on one device, each reading only
    its declared inputs; the grad-boundary operands (accumulated gradients) come back."""
    flat = jax.tree.leaves((state, batch))
    values = dict(zip(graph.invars, flat))
    for seg in (*part.forward, *reversed(part.backward)):
        sub = part.stage_graphs[seg.stage]
        env = {v: values[v] for v in seg.inputs}
        sub.run_nodes(env, [sub.nodes[n] for n in seg.nodes])
        values.update({v: env[v] for v in seg.outputs})
    return values


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_rewritten_segments_compute_the_same_gradients(model):
    cfg, module = (GPT, gpt) if model == "gpt" else (MOE, moe)
    _, state, batch, graph = _gpt_graph(cfg=cfg, module=module)
    layers = assign_layers(graph)
    n = layers.num_layers
    stages = [(0, 2), (2, n)]
    plain = partition(graph, layers, stages)
    want = _run_segments(graph, plain, state, batch)
    grads = list(plain.grad_vars)
    for remat in ("selective", "full"):
        remats = [(remat,) * (b - a) for a, b in stages]
        part = with_remat(graph, partition(graph, layers, stages), layers, remats)
        got = _run_segments(graph, part, state, batch)
        for v in grads:
            np.testing.assert_allclose(got[v], want[v], rtol=1e-5, atol=1e-7)
        kept_before = sum(graph.vars[v].nbytes for v in plain.forward[0].outputs)
        kept_after = sum(graph.vars[v].nbytes for v in part.forward[0].outputs)
        assert kept_after < kept_before, remat
        assert len(part.backward[0].nodes) > len(plain.backward[0].nodes)


def _planned_loss(step, state, batch, remat, num_stages):
    devices = 8 // num_stages
    train = autopar.autoparallel(
        step, cluster="cpu-local", remat=remat, num_stages=num_stages, num_microbatches=2,
        submeshes=[(1, devices)], logical_shapes=[(devices,)], cache=False,
        donate_argnums=(), **NO_MICROBATCH_CHECK,
    )
    _, metrics = train(state, batch)
    return train.plan, metrics["loss"]


@pytest.mark.extended
def test_full_remat_two_stages_matches_one_device():
    step, state, batch, _ = _gpt_graph(rows=8)
    want = jax.jit(step)(state, batch)[1]["loss"]
    plan, loss = _planned_loss(step, state, batch, "full", 2)
    assert all("full" in r for r in plan.stage_remat)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    assert "remat: layers" in plan.explain()


@pytest.mark.extended
@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("remat", ["selective", "full"])
@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_remat_matches_one_device(model, remat, num_stages):
    cfg, module = (GPT, gpt) if model == "gpt" else (MOE, moe)
    step, state, batch, _ = _gpt_graph(rows=8, cfg=cfg, module=module)
    want = jax.jit(step)(state, batch)[1]["loss"]
    plan, loss = _planned_loss(step, state, batch, remat, num_stages)
    assert any(remat in r for r in plan.stage_remat)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


# ---- search ------------------------------------------------------------------------------


def test_auto_recomputes_only_what_does_not_fit():
    _, _, _, graph = _gpt_graph()
    layers = assign_layers(graph)
    cluster = autopar.Cluster.from_profile("cpu-local", num_hosts=1)
    table = LayerCostTable(graph, layers, cluster, ShardOptions(method="shard"), ())
    blocks = range(1, layers.num_layers - 1)
    roomy = choose_remat(table, blocks, (1,), 0, 4, math.inf)
    assert set(roomy.remat) == {"none"}
    full = choose_remat(table, blocks, (1,), 0, 4, math.inf, "full")
    budget = (roomy.memory + full.memory) / 2
    tight = choose_remat(table, blocks, (1,), 0, 4, budget)
    assert tight.memory <= budget < roomy.memory
    assert "none" in tight.remat or "selective" in tight.remat  # not everything recomputed
    assert roomy.latency < tight.latency <= full.latency


def test_remat_option_is_checked_and_keyed():
    with pytest.raises(ValueError, match="unknown remat 'some'; choose one of 'auto'"):
        autopar.autoparallel(lambda s, b: (s, {}), remat="some")
    with pytest.raises(ValueError, match="unknown recompute 'all'"):
        MegatronConfig(dp=1, tp=2, recompute="all")
    assert PlanOptions().remat == "auto"
    assert dataclasses.asdict(PlanOptions(remat="full")) != dataclasses.asdict(PlanOptions())
    assert MegatronConfig(dp=1, tp=2, recompute="selective").name.endswith(
        ",recompute=selective)")


def test_plan_json_keeps_the_remat_choice_and_runs_it(tmp_path):
    """A one-stage plan with selective recompute (gradient accumulation over two
    microbatches) saves, loads, and runs as one device does."""
    step, state, batch, _ = _gpt_graph(rows=8)
    plan = autopar.plan(step, state, batch, cluster="cpu-local", remat="selective",
                        num_stages=1, num_microbatches=2, submeshes=[(1, 8)],
                        logical_shapes=[(8,)], cache=False, **NO_MICROBATCH_CHECK)
    assert plan.stages[0].remat[1] == "selective" and plan.stages[0].recompute_time > 0
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == plan and again.stage_remat == plan.stage_remat
    assert again.predicted_step_time == pytest.approx(plan.predicted_step_time)
    assert "remat: layers" in again.explain()
    # The predicted memory by part comes back with the plan, and adds up to its total.
    parts = again.stages[0].memory_parts
    assert parts == plan.stages[0].memory_parts and parts.in_flight == 1
    assert again.stages[0].memory_per_device == pytest.approx(parts.total)
    assert parts.total == pytest.approx(plan.stages[0].predicted_memory)
    assert "kept activations" in again.explain()
    want = jax.jit(step)(state, batch)[1]["loss"]
    train = autopar.autoparallel(step, plan=again, donate_argnums=())
    _, metrics = train(state, batch)
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)


def test_selective_reruns_the_attention_core_in_the_compiled_backward():
    """The compiled backward program of a stage of two transformer blocks gains exactly
    one matmul (queries x keys) and one exponential (softmax) per block with "selective",
    and nothing else of the kind: the parameter matmuls are not rerun. (XLA:CPU, measured:
    24 -> 26 dots, 0 -> 2 exponentials.)"""
    _, _, _, graph = _gpt_graph()
    layers = assign_layers(graph)
    stages = [(0, 2), (2, layers.num_layers)]

    def compiled_backward(part):
        seg, sub = part.backward[0], part.stage_graphs[0]

        def run(*ins):
            env = dict(zip(seg.inputs, ins))
            sub.run_nodes(env, [sub.nodes[n] for n in seg.nodes])
            return [env[v] for v in seg.outputs]

        avals = [jax.ShapeDtypeStruct(graph.vars[v].shape, graph.vars[v].dtype)
                 for v in seg.inputs]
        return jax.jit(run).lower(*avals).compile().as_text()

    # "none" reruns the values made inside forward fusions (`fused_recompute`), no matmul
    none = [("none",) * 2, ("none",) * (layers.num_layers - 2)]
    plain = compiled_backward(with_remat(graph, partition(graph, layers, stages), layers, none))
    assert plain.count(" dot(") == compiled_backward(partition(graph, layers, stages)).count(
        " dot(")
    remats = [("selective",) * 2, ("none",) * (layers.num_layers - 2)]
    selective = compiled_backward(with_remat(graph, partition(graph, layers, stages), layers,
                                             remats))
    assert selective.count(" dot(") - plain.count(" dot(") == 2
    assert selective.count(" exponential(") - plain.count(" exponential(") == 2


# ---- large models: GPT-3 175B on 64 A100-80GB ---------------------------------------------

GPT3 = dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, tp=8, pp=8)


def test_stored_residuals_of_a_gelu_mlp():
    """`gelu(x @ w1 + b1) @ w2` (`autopar.graph.stored_residuals`' example): the backward
    reads the GELU's inner values (tanh, powers) and its output; of the forward's values,
    stored are the first dot's result and the GELU's output (read by the second dot),
    nothing else (Korthikanti et al. 2022, section 4.1: the GELU's input and the second
    linear's input; x is the step's input, held anyway)."""
    from autopar.graph import stored_residuals
    from autopar.manual._sequence import forward_nodes

    def loss_fn(params, x):
        return jax.numpy.sum(gpt.gelu(x @ params["w1"] + params["b1"]) @ params["w2"])

    def step(params, x):
        loss, grads = autopar.value_and_grad(loss_fn)(params, x)
        return loss, grads

    params = {"w1": np.ones((8, 32), np.float32), "b1": np.ones((32,), np.float32),
              "w2": np.ones((32, 8), np.float32)}
    graph = trace(step, params, np.ones((4, 8), np.float32))
    forward = sorted(forward_nodes(graph))
    made = {v for n in forward for v in graph.nodes[n].outputs}
    read_later = {v for n in graph.nodes if n.id not in set(forward) for v in n.inputs}
    kept = {v for v in made & read_later if graph.vars[v].shape}  # not the loss
    state = (Role.PARAM, Role.OPT_STATE, Role.CONST)
    stored = stored_residuals(graph, forward, kept,
                              free=lambda v: graph.vars[v].role in state)
    producers = {v: n.primitive for n in graph.nodes for v in n.outputs}
    assert len(kept) > 3  # JAX's autodiff reads the GELU's intermediates
    assert sorted((graph.vars[v].shape, producers[v]) for v in stored) == [
        ((4, 32), "dot_general"), ((4, 32), "mul")
    ]


def _megatron_attention(p: dict, x, cfg):
    """`gpt.attention` with Megatron-LM's QKV layout: the fused projection's columns
    ordered head by head (q, k, v of each head together), so a column split over t devices
    gives each device whole heads and q, k, v stay split by heads."""
    b, s, _ = x.shape
    qkv = (x @ p["wqkv"] + p["bqkv"]).reshape(b, s, cfg.num_heads, 3, cfg.head_dim)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    scores = jax.numpy.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(cfg.head_dim)
    causal = jax.numpy.tril(jax.numpy.ones((s, s), dtype=bool))
    scores = jax.numpy.where(causal, scores, jax.numpy.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jax.numpy.einsum("bnqk,bknd->bqnd", weights, v).reshape(b, s, cfg.hidden)
    return out @ p["wo"] + p["bo"]


def test_layer_activation_bytes_follow_korthikanti(monkeypatch):
    """Per-layer kept bytes of a bf16 GPT layer with tensor + sequence parallelism t, against
    Korthikanti et al. 2022 (section 4.1, table 2; REFERENCES.md), microbatch b = 1:

    - tp + sp, no recompute: ``sbh (34/t + 5as/(ht))``. The paper's layer has dropout (a
      1-byte mask of sbh after attention and after the MLP, and in the core a 1-byte
      as^2b mask and its 2-byte output); ours has none, so the non-core term is 32 sbh/t.
      Its core is the softmax output, 2 as^2b/t; JAX differentiates softmax by the quotient
      rule, which also reads the exponentials: 4 as^2b/t.
    - tp + sp, selective recompute: ``34 sbh/t``, here 32 sbh/t (no dropout masks).
    - full recompute: the layer input only, ``2 sbh`` in the paper's table (before t);
      under sequence parallelism the input is split by sequence: 2 sbh/t.

    Beside these, each layer norm keeps its mean and variance, 2 x 4 bytes per token (f32)
    and the softmax its denominator, 4 bytes per (head, query): within `TOLERANCE`.
    The layer counts what XLA keeps: the GELU's and the layer norms' inner elementwise
    values are recomputed inside the backward's fusions (`autopar.graph.stored_residuals`),
    so the MLP keeps 2 x 8 sbh/t (the GELU's input and output), not every intermediate.
    """
    import autopar.inter
    from autopar.cluster import Cluster
    from autopar.manual import megatron_plan_for_graph
    from autopar.search import microbatch_args
    from examples.megatron_published import mixed_precision_adamw

    tolerance = 0.02
    s, h, a, t = 512, 1024, 16, 8
    cfg = gpt.GPTConfig(1024, s, h, 3, a, layer_markers=True, dtype="bfloat16")
    monkeypatch.setattr(gpt, "attention", _megatron_attention)
    optimizer = mixed_precision_adamw()
    step = gpt.make_train_step(cfg, optimizer)
    args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 2))
    graph = trace(step, *microbatch_args(args, (1,), 2), batch_argnums=(1,))
    cluster = Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    tables = []

    class Recorded(LayerCostTable):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tables.append(self)

    monkeypatch.setattr(autopar.inter, "LayerCostTable", Recorded)
    sbh = s * h
    core = 4 * a * s * s / t
    want = {"none": sbh * 32 / t + core, "selective": sbh * 32 / t, "full": sbh * 2 / t}
    config = MegatronConfig(dp=1, tp=t, pp=2, sequence_parallel=True, num_microbatches=2)
    megatron_plan_for_graph(graph, cluster, config)
    (table,) = tables
    for remat, expected in want.items():
        kept = table.remat_cost(1, (1, t), 0, remat).activation_memory  # a middle layer
        print(f"{remat}: {kept:.0f} B per device, {kept / sbh * t:.3f} sbh/t "
              f"(expected {expected / sbh * t:.3f})")
        assert kept == pytest.approx(expected, rel=tolerance), remat
    assert want["none"] - want["selective"] == core


def test_gpt3_175b_megatron_fits_with_selective_by_arithmetic():
    """Korthikanti et al. 2022 (section 4, with tensor and sequence parallelism t): a layer
    keeps ``sbh (34 / t + 5 a s / (h t))`` bytes per microbatch, the second term the
    attention core; state is 16 bytes per parameter (bf16 weights and gradients, fp32
    master and Adam moments). Through the cost model's formulas, stage 0 of tp 8 x pp 8
    (12 layers, 8 microbatches in flight under 1F1B) fits 80 GiB with selective recompute,
    and selective removes exactly the attention term."""
    from autopar.cost import in_flight_microbatches

    g = GPT3
    s, h, a, t = g["seq"], g["hidden"], g["heads"], g["tp"]
    sbh = s * 1 * h
    core = sbh * 5 * a * s / (h * t)
    kept = sbh * 34 / t + core
    params = 12 * h * h / t
    base = LayerCost(latency=1.0, memory=params * 16 + kept, activation_memory=kept,
                     state_memory=params * 14, gradient_memory=params * 2)
    selective = selective_recompute_cost(base, core_seconds=0.01, core_bytes=core)
    assert selective.activation_memory == pytest.approx(sbh * 34 / t)
    layers_per_stage = g["layers"] // g["pp"]
    in_flight = in_flight_microbatches("1f1b", 64, g["pp"])  # stage 0 of 8
    assert in_flight == 8
    embedding = g["vocab"] * h / t * 16
    memory = stage_memory([selective] * layers_per_stage, in_flight) + embedding
    assert memory < 80 * 2**30
    assert stage_memory([base] * layers_per_stage, in_flight) - (memory - embedding) == (
        pytest.approx(layers_per_stage * in_flight * core - core)
    )


@pytest.mark.extended
def test_gpt3_175b_megatron_plan_fits_with_selective():
    """The traced GPT-3 175B (abstract; examples/megatron_published.py): measured 67.8 GiB
    on stage 0 with selective recompute, 90.1 GiB without (does not fit)."""
    from examples.megatron_published import megatron_memory

    plan, fits, _ = megatron_memory("175B", "selective")
    assert fits and max(s.predicted_memory for s in plan.stages) <= 80 * 2**30
    assert all("selective" in s.remat for s in plan.stages[:-1])


def test_a_users_checkpoint_is_left_as_written():
    """Layers the user wrapped in `jax.checkpoint` already rerun their forward (the traced
    backward holds the rerun); remat adds nothing to them."""
    cfg = dataclasses.replace(GPT, remat_layers=True)
    _, _, _, graph = _gpt_graph(cfg=cfg)
    layers = assign_layers(graph)
    part = partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)])
    sub, fwd, bwd = part.stage_graphs[1], part.forward[1], part.backward[1]
    assert any(sub.nodes[n].remat for n in bwd.nodes)
    kept = set(fwd.outputs) & set(bwd.inputs)
    assert not kept  # the checkpoint keeps nothing of the forward but the layer's input
    for remat in ("selective", "full"):
        assert recompute(sub, fwd.nodes, kept, remat, bwd.nodes).nodes == ()


@pytest.mark.extended
def test_megatron_recompute_matches_one_device():
    """A Megatron plan (dp 2 x tp 2 x pp 2) with selective recompute runs as one device."""
    cfg = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, num_layers=2, layer_markers=True)
    opt = optax.sgd(1e-2)
    state = gpt.init_state(cfg, opt, jax.random.key(0))
    batch = gpt.make_batch(cfg, 8, jax.random.key(1))
    step = gpt.make_train_step(cfg, opt)
    plan = autopar.megatron_plan(step, state, batch, cluster="cpu-local", dp=2, tp=2, pp=2,
                                 num_microbatches=2, recompute="selective")
    assert plan.stages[0].remat == ("selective",) * (plan.stages[0].layers[1])
    assert plan.stages[0].recompute_time > 0
    want = jax.jit(step)(state, batch)[1]["loss"]
    train = autopar.autoparallel(step, plan=plan, donate_argnums=())
    _, metrics = train(state, batch)
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
