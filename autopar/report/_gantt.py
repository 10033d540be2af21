"""Pipeline schedules: predicted task timings and Gantt charts of them.

`simulate_schedule` turns per-stage forward/backward times into the start and end of every
task of a pipeline under any `Schedule` (GPipe, 1F1B, interleaved 1F1B, zero bubble);
`gantt` draws such a list (predicted or measured), and
`gantt_compare` draws a prediction above a measurement, each on its own time axis.

A `TaskRecord` is plain data. The drawings take any records with the same fields, such as
the measured timeline of the pipeline runtime (`PipelineExecutable.timeline`).

**Example:**

```python
tasks = simulate_schedule([1.0, 1.0], [2.0, 2.0], num_microbatches=4, schedule="1f1b")
max(t.end for t in tasks)  # (4 + 2 - 1) * (1 + 2) = 15.0
gantt(tasks, "schedule.png", title="GPT, 2 stages")
```
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from autopar.choices import SCHEDULES, Schedule, check_choice
from autopar.cost import DEFAULT_PHASE_SHARES, stage_dispatch_time
from autopar.cost._schedule import simulate
from autopar.report._pictures import new_figure
from autopar.runtime import TaskRecord as RuntimeTaskRecord

Kind = Literal["forward", "backward", "weight", "apply"]

# The microbatch number of an "apply" task, which updates the weights once per step.
APPLY_MICROBATCH = -1

KIND_COLORS = {
    "forward": "#4C72B0", "backward": "#DD8452", "weight": "#C44E52", "apply": "#55A868",
}


# The runtime's record of a task (stage, kind, microbatch, start, end): measured timelines
# and simulated ones share it.
TaskRecord = RuntimeTaskRecord


# ---- simulation --------------------------------------------------------------------------


def simulate_schedule(
    forward_times: Sequence[float],
    backward_times: Sequence[float],
    num_microbatches: int,
    schedule: Schedule = "1f1b",
    apply_times: Sequence[float] | None = None,
    virtual_stages: int = 1,
    weight_times: Sequence[float] | None = None,
) -> list[TaskRecord]:
    """Predicted start and end of every task of one pipelined train step.

    The cost model's simulation (`autopar.cost._schedule.simulate`, which also gives every
    schedule's predicted bubble): each device group runs its tasks in the order the
    pipeline runtime runs them (`autopar.runtime.device_orders`), each as soon as the tasks
    it reads from (`autopar.runtime.dependencies`) have ended and its devices are free:
    GPipe, all forwards then all backwards; 1F1B, ``num_stages - i - 1`` warm-up forwards,
    then one forward and one backward in turn; interleaved 1F1B, stage s on device group
    s mod p; zero bubble, the backward split into B ("backward") and W ("weight",
    `weight_times` of it, by default half). "apply" (the optimizer update) follows the
    stage's group's last task. Transfers take no time.

    **Arguments:**
    - `forward_times`, `backward_times`: seconds per microbatch, one per stage (the
      backward whole, B and W together).
    - `num_microbatches`: microbatches per step.
    - `schedule`: a `Schedule`; `virtual_stages`: stages per device group (interleaved).
    - `apply_times`: seconds of each stage's optimizer update; None for none.
    - `weight_times`: zero bubble: seconds of each stage's W; None for half its backward.

    **Returns:** the tasks, sorted by start time, then stage.
    """
    _check_inputs(forward_times, backward_times, num_microbatches, schedule, apply_times)
    timed, group_free = simulate(forward_times, backward_times, num_microbatches, schedule,
                                 virtual_stages, weight=weight_times)
    records = [TaskRecord(stage, kind, mb, start, end)
               for (kind, stage, mb), start, end in timed]
    num_groups = len(group_free)
    for i, t in enumerate(apply_times or ()):
        free = group_free[i % num_groups]
        records.append(TaskRecord(i, "apply", APPLY_MICROBATCH, free, free + t))
    return sorted(records, key=lambda t: (t.start, t.stage))


def _check_inputs(forward_times, backward_times, num_microbatches, schedule, apply_times):
    num_stages = len(forward_times)
    if num_stages == 0 or len(backward_times) != num_stages:
        raise ValueError(
            f"got {num_stages} forward times and {len(backward_times)} backward times; give "
            "one of each per pipeline stage (at least one stage)"
        )
    if apply_times is not None and len(apply_times) != num_stages:
        raise ValueError(
            f"got {len(apply_times)} apply times for {num_stages} stages; give one per stage "
            "or None"
        )
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    check_choice("schedule", schedule, SCHEDULES)
    times = [*forward_times, *backward_times, *(apply_times or ())]
    if any(t < 0 for t in times):
        raise ValueError(f"task times must be >= 0 seconds, got {min(times)}")


def makespan(tasks: Sequence[TaskRecord]) -> float:
    """Seconds from the first task's start to the last task's end."""
    return max(t.end for t in tasks) - min(t.start for t in tasks) if tasks else 0.0


def idle_fraction(tasks: Sequence[TaskRecord]) -> float:
    """The pipeline bubble: the share of stage-time no task runs, in [0, 1)."""
    if not tasks:
        return 0.0
    num_stages = len({t.stage for t in tasks})
    busy = sum(t.duration for t in tasks)
    total = num_stages * makespan(tasks)
    return 1.0 - busy / total if total > 0 else 0.0


def plan_schedule(plan) -> list[TaskRecord]:
    """The predicted tasks of a pipelined `Plan`, from its stages' predicted costs.

    Each stage's predicted cost is its time per microbatch (as `Plan.predicted_step_time`
    reads it), split into forward, input-gradient and weight-gradient passes by the plan's
    `phase_shares` (a third each when it has none; B and W run as one backward except
    under zero bubble); the update is not modelled separately. Launching the stage's
    programs (`autopar.cost.stage_dispatch_time`) counts with it, as
    `Plan.predicted_step_time` adds it.
    """
    shares = plan.phase_shares or DEFAULT_PHASE_SHARES
    total = sum(shares)
    forward_share, weight_share = shares[0] / total, shares[2] / total
    dispatch = stage_dispatch_time(
        plan.cluster, plan.num_stages, plan.num_microbatches, plan.schedule
    )
    per_microbatch = [s.time_per_microbatch + dispatch for s in plan.stages]
    forward = [t * forward_share for t in per_microbatch]
    backward = [t - f for t, f in zip(per_microbatch, forward)]
    weight = [t * weight_share for t in per_microbatch]
    groups = len({tuple(s.sharding.mesh.device_ids) for s in plan.stages})
    return simulate_schedule(
        forward, backward, plan.num_microbatches, plan.schedule,
        virtual_stages=len(plan.stages) // groups, weight_times=weight,
    )


# ---- drawing -----------------------------------------------------------------------------


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds >= 1:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "us", 1e6


def _draw(ax, tasks: Sequence[TaskRecord], title: str, unit: str, scale: float) -> None:
    num_stages = max(t.stage for t in tasks) + 1
    for t in tasks:
        ax.barh(
            t.stage, t.duration * scale, left=t.start * scale, height=0.8,
            color=KIND_COLORS.get(t.kind, "#8C8C8C"), edgecolor="white", linewidth=0.8,
        )
        if t.kind != "apply":
            ax.text(
                (t.start + t.end) / 2 * scale, t.stage, str(t.microbatch),
                ha="center", va="center", fontsize=7, color="white",
            )
    ax.set_yticks(range(num_stages), [f"stage {i}" for i in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(
        f"{title}: makespan {makespan(tasks) * scale:.3g} {unit}, "
        f"idle {idle_fraction(tasks):.0%}",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    handles = [
        _patch(color, kind) for kind, color in KIND_COLORS.items()
        if any(t.kind == kind for t in tasks)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def _patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def gantt(
    tasks: Sequence[TaskRecord], path: str | Path, title: str = "pipeline schedule"
) -> Path:
    """Draw a pipeline schedule: one row per stage, a bar per task labelled by microbatch.

    **Arguments:**
    - `tasks`: `TaskRecord`s (from `simulate_schedule`, or measured).
    - `path`: the image file; ``.png``, ``.svg`` or ``.pdf`` by its suffix.
    - `title`: the title; the makespan and the idle share are added.

    **Returns:** the path written. Needs matplotlib (``pip install autopar[plot]``).
    """
    _require_tasks(tasks, "tasks")
    unit, scale = _time_unit(makespan(tasks))
    num_stages = max(t.stage for t in tasks) + 1
    fig = new_figure(figsize=(10, 1.0 + 0.5 * num_stages))
    _draw(fig.add_subplot(), tasks, title, unit, scale)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def gantt_compare(
    predicted: Sequence[TaskRecord],
    measured: Sequence[TaskRecord],
    path: str | Path,
    title: str = "pipeline schedule",
    profile: str | None = None,
) -> Path:
    """Draw a predicted schedule above a measured one, each on its own time axis (a
    prediction of milliseconds stays visible beside a measurement of seconds), with a
    line comparing the two step times (`step_time_comparison`).

    **Arguments:**
    - `predicted`, `measured`: `TaskRecord`s; the measured ones from a steady-state step
      (not the first, which compiles), shifted to start at 0.
    - `profile`: the name of the cost profile the prediction used, for the comparison.

    **Returns:** the path written. Needs matplotlib (``pip install autopar[plot]``).
    """
    fig = gantt_compare_figure(predicted, measured, title, profile)
    fig.savefig(path, dpi=120)
    return Path(path)


def gantt_compare_figure(
    predicted: Sequence[TaskRecord],
    measured: Sequence[TaskRecord],
    title: str = "pipeline schedule",
    profile: str | None = None,
):
    """The figure `gantt_compare` saves: two axes, not shared, each in its own unit."""
    _require_tasks(predicted, "predicted")
    _require_tasks(measured, "measured")
    origin = min(t.start for t in measured)
    measured = [TaskRecord(t.stage, t.kind, t.microbatch, t.start - origin, t.end - origin)
                for t in measured]
    num_stages = max(t.stage for t in [*predicted, *measured]) + 1
    fig = new_figure(figsize=(10, 2.6 + 1.0 * num_stages))
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2)
    for ax, tasks, name in ((top, predicted, "predicted"), (bottom, measured, "measured")):
        unit, scale = _time_unit(makespan(tasks))
        _draw(ax, tasks, f"{title}, {name}", unit, scale)
        ax.set_xlim(0, max(t.end for t in tasks) * scale * 1.02)
    line = step_time_comparison(makespan(predicted), makespan(measured), profile)
    fig.suptitle(textwrap.fill(line, 130), fontsize=9)  # fits the figure's width
    fig.tight_layout()
    return fig


def step_time_comparison(predicted: float, measured: float, profile: str | None) -> str:
    """One line: predicted against measured seconds per step, the profile the prediction
    used, and, when that is a built-in profile (vendor or default figures rather than a
    measurement of this machine), the command that measures one."""
    ratio = f" ({measured / predicted:.3g}x the prediction)" if predicted > 0 else ""
    line = (f"predicted {_seconds(predicted)} per step, measured {_seconds(measured)}"
            f"{ratio}")
    if profile:
        line += f"; cost profile {profile!r}"
        if is_builtin_profile(profile):
            line += (" (built-in figures, not this machine's: run `autopar profile` to "
                     "measure it)")
    return line


def _seconds(seconds: float) -> str:
    unit, scale = _time_unit(seconds)
    return f"{seconds * scale:.3g} {unit}"


def is_builtin_profile(name: str) -> bool:
    """Whether a cluster named `name` takes its figures from a built-in profile rather than
    from a measurement (``autopar profile`` names its profiles ``...-measured``)."""
    inner = name[len("local ("):-1] if name.startswith("local (") else name
    return "measured" not in inner


def _require_tasks(tasks: Sequence[TaskRecord], name: str) -> None:
    if not tasks:
        raise ValueError(f"{name} is empty; there is no schedule to draw")
