"""The stage DP's words when it finds no plan (`autopar.inter._stage_dp`): which stage
came closest to fitting and by how much, and what to change. `problem` and `costs` are the
DP's own (`_Problem`, `_Costs`), read by their fields."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost._units import format_gib


@dataclass(frozen=True)
class MemoryFloor:
    """The `StageCost.detail` of an infeasible stage whose `memory` is a lower bound, not
    a fit's peak: every logical mesh it could have taken was skipped by its memory floor
    (`autopar.inter._memory_bound.stage_memory_floor`) or fitted no better, so the stage
    needs at least that much (the message says so)."""


@dataclass(frozen=True)
class OffPlan:
    """The `StageCost.detail` of a stage answered infeasible without a cost: no slicing of
    the layers whose every stage is within the budget by its memory floor holds it
    (`autopar.inter._floor_reach`). Its memory is not known (inf)."""


OFF_PLAN = OffPlan()


def _off_plan_note(costs) -> str:
    """How many of the candidate stages are on no plan within their memory floors."""
    off = len({key[:3] for key, c in costs.items() if isinstance(c.detail, OffPlan)})
    return (f" {off} (layer range, submesh) pairs are on no slicing whose every stage is "
            "within the budget by its memory floor, and were not costed." if off else "")


def format_bytes(num_bytes: float) -> str:
    return format_gib(num_bytes)


def _memory_note(problem, costs, memory_budget: float | None) -> str:
    short = [(c.memory, key, isinstance(c.detail, MemoryFloor)) for key, c in costs.items()
             if not c.feasible and 0 < c.memory < math.inf]
    if not short:
        if memory_budget is None:
            return ""
        largest = "" if any(isinstance(c.detail, OffPlan) for c in costs.values()) else (
            " (not even one layer on the largest submesh)")
        return (f" No stage could be costed within the memory budget of "
                f"{format_bytes(memory_budget)} per device{largest}.")
    memory, (start, end, index, position), floor = min(short)
    needs = "needs at least" if floor else "needs"
    where = f"pipeline layers [{start}, {end}) on submesh {problem.submeshes[index]}"
    if problem.positional:
        where += f" as stage {position} from the last"
    if memory_budget is None:
        return (
            f" The least memory an infeasible stage needs is {format_bytes(memory)} per "
            f"device ({where})."
        )
    return (
        f" The smallest memory shortfall is {'at least ' if floor else ''}"
        f"{format_bytes(memory - memory_budget)} per device: {where} {needs} "
        f"{format_bytes(memory)} against a budget of {format_bytes(memory_budget)}."
    )


def no_plan_error(problem, costs, memory_budget) -> ValueError:
    num_feasible = sum(c.feasible for c in costs.values())
    note = _memory_note(problem, costs, memory_budget) + _off_plan_note(costs)
    fix = "Use more devices or a larger memory budget, smaller microbatches, or rematerialisation"
    if num_feasible == 0:
        return ValueError(
            f"no feasible pipeline stage: all {len(costs)} candidate stages (a range of "
            f"the {_layers(problem.num_layers)} on a submesh) exceed the memory or were "
            "rejected, on "
            f"{problem.num_hosts}x{problem.devices_per_host} devices.{note} {fix}."
        )
    fewest, most = problem.stage_count_range()
    subs = ", ".join(str(problem.submeshes[i]) for i in problem.allowed)
    return ValueError(
        f"no plan: the {_layers(problem.num_layers)} cannot be sliced into {fewest}..{most} "
        f"stages that each fit and together use all {problem.num_devices} devices of the "
        f"{problem.num_hosts}x{problem.devices_per_host} cluster (only {num_feasible} of "
        f"the {len(costs)} candidate stages fit on their own, and no set of them covers "
        f"every layer and device; submeshes allowed: {subs}).{note} {fix}, "
        "or allow more submesh shapes and stage counts."
    )


def _layers(num_layers: int) -> str:
    """``"3 pipeline layers"``: the units the stage DP slices (the model's marked layers,
    or pieces cut automatically, `PlanOptions.num_layers`), named as such."""
    return f"{num_layers} pipeline layer{'s' if num_layers != 1 else ''}"
