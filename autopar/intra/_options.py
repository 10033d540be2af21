"""Options of the intra-operator planner."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.choices import (
    ANNOTATIONS,
    CONTEXT_PARALLEL,
    MOE_DISPATCHES,
    MOE_OVERLAPS,
    SHARD_METHODS,
    Annotations,
    ContextParallel,
    MoeDispatch,
    MoeOverlap,
    ShardMethod,
    SolverName,
    check_choice,
)


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """How the intra-operator ILP is built and solved.

    **Arguments:**
    - `method`: "shard" searches freely; "data" keeps parameters and optimizer state
      replicated and splits the batch; "zero2" also shards optimizer state (and so
      gradients); "zero3" shards parameters too.
    - `memory_budget`: bytes per device; None uses the cluster's device memory.
    - `time_limit`: seconds for one ILP solve and its tie-break, counted so that a loaded
      machine gets the same plans (see `autopar.intra._ilp.solve`).
    - `solver`: "auto" uses HiGHS when installed, else CBC.
    - `num_memory_points`: program points whose live bytes are constrained.
    - `merge_followers`: let elementwise-like ops share their producer's choice.
    - `open_scans`: plan a `scan`'s body once, jointly with the step (`_scan.py`: its
      layers' weights and activations split like one unrolled layer); False plans a scan
      as one node, split along a batch its body keeps apart or replicated.
    - `annotations`: the step's own `with_sharding_constraint`s: "keep" (a hard
      constraint), "hint" (preferred) or "ignore" (`autopar.intra._rules_annotations`).
    - `context_parallel`: how attention's sequence may split (`autopar.choices.
      ContextParallel`; the strategies each value keeps: `autopar.intra._context`).
    - `moe_overlap`: whether expert-parallel grouped GEMMs may run in two token chunks
      that overlap all-to-all with compute (`autopar.choices.MoeOverlap`; the strategies:
      `autopar.intra._strategies_moe`).
    - `moe_dispatch`: "mlp" prices an expert-parallel expert MLP's grouped GEMMs with one
      dispatch and one combine for the whole MLP, "gemm" with one around each
      (`autopar.choices.MoeDispatch`; the strategies: `autopar.intra._strategies_moe`).
    """

    method: ShardMethod = "shard"
    memory_budget: float | None = None
    time_limit: float = 60.0
    solver: SolverName = "auto"
    num_memory_points: int = 4
    merge_followers: bool = True
    open_scans: bool = True
    annotations: Annotations = "keep"
    context_parallel: ContextParallel = "auto"
    moe_overlap: MoeOverlap = "auto"
    moe_dispatch: MoeDispatch = "mlp"

    def __post_init__(self):
        check_choice("sharding method", self.method, SHARD_METHODS)
        check_choice("annotations", self.annotations, ANNOTATIONS)
        check_choice("context_parallel", self.context_parallel, CONTEXT_PARALLEL)
        check_choice("moe_overlap", self.moe_overlap, MOE_OVERLAPS)
        check_choice("moe_dispatch", self.moe_dispatch, MOE_DISPATCHES)
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(
                f"memory_budget must be a positive number of bytes, got {self.memory_budget}"
            )
