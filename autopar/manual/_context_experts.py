"""Context parallelism (CP) and expert parallelism (EP) in the Megatron baseline.

In: a `MegatronConfig` with ``cp > 1`` and/or ``ep``/``etp``, the step traced at the
shapes one CP rank holds (`context_args`), the model's attention (`AttentionShape`) and
MoE (`MoEShape`) shapes, and the stages `build_stages` made. Out: the stages with what CP
and EP add per microbatch priced by `autopar.cost`'s CP and EP formulas.

How Megatron runs CP (Megatron-Core's context parallel guide; REFERENCES.md): every
operator but attention is independent per token, so a CP rank runs the layer on its
1/cp of every sequence exactly as a data-parallel rank would; the gradients are reduced
over the data-parallel × CP group and the distributed optimizer shards over it too. So
the step is traced with each sequence cut into cp pieces laid along the batch
(`context_args`: batch × cp, sequence / cp) and planned on a (dp·cp, tp) mesh whose
"data" axis runs over the dp × cp group, CP inside DP as in Megatron's rank order (TP,
CP, DP, PP from the innermost). Attention is the exception: each query chunk attends to
the keys of the whole sequence, so

- its core (the dots ``q·kᵀ``, ``p·v`` and their gradients, and the score-sized
  element-wise work: scale, mask, softmax and their gradients) does more than the local
  trace holds: the local trace scores s/cp queries against s/cp keys, the real rank
  against all s keys, of which the algorithm computes the blocks it does not skip under
  the causal mask with load balancing (`cost.context_core_time`: the ring's zig-zag
  blocks, all-gather's two chunks against the keys up to their ends, Ulysses' whole
  sequence for heads/cp). The local core is priced node by node as the plan prices it
  (`local_attention_core`) and the difference is added as compute, so that the grid
  prices an algorithm's attention exactly as autopar's planner prices the same one
  (`autopar.intra._ring_strategies`);
- the K/V blocks travel: Megatron's default is the ring (``--cp-comm-type p2p``), whose
  hops hide under the blockwise attention (`ring_attention_time`); all-gather and
  Ulysses all-to-all (``allgather``, ``a2a``) are the other choices
  (`context_parallel_time`);
- the K/V buffers of the chosen algorithm are added to the working memory.

EP on a dense proxy: a dropless top-k MoE layer computes, per token, k routed experts
plus its shared ones; a dense SwiGLU of width ``(k + shared) · expert_ffn`` does the same
FLOPs. Traced as such (`MoEShape.proxy_ffn`), the plan has every operator of the MoE
model but the routing; `MoEShape` adds per MoE layer and microbatch the dispatch and
combine all-to-alls over the EP group (`moe_all_to_all_time`, Megatron-Core's alltoall
dispatcher, each device sending its 1/tp of the tokens under sequence parallelism), the
busiest expert's extra rows (`DEFAULT_TOKEN_IMBALANCE`), and the memory of the experts
the proxy does not hold (E/ep experts split etp ways instead of k, with their gradients
and optimizer state) and of the routed activations. What it leaves out is said where it
is: the router's small GEMM, and the expert gradients' reduction over the expert-data
group instead of the data group (the proxy charges its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from autopar.cluster import LogicalMesh
from autopar.cost import (
    DEFAULT_OVERLAP_EFFICIENCY,
    DEFAULT_TOKEN_IMBALANCE,
    causal_attention_flops,
    check_load_balanced_sequence,
    check_ulysses_heads,
    compute_time,
    context_core_time,
    context_parallel_buffer_bytes,
    context_parallel_time,
    expert_flops,
    expert_weight_bytes,
    imbalance_compute_time,
    moe_all_to_all_time,
    overlap_saving,
    routed_activation_bytes,
    trained_param_bytes,
)

CONTEXT_AXIS = "context"
EXPERT_AXIS = "expert"


@dataclass(frozen=True)
class AttentionShape:
    """A transformer's attention, as CP prices it: `num_heads` query heads and
    `num_kv_heads` key/value heads of `head_dim`, elements of `itemsize` bytes (2 for
    bf16), `num_layers` attention layers, `causal` masking."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    itemsize: int = 2
    causal: bool = True


@dataclass(frozen=True)
class MoEShape:
    """A dropless top-k MoE's routed part (DeepSeek-V3, Mixtral), as EP prices it.

    `num_experts` routed experts of width `expert_ffn` (SwiGLU when `gated`), each token
    to `top_k` of them, plus `num_shared` always-on experts; `hidden`; `num_moe_layers`
    layers with experts out of `num_layers` (DeepSeek-V3: 58 of 61, the first 3 dense);
    `itemsize` bytes per element; `imbalance`, the busiest device's routed tokens over
    the mean; `overlap`: the all-to-all runs under another microbatch's compute
    (DualPipe, Megatron-Core's ``--moe-a2a-overlap``) with `overlap_efficiency`.
    """

    num_experts: int
    top_k: int
    expert_ffn: int
    hidden: int
    num_moe_layers: int
    num_layers: int
    num_shared: int = 0
    gated: bool = True
    itemsize: int = 2
    imbalance: float = DEFAULT_TOKEN_IMBALANCE
    overlap: bool = False
    overlap_efficiency: float = DEFAULT_OVERLAP_EFFICIENCY

    @property
    def proxy_ffn(self) -> int:
        """The dense FFN width with the MoE layer's FLOPs per token:
        ``(top_k + num_shared) · expert_ffn``."""
        return (self.top_k + self.num_shared) * self.expert_ffn


def context_args(args: Sequence[Any], batch_argnums: Sequence[int], cp: int) -> tuple:
    """Abstract arguments as one CP rank sees them: every batch leaf of shape
    ``(B, S, ...)`` becomes ``(B·cp, S/cp, ...)`` (each sequence cut into cp pieces laid
    along the batch, so that the data axis of a (dp·cp, tp) mesh runs over DP × CP).

    Raises ValueError naming the leaf unless S splits into 2·cp balanced chunks
    (`check_load_balanced_sequence`, Megatron's rule) or a leaf has no sequence dimension.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(getattr(x, "shape", ())), x.dtype), tuple(args))
    if cp == 1:
        return abstract
    out = list(abstract)
    for i in batch_argnums:
        if i >= len(out):
            continue

        def cut(x, i=i):
            if len(x.shape) < 2:
                raise ValueError(
                    f"context parallelism cp={cp} splits the sequence (dim 1) of every batch "
                    f"input, but batch argument {i} has a leaf of shape {x.shape}; pass "
                    "(batch, sequence, ...) inputs or use cp=1"
                )
            check_load_balanced_sequence(x.shape[1], cp)
            return jax.ShapeDtypeStruct((x.shape[0] * cp, x.shape[1] // cp, *x.shape[2:]),
                                        x.dtype)

        out[i] = jax.tree.map(cut, out[i])
    return tuple(out)


def stage_cp_mesh(config, stage: int) -> LogicalMesh:
    """The (dp, cp, tp) mesh of pipeline stage `stage` in Megatron's rank order (TP
    innermost, then CP, then DP; PP outermost), for pricing the CP group's collectives."""
    per_stage = config.dp * config.cp * config.tp
    first = (stage % config.pp) * per_stage
    return LogicalMesh.create((config.dp, config.cp, config.tp),
                              range(first, first + per_stage),
                              ("data", CONTEXT_AXIS, "model"))


def stage_ep_mesh(config, stage: int) -> LogicalMesh:
    """The (edp, ep, etp) expert mesh of pipeline stage `stage`: Megatron-Core's expert
    rank order (expert-TP innermost, then EP, then expert-DP) over the stage's
    tp·cp·dp devices."""
    per_stage = config.dp * config.cp * config.tp
    ep, etp = config.expert_parallel, config.expert_tensor_parallel
    first = (stage % config.pp) * per_stage
    return LogicalMesh.create((per_stage // (ep * etp), ep, etp),
                              range(first, first + per_stage),
                              ("expert_data", EXPERT_AXIS, "expert_model"))


@dataclass(frozen=True)
class StageTerms:
    """What CP and EP add to one stage per microbatch: seconds of compute and of exposed
    communication; bytes per device of state (weights, gradients, optimizer state), of
    activations kept per microbatch in flight, and of working buffers."""

    compute: float = 0.0
    communication: float = 0.0
    state: float = 0.0
    activations: float = 0.0
    working: float = 0.0

    def memory(self, in_flight: float) -> float:
        return self.state + in_flight * self.activations + self.working


@dataclass(frozen=True)
class LocalCore:
    """One attention layer's core per microbatch as a CP rank's local trace holds it and
    its plan prices it (seconds per device): the forward's dots (``q·kᵀ``, ``p·v``),
    the forward's score-sized element-wise work (scale, mask, softmax), and the
    backward's dots and element-wise work together."""

    forward_dots: float
    forward_other: float
    backward: float

    @property
    def forward(self) -> float:
        return self.forward_dots + self.forward_other


def local_attention_core(graph, cluster, mesh: LogicalMesh, local_seq: int,
                         per_layer: bool = False) -> LocalCore | None:
    """The first attention of `graph` (traced at one CP rank's shapes, sequence
    `local_seq`) priced as the Megatron plan on `mesh` lays it out: each of its nodes
    (`autopar.intra._attention_roles`: the dots and every node reading or making a score
    tensor, forward and backward) at its cheapest strategy that keeps both sequence
    dimensions of the scores whole (batch and heads split over the mesh), by the
    planner's own node costs (`node_strategies`: roofline FLOPs and bytes across fusion
    boundaries, kernel launches). With `per_layer` (a plan made layer by layer, the
    pipeline runtime's) the nodes are priced on their layer's sub-graph
    (`autopar.inter.partition`), as the layer's plan prices them: a score tensor its
    layer hands on is written there. None when no attention's roles can be named."""
    from autopar.intra._attention_roles import AttentionRoles, attention_components
    from autopar.intra._strategies import CostContext, node_signature, node_strategies

    roles = None
    for sub in layer_graphs(graph) if per_layer else (graph,):
        for component in attention_components(sub, local_seq):
            try:
                roles = AttentionRoles(sub, component, local_seq)
                break
            except ValueError:
                continue
        if roles is not None:
            graph = sub
            break
    if roles is None:
        return None
    backward_dots = [n.id for n in roles.nodes if n.primitive == "dot_general"
                     and n is not roles.qk and n is not roles.roles.get("o", (None,))[0]]
    first_backward = min(backward_dots, default=len(graph.nodes))
    ctx = CostContext(cluster, mesh)
    parts = [0.0, 0.0, 0.0]
    for node in roles.nodes:
        sig = node_signature(node, graph)
        if sig is None:
            continue
        strategies = node_strategies(node, graph, sig, ctx)
        whole = [t for t in strategies if _keeps_sequence(node, roles, t)] or strategies
        seconds = min(t.compute_cost for t in whole)
        part = (2 if node.id >= first_backward
                else 0 if node.primitive == "dot_general" else 1)
        parts[part] += seconds
    return LocalCore(*parts)


def layer_graphs(graph):
    """The per-layer sub-graphs of `graph` as the layer-wise planner splits it (its layer
    marks); `graph` alone without marks."""
    from autopar.inter import assign_layers, partition

    try:
        layers = assign_layers(graph)
    except ValueError:
        layers = None
    if layers is None or layers.num_layers == 1:
        return (graph,)
    return partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)]
                     ).stage_graphs


def _keeps_sequence(node, roles, strategy) -> bool:
    """Whether `strategy` keeps the query and key dimensions of the node's score tensors
    whole (Megatron's layout: CP is in the batch of the local trace)."""
    pairs = [*zip(node.outputs, strategy.out_specs), *zip(node.inputs, strategy.in_specs)]
    for v, spec in pairs:
        labels = roles.labels.get(v)
        if v in roles.score and spec is not None and labels is not None:
            if spec[labels.index("sq")] or spec[labels.index("sk")]:
                return False
    return True


def formula_core(cluster, attention: AttentionShape, micro_batch: int, seq_len: int,
                 tp: int, cp: int) -> LocalCore:
    """The local core's dots by formula (`causal_attention_flops` of the local piece, the
    whole square, as the traced einsum computes it; the backward twice the forward), for
    a step whose attention `local_attention_core` cannot name: no element-wise work."""
    heads = attention.num_heads // tp
    d = attention.head_dim
    dtype = "bfloat16" if attention.itemsize == 2 else "float32"
    local = causal_attention_flops(micro_batch, seq_len // cp, heads, d, causal=False)
    forward = compute_time(local, 0.0, cluster, dtype, matmul=True,
                           gemm_shape=(micro_batch * heads * seq_len / cp, seq_len / cp, d))
    return LocalCore(forward, 0.0, 2 * forward)


def context_terms(config, cluster, attention: AttentionShape, micro_batch: int,
                  seq_len: int, num_layers: int, stage: int,
                  core: LocalCore | None = None) -> StageTerms:
    """CP's additions to a stage of `num_layers` attention layers, per microbatch of
    `micro_batch` sequences of `seq_len` per data-parallel rank (module docstring).
    `core`: one attention layer's local core as the plan prices it
    (`local_attention_core`); None: its dots by formula (`formula_core`)."""
    cp, tp = config.cp, config.tp
    if cp == 1 or num_layers == 0:
        return StageTerms()
    heads = attention.num_heads // tp
    kv_heads = max(1, attention.num_kv_heads // tp)
    algorithm = config.cp_algorithm
    if algorithm == "ulysses":
        check_ulysses_heads(heads, kv_heads, cp)
    if core is None:
        core = formula_core(cluster, attention, micro_batch, seq_len, tp, cp)
    d = attention.head_dim
    recompute = config.recompute in ("selective", "full")
    # The rank's real core (`context_core_time`) less what the local trace charges: the
    # forward, the backward, and the recomputed forward, if any.
    real_forward = context_core_time(core.forward, algorithm, cp)
    real_backward = context_core_time(core.backward, algorithm, cp)
    compute = ((1 + recompute) * (real_forward - core.forward)
               + real_backward - core.backward)
    # The ring's steps overlap its hops with the forward's dots, as autopar's ring twins
    # price it (`autopar.intra._ring_strategies`).
    dots = context_core_time(core.forward_dots, algorithm, cp)
    mesh = stage_cp_mesh(config, stage)
    fwd, bwd = context_parallel_time(
        algorithm, attention_compute=dots, batch=micro_batch, seq_len=seq_len,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=d, itemsize=attention.itemsize,
        cluster=cluster, mesh=mesh, axis=CONTEXT_AXIS)
    recomputed = fwd if recompute else 0.0
    buffers = context_parallel_buffer_bytes(
        algorithm, batch=micro_batch, seq_len=seq_len, cp=cp, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=d, itemsize=attention.itemsize)
    return StageTerms(num_layers * compute, num_layers * (fwd + bwd + recomputed),
                      working=buffers)


def expert_terms(config, cluster, moe: MoEShape, micro_batch: int, seq_len: int,
                 num_layers: int, stage: int, other_compute: float = 0.0,
                 zero1_group: int = 1) -> StageTerms:
    """EP's additions to a stage of `num_layers` MoE layers traced as their dense proxy,
    per microbatch of `micro_batch` sequences of `seq_len` per data-parallel rank
    (module docstring). `other_compute`: the stage's compute seconds per microbatch, under
    which an overlapped schedule hides the all-to-all (`overlap_saving`);
    `zero1_group`: devices the distributed optimizer splits the experts' master weights
    and moments over (1: none)."""
    if num_layers == 0:
        return StageTerms()
    ep, etp, tp = config.expert_parallel, config.expert_tensor_parallel, config.tp
    # Each device dispatches its 1/tp of the CP rank's tokens (sequence parallel).
    tokens = micro_batch * seq_len / (config.cp * tp)
    mesh = stage_ep_mesh(config, stage)
    fwd, bwd = moe_all_to_all_time(tokens, moe.top_k, moe.hidden, moe.itemsize, cluster,
                                   mesh, EXPERT_AXIS, moe.imbalance)
    a2a = num_layers * (fwd + bwd)
    if moe.overlap:
        a2a -= overlap_saving(a2a, other_compute, moe.overlap_efficiency)
    dtype = "bfloat16" if moe.itemsize == 2 else "float32"
    # The busiest device's extra routed rows (forward, backward twice, as the proxy's MLP).
    # (any balanced layout leaves each device 1/tp of its CP rank's expert work)
    flops = expert_flops(tokens, moe.top_k, moe.hidden, moe.expert_ffn, moe.gated)
    extra = imbalance_compute_time(flops, moe.imbalance, cluster, dtype)
    # Memory: E/ep experts split etp ways in place of the proxy's k experts split tp ways.
    routed = expert_weight_bytes(moe.num_experts, moe.hidden, moe.expert_ffn, 1,
                                 ep, etp, moe.gated)
    proxy = expert_weight_bytes(moe.top_k, moe.hidden, moe.expert_ffn, 1, 1, tp, moe.gated)
    # the proxy's MLP state is split over the whole data-parallel group under ZeRO-1
    proxy_group = config.dp * config.cp if zero1_group > 1 else 1
    state = num_layers * (routed * trained_param_bytes(moe.itemsize, zero1_group)
                          - proxy * trained_param_bytes(moe.itemsize, proxy_group))
    activations = routed_activation_bytes(tokens, moe.top_k, moe.hidden, moe.expert_ffn,
                                          moe.itemsize, moe.gated, moe.imbalance)
    return StageTerms(num_layers * extra, a2a, state=state,
                      activations=num_layers * activations)


def with_terms(stage, terms: StageTerms):
    """`stage` with `terms` added: compute and exposed communication to its sharding
    plan's per-microbatch cost, memory by part to its predicted memory (activations
    times the microbatches its schedule keeps in flight)."""
    if terms == StageTerms():
        return stage
    parts = stage.memory_parts
    in_flight = parts.in_flight if parts is not None else 1.0
    added = terms.memory(in_flight)
    cost = stage.sharding.cost
    cost = replace(cost, compute=cost.compute + terms.compute,
                   communication=cost.communication + terms.communication,
                   memory_per_device=cost.memory_per_device + added)
    sharding = replace(stage.sharding, cost=cost)
    if parts is not None:
        parts = replace(parts, state=parts.state + terms.state,
                        activations=parts.activations + in_flight * terms.activations,
                        working=parts.working + terms.working)
    memory = stage.predicted_memory + added if stage.predicted_memory else 0.0
    return replace(stage, sharding=sharding, predicted_memory=memory, memory_parts=parts)
