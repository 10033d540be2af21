"""Expert parallelism (EP): what routing tokens to experts over ep devices costs.

In: plain numbers (tokens per device, top-k, hidden and expert FFN sizes, bytes per
element, an imbalance factor) and, for seconds, the `Cluster` plus a `LogicalMesh` axis
that is the EP group (`collective_time` prices the all-to-all: NVLink inside a host, each
device's rail for the blocks bound to other hosts). Out: bytes, FLOPs and seconds per MoE
layer, per microbatch, per device.

A dropless top-k MoE layer (tokens sorted by expert, one grouped GEMM per expert weight):

1. dispatch: every token's k copies of its hidden vector go to the devices holding their
   experts, one all-to-all (`dispatch_bytes`);
2. the experts' grouped GEMMs over tokens·k rows (`expert_flops`, `grouped_gemm_time`);
3. combine: the results come back, the same bytes, one all-to-all;

and the backward repeats both exchanges on the gradients (4 all-to-alls per layer per
microbatch, `moe_all_to_all_time`). Routers are rarely even: the busiest device receives
`imbalance` times the mean (`DEFAULT_TOKEN_IMBALANCE`), which scales the all-to-all, the
routed activations and the grouped GEMM (the slowest device sets the pace).

Sources: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (sec. 3.2: EP 64 over 8 nodes,
node-limited routing, dispatch/combine all-to-all overlapped with the other microbatch's
compute in DualPipe); Megatron-Core MoE (docs.nvidia.com/megatron-core, "Mixture of
Experts": expert-model-parallel and expert-tensor-parallel sizes, grouped GEMM, the
alltoall token dispatcher and its overlap with compute, `--moe-a2a-overlap`); Lepikhin et
al. 2020, "GShard" (the dispatch/combine all-to-all pair).
"""

from __future__ import annotations

from autopar.cluster._cluster import Cluster
from autopar.cluster._mesh import LogicalMesh
from autopar.cost._collective import collective_time
from autopar.cost._compute import compute_time
from autopar.cost._context import _check_positive  # one check for both formula modules

# The busiest device's routed tokens over the mean. 1.0 is the balanced routing that
# auxiliary-loss (GShard, Switch, Mixtral) and bias-based (DeepSeek-V3, sec. 2.1.2)
# balancing drive toward; no published run gives one measured figure to default to, so
# it is a parameter: pass the imbalance you measure (e.g. 1.25, Switch Transformer's
# capacity factor, for a router allowed that much skew). The nearest published measure,
# MaxVio (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
# Mixture-of-Experts", arXiv 2408.15664: the busiest *expert*'s load over the mean, minus
# one), is per expert on 1B-3B models, not per EP rank, which holds E/ep experts and so
# averages their loads; it is not taken as the default.
DEFAULT_TOKEN_IMBALANCE = 1.0
# Dispatch and combine, each in the forward and again in the backward.
ALL_TO_ALLS_PER_LAYER = 4
# Fraction of min(all-to-all, other compute) an overlapped schedule hides by default:
# all of it, DeepSeek-V3's DualPipe claim (sec. 3.2.1: "both all-to-all and PP
# communication can be fully hidden"); lower it where the SMs spent on communication slow
# the compute (DeepSeek-V3 gives 20 of 132 SMs to communication).
DEFAULT_OVERLAP_EFFICIENCY = 1.0


def dispatch_bytes(tokens: float, top_k: int, hidden: int, itemsize: float,
                   imbalance: float = DEFAULT_TOKEN_IMBALANCE) -> float:
    """Bytes per device that one dispatch (or combine) all-to-all moves:
    ``tokens · top_k · hidden · itemsize · imbalance`` (every token's k copies; the
    all-to-all keeps 1/ep of them on the device, which `collective_time` accounts for).

    **Example:** 4096 tokens, top-8, hidden 7168, bf16: ``4096 · 8 · 7168 · 2`` = 448 MiB.
    """
    _check_positive(tokens=tokens, top_k=top_k, hidden=hidden, itemsize=itemsize)
    check_imbalance(imbalance)
    return tokens * top_k * hidden * itemsize * imbalance


def all_to_all_time(nbytes: float, cluster: Cluster, mesh: LogicalMesh,
                    axis: str | tuple[str, ...]) -> float:
    """Seconds of one dispatch or combine all-to-all of `nbytes` per device over the EP
    `axis` (`collective_time("all_to_all")`: inside a host over NVLink, across hosts the
    remote blocks over each device's rail)."""
    return collective_time("all_to_all", nbytes, cluster, mesh, axis)


def moe_all_to_all_time(tokens: float, top_k: int, hidden: int, itemsize: float,
                        cluster: Cluster, mesh: LogicalMesh, axis: str | tuple[str, ...],
                        imbalance: float = DEFAULT_TOKEN_IMBALANCE) -> tuple[float, float]:
    """Seconds of one MoE layer's all-to-alls per microbatch: (forward, backward), each a
    dispatch and a combine of `dispatch_bytes` (`ALL_TO_ALLS_PER_LAYER` = 4 in all)."""
    one = all_to_all_time(dispatch_bytes(tokens, top_k, hidden, itemsize, imbalance),
                          cluster, mesh, axis)
    return 2 * one, 2 * one


def expert_flops(tokens: float, top_k: int, hidden: int, expert_ffn: int,
                 gated: bool = True) -> float:
    """Forward FLOPs of the routed experts' grouped GEMMs for `tokens` tokens:
    ``2 · tokens · top_k · hidden · expert_ffn · m`` with m = 3 matrices for a gated
    (SwiGLU) expert, 2 otherwise; dropless, so every token's k choices are computed. The
    backward does twice this.

    **Example:** Mixtral 8x7B (hidden 4096, FFN 14,336, top-2, SwiGLU), 4096 tokens:
    ``2 · 4096 · 2 · 4096 · 14336 · 3`` = 2.89 TFLOP.
    """
    _check_positive(tokens=tokens, top_k=top_k, hidden=hidden, expert_ffn=expert_ffn)
    return 2.0 * tokens * top_k * hidden * expert_ffn * (3 if gated else 2)


def grouped_gemm_time(tokens: float, top_k: int, hidden: int, expert_ffn: int,
                      num_local_experts: int, itemsize: float, cluster: Cluster,
                      dtype: str = "bfloat16", gated: bool = True,
                      imbalance: float = DEFAULT_TOKEN_IMBALANCE) -> float:
    """Forward seconds of one device's grouped GEMMs: the routed rows its
    `num_local_experts` experts receive (``tokens · top_k · imbalance`` rows, tokens being
    the EP group's mean per device, which an even all-to-all leaves each device) through
    `expert_flops`, as one roofline GEMM (`compute_time(matmul=True)`) with the
    per-expert shape (rows / experts, expert_ffn, hidden) and the expert weights plus the
    rows read once."""
    check_imbalance(imbalance)
    _check_positive(num_local_experts=num_local_experts)
    rows = tokens * top_k * imbalance
    flops = expert_flops(tokens, top_k, hidden, expert_ffn, gated) * imbalance
    matrices = 3 if gated else 2
    weights = num_local_experts * matrices * hidden * expert_ffn * itemsize
    activations = rows * (2 * hidden + matrices * expert_ffn) * itemsize
    shape = (rows / num_local_experts, expert_ffn, hidden)
    return compute_time(flops, weights + activations, cluster, dtype, matmul=True,
                        gemm_shape=shape)


def routed_activation_bytes(tokens: float, top_k: int, hidden: int, expert_ffn: int,
                            itemsize: float, gated: bool = True,
                            imbalance: float = DEFAULT_TOKEN_IMBALANCE) -> float:
    """Bytes per device of one MoE layer's routed activations kept for the backward:
    ``tokens · top_k · imbalance · (2·hidden + m·expert_ffn) · itemsize``: the dispatched
    input and the expert output before the combine (hidden each), and the expert's
    intermediates (m = 3 for SwiGLU: gate, up and their product; 2 otherwise: before and
    after the activation)."""
    _check_positive(tokens=tokens, top_k=top_k, hidden=hidden, expert_ffn=expert_ffn,
                    itemsize=itemsize)
    check_imbalance(imbalance)
    per_row = 2 * hidden + (3 if gated else 2) * expert_ffn
    return tokens * top_k * imbalance * per_row * itemsize


def expert_weight_bytes(num_experts: int, hidden: int, expert_ffn: int, itemsize: float,
                        ep: int = 1, etp: int = 1, gated: bool = True) -> float:
    """Bytes of one MoE layer's routed expert weights per device: E/ep experts, each FFN
    split etp ways (Megatron-Core's expert tensor parallelism):
    ``E/ep · m · hidden · expert_ffn / etp · itemsize``."""
    _check_positive(num_experts=num_experts, ep=ep, etp=etp)
    if num_experts % ep:
        raise ValueError(
            f"{num_experts} experts do not split over ep={ep} devices "
            "(num_experts % ep must be 0); choose an ep dividing the number of experts"
        )
    return num_experts / ep * (3 if gated else 2) * hidden * expert_ffn / etp * itemsize


def ep_exchange_bytes(form: int, lhs: float, rhs: float, out_bytes: float,
                      imbalance: float, num_chunks: int
                      ) -> tuple[list[float], list[float], float]:
    """What one chunk of an expert-parallel grouped GEMM moves and reads, bytes per
    device: (its dispatch all-to-alls, its combine all-to-alls, the bytes its GEMM reads
    and writes beside its other operands). Form 1 (forward, token gradient) dispatches the
    routed rows `lhs` and combines the result `out_bytes`, reading the expert weights `rhs`
    whole; form 2 (weight gradient) dispatches both row operands and writes the weight
    gradient whole. Routed rows scale by the token imbalance and split over the chunks."""
    imb, n = imbalance, num_chunks
    if form == 1:
        return [lhs * imb / n], [out_bytes * imb / n], (lhs + out_bytes) / n + rhs
    return [lhs * imb / n, rhs * imb / n], [], (lhs + rhs) / n + out_bytes


def ep_region_exchange_bytes(dispatched: list[float], combined: list[float],
                             imbalance: float, num_gemms: int
                             ) -> tuple[list[float], list[float], float]:
    """What an expert MLP region run expert-parallel moves, bytes per device: (each
    dispatch all-to-all, each combine all-to-all, the share one of its `num_gemms`
    grouped GEMMs carries). The region's rows cross by all-to-all only where they enter
    (`dispatched`: the block of each entering row variable a device holds) and leave
    (`combined`); the GEMMs and row-wise ops between run on the experts' devices
    (`autopar.intra._moe_regions`). Each moves its block times the token imbalance; the
    GEMMs each carry ``1 / num_gemms`` of the exchange (a plan runs all of them
    expert-parallel or prices its own resharding).

    **Example:** a SwiGLU MLP's forward (gate, up, down: 3 GEMMs), 4,096 routed rows of
    hidden 7168 per device in bf16, imbalance 1.25: a dispatch and a combine of
    ``4096 · 7168 · 2 · 1.25`` = 70 MiB each, each GEMM carrying 1/3 of them.
    """
    check_imbalance(imbalance)
    _check_positive(num_gemms=num_gemms)
    return ([b * imbalance for b in dispatched], [b * imbalance for b in combined],
            1.0 / num_gemms)


def ep_buffer_bytes(rows: float, width: int, itemsize: float,
                    imbalance: float = DEFAULT_TOKEN_IMBALANCE,
                    capacity: float | None = None) -> float:
    """Bytes of one device's receive buffer of an expert-parallel dispatch or combine: the
    routed rows it receives, ``rows · imbalance`` dropless (`rows` the mean a device
    holds, tokens · top_k / ep, the busiest receiving `imbalance` times that) or
    `capacity` rows with a fixed expert capacity (GShard / Switch: tokens past it are
    dropped), times ``width · itemsize``.

    **Example:** DeepSeek-V3 on 64 devices, 4,096 tokens each, top-8, hidden 7168, bf16,
    imbalance 1.25: ``4096 · 8 · 1.25 · 7168 · 2`` = 560 MiB per buffer; with a capacity
    of 36,864 rows, ``36864 · 7168 · 2`` = 504 MiB.
    """
    _check_positive(width=width, itemsize=itemsize)
    check_imbalance(imbalance)
    if capacity is not None:
        _check_positive(capacity=capacity)
        return capacity * width * itemsize
    if not rows >= 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return rows * imbalance * width * itemsize


def ep_grouped_gemm_time(flops: float, ep: int, imbalance: float, num_chunks: int,
                         other_bytes: float, rows_bytes: float, cluster: Cluster,
                         dtype: str) -> float:
    """Seconds of one chunk of an expert-parallel grouped GEMM on the busiest device: the
    GEMM's `flops` over `ep` devices, times the imbalance, over the chunks, with its bytes
    (`other_bytes` of its other operands and `rows_bytes`, `ep_exchange_bytes`) times the
    imbalance."""
    return compute_time(flops / ep * imbalance / num_chunks,
                        (other_bytes + rows_bytes) * imbalance, cluster, dtype, matmul=True)


# Bytes per parameter of the training state besides its bf16 weight: Megatron's fp32
# gradient buffer (4), fp32 master copy (4) and Adam's two fp32 moments (8), the last two
# split over the data-parallel group by the distributed optimizer.
GRAD_BYTES, MASTER_BYTES, MOMENT_BYTES = 4, 4, 8


def trained_param_bytes(itemsize: float, group: int) -> float:
    """Bytes per device of one trained parameter: its weight, its fp32 gradient buffer,
    and its fp32 master copy and two moments split over `group` devices (the distributed
    optimizer's group; 1 without it): ``itemsize + 4 + (4 + 8) / group``."""
    return itemsize + GRAD_BYTES + (MASTER_BYTES + MOMENT_BYTES) / group


def weight_and_gradient_bytes(itemsize: float) -> float:
    """Bytes per device of one parameter's weight and fp32 gradient buffer (what a
    stage holds whole whatever the optimizer splits): ``itemsize + 4``."""
    return itemsize + GRAD_BYTES


def imbalance_compute_time(flops: float, imbalance: float, cluster: Cluster,
                           dtype: str) -> float:
    """Seconds the busiest device's extra routed rows add to a step's expert GEMMs: the
    forward's `flops` times (imbalance - 1), run forward and backward (twice the
    forward's work) as matmuls: ``3 · compute_time(flops · (imbalance - 1))``."""
    return 3 * compute_time(flops * (imbalance - 1.0), 0.0, cluster, dtype, matmul=True)


def overlap_saving(all_to_all: float, other_compute: float,
                   efficiency: float = DEFAULT_OVERLAP_EFFICIENCY) -> float:
    """Seconds an overlapped schedule hides by running one microbatch's all-to-all during
    another's compute (DeepSeek-V3's DualPipe, Megatron-Core's all-to-all overlap):
    ``min(all_to_all, other_compute) · efficiency``."""
    if all_to_all < 0 or other_compute < 0:
        raise ValueError(
            f"overlap_saving needs seconds >= 0, got {all_to_all} and {other_compute}"
        )
    if not 0 <= efficiency <= 1:
        raise ValueError(f"overlap efficiency must be in [0, 1], got {efficiency}")
    return min(all_to_all, other_compute) * efficiency


def check_imbalance(imbalance: float) -> None:
    if not imbalance >= 1:
        raise ValueError(
            f"token imbalance is the busiest device's tokens over the mean, so >= 1; got "
            f"{imbalance}"
        )
