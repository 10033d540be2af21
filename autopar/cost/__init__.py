"""The cost model: pure functions, the single source of truth for every prediction.

In: a `Cluster` (links, FLOP/s, memory bandwidth) and a `LogicalMesh`. Out: seconds and
bytes. Collectives use the ring alpha-beta model (two-level, over every NIC rail, for
groups spanning hosts), compute the roofline model with a GEMM efficiency by size and the
bytes that cross fusion boundaries (REFERENCES.md); pipelines Alpa's latency, every
schedule's bubble simulated from its task order (`_schedule`) and in-flight microbatches.
The ILP, the stage DP, the manual-plan scorer and the reports all call these functions.

What only one backend's runtime does sits behind a seam, `autopar.cost.backends`: the
general functions ask `backend_for(cluster)` (by the cluster's `device_kind`) at each
such place. XLA:CPU's module holds its layout copies of GEMM operands, the copies of a
pipelined backend's returned gradients, devices sharing the host's cores and the
latency of collectives inside a program; XLA:GPU's charges none of those. A new
accelerator is one backend module and one profile.
"""

from autopar.cost._attention_memory import fused_attention_bytes
from autopar.cost._collective import (
    COMBINE_THRESHOLD_BYTES,
    collective_time,
    combined_bucket_count,
    combined_collective_time,
    link_for,
    transfer_time,
)
from autopar.cost._compute import (
    MATMUL_PRIMITIVES,
    bytes_per_device,
    compute_time,
    gemm_efficiency,
    kernel_launch_time,
    rate_dtype,
    shape_efficiency,
    shard_shape,
)
from autopar.cost._context import (
    CP_ALGORITHMS,
    CPAlgorithm,
    all_gather_kv_buffer_bytes,
    all_gather_kv_time,
    causal_attention_flops,
    causal_imbalance,
    check_load_balanced_sequence,
    check_ulysses_heads,
    context_parallel_buffer_bytes,
    context_parallel_time,
    kv_block_bytes,
    ring_attention_time,
    ring_kv_buffer_bytes,
    ring_step_time,
    ulysses_buffer_bytes,
    ulysses_bytes,
    ulysses_time,
)
from autopar.cost._experts import (
    DEFAULT_OVERLAP_EFFICIENCY,
    DEFAULT_TOKEN_IMBALANCE,
    all_to_all_time,
    dispatch_bytes,
    expert_flops,
    expert_weight_bytes,
    grouped_gemm_time,
    moe_all_to_all_time,
    overlap_saving,
    routed_activation_bytes,
)
from autopar.cost._fit import CollectiveSample, fit_link
from autopar.cost._formulas import (
    COLLECTIVE_KINDS,
    AlphaBetaTerms,
    CollectiveKind,
    alpha_beta_terms,
)
from autopar.cost._layer_cost import LayerCost
from autopar.cost._links import (
    device_flops,
    group_collective_latency,
    intra_link,
    kind_bandwidth_scale,
    nearest_group_entry,
    network_link,
    rail_share,
    write_bandwidth,
)
from autopar.cost._memory import (
    MEMORY_PARTS,
    StageMemory,
    device_group_memory,
    distributed_optimizer_param_bytes,
    gradient_bytes,
    sharded_bytes,
    stage_memory,
    stage_memory_parts,
)
from autopar.cost._node_cost import (
    batch_feed_seconds,
    kernel_seconds,
    layout_copy_seconds,
    node_compute_seconds,
    reduction_seconds,
    reductions_seconds,
    unfused_bytes,
)
from autopar.cost._overlap import exposed_time, hideable_weight
from autopar.cost._pipeline import (
    DEFAULT_PHASE_SHARES,
    boundary_transfer_time,
    bubble_fraction,
    bubble_scale,
    crossing_bytes,
    in_flight_microbatches,
    memory_budget,
    pipeline_latency,
    pipelined_step_time,
    stage_dispatch_time,
)
from autopar.cost._remat import (
    full_recompute_cost,
    fused_rerun_seconds,
    planned_rerun_seconds,
    recompute_seconds,
    recomputed_layer_cost,
    scan_rerun_seconds,
    selective_recompute_cost,
    stage_recompute_seconds,
)
from autopar.cost._schedule import tasks_per_step

__all__ = [
    "CP_ALGORITHMS",
    "CPAlgorithm",
    "all_gather_kv_buffer_bytes",
    "all_gather_kv_time",
    "causal_attention_flops",
    "causal_imbalance",
    "check_load_balanced_sequence",
    "check_ulysses_heads",
    "context_parallel_buffer_bytes",
    "context_parallel_time",
    "kv_block_bytes",
    "ring_attention_time",
    "ring_kv_buffer_bytes",
    "ring_step_time",
    "ulysses_buffer_bytes",
    "ulysses_bytes",
    "ulysses_time",
    "DEFAULT_OVERLAP_EFFICIENCY",
    "DEFAULT_TOKEN_IMBALANCE",
    "all_to_all_time",
    "dispatch_bytes",
    "expert_flops",
    "expert_weight_bytes",
    "grouped_gemm_time",
    "moe_all_to_all_time",
    "overlap_saving",
    "routed_activation_bytes",
    "fused_attention_bytes",
    "COLLECTIVE_KINDS",
    "COMBINE_THRESHOLD_BYTES",
    "combined_bucket_count",
    "combined_collective_time",
    "DEFAULT_PHASE_SHARES",
    "MATMUL_PRIMITIVES",
    "LayerCost",
    "boundary_transfer_time",
    "bubble_fraction",
    "bubble_scale",
    "crossing_bytes",
    "in_flight_microbatches",
    "memory_budget",
    "pipeline_latency",
    "pipelined_step_time",
    "rate_dtype",
    "stage_dispatch_time",
    "stage_memory",
    "stage_memory_parts",
    "device_group_memory",
    "distributed_optimizer_param_bytes",
    "StageMemory",
    "MEMORY_PARTS",
    "tasks_per_step",
    "full_recompute_cost",
    "fused_rerun_seconds",
    "gradient_bytes",
    "planned_rerun_seconds",
    "recompute_seconds",
    "recomputed_layer_cost",
    "scan_rerun_seconds",
    "selective_recompute_cost",
    "sharded_bytes",
    "stage_recompute_seconds",
    "AlphaBetaTerms",
    "CollectiveKind",
    "CollectiveSample",
    "alpha_beta_terms",
    "bytes_per_device",
    "collective_time",
    "compute_time",
    "exposed_time",
    "fit_link",
    "hideable_weight",
    "gemm_efficiency",
    "kernel_launch_time",
    "link_for",
    "transfer_time",
    "shape_efficiency",
    "shard_shape",
    "device_flops",
    "group_collective_latency",
    "intra_link",
    "kind_bandwidth_scale",
    "nearest_group_entry",
    "network_link",
    "rail_share",
    "write_bandwidth",
    "batch_feed_seconds",
    "kernel_seconds",
    "layout_copy_seconds",
    "node_compute_seconds",
    "reduction_seconds",
    "reductions_seconds",
    "unfused_bytes",
]
