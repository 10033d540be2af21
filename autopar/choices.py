"""Every named choice autopar offers, declared once.

In: nothing (this module imports no other part of autopar). Out: one `Literal` type per
choice and the tuple of its values, plus `check_choice`, which every part uses to reject an
unknown value with the same message. Plans store choices as these plain strings, so they
stay JSON-ready.
"""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["auto", "shard", "data", "zero2", "zero3"]
"""How `autoparallel` plans: "auto" searches pipeline stages and operator parallelism;
"shard" operator parallelism on one mesh; "data", "zero2", "zero3" fixed data-parallel
layouts (replicated state; sharded optimizer state; sharded parameters too)."""

ShardMethod = Literal["shard", "data", "zero2", "zero3"]
"""The methods the single-mesh (intra-operator) planner takes."""

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
"""Pipeline schedules the runtime and the cost model know: GPipe; 1F1B (PipeDream-flush);
Megatron-LM's interleaved 1F1B (`virtual_stages` non-adjacent layer chunks per device);
zero bubble ZB-H1 (Qi et al. 2024: the backward split into input-gradient and
weight-gradient passes, the latter filling the bubble)."""

ScheduleOption = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "auto"]
"""The user's schedule option: one `Schedule`, or "auto" to let the planner choose the one
with the lowest predicted step time that fits the memory limit."""

Runtime = Literal["spmd", "pipeline"]
"""How a plan runs: "spmd" one `jax.jit` of the whole step; "pipeline" per-stage forward,
backward and update programs run by the pipeline runtime (microbatches, accumulation)."""

Remat = Literal["none", "selective", "full"]
"""What a layer recomputes in its backward: "none" keeps every activation; "selective" drops
and recomputes the attention core (scores, softmax, dropout; Korthikanti et al. 2022);
"full" keeps only the layer's input and reruns its forward."""

RematOption = Literal["auto", "none", "selective", "full"]
"""The user's remat option: one `Remat` for every layer, or "auto" to let the planner choose
per layer."""

MemoryLevels = Literal["price", "limit"]
"""How the stage DP makes a stage's layer plans leaner when their fastest plans do not fit
together: "price" puts a price on each layer's footprint (one unconstrained solve per
level); "limit" bounds it with a row (any point of the trade-off, each a harder MIP)."""

SolverName = Literal["auto", "highs", "cbc"]
"""The MILP solver of the sharding ILP; "auto" is HiGHS when highspy is installed."""

Annotations = Literal["keep", "hint", "ignore"]
"""What the planner does with the step's own sharding annotations (`with_sharding_constraint`,
`reshard`, `mesh_cast`, flax's logical constraints): "keep" makes the user's spec a hard
constraint on that value; "hint" prefers it (a layout that differs pays the resharding into
the user's spec, which the program still performs); "ignore" drops the annotation (the plan
is the plan of the step without it)."""

MicrobatchCheck = Literal["warn", "strict", "off"]
"""What the search does when the plan's microbatches change the step's math (a loss that is
not a mean over examples, `autopar.search._microbatch_math`): "warn" adds a warning to the
plan naming the value, "strict" refuses the plan, "off" does not check."""
ContextParallel = Literal["auto", "none", "allgather", "ring", "ulysses"]
"""How attention's sequence may be split over a mesh axis (context parallelism): "auto"
lets the sharding ILP choose (any split it prices best, none included); "none" keeps the
query and key sequence of attention whole; "allgather" splits the query sequence and
gathers K/V whole on every device (Llama 3's CP); "ulysses" moves the sequence split to a
heads split for attention with all-to-alls (DeepSpeed-Ulysses); "ring" passes K/V blocks
around a ring of devices (ring attention)."""

MoeOverlap = Literal["auto", "off", "on"]
"""Whether an expert-parallel grouped GEMM hides its dispatch and combine all-to-alls
behind its own compute, in two token chunks (chunk 2's dispatch while chunk 1 computes,
chunk 1's combine while chunk 2 computes: DeepSeek-V3's dual micro-batch overlap,
Megatron-Core's ``--overlap-moe-expert-parallel-comm``, inside one layer): "auto" lets
the sharding ILP choose per grouped GEMM by the predicted time; "off" never; "on" always
where the routed rows split in two."""
MoeDispatch = Literal["mlp", "gemm"]
"""How often an expert-parallel expert MLP exchanges its routed tokens: "mlp" (default)
dispatches them once where they enter the MLP's grouped GEMMs and combines once where
they leave (`autopar.intra._moe_regions`; DeepSeek-V3's and Megatron-Core's dispatcher);
"gemm" dispatches and combines around every grouped GEMM (priced and lowered so; to
compare the two)."""

METHODS: tuple[str, ...] = get_args(Method)
MICROBATCH_CHECKS: tuple[str, ...] = get_args(MicrobatchCheck)
ANNOTATIONS: tuple[str, ...] = get_args(Annotations)
SHARD_METHODS: tuple[str, ...] = get_args(ShardMethod)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
SCHEDULE_OPTIONS: tuple[str, ...] = get_args(ScheduleOption)
RUNTIMES: tuple[str, ...] = get_args(Runtime)
SOLVERS: tuple[str, ...] = get_args(SolverName)
REMATS: tuple[str, ...] = get_args(Remat)
REMAT_OPTIONS: tuple[str, ...] = get_args(RematOption)
MEMORY_LEVELS: tuple[str, ...] = get_args(MemoryLevels)
CONTEXT_PARALLEL: tuple[str, ...] = get_args(ContextParallel)
MOE_OVERLAPS: tuple[str, ...] = get_args(MoeOverlap)
MOE_DISPATCHES: tuple[str, ...] = get_args(MoeDispatch)


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError naming `name`, the bad `value` and the allowed values.

    **Example:** ``check_choice("schedule", "zigzag", SCHEDULES)`` raises
    ``ValueError: unknown schedule 'zigzag'; choose one of 'gpipe', '1f1b'``.
    """
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"unknown {name} {value!r}; choose one of {choices}")
