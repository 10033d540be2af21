"""The cost model against published large-model training runs (issue 14, item 7).

In: published runs with a known plan (dp x tp x pp, microbatches, sequence, batch) and a
measured throughput. Out: a table in ``docs/benchmarks.md`` (section "Validation against
published training runs"): per run the plan expressed with `MegatronConfig` and scored by
`megatron_plan_for_graph` on the model's shapes (`examples/gpt.py`, `examples/llama.py`
at the published hidden/layers/heads/seq), the predicted and the published step time,
their ratio and the source. Nothing executes; the step is traced with abstract arguments
at one microbatch, as `bench_large.py` does.

Nothing here is calibrated on these rows (nor on the Megatron papers' own tables): the
profiles come from vendor specifications and cited GEMM/NCCL figures
(cost_profiles/README.md).

Published step time: the runs report TFLOP/s per GPU. BLOOM and MT-NLG count them with
Megatron-LM's formula, which includes the recomputed forward (4 passes over the model
instead of 3; Narayanan et al. 2021, eq. 3), so their step time is
``4/3 · F / (TFLOP/s · GPUs)`` with F the traced step's model FLOPs; Llama 3 reports model
FLOPs (MFU), so ``F / (TFLOP/s · GPUs)``. F is the traced one-microbatch step's FLOPs times
the step's microbatches.

Each row runs the published plan as published where autopar can express it: recompute
(`MegatronConfig(recompute="full")` for BLOOM, MT-NLG and Megatron-LM, which all used full
activation recomputation), the distributed optimizer (ZeRO-1) where the system had it
(Megatron-DeepSpeed, Llama 3; not Megatron-LM 2021), with the gradients sharded too for
Llama 3 405B at every sequence length (ZeRO-2, `MegatronConfig(zero2=True)`: its FSDP
"shards the optimizer states and gradients", Dubey et al. 2024, sec. 3.3.2; at 128k the
whole fp32 gradient sums alone, 11.9 GiB per device, would take the layout past 80 GiB)
and sequence parallelism only for
Llama 3 (Korthikanti et al. 2022 came after the other runs), 1F1B except Llama 3, which
ran an interleaved schedule (Dubey et al. 2024, sec. 3.3.2: "we use an interleaved
schedule (Narayanan et al., 2021) with V pipeline stages on one pipeline rank", and one
Transformer layer fewer on the first and the last stage, so 126 layers over 16 ranks):
`MegatronConfig(schedule="interleaved_1f1b", virtual_stages=8, even_chunks=False)`. The
paper gives no number for V, but fixes it: "This means that the first model chunk on the
first stage has only the embedding, and the last model chunk on the last stage has only
output projection and loss calculation" (same section). Taking one layer off the first
rank leaves its first chunk empty of layers only when a chunk is one layer: 126 layers plus
the embedding and the output make 128 = 16 ranks x V chunks of one, V = 8. The model is
traced with a layer mark after the embedding (`LlamaConfig(embedding_marker=True)`), so the
embedding and the output head are chunks of their own. (With V = 2, the least
interleaving, the model predicted Llama 3 @16k at 1.25x published, its fill and
drain 15/32 of the busy time at 16 microbatches.) The last column splits the predicted
step: the slowest stage's seconds per microbatch into compute, the collectives inside
operators (tensor-parallel all-reduce/reduce-scatter, the once-per-step data-parallel
reduction weighed per microbatch), resharding between operators (sequence parallelism's
all-gathers), and recompute; the step into m x the slowest device group plus the
pipeline's fill and drain (and the programs' launches).

Long context and MoE (rows llama3-405b-128k, deepseek-v3-*): the context-parallel row is
traced at one CP rank's shapes (`autopar.manual.context_args`: batch x cp, sequence / cp)
and scored with ``MegatronConfig(cp=16)``, ring CP as Megatron runs it; its model FLOPs
are the traced step's plus the attention the local trace leaves out (each query chunk
against the whole sequence; counted, like every row here, as the traced einsum counts it:
the whole s x s square, not the causal half, as torchtitan, Meta's PyTorch training
library, counts it in its MFU: `get_num_flop_per_token`, 12 x layers x heads x head_dim x
sequence per token, no causal halving). The MoE rows trace the model's dense proxy
(a SwiGLU of width (top-k + shared) x expert FFN, the FLOPs per token of the MoE layer)
with `MoEShape` adding expert parallelism's all-to-alls and the memory of the experts the
proxy does not hold; their published step time is tokens per step over the published
tokens/s. DeepSeek-V3's multi-head latent attention is traced as multi-head attention of
the same width (hidden 7168 over 128 heads); its attention core is under 1% of its FLOPs
at 4,096 tokens.

Usage: ``python benchmarks/validate_public.py [--rows bloom-176b,...] [--no-write]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import replace  # noqa: E402

import optax  # noqa: E402

from autopar.cluster import Cluster, Link  # noqa: E402
from autopar.cost import causal_attention_flops  # noqa: E402
from autopar.graph import trace  # noqa: E402
from autopar.manual import (  # noqa: E402
    AttentionShape,
    MegatronConfig,
    MoEShape,
    context_args,
    megatron_plan_for_graph,
)
from autopar.search import microbatch_args  # noqa: E402
from examples import gpt, llama  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "benchmarks.md")
SECTION = "## Validation against published training runs"
TERA = 1e12
UNLIMITED = 1e15  # bytes per device: the memory check lifted (see `evaluate`)


@dataclass(frozen=True)
class PublishedRun:
    key: str
    system: str
    model: object  # a GPTConfig or LlamaConfig at the published shapes
    family: str  # "gpt" or "llama"
    profile: str
    num_gpus: int
    dp: int
    tp: int
    pp: int
    global_batch: int  # sequences per step
    micro_batch: int  # sequences per microbatch per data-parallel replica
    tflops_per_gpu: float
    counts_recompute: bool  # the published TFLOP/s include the recomputed forward
    waits_on: str  # "" or which feature of the published run autopar cannot express yet
    source: str
    expressible: str = ""  # why the plan cannot be written as a MegatronConfig, if so
    recompute: str = "none"  # as published: Megatron-LM's --recompute-granularity
    sequence_parallel: bool = True
    distributed_optimizer: bool = True
    # gradients sharded over DP as well (ZeRO-2, `MegatronConfig.zero2`), as published
    zero2: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    cp_algorithm: str = "ring"
    ep: int | None = None
    moe: MoEShape | None = None  # the model is this MoE's dense proxy
    # published throughput as tokens/s per GPU (the MoE reports) instead of TFLOP/s
    tokens_per_gpu_second: float = 0.0
    # intra-host bandwidth in bytes/s where the system's differs from the profile's
    nvlink: float | None = None

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)


# BLOOM: vocabulary 250,880, hidden 14,336, 70 layers, 112 heads, sequence 2048.
BLOOM = gpt.GPTConfig(250880, 2048, 14336, 70, 112, dtype="bfloat16", master_dtype="float32",
                      layer_markers=True)
# MT-NLG: hidden 20,480, 105 layers, 128 heads, sequence 2048, GPT-2 vocabulary (padded).
MTNLG = gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 20480, 105, 128, dtype="bfloat16",
                      master_dtype="float32", layer_markers=True)
# OPT-175B: GPT-3 175B's shapes (hidden 12,288, 96 layers, 96 heads, sequence 2048).
OPT = gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 12288, 96, 96, dtype="bfloat16",
                    master_dtype="float32", layer_markers=True)
# Llama 3 405B (Llama 3 paper, Table 3): hidden 16,384, 126 layers, 128 heads, 8 KV heads,
# FFN 53,248, vocabulary 128,256, sequence 8192.
LLAMA405 = llama.LlamaConfig(llama.LLAMA3_VOCAB, 8192, 16384, 126, 128, 8, 53248,
                             rope_theta=500000.0, dtype="bfloat16", master_dtype="float32",
                             layer_markers=True, embedding_marker=True)

BLOOM_SRC = ("BigScience, 'The Technology Behind BLOOM Training' (Hugging Face blog, 2022) and "
             "Le Scao et al. 2022 (BLOOM paper, sec. 3.4): 384 A100-80GB, TP4 PP12 DP8, global "
             "batch 2048, micro-batch 2, 150 TFLOP/s per GPU, Megatron-DeepSpeed, full recompute")
MTNLG_SRC = ("Smith et al. 2022 (Megatron-Turing NLG 530B, sec. 2.3 and Fig. 4): TP8 PP35, "
             "batch 1920, micro-batch 1; 126 TFLOP/s per GPU on 280 DGX A100 (2240 GPUs), "
             "113 on 420 (3360); Megatron-DeepSpeed, activation recompute")
# The same report's middle point (Smith et al. 2022, sec. 2.4: 60.1 / 50.2 / 44.4 s per
# iteration on 280 / 350 / 420 DGX A100, i.e. 126 / 121 / 113 TFLOP/s per GPU).
MTNLG_2800_SRC = ("Smith et al. 2022 (Megatron-Turing NLG 530B, sec. 2.4): TP8 PP35, batch 1920, "
                  "micro-batch 1; 50.2 s per iteration, 121 TFLOP/s per GPU on 350 DGX A100 "
                  "(2800 GPUs); Megatron-DeepSpeed, activation recompute")
LLAMA_SRC = ("Llama 3 Herd of Models (Dubey et al. 2024), Table 4: 405B on H100, TP8 CP1 PP16, "
             "sequence 8192; 430 TFLOP/s/GPU (43% BF16 MFU) on 8192 GPUs with DP64, 400 "
             "(41%) on 16384 with DP128; interleaved pipeline schedule; FSDP sharding "
             "optimizer states and gradients (ZeRO-2, sec. 3.3.2)")

# Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", Table 1): GPT models, sequence 2048, vocabulary 51,200,
# micro-batch 1, full activation recompute, no sequence parallelism (it came in 2022), no
# distributed optimizer; TFLOP/s per GPU counted with eq. 3 (recompute included).
GPT146 = gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 12288, 80, 96, dtype="bfloat16",
                       master_dtype="float32", layer_markers=True)
GPT310 = gpt.GPTConfig(gpt.PADDED_VOCAB, 2048, 16384, 96, 128, dtype="bfloat16",
                       master_dtype="float32", layer_markers=True)
MEGATRON_SRC = ("Narayanan et al. 2021 (Megatron-LM, SC21), Table 1: {}: tensor 8, pipeline "
                "{}, {} A100 GPUs, batch {}, {} TFLOP/s per GPU (eq. 3, recompute counted)")

# Llama 3 ran Megatron's interleaved schedule with V chunks per rank over uneven stages
# (Dubey et al. 2024, sec. 3.3.2; 126 layers on 16 ranks, the first and the last a layer
# short, whose first / last chunk holds only the embedding / the output): one layer per
# chunk, V = 8 (module docstring).
LLAMA_VIRTUAL_STAGES = 8

RUNS = (
    PublishedRun("bloom-176b", "Megatron-DeepSpeed (BigScience)", BLOOM, "gpt", "dgx-a100-80g",
                 384, 8, 4, 12, 2048, 2, 150.0, True, "", BLOOM_SRC, recompute="full",
                 sequence_parallel=False),
    PublishedRun("mtnlg-530b-2240", "Megatron-DeepSpeed (Microsoft/NVIDIA)", MTNLG, "gpt",
                 "dgx-a100-80g", 2240, 8, 8, 35, 1920, 1, 126.0, True, "", MTNLG_SRC,
                 recompute="full", sequence_parallel=False),
    PublishedRun("mtnlg-530b-2800", "Megatron-DeepSpeed (Microsoft/NVIDIA)", MTNLG, "gpt",
                 "dgx-a100-80g", 2800, 10, 8, 35, 1920, 1, 121.0, True, "", MTNLG_2800_SRC,
                 recompute="full", sequence_parallel=False),
    PublishedRun("mtnlg-530b-3360", "Megatron-DeepSpeed (Microsoft/NVIDIA)", MTNLG, "gpt",
                 "dgx-a100-80g", 3360, 12, 8, 35, 1920, 1, 113.0, True, "", MTNLG_SRC,
                 recompute="full", sequence_parallel=False),
    PublishedRun("megatron-146b", "Megatron-LM (NVIDIA)", GPT146, "gpt", "dgx-a100-80g", 1536,
                 24, 8, 8, 2304, 1, 148.0, True, "",
                 MEGATRON_SRC.format("145.6B (hidden 12288, 80 layers)", 8, 1536, 2304, 148),
                 recompute="full", sequence_parallel=False, distributed_optimizer=False),
    PublishedRun("megatron-310b", "Megatron-LM (NVIDIA)", GPT310, "gpt", "dgx-a100-80g", 1920,
                 15, 8, 16, 2160, 1, 155.0, True, "",
                 MEGATRON_SRC.format("310.1B (hidden 16384, 96 layers)", 16, 1920, 2160, 155),
                 recompute="full", sequence_parallel=False, distributed_optimizer=False),
    PublishedRun("opt-175b", "Metaseq (FSDP + Megatron TP)", OPT, "gpt", "dgx-a100-80g", 992,
                 124, 8, 1, 1024, 1, 147.0, True, "recompute",
                 "Zhang et al. 2022 (OPT, sec. 2.4): 992 A100-80GB, FSDP with Megatron TP8, "
                 "batch 2M tokens (1024 sequences of 2048), 147 TFLOP/s per GPU",
                 recompute="full",
                 expressible="1024 sequences do not split over 124 data-parallel replicas "
                 "(OPT's FSDP ran 992 GPUs = 124 x TP8); no even MegatronConfig"),
    PublishedRun("llama3-405b-8k", "Meta Llama 3 (4D parallelism)", LLAMA405, "llama",
                 "dgx-h100", 8192, 64, 8, 16, 2048, 1, 430.0, False, "", LLAMA_SRC,
                 schedule="interleaved_1f1b", virtual_stages=LLAMA_VIRTUAL_STAGES,
                 zero2=True),
    PublishedRun("llama3-405b-16k", "Meta Llama 3 (4D parallelism)", LLAMA405, "llama",
                 "dgx-h100", 16384, 128, 8, 16, 2048, 1, 400.0, False, "", LLAMA_SRC,
                 schedule="interleaved_1f1b", virtual_stages=LLAMA_VIRTUAL_STAGES,
                 zero2=True),
)

# Llama 3 405B at 131,072 tokens (Dubey et al. 2024, Table 4, last row): 16,384 H100, TP8
# CP16 PP16, 16 sequences per data-parallel rank, 16M tokens per batch, 380 TFLOP/s per GPU
# (38% BF16 MFU). The degrees fix DP: 16,384 / (8 x 16 x 16) = 8, and 8 x 16 sequences of
# 131,072 are the 16M tokens (DP4, as sometimes quoted, would cover only 8,192 GPUs). The
# paper all-gathers K and V per layer (sec. 3.3.2), which `cp_algorithm="all_gather"`
# prices; Megatron's default, the ring, is the second row.
# Attention FLOPs as the whole s x s square: Table 4's TFLOP/s are "BF16 Model FLOPs
# Utilization (MFU; Chowdhery et al. (2023))" (sec. 3.3.2, p. 10; 380 = 38% of the H100's
# 989 dense BF16), and Chowdhery et al. (PaLM, Appendix B) count 6N + 12·L·H·Q·T FLOPs
# per token, the attention's two products over the whole square in the forward and
# backward, with no causal halving. `_causal_note` gives the other convention.
LLAMA405_128K = replace(LLAMA405, seq_len=131072)
LLAMA_128K_SRC = ("Llama 3 Herd of Models (Dubey et al. 2024), Table 4: 405B, 16,384 H100, TP8 "
                  "CP16 PP16 DP8, sequence 131,072, batch 16 per DP rank (16M tokens), 380 "
                  "TFLOP/s/GPU "
                  "(38% BF16 MFU); K/V all-gathered per layer (sec. 3.3.2)")

# DeepSeek-V3 (DeepSeek-AI 2024, technical report): hidden 7168, 61 layers (the first 3
# dense with FFN 18,432), 128 heads (MLA), vocabulary 129,280; MoE layers: 1 shared + 256
# routed experts of FFN 2048, top-8 (sec. 4.2). The dense proxy's FFN: (8 + 1) x 2048 =
# 18,432, the dense layers' own width, so one proxy width serves every layer.
DEEPSEEK_V3 = llama.LlamaConfig(129280, 4096, 7168, 61, 128, 128, 18432, rope_theta=10000.0,
                                dtype="bfloat16", master_dtype="float32", layer_markers=True)
DEEPSEEK_V3_MOE = MoEShape(num_experts=256, top_k=8, expert_ffn=2048, hidden=7168,
                           num_moe_layers=58, num_layers=61, num_shared=1)
DEEPSEEK_SRC = ("DeepSeek-V3 Technical Report (DeepSeek-AI 2024): 2,048 H800, PP16 EP64 (8 "
                "nodes) ZeRO-1 DP, no TP (sec. 3.2); 180K H800 GPU hours per trillion tokens "
                "(sec. 1, Table 1) = 1,543 tokens/s/GPU; batch 15,360 x 4,096 tokens "
                "(sec. 4.2); FP8 GEMMs (sec. 3.3), DualPipe overlapping the all-to-all "
                "(sec. 3.2.1); NVLink 160 GB/s, IB 50 GB/s (sec. 3.2.2)")
AUTOMODEL_SRC = ("NVIDIA NeMo AutoModel performance summary (docs.nvidia.com/nemo/automodel, "
                 "Pre-Training, DGX-H100 BF16): DeepSeek V3 671B, {} GPUs, GBS {}, MBS 1, "
                 "seq 4096, TP1 PP4 CP1 EP64 VP8, FSDP {}, TE + DeepEP: {} s per step, {} "
                 "tokens/s/GPU, {} TFLOP/s/GPU")
# H800: NVLink cut to 400 GB/s both ways; DeepSeek-V3 measured 160 GB/s (sec. 3.2.2).
H800_NVLINK = 160e9

RUNS = RUNS + (
    PublishedRun("llama3-405b-128k", "Meta Llama 3 (4D parallelism)", LLAMA405_128K, "llama",
                 "dgx-h100", 16384, 8, 8, 16, 128, 1, 380.0, False, "", LLAMA_128K_SRC,
                 schedule="interleaved_1f1b", virtual_stages=LLAMA_VIRTUAL_STAGES, cp=16,
                 cp_algorithm="all_gather", zero2=True),
    PublishedRun("llama3-405b-128k-ring", "Meta Llama 3 (4D parallelism)", LLAMA405_128K,
                 "llama", "dgx-h100", 16384, 8, 8, 16, 128, 1, 380.0, False,
                 "the paper's all-gather (this row: Megatron's ring)", LLAMA_128K_SRC,
                 schedule="interleaved_1f1b", virtual_stages=LLAMA_VIRTUAL_STAGES, cp=16,
                 zero2=True),
    PublishedRun("deepseek-v3-2048", "DeepSeek-V3 (HAI-LLM)", DEEPSEEK_V3, "llama", "dgx-h100",
                 2048, 128, 1, 16, 15360, 1, 0.0, False, "FP8 GEMMs, DualPipe, node-limited "
                 "routing", DEEPSEEK_SRC, sequence_parallel=False, ep=64,
                 moe=replace(DEEPSEEK_V3_MOE, overlap=True),
                 tokens_per_gpu_second=1e12 / (180e3 * 3600), nvlink=H800_NVLINK),
    PublishedRun("deepseek-v3-256", "NeMo AutoModel (FSDP2 + DeepEP)", DEEPSEEK_V3, "llama",
                 "dgx-h100", 256, 64, 1, 4, 512, 1, 0.0, False, "FSDP (scored as ZeRO-1)",
                 AUTOMODEL_SRC.format(256, 512, 64, 8.18, "1,002", 250),
                 sequence_parallel=False, ep=64, moe=DEEPSEEK_V3_MOE,
                 tokens_per_gpu_second=1002.0, schedule="interleaved_1f1b",
                 virtual_stages=8),
    PublishedRun("deepseek-v3-1024", "NeMo AutoModel (FSDP2 + DeepEP)", DEEPSEEK_V3, "llama",
                 "dgx-h100", 1024, 256, 1, 4, 8192, 1, 0.0, False, "FSDP (scored as ZeRO-1)",
                 AUTOMODEL_SRC.format(1024, 8192, 256, 37.87, 865, 216),
                 sequence_parallel=False, ep=64, moe=DEEPSEEK_V3_MOE,
                 tokens_per_gpu_second=865.0, schedule="interleaved_1f1b",
                 virtual_stages=8),
)


def _step(run: PublishedRun):
    module = {"gpt": gpt, "llama": llama}[run.family]
    optimizer = optax.adamw(1e-4)
    args = (module.abstract_state(run.model, optimizer),
            module.abstract_batch(run.model, run.global_batch))
    return module.make_train_step(run.model, optimizer), args


def evaluate(run: PublishedRun) -> dict:
    row = {"run": run}
    if run.expressible:
        row["note"] = run.expressible
        return row
    start = time.perf_counter()
    step, args = _step(run)
    m = run.num_microbatches
    # one microbatch of every data-parallel replica (dp x micro_batch sequences; times cp
    # pieces of a sequence each under context parallelism), as the scorer plans it; its
    # optimizer update (about 0.1% of the FLOPs here) counts m times
    args = context_args(args, (1,), run.cp)
    graph = trace(step, *microbatch_args(args, (1,), m), batch_argnums=(1,))
    model_flops = (graph.total_flops + _context_flops(run)) * m
    if run.tokens_per_gpu_second:
        published = run.global_batch * run.model.seq_len / (
            run.tokens_per_gpu_second * run.num_gpus)
    else:
        published = model_flops * (4 / 3 if run.counts_recompute else 1) / (
            run.tflops_per_gpu * TERA * run.num_gpus)
    cluster = Cluster.from_profile(run.profile, num_hosts=run.num_gpus // 8)
    if run.nvlink:
        cluster = replace(cluster, intra_host=Link(run.nvlink, cluster.intra_host.latency))
    config = MegatronConfig(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep,
                            cp_algorithm=run.cp_algorithm,
                            num_microbatches=run.num_microbatches,
                            sequence_parallel=run.sequence_parallel,
                            distributed_optimizer=run.distributed_optimizer,
                            zero2=run.zero2,
                            recompute=run.recompute, schedule=run.schedule,
                            virtual_stages=run.virtual_stages,
                            even_chunks=run.virtual_stages == 1)
    shapes = dict(attention=_attention(run) if run.cp > 1 else None, moe=run.moe)
    try:
        plan = megatron_plan_for_graph(graph, cluster, config, **shapes)
    except ValueError as err:  # the published layout may not fit autopar's memory model
        if "does not fit" not in str(err):
            raise
        # time scored with the memory check lifted, and said so in the table
        plan = megatron_plan_for_graph(graph, cluster, config, memory_budget=UNLIMITED,
                                       **shapes)
        row["note"] = f"does not fit {cluster.device_memory / 2**30:.0f} GiB in autopar's " \
            "memory model; time scored with the memory check lifted"
    if run.cp > 1:
        row["note"] = "; ".join(filter(None, (row.get("note"), _causal_note(
            run, model_flops, plan.predicted_step_time))))
    row.update(predicted=plan.predicted_step_time, published=published,
               seconds=time.perf_counter() - start, config=config.name,
               split=decomposition(plan))
    return row


def _attention(run: PublishedRun) -> AttentionShape:
    model = run.model
    return AttentionShape(model.num_heads, model.num_kv_heads, model.head_dim,
                          model.num_layers)


def _context_flops(run: PublishedRun) -> float:
    """Attention FLOPs one microbatch does that its CP-local trace leaves out: per layer,
    each of the dp x micro_batch sequences' cp query chunks against the whole sequence
    instead of its own chunk, forward and backward (3 x the forward), counted as the trace
    counts the core (the whole square)."""
    if run.cp == 1:
        return 0.0
    model, cp = run.model, run.cp
    sequences = run.dp * run.micro_batch
    whole = causal_attention_flops(sequences, model.seq_len, model.num_heads,
                                   model.head_dim, causal=False)
    local = causal_attention_flops(sequences * cp, model.seq_len // cp, model.num_heads,
                                   model.head_dim, causal=False)
    return 3 * model.num_layers * (whole - local)


def _causal_note(run: PublishedRun, model_flops: float, predicted: float) -> str:
    """The published step counted with causal attention (half the square; what the
    kernels compute), for a long-context row, where the convention moves the figure by a
    third."""
    model = run.model
    square = 3 * model.num_layers * causal_attention_flops(
        run.global_batch, model.seq_len, model.num_heads, model.head_dim, causal=False)
    published = (model_flops - square / 2) / (run.tflops_per_gpu * TERA * run.num_gpus)
    return (f"with the published TFLOP/s counting causal attention (half the s x s square) "
            f"the published step is {published:.2f} s and predicted/published "
            f"{predicted / published:.2f}")


def decomposition(plan) -> str:
    """Where the predicted step goes: the slowest stage's seconds per microbatch split into
    compute, collectives inside its operators, resharding between them, and recompute, then
    the step as m x the slowest device group (its v chunks under interleaving) plus the
    fill and drain and the programs' launches (`pipeline_latency`)."""
    slowest = max(plan.stages, key=lambda st: st.time_per_microbatch)
    c = slowest.sharding.cost
    m = plan.num_microbatches
    groups = plan.num_device_groups
    group_times = [sum(st.time_per_microbatch for st in plan.stages[g::groups])
                   for g in range(groups)]
    busy = m * max(group_times)
    chunks = f" ({plan.virtual_stages} chunks)" if plan.virtual_stages > 1 else ""
    return (f"slowest stage {slowest.time_per_microbatch * 1e3:.0f} ms/microbatch = compute "
            f"{c.compute * 1e3:.0f} + collectives {c.communication * 1e3:.0f} + resharding "
            f"{c.resharding * 1e3:.0f} + recompute {slowest.recompute_time * 1e3:.0f}; "
            f"step = {m} x slowest device group{chunks} {busy:.1f} s + fill/drain "
            f"{plan.predicted_step_time - busy:.1f} s")


def table(rows: list[dict]) -> str:
    lines = [
        SECTION,
        "",
        "Dry runs, no devices. Predicted: the "
        "published plan as a `MegatronConfig` (sequence parallelism and the distributed "
        "optimizer as published, ZeRO-2 where the gradients were sharded too, 1F1B or "
        "interleaved as published) scored by the cost "
        "model; published: the run's TFLOP/s per GPU "
        "turned into a step time (module docstring). Profiles are not calibrated on any of "
        "these rows. Rows marked *waits on* use a feature autopar's Megatron scorer cannot "
        "express yet: their predictions leave it out and are not yet a check.",
        "",
        "How to read it: *predicted/published* is the cost model's step time over the "
        "published one for the published plan (1 is exact; the aim is within +-20%). The "
        "breakdown column shows where the predicted time goes, stage by stage.",
        "",
        "Long-context rows (cp) are traced at one CP rank's shapes with attention's extra "
        "work and K/V traffic added (`autopar/manual/_context_experts.py`); their published "
        "step counts attention as the traced einsum does, the whole s x s square, and the "
        "note in the *waits on* column gives it with the causal half, the other "
        "convention in use (at "
        "131,072 tokens it moves the published step by 30%). MoE rows (ep) are the "
        "model's dense proxy with expert parallelism's all-to-alls and expert memory "
        "added; their published step is tokens per step over the published tokens/s.",
        "",
        "| run | system | GPUs | plan | predicted s/step | published s/step | "
        "predicted/published | waits on | where the predicted time goes | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        run = row["run"]
        plan = (f"dp{run.dp} tp{run.tp} pp{run.pp}"
                f"{f' cp{run.cp} ({run.cp_algorithm})' if run.cp > 1 else ''}"
                f"{f' ep{run.ep}' if run.ep else ''}, "
                f"{run.num_microbatches} microbatches, "
                f"recompute {run.recompute}{', sp' if run.sequence_parallel else ''}"
                f"{', zero2' if run.zero2 else ', zero1' if run.distributed_optimizer else ''}"
                f"{f', interleaved v={run.virtual_stages}' if run.virtual_stages > 1 else ''}")
        if "predicted" in row:
            numbers = (f"{row['predicted']:.2f} | {row['published']:.2f} | "
                       f"{row['predicted'] / row['published']:.2f}")
        else:
            numbers = f"— | — | not expressed: {row.get('note', row.get('error', ''))}"
        waits = run.waits_on or "—"
        if "predicted" in row and row.get("note"):
            waits += f" ({row['note']})"
        lines.append(f"| {run.key} | {run.system} | {run.num_gpus} ({run.profile}) | {plan} | "
                     f"{numbers} | {waits} | {row.get('split', '—')} | {run.source} |")
    return "\n".join(lines) + "\n"


def write(section: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md (`benchmarks._results`)."""
    from benchmarks._results import write_section

    write_section("validate_public", section, path=DOC)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(r.key for r in RUNS))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--save", help="also write the scored rows to this JSON file")
    parser.add_argument("--load", nargs="*", default=(),
                        help="JSON files of rows scored earlier (--save): table them with "
                        "this run's rows instead of scoring them again (several processes "
                        "can score disjoint --rows)")
    args = parser.parse_args()
    wanted = args.rows.split(",")
    loaded = {}
    for path in args.load:
        with open(path) as f:
            loaded.update(json.load(f))
    rows, scored = [], {}
    for run in RUNS:
        if run.key in loaded:
            rows.append({"run": run, **loaded[run.key]})
            continue
        if run.key not in wanted or args.load:
            continue
        try:
            row = evaluate(run)
        except Exception as err:  # report every row, including those that fail
            row = {"run": run, "error": f"{type(err).__name__}: {str(err)[:200]}"}
        rows.append(row)
        scored[run.key] = {k: v for k, v in row.items() if k != "run"}
        print(scored[run.key], run.key, flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(scored, f, indent=1)
    section = table(rows)
    print(section)
    if not args.no_write:
        write(section)


if __name__ == "__main__":
    main()
