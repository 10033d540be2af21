"""`compare`: plans side by side, one column each, from the shared cost model.

In: `Plan`s (automatic, Megatron-style, loaded from files) of the same train step, and
optionally measured step times and the step's FLOPs. Out: a text table of predicted step
time, achieved TFLOP/s per device, memory per device, communication by collective kind,
the pipeline bubble, and measured times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.cost import bubble_fraction
from autopar.plan import Plan
from autopar.report._explain import _fmt_bytes, _fmt_time

# Marks a value a plan does not have (e.g. no measurement).
MISSING = "-"
TERA = 1e12


# The bubble of a GPipe/1F1B pipeline, one formula for every part (`autopar.cost`).
pipeline_bubble = bubble_fraction


@dataclass(frozen=True)
class PlanFigures:
    """The numbers `compare` shows for one plan."""

    name: str
    num_stages: int
    mesh: str
    num_devices: int
    num_microbatches: int
    step_time: float  # predicted seconds
    memory_per_device: float  # bytes, the largest over stages
    collectives: dict[str, tuple[int, float]]  # kind -> (count, bytes per device) per step
    bubble: float
    tflops_per_device: float | None  # from `flops`, if given
    measured: float | None  # seconds


def plan_figures(plan, flops: float | None = None, measured: float | None = None) -> PlanFigures:
    """The figures of one plan.

    **Arguments:**
    - `plan`: a `Plan`.
    - `flops`: FLOPs of one training step (e.g. `OpGraph.total_flops`); None: unknown.
    - `measured`: a measured step time in seconds, or None.
    """
    # A pipelined plan's stages are costed per microbatch (see Plan.predicted_step_time).
    per_step = plan.num_microbatches if plan.runtime == "pipeline" else 1
    collectives: dict[str, list] = {}
    for stage in plan.stages:
        for kind, (count, nbytes) in stage.sharding.cost.collectives.items():
            entry = collectives.setdefault(kind, [0, 0.0])
            entry[0] += count * per_step
            entry[1] += nbytes * per_step
    # Interleaved 1F1B puts several stages (model chunks) on each device group.
    num_devices = len({d for stage in plan.stages for d in stage.mesh.device_ids})
    step_time = plan.predicted_step_time
    tflops = None
    if flops is not None and step_time > 0:
        tflops = flops / (step_time * num_devices) / TERA
    collectives = {k: [round(n), b] for k, (n, b) in collectives.items()}
    return PlanFigures(
        name=plan.method,
        num_stages=plan.num_stages,
        mesh=_mesh_text(plan),
        num_devices=num_devices,
        num_microbatches=plan.num_microbatches,
        step_time=step_time,
        memory_per_device=max(s.memory_per_device for s in plan.stages),
        collectives={k: (int(n), float(b)) for k, (n, b) in sorted(collectives.items())},
        bubble=plan.bubble_fraction,
        tflops_per_device=tflops,
        measured=measured,
    )


def compare(
    plans: Sequence,
    measured: Sequence[float | None] | None = None,
    flops: float | Sequence[float | None] | None = None,
) -> str:
    """A table comparing plans of one train step, one column per plan.

    **Arguments:**
    - `plans`: `Plan`s, e.g. ``[autopar.plan(...), megatron_plan(...)]``.
    - `measured`: a measured step time in seconds (or None) per plan.
    - `flops`: FLOPs of one training step (``trace(step, ...).total_flops``), one number
      for all plans or one per plan; enables the TFLOP/s row (a Plan does not store its
      FLOPs).

    **Returns:** the table as text.

    **Example:**

    ```python
    print(compare([auto_plan, megatron_plan(step, *args, cluster=c, dp=2, tp=4)],
                  flops=graph.total_flops))
    ```
    """
    if isinstance(plans, Mapping):
        raise TypeError("compare takes a sequence of Plans, not a mapping; pass "
                        "list(plans.values()).")
    plans = list(plans)
    if not plans:
        raise ValueError("compare needs at least one plan")
    for i, p in enumerate(plans):
        if not isinstance(p, Plan):
            raise TypeError(f"compare: plans[{i}] is a {type(p).__name__}, not an "
                            "autopar.Plan; pass the plans autopar.plan or megatron_plan "
                            "returned.")
    measured_list = _per_plan(measured, len(plans), "measured")
    flops_list = _per_plan(flops, len(plans), "flops")
    figures = [plan_figures(p, f, m) for p, f, m in zip(plans, flops_list, measured_list)]
    return _table(figures)


def _per_plan(value, n: int, name: str) -> list:
    if value is None:
        return [None] * n
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(
            f"{name} has {len(values)} entries for {n} plans; give one value (or None) per "
            "plan, in the order of the plans"
        )
    return values


def _table(figures: Sequence[PlanFigures]) -> str:
    best = min(f.step_time for f in figures)
    kinds = sorted({k for f in figures for k in f.collectives})
    rows: list[tuple[str, list[str]]] = [
        ("plan", [f.name for f in figures]),
        ("stages x mesh", [f"{f.num_stages} x {f.mesh}" for f in figures]),
        ("microbatches", [str(f.num_microbatches) for f in figures]),
        ("predicted step time", [_fmt_time(f.step_time) for f in figures]),
        ("vs fastest", [f"{f.step_time / best:.2f}x" if best > 0 else MISSING
                        for f in figures]),
        ("TFLOP/s per device", [MISSING if f.tflops_per_device is None
                                else f"{f.tflops_per_device:.4g}" for f in figures]),
        ("memory per device", [_fmt_bytes(f.memory_per_device) for f in figures]),
    ]
    for kind in kinds:
        rows.append((f"{kind} (count, bytes)", [_collective_text(f.collectives.get(kind))
                                                for f in figures]))
    rows.append(("pipeline bubble", [f"{100 * f.bubble:.1f}%" for f in figures]))
    if any(f.measured is not None for f in figures):
        rows.append(("measured step time", [MISSING if f.measured is None
                                            else _fmt_time(f.measured) for f in figures]))
        rows.append(("measured / predicted", [
            MISSING if f.measured is None or f.step_time <= 0
            else f"{f.measured / f.step_time:.2f}" for f in figures
        ]))
    return _render(rows)


def _collective_text(entry: tuple[int, float] | None) -> str:
    if entry is None:
        return MISSING
    count, nbytes = entry
    return f"{count} x, {_fmt_bytes(nbytes)}"


def _render(rows: list[tuple[str, list[str]]]) -> str:
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(rows[0][1]))]
    lines = []
    for r, (label, cells) in enumerate(rows):
        text = "  ".join(cell.rjust(w) for cell, w in zip(cells, widths))
        lines.append(f"{label.ljust(label_width)}  {text}")
        if r == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _mesh_text(plan) -> str:
    """``data=4 x model=2``; stages of different meshes are listed, separated by "|"."""
    texts = []
    for stage in plan.stages:
        mesh = stage.mesh
        texts.append(" x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.shape)))
    unique = list(dict.fromkeys(texts))
    return unique[0] if len(unique) == 1 else " | ".join(texts)
