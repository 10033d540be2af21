"""`plan.explain()` and `plan.diff()`: what a plan does, on one screen."""

from __future__ import annotations

import re
from collections import defaultdict

from autopar.cluster import spec_axes, spec_str
from autopar.graph import dtype_itemsize
from autopar.report._frontier import frontier_lines
from autopar.report._why import _bytes as _fmt_bytes
from autopar.report._why import (
    alternatives_lines,
    batch_lines,
    choice_sentences,
    planning_lines,
)

_LAYER = re.compile(r"(?:^|/)(layers?|blocks?|h)[/_](\d+)(?:/|$)")


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _group(path: str) -> str:
    m = _LAYER.search(path)
    return f"layer {m.group(2)}" if m else "other"


def _short(path: str) -> str:
    return _LAYER.sub("/", path).strip("/") or path


def _remat_line(stage, scan_ranges=()) -> str:
    """What the stage's layers recompute, runs of equal choices grouped, and its cost,
    e.g. ``layers 0-2 selective, 3 none (+1.2 ms per microbatch)``. A layer that runs a
    piece of a scanned stack (`Plan.scan_ranges`) recomputes under a `jax.checkpoint`
    around its sub-scan's body, whose rerun is part of the stage's compute."""
    runs: list[list] = []
    for k, r in enumerate(stage.remat, start=stage.layers[0]):
        if runs and runs[-1][2] == r:
            runs[-1][1] = k
        else:
            runs.append([k, k, r])
    parts = [f"{a}-{b} {r}" if a != b else f"{a} {r}" for a, b, r in runs]
    line = "layers " + ", ".join(parts) + f" (+{_fmt_time(stage.recompute_time)} per microbatch)"
    stacked = [
        f"layer {k}: iterations {scan_ranges[k - 1][0]}..{scan_ranges[k - 1][1] - 1}"
        for k, r in enumerate(stage.remat, start=stage.layers[0])
        if r != "none" and 1 <= k <= len(scan_ranges)
    ]
    if stacked:
        line += (f"; scanned stack ({', '.join(stacked)}) under jax.checkpoint, its rerun "
                 "in the compute above")
    return line


def _memory_line(parts) -> str:
    """A stage's predicted memory by part (`autopar.cost.StageMemory`)."""
    return (
        f"state {_fmt_bytes(parts.state)} + gradient sums {_fmt_bytes(parts.gradients)} + "
        f"kept activations {_fmt_bytes(parts.activations)} ({parts.in_flight:g} "
        f"microbatch(es) in flight) + working {_fmt_bytes(parts.working)}"
    )


def explain(plan, detail: int = 1, alternatives=None, graph=None) -> str:
    """A text report of a plan: cluster, stages, predicted costs, parameter specs, the
    batch layout, and why: one sentence per big choice saying what it saves.

    `detail=1` fits on one screen for a small model: identical layers are shown once.
    `detail=2` lists every parameter and optimizer-state leaf. `alternatives`: the plans
    a user would write by hand (`autopar.report.alternatives`), shown beside this one
    with their times and memory; `graph`: the traced step, to name what reads each batch
    input. `train_step.explain()` of an `autoparallel` step passes both.
    """
    c = plan.cluster
    lines = [
        f"autopar plan — method {plan.method}, {plan.num_stages} stage(s), "
        f"{plan.num_microbatches} microbatch(es), schedule {plan.schedule}",
        f"cluster {c.get('name', '?')}: {c.get('num_hosts', '?')} host(s) x "
        f"{c.get('devices_per_host', '?')} device(s)",
        f"predicted step time {_fmt_time(plan.predicted_step_time)}",
    ]
    for i, stage in enumerate(plan.stages):
        sp = stage.sharding
        mesh = sp.mesh
        cost = sp.cost
        lines.append(
            f"stage {i}: layers {stage.layers[0]}..{stage.layers[1] - 1}, devices "
            f"{_ranges(mesh.device_ids)}, mesh {dict(zip(mesh.axis_names, mesh.shape))}"
        )
        lines.append(
            f"  compute {_fmt_time(cost.compute)}  communication {_fmt_time(cost.communication)}"
            f"  resharding {_fmt_time(cost.resharding)}  peak memory/device "
            f"{_fmt_bytes(stage.memory_per_device)}"
        )
        if stage.memory_parts is not None:
            lines.append(f"  memory/device: {_memory_line(stage.memory_parts)}")
        if cost.collectives:
            items = sorted(cost.collectives.items())
            parts = [f"{k} x{n:.4g} ({_fmt_bytes(b)})" for k, (n, b) in items]
            lines.append("  collectives: " + ", ".join(parts))
        if any(r != "none" for r in stage.remat):
            lines.append(f"  remat: {_remat_line(stage, plan.scan_ranges)}")
        context = getattr(sp, "context_parallel", None)
        if context is not None and context.algorithm != "none":
            lines.append(
                f"  context parallel: {context.algorithm}, degree {context.degree} over mesh "
                f"axis {''.join(context.axes)} (attention's sequence split)"
            )
    lines.append("parameters (PartitionSpec by path):")
    lines.extend(_param_table(plan, detail))
    lines.extend(batch_lines(plan, graph))
    largest = _largest_replicated(plan)
    if largest:
        lines.append("largest replicated tensors:")
        lines.extend(largest)
    if alternatives:
        lines.extend(alternatives_lines(plan, alternatives))
    lines.extend(frontier_lines(getattr(plan, "frontier_points", ())))
    why = choice_sentences(plan, alternatives or ())
    if why:
        lines.append("why this plan:")
        lines.extend(f"  {s}" for s in why)
    lines.extend(planning_lines(plan.timings))
    if plan.warnings:
        lines.append("warnings:")
        lines.extend(f"  - {w}" for w in plan.warnings)
    return "\n".join(lines)


def _param_table(plan, detail: int) -> list[str]:
    params = [i for i in plan.inputs if i.role == "param"]
    if detail >= 2:
        rows = [i for i in plan.inputs if i.role in ("param", "opt_state", "batch")]
        return [f"  {i.path:<48} {str(i.shape):<18} {spec_str(i.spec)}" for i in rows]
    by_layer: dict[str, list] = defaultdict(list)
    for i in params:
        by_layer[_group(i.path)].append(i)
    lines = []
    previous = None
    same: list[str] = []

    def flush():
        if same:
            lines.append(f"  {', '.join(same)}: same as above")
            same.clear()

    for layer, items in by_layer.items():
        signature = tuple((_short(i.path), i.shape, i.spec, i.stage) for i in items)
        if layer != "other" and signature == previous:
            same.append(layer)
            continue
        flush()
        previous = signature if layer != "other" else None
        stages = sorted({i.stage for i in items})
        where = f", stage {', '.join(map(str, stages))}" if plan.num_stages > 1 else ""
        lines.append(f"  [{layer}{where}]")
        for i in items:
            lines.append(f"    {_short(i.path):<40} {str(i.shape):<18} {spec_str(i.spec)}")
    flush()
    batch = [i for i in plan.inputs if i.role == "batch"]
    for i in batch:
        lines.append(f"  batch {i.path:<34} {str(i.shape):<18} {spec_str(i.spec)}")
    opt = [i for i in plan.inputs if i.role == "opt_state" and spec_axes(i.spec)]
    total_opt = [i for i in plan.inputs if i.role == "opt_state"]
    if total_opt:
        lines.append(f"  optimizer state: {len(opt)} of {len(total_opt)} leaves sharded")
    return lines


def _largest_replicated(plan, top: int = 3) -> list[str]:
    import numpy as np

    rows = []
    for i in plan.inputs:
        if spec_axes(i.spec):
            continue
        nbytes = int(np.prod(i.shape, dtype=np.int64)) * dtype_itemsize(i.dtype)
        if nbytes > 0 and len(i.shape) > 0:
            rows.append((nbytes, i.path))
    rows.sort(reverse=True)
    return [f"  {path} ({_fmt_bytes(n)})" for n, path in rows[:top]]


def _ranges(ids) -> str:
    ids = list(ids)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids))


def diff_plans(a, b) -> str:
    """Differences between two plans: stages, meshes, and each input whose spec changed."""
    lines = []
    if a.method != b.method:
        lines.append(f"method: {a.method} -> {b.method}")
    if a.num_stages != b.num_stages:
        lines.append(f"stages: {a.num_stages} -> {b.num_stages}")
    for i, (sa, sb) in enumerate(zip(a.stages, b.stages)):
        if sa.mesh != sb.mesh:
            lines.append(f"stage {i} mesh: {sa.mesh.shape} -> {sb.mesh.shape}")
        if sa.layers != sb.layers:
            lines.append(f"stage {i} layers: {sa.layers} -> {sb.layers}")
    specs_b = b.specs_by_path()
    for path, spec in a.specs_by_path().items():
        other = specs_b.get(path)
        if other is None:
            lines.append(f"{path}: only in the first plan")
        elif other != spec:
            lines.append(f"{path}: {spec_str(spec)} -> {spec_str(other)}")
    ta, tb = a.predicted_step_time, b.predicted_step_time
    lines.append(f"predicted step time: {_fmt_time(ta)} -> {_fmt_time(tb)}")
    return "\n".join(lines) if len(lines) > 1 else "plans are the same; " + lines[-1]
