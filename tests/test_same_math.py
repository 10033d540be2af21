"""The same arithmetic costs the same whatever its form (issue 44, item 2).

Three pairs of programs that do identical arithmetic: a GPT's layers as a `jax.lax.scan`
over stacked weights and as a Python loop of blocks; causal attention as
`jax.nn.dot_product_attention` and as einsums; a layer under `jax.checkpoint` and not (the
checkpointed step's extra compute is one forward of the layer, recomputed in the
backward). Their FLOPs are checked against a hand count of the dots, then their predicted
compute (per node the roofline of its FLOPs and the bytes crossing its fusion's boundary,
`compute_time` over `fusion_traffic`, a scan's body weighed by its length as the planner
opens it, `expand_scans`) against each other within 2%, per profile.

What the runtime really does differently is priced as its own term, not in the compute:
XLA:CPU copies each iteration's slice of a stacked operand (`scan_slice_copies`), checked
against a hand count of the stacked bytes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.cost import compute_time, fusion_boundary_bytes
from autopar.cost._compute import MATMUL_PRIMITIVES, rate_dtype
from autopar.cost.backends import XLA_CPU, backend_for
from autopar.graph import Role, fusion_traffic, trace
from autopar.intra._scan import expand_scans
from examples import gpt

SAME = 0.02  # predicted compute of identical arithmetic: within 2%
PROFILES = ("cpu-local", "cpu-local-measured", "dgx-a100-80g", "dgx-h100")
CFG = gpt.GPTConfig(vocab_size=128, seq_len=16, hidden=64, num_layers=4, num_heads=4)
BATCH = 4


def _profile_cluster(name: str) -> autopar.Cluster:
    return autopar.Cluster.from_profile(name)


def predicted_compute(graph, cluster, fused_attention: bool = False) -> float:
    """Seconds of compute on one device: every node's roofline over the bytes crossing its
    fusion's boundary, an opened scan's body weighed by its length."""
    expansion = expand_scans(graph)
    weights = {}
    if expansion is not None:
        graph, weights = expansion.graph, expansion.weights
    traffic = fusion_traffic(graph, fused_attention)
    total = 0.0
    for node in graph.nodes:
        ins = [None if graph.vars[v].role is Role.CONST else graph.vars[v].nbytes
               for v in node.inputs]
        outs = [graph.vars[v].nbytes for v in node.outputs]
        dtype = rate_dtype(node.primitive, [graph.vars[v].dtype for v in node.inputs],
                           graph.vars[node.outputs[0]].dtype)
        accessed = fusion_boundary_bytes(ins, outs, traffic.reads[node.id],
                                         traffic.writes[node.id])
        seconds = compute_time(node.flops, accessed, cluster, dtype,
                               matmul=node.primitive in MATMUL_PRIMITIVES)
        total += weights.get(node.id, (1.0, 1.0))[0] * seconds
    return total


def dot_flops(graph) -> float:
    expansion = expand_scans(graph)
    weights = {}
    if expansion is not None:
        graph, weights = expansion.graph, expansion.weights
    return sum(weights.get(n.id, (1.0, 1.0))[0] * n.flops for n in graph.nodes
               if n.primitive == "dot_general")


def _gpt_graph(cfg):
    optimizer = optax.adamw(1e-3)
    step = gpt.make_train_step(cfg, optimizer)
    return trace(step, gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, BATCH),
                 batch_argnums=(1,))


def _gpt_dot_flops(cfg, recompute: bool) -> float:
    """Hand count: per layer the four weight GEMMs (12 h^2 per token) and the two attention
    products (2 s h per token), 2 FLOPs per multiply-add; the head 2 h V per token; a
    forward and a backward twice its size. With the layers checkpointed, the backward
    recomputes each layer's forward but its last GEMM (the MLP's output, 8 h^2 per token:
    only the residual add reads it, whose gradient needs no value of it)."""
    tokens, h, s = BATCH * CFG.seq_len, cfg.hidden, cfg.seq_len
    layer = 2 * tokens * (12 * h * h + 2 * s * h)
    head = 2 * tokens * h * cfg.vocab_size
    recomputed = layer - 2 * tokens * 4 * h * h if recompute else 0
    return (3 * layer + recomputed) * cfg.num_layers + 3 * head


@pytest.fixture(scope="module")
def gpt_graphs():
    return {
        "loop": _gpt_graph(CFG),
        "scan": _gpt_graph(dataclasses.replace(CFG, scan_layers=True)),
        "remat": _gpt_graph(dataclasses.replace(CFG, remat_layers=True)),
        "scan_remat": _gpt_graph(dataclasses.replace(CFG, scan_layers=True,
                                                     remat_layers=True)),
    }


def test_gpt_dots_match_the_hand_count(gpt_graphs):
    for form in ("loop", "scan"):
        assert dot_flops(gpt_graphs[form]) == pytest.approx(_gpt_dot_flops(CFG, False),
                                                             rel=1e-9)
    for form in ("remat", "scan_remat"):
        assert dot_flops(gpt_graphs[form]) == pytest.approx(_gpt_dot_flops(CFG, True),
                                                             rel=1e-9)


@pytest.mark.parametrize("profile", PROFILES)
def test_scan_and_loop_same_compute(gpt_graphs, profile):
    cluster = _profile_cluster(profile)
    fused = getattr(cluster, "fused_attention", False)
    scan = predicted_compute(gpt_graphs["scan"], cluster, fused)
    loop = predicted_compute(gpt_graphs["loop"], cluster, fused)
    assert abs(scan / loop - 1) <= SAME, (profile, scan, loop)
    scan = predicted_compute(gpt_graphs["scan_remat"], cluster, fused)
    loop = predicted_compute(gpt_graphs["remat"], cluster, fused)
    assert abs(scan / loop - 1) <= SAME, (profile, scan, loop)


def _loss_graph(cfg):
    """The loss alone (the step's forward part)."""
    params = gpt.abstract_state(cfg, optax.adamw(1e-3)).params
    return trace(lambda p, b: gpt.loss_fn(p, b, cfg), params, gpt.abstract_batch(cfg, BATCH),
                 batch_argnums=(1,))


@pytest.mark.parametrize("profile", PROFILES)
def test_checkpointed_forward_same_compute(profile):
    """`jax.checkpoint` around each layer: the forward part costs what it costs unchecked
    (the recomputation is the backward's: `test_gpt_dots_match_the_hand_count`), looped
    and scanned."""
    cluster = _profile_cluster(profile)
    fused = getattr(cluster, "fused_attention", False)
    for scan in (False, True):
        cfg = dataclasses.replace(CFG, scan_layers=scan)
        plain = predicted_compute(_loss_graph(cfg), cluster, fused)
        checkpointed = predicted_compute(
            _loss_graph(dataclasses.replace(cfg, remat_layers=True)), cluster, fused)
        assert abs(checkpointed / plain - 1) <= SAME, (profile, scan, checkpointed, plain)


def _attention_einsum(q, k, v):
    """Causal attention ``[B, S, N, D]`` with einsums (examples/gpt.py's)."""
    s, d = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bnqk,bknd->bqnd", weights, v)


def _attention_fused(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _attention_graph(fn):
    shape = jax.ShapeDtypeStruct((4, 64, 4, 32), jnp.float32)

    def step(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)

    return trace(step, shape, shape, shape)


# Profiles without a fused attention kernel (dgx-h100 has one).
EINSUM_PROFILES = tuple(p for p in PROFILES if p != "dgx-h100")


@pytest.mark.parametrize("profile", EINSUM_PROFILES)
def test_einsum_and_dot_product_attention_same_compute(profile):
    cluster = _profile_cluster(profile)
    einsum, fused = _attention_graph(_attention_einsum), _attention_graph(_attention_fused)
    # the two products forward, four backward: 6 x 2 B N S^2 D
    hand = 6 * 2 * 4 * 4 * 64 * 64 * 32
    assert dot_flops(einsum) == dot_flops(fused) == hand
    a, b = predicted_compute(einsum, cluster), predicted_compute(fused, cluster)
    assert abs(a / b - 1) <= SAME, (profile, a, b)


def test_scan_slices_are_priced_as_copies_on_xla_cpu(gpt_graphs):
    """XLA:CPU copies every iteration's slice of a stacked operand (a
    ``dynamic-slice_bitcast_fusion`` before each GEMM in the optimized HLO of a scanned
    step); its cost is the stack's bytes read and written once at `hbm_bandwidth`, and 0
    on XLA:GPU."""
    expansion = expand_scans(gpt_graphs["scan"])
    graph = expansion.graph
    slices = [n for n in graph.nodes if n.primitive == "scan_slice"]
    assert slices
    cpu = _profile_cluster("cpu-local-measured")
    assert backend_for(cpu) is XLA_CPU
    for node in slices:
        (copy,) = XLA_CPU.layout_copies(graph, node)
        assert copy.operand == 0 and not copy.strided
    stacked = sum(graph.vars[n.inputs[0]].nbytes for n in slices)
    # forward: the layers' weights, once: 12 h^2 + 13 h floats per layer (and more slices
    # backward: the residuals and the weights again)
    h = CFG.hidden
    forward_weights = 4 * CFG.num_layers * (12 * h * h + 13 * h)
    assert stacked > forward_weights
    seconds = sum(XLA_CPU.layout_copy_seconds(cpu, graph.vars[n.inputs[0]].nbytes,
                                              strided=False) for n in slices)
    assert seconds == pytest.approx(2 * stacked / cpu.hbm_bandwidth)
    gpu = _profile_cluster("dgx-a100-80g")
    assert backend_for(gpu).layout_copy_seconds(gpu, stacked, strided=False) == 0.0


def test_scanned_plan_pays_its_slices_on_the_measured_profile():
    """Planned on `cpu-local-measured`, the scanned twin's predicted step is slower than its
    loop twin's, by its slice copies (the ranking XLA:CPU measures:
    benchmarks/investigations/scan_vs_loop.py)."""
    optimizer = optax.adamw(1e-3)
    plans = {}
    for profile in ("cpu-local-measured",):
        for form, cfg in (("scan", dataclasses.replace(CFG, scan_layers=True)),
                          ("loop", CFG)):
            plans[profile, form] = autopar.plan(
                gpt.make_train_step(cfg, optimizer), gpt.abstract_state(cfg, optimizer),
                gpt.abstract_batch(cfg, 8), cluster=_profile_cluster(profile),
                method="shard", mesh_shape=(8,), cache=False)
    assert plans["cpu-local-measured", "scan"].predicted_step_time > \
        plans["cpu-local-measured", "loop"].predicted_step_time
