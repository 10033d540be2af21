"""One row of the explored space per plan priced: what it is, what it costs, where.

In: a `Plan` (autopar's candidate or a Megatron configuration's plan) or a configuration
that was not costed with its reason. Out: a flat JSON-ready dict whose keys are the
columns `docs/space.md` describes (`COLUMNS`). The figures are read off the plan, which
the shared cost model priced (`autopar.cost`); nothing is priced here.

The breakdown of the step time is that of the slowest device group (the stage with the
most seconds per microbatch), times the microbatches: its compute, its collectives (the
reductions its nodes issue and the resharding between them), its recompute and its
transfers in; the bubble is the schedule's idle share of the step (`Plan.bubble_fraction`,
`autopar.cost.bubble_fraction`), and `other` the rest (launching programs, host work,
stages of unequal time).
"""

from __future__ import annotations

from autopar.plan import FrontierPoint, Plan

SOURCES = ("auto", "megatron")

# column -> what it holds (docs/space.md lists them too; a test checks each row has
# exactly these keys).
COLUMNS = {
    "record": '"plan" (the header is "header")',
    "source": '"auto" (a candidate of autopar\'s search) or "megatron" (a grid configuration)',
    "kind": '"grid" (a Megatron configuration), "search" (the plan autopar\'s search kept '
            'for a microbatch count and schedule) or "stage_count" (the stage DP\'s best plan '
            'for one stage count at a microbatch count, or why it has none)',
    "label": "the plan in words (a Megatron configuration's name, or autopar's stages)",
    "feasible": "whether it was priced as a plan that fits",
    "reason": "why not, when not feasible (a Megatron rule, 'not needed', a memory error)",
    "chosen": "autopar's plan (the one `autopar.plan` returns at `budget`)",
    "budget": "the memory budget per device (bytes) it was searched or checked under",
    "dp": "Megatron data-parallel degree (null for autopar)",
    "tp": "Megatron tensor-parallel degree (null for autopar)",
    "pp": "Megatron pipeline degree (null for autopar)",
    "cp": "Megatron context-parallel degree (null for autopar)",
    "ep": "Megatron expert-parallel degree (null: none)",
    "sequence_parallel": "Megatron sequence parallelism (null for autopar)",
    "distributed_optimizer": "Megatron distributed optimizer, ZeRO-1 (null for autopar)",
    "virtual_stages": "model chunks per device group (interleaved 1F1B)",
    "num_stages": "pipeline stages",
    "meshes": "per stage, its logical mesh shape",
    "num_microbatches": "microbatches per step",
    "schedule": "pipeline schedule",
    "remat": "what layers recompute: Megatron's --recompute-granularity, or autopar's "
             "choices counted, e.g. 'none', 'selective x12', 'full x4, none x8'",
    "step_time": "predicted seconds per step",
    "compute": "seconds per step the slowest device group computes",
    "communication": "seconds per step of its collectives (node reductions + resharding)",
    "communication_by_kind": "`communication` by collective kind, shared out by the "
                             "slowest group's bytes of each (as `autopar compare` splits it)",
    "recompute": "seconds per step of its recompute",
    "transfer": "seconds per step of its cross-stage transfers",
    "bubble": "the schedule's idle share (`Plan.bubble_fraction`) of step_time",
    "other": "step_time less the five above: program launches, host overhead, the "
             "schedule's uneven stages",
    "collective_bytes": "bytes per device per step by collective kind, all stages",
    "collective_counts": "collectives per step by kind, all stages",
    "memory_peak": "peak bytes per device (the largest stage's)",
    "memory_per_stage": "peak bytes per device, per stage",
    "measured_step_time": "seconds per step measured on devices (null: not run)",
    "lower_bound": "for a stage count the search's bound pruned (kind stage_count, not "
                   "feasible): the least stage-DP objective, seconds per step, any plan of "
                   "that count can have (null elsewhere)",
}


def plan_row(plan: Plan, source: str, label: str, *, budget: float, chosen: bool = False,
             config=None, kind: str | None = None) -> dict:
    """The row of a priced plan (`config`: its `MegatronConfig` for a Megatron plan;
    `kind`: default "grid" for a Megatron plan, "search" for autopar's)."""
    row_kind = kind
    m = plan.num_microbatches if plan.runtime == "pipeline" else 1
    slowest = max(plan.stages, key=lambda s: s.time_per_microbatch)
    cost = slowest.sharding.cost
    step = plan.predicted_step_time
    parts = {
        "compute": cost.compute * m,
        "communication": (cost.communication + cost.resharding) * m,
        "recompute": slowest.recompute_time * m,
        "transfer": slowest.transfer_time * m,
    }
    collective_bytes: dict[str, float] = {}
    collective_counts: dict[str, float] = {}
    for stage in plan.stages:
        for kind, (count, nbytes) in stage.sharding.cost.collectives.items():
            collective_bytes[kind] = collective_bytes.get(kind, 0.0) + nbytes * m
            collective_counts[kind] = collective_counts.get(kind, 0.0) + count * m
    nbytes = {k: b for k, (_, b) in cost.collectives.items() if b > 0}
    total_bytes = sum(nbytes.values())
    by_kind = ({k: parts["communication"] * b / total_bytes for k, b in sorted(nbytes.items())}
               if total_bytes > 0 else {"collectives": parts["communication"]})
    row = _empty(source, label, budget, chosen, row_kind)
    row.update(_config_columns(config))
    row.update(
        feasible=True,
        communication_by_kind=by_kind,
        virtual_stages=plan.virtual_stages,
        num_stages=plan.num_stages,
        meshes=[list(s.mesh.shape) for s in plan.stages],
        num_microbatches=plan.num_microbatches,
        schedule=plan.schedule,
        remat=remat_text(plan) if config is None else config.recompute,
        step_time=step,
        bubble=plan.bubble_fraction * step,
        other=step - sum(parts.values()) - plan.bubble_fraction * step,
        collective_bytes=dict(sorted(collective_bytes.items())),
        collective_counts={k: round(v, 6) for k, v in sorted(collective_counts.items())},
        memory_peak=max(s.memory_per_device for s in plan.stages),
        memory_per_stage=[s.memory_per_device for s in plan.stages],
        **parts,
    )
    return row


def unpriced_row(source: str, label: str, reason: str, *, budget: float, config=None,
                 num_microbatches: int | None = None, kind: str | None = None) -> dict:
    """The row of a configuration that was not priced as a plan, with why."""
    row = _empty(source, label, budget, False, kind)
    row.update(_config_columns(config))
    row.update(reason=reason)
    if config is not None:
        row.update(virtual_stages=config.virtual_stages, num_stages=config.pp,
                   num_microbatches=config.num_microbatches, schedule=config.schedule,
                   remat=config.recompute)
    elif num_microbatches is not None:
        row.update(num_microbatches=num_microbatches)
    return row


def _empty(source: str, label: str, budget: float, chosen: bool, kind: str | None) -> dict:
    row = dict.fromkeys(COLUMNS)
    kind = kind or ("grid" if source == "megatron" else "search")
    row.update(record="plan", source=source, kind=kind, label=label, feasible=False,
               chosen=chosen, budget=budget)
    return row


def _config_columns(config) -> dict:
    if config is None:
        return {}
    return dict(dp=config.dp, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep,
                sequence_parallel=config.sequence_parallel,
                distributed_optimizer=config.distributed_optimizer)


def remat_text(plan: Plan) -> str:
    """What the plan's layers recompute, counted: ``"none"``, ``"selective x12"``,
    ``"full x4, none x8"``."""
    counts: dict[str, int] = {}
    for remats in plan.stage_remat:
        for r in remats:
            counts[r] = counts.get(r, 0) + 1
    if set(counts) <= {"none"}:
        return "none"
    return ", ".join(f"{r} x{n}" for r, n in sorted(counts.items()))


def auto_label(plan: Plan) -> str:
    """``auto: 2 stage(s) (1, 8)|(1, 8), 4 mb, 1f1b, remat selective x12``."""
    meshes = "|".join(str(tuple(s.mesh.shape)) for s in plan.stages)
    remat = remat_text(plan)
    return (f"auto: {plan.num_stages} stage(s) {meshes}, {plan.num_microbatches} mb, "
            f"{plan.schedule}" + ("" if remat == "none" else f", remat {remat}"))


def point_of(row: dict) -> FrontierPoint:
    """A feasible row as a frontier point."""
    return FrontierPoint(row["memory_peak"], row["step_time"], row["label"], row["source"],
                         bool(row["chosen"]))
