"""`PlanOptions`: every planning option, its default and its check, declared once.

`autopar.plan` and `autopar.autoparallel` take these as keyword arguments (their
signatures are built from this class, `takes_plan_options`); the search resolves the
defaults that depend on the cluster or the batch here (`memory_budget_for`,
`microbatch_counts`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from autopar.choices import (
    ANNOTATIONS,
    CONTEXT_PARALLEL,
    MEMORY_LEVELS,
    METHODS,
    MICROBATCH_CHECKS,
    MOE_DISPATCHES,
    MOE_OVERLAPS,
    REMAT_OPTIONS,
    SCHEDULE_OPTIONS,
    SOLVERS,
    Annotations,
    ContextParallel,
    MemoryLevels,
    Method,
    MicrobatchCheck,
    MoeDispatch,
    MoeOverlap,
    RematOption,
    ScheduleOption,
    SolverName,
    check_choice,
)
from autopar.cluster import Cluster
from autopar.cost import memory_budget

# With num_microbatches="auto": one microbatch (no bubble to fill, no accumulation) and the
# largest few powers of two up to this that divide the batch (the bubble shrinks as they grow).
MAX_MICROBATCH_CANDIDATES = 3
MICROBATCH_POWERS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything the search takes besides the function, its arguments and the cluster.

    **Arguments** (all keyword, all optional):
    - `method`: "auto" (search pipeline stages and operator parallelism), "shard"
      (operator parallelism on one mesh), "data", "zero2", "zero3".
    - `memory_budget`: bytes per device; None: the cluster's device memory.
    - `mesh_shape`: fix the logical mesh shape of a one-mesh plan, e.g. (2, 4).
    - `donate_argnums`: arguments whose buffers the step may reuse (the state);
      `batch_argnums`: arguments holding the batch.
    - `ilp_time_limit`: seconds for one sharding ILP solve (with HiGHS, counted so that
      a loaded machine gets the same plans: CPU seconds between its two solves, ten times
      the limit in wall-clock seconds for HiGHS itself); `solver`: its MILP
      solver, "highs", "cbc" or "auto" (HiGHS when highspy is installed). Plans do not
      depend on it while no solve reaches it: ties between equal-cost plans are broken
      canonically.
    - `num_microbatches`: "auto" or an int dividing the batch; `schedule`: "gpipe",
      "1f1b", "interleaved_1f1b" (with `virtual_stages` v: `num_stages` device groups of
      v non-adjacent layer chunks each), "zero_bubble", or "auto" (the lowest predicted
      step time among 1F1B, zero bubble and interleaved 1F1B with 2 or 4 virtual stages,
      each planned by the stage DP under the memory limit); `num_stages`,
      `submeshes` ((hosts, devices per host) pairs a stage may use)
      and `logical_shapes` fix parts of the pipeline search (method "auto").
    - `num_layers`: layers cut automatically when the model has no `layer_boundary` marks.
    - `remat`: what layers recompute in their backward (method "auto"): "auto" (the stage
      DP chooses per layer, recomputing only where a stage would not fit otherwise),
      "none", "selective" (the attention core) or "full" (all but the layer input).
    - `context_parallel`: how attention's sequence may split over a mesh axis: "auto"
      (the ILP chooses, no split included), "none", "allgather" (query sequence split,
      K/V gathered) or "ulysses" (sequence split outside attention, heads inside, with
      all-to-alls) or "ring" (the all-gather layouts, attention run by the ring kernel:
      K/V blocks passed round the axis, zig-zag load balanced); see
      `autopar.intra._context`.
    - `moe_overlap`: whether an expert-parallel grouped GEMM runs in two token chunks so
      one chunk's dispatch/combine all-to-all runs beside the other's compute: "auto"
      (the ILP chooses per grouped GEMM by predicted time,
      `autopar.cost.chunked_exchange_time`), "off" or "on".
    - `moe_dispatch`: how often an expert-parallel expert MLP exchanges its routed
      tokens: "mlp" (one dispatch where they enter its grouped GEMMs, one combine where
      they leave, `autopar.intra._moe_regions`) or "gemm" (one of each around every
      grouped GEMM); priced and lowered alike.

    How the pipeline search works (method "auto"; the defaults are the planner's, the
    others exist to compare):
    - `share_layouts`: with several microbatch counts, solve the layer ILPs of one count
      and price its layouts for the others (the count kept is searched again on its own
      layouts); False searches every count in full (the same plan or one no slower, at
      more planning time).
    - `prune_by_bound`: cut off stages that cannot be part of a plan as fast as the best
      even plan; False costs every stage (the same plan, more solves).
    - `lower_bounds`: skip the mesh shapes and memory levels whose layers' fastest plans
      already lose; False solves every one the stage DP asks about (the same plan, more
      solves).
    - `every_mesh_shape`: also try the logical mesh shapes of a several-host stage whose
      axes would both cross hosts (`autopar.inter.logical_mesh_shapes`; left out by
      default, which changed no plan where checked); True is the reference for that rule.
    - `memory_levels`: how a stage's layer plans get leaner when they do not fit
      together: "price" (a price on the footprint) or "limit" (a footprint limit row,
      each a harder MIP).

    The user's own shardings:
    - `annotations`: what the step's `with_sharding_constraint` / `reshard` / `mesh_cast`
      (and flax's logical constraints) mean to the plan: "keep" (the user's spec is a hard
      constraint on that value), "hint" (preferred: any other layout pays the resharding
      into it) or "ignore" (dropped: the plan of the step without them).
    - `constraints`: pins on the arguments (`autopar.search._pins`): a pytree like the
      arguments with `PartitionSpec` / `NamedSharding` / None (free) leaves, or
      `autopar.search.LogicalPins` (parameter paths -> logical axes -> mesh axes). A pinned
      leaf keeps its spec in the plan; the rest is searched. Plans with pins or kept
      annotations are planned on one mesh (operator parallelism, no pipeline stages).
    - `microbatch_check`: when the plan runs several microbatches, whether their mean
      still equals the full batch's loss and gradient (`autopar.search._microbatch_math`):
      "warn" (a warning naming the value), "strict" (a ValueError instead) or "off".
    """

    method: Method = "auto"
    memory_budget: float | None = None
    mesh_shape: tuple[int, ...] | None = None
    donate_argnums: tuple[int, ...] = (0,)
    batch_argnums: tuple[int, ...] = (1,)
    ilp_time_limit: float = 60.0
    solver: SolverName = "auto"
    num_microbatches: int | Literal["auto"] = "auto"
    schedule: ScheduleOption = "1f1b"
    virtual_stages: int = 1
    num_stages: int | None = None
    submeshes: tuple[tuple[int, int], ...] | None = None
    logical_shapes: tuple[tuple[int, ...], ...] | None = None
    num_layers: int = 8
    remat: RematOption = "auto"
    share_layouts: bool = True
    prune_by_bound: bool = True
    lower_bounds: bool = True
    every_mesh_shape: bool = False
    memory_levels: MemoryLevels = "price"
    annotations: Annotations = "keep"
    constraints: Any = dataclasses.field(default=None, hash=False)
    microbatch_check: MicrobatchCheck = "warn"
    context_parallel: ContextParallel = "auto"
    moe_overlap: MoeOverlap = "auto"
    moe_dispatch: MoeDispatch = "mlp"

    def __post_init__(self):
        # Callers may pass lists; keep the frozen options hashable plain tuples.
        def tuples(value, depth):
            if value is None:
                return None
            return tuple(tuples(v, depth - 1) for v in value) if depth else value

        for name, depth in (("mesh_shape", 1), ("donate_argnums", 1), ("batch_argnums", 1),
                            ("submeshes", 2), ("logical_shapes", 2)):
            object.__setattr__(self, name, tuples(getattr(self, name), depth))
        check_choice("method", self.method, METHODS)
        check_choice("schedule", self.schedule, SCHEDULE_OPTIONS)
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(
                f"virtual_stages must be a positive int, got {self.virtual_stages!r}"
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b', "
                f"not {self.schedule!r}"
            )
        check_choice("solver", self.solver, SOLVERS)
        check_choice("remat", self.remat, REMAT_OPTIONS)
        check_choice("memory_levels", self.memory_levels, MEMORY_LEVELS)
        check_choice("annotations", self.annotations, ANNOTATIONS)
        check_choice("microbatch_check", self.microbatch_check, MICROBATCH_CHECKS)
        check_choice("context_parallel", self.context_parallel, CONTEXT_PARALLEL)
        check_choice("moe_overlap", self.moe_overlap, MOE_OVERLAPS)
        check_choice("moe_dispatch", self.moe_dispatch, MOE_DISPATCHES)
        m = self.num_microbatches
        if m != "auto" and (not isinstance(m, int) or m < 1):
            raise ValueError(f"num_microbatches must be a positive int or 'auto', got {m!r}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(
                f"memory_budget must be a positive number of bytes, got {self.memory_budget}"
            )

    def check_cluster(self, cluster: Cluster) -> None:
        """Raise a ValueError naming the fix when an option cannot hold on `cluster`."""
        if self.mesh_shape is not None and math.prod(self.mesh_shape) != cluster.num_devices:
            n = cluster.num_devices
            fitting = [(a, n // a) for a in range(1, n + 1) if n % a == 0]
            raise ValueError(
                f"mesh_shape {self.mesh_shape} needs {math.prod(self.mesh_shape)} devices but "
                f"the cluster has {n}; pass a shape whose product is {n}, e.g. (" + str(n) +
                ",) or one of " + ", ".join(map(str, fitting)) + ", or mesh_shape=None to "
                "let the planner choose"
            )

    def memory_budget_for(self, cluster: Cluster) -> float:
        """Bytes per device plans may use on `cluster` (`autopar.cost.memory_budget`)."""
        return memory_budget(cluster, self.memory_budget)

    def microbatch_counts(self, rows: int | None) -> list[int]:
        """The microbatch counts the search tries for a batch of `rows` (None: no batch)."""
        if self.num_microbatches != "auto":
            if rows is not None and rows % self.num_microbatches:
                raise ValueError(
                    f"the batch has {rows} rows, which is not divisible by num_microbatches="
                    f"{self.num_microbatches}; choose a number of microbatches that divides "
                    f"{rows}"
                )
            return [self.num_microbatches]
        if rows is None:
            return [1]
        powers = [b for b in MICROBATCH_POWERS if rows % b == 0 and b <= rows]
        return [1, *powers[-(MAX_MICROBATCH_CANDIDATES - 1):]]


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PlanOptions))


def options_from(caller: str, keywords: dict[str, Any]) -> PlanOptions:
    """`PlanOptions(**keywords)`, with a TypeError naming an unknown option and the known."""
    unknown = sorted(set(keywords) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"{caller}() got unknown option(s) {', '.join(map(repr, unknown))}; the options "
            f"are {', '.join(OPTION_NAMES)} (see autopar.PlanOptions)"
        )
    return PlanOptions(**keywords)


def takes_plan_options(fn: Callable) -> Callable:
    """Give `fn(..., **options)` a signature that lists every `PlanOptions` field as a
    keyword argument with its default, so `help()` and editors show them."""
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                          annotation=f.type)
        for f in dataclasses.fields(PlanOptions)
    ]
    fn.__signature__ = signature.replace(parameters=params)
    return fn


def resolve_cluster(cluster: Any) -> Cluster:
    """A `Cluster` from None (local devices), a profile name, a path, or a Cluster."""
    if cluster is None:
        return Cluster.local()
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.from_profile(cluster)
    raise TypeError(
        f"cluster must be None, a Cluster, or a profile name or path, got {type(cluster).__name__}"
    )
