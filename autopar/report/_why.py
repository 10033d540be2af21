"""The part of `explain()` that says why: the chosen plan against the plans a user would
write by hand, one sentence per big choice saying what it saves, and the batch layout.

Words used (defined once, in the report itself): a *stage* is a group of consecutive
layers run on its own devices; *pipeline layers* are what the planner cuts stages from
(the model's `layer_boundary` marks, or pieces of similar cost cut automatically).
"""

from __future__ import annotations

import math

from autopar.cluster import spec_axes
from autopar.graph import dtype_itemsize

# What the planning-time keys of `Plan.timings` mean, in the order shown; keys whose time
# another key already contains are left out (`OVERLAPPING`), so the parts add up.
PHASE_WORDS = {
    "trace": "tracing the step",
    "intra_op_ilp": "sharding the step (integer program)",
    "layer clustering": "grouping layers",
    "layer ILPs": "sharding each layer (integer programs)",
    "stage DP": "choosing pipeline stages",
    "stage plans": "planning each stage",
}
OVERLAPPING = frozenset({"stage_dp_and_ilps", "search"})
COUNT_WORDS = {
    "layer ILPs solved": "layer sharding problems solved",
    "layer costs reused": "reused",
    "layer costs priced": "priced from another microbatch count",
}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _nbytes(info) -> float:
    return math.prod(info.shape) * dtype_itemsize(info.dtype)


def _ways(plan, info) -> int:
    """How many pieces `info` is split into on its stage's mesh."""
    mesh = plan.stages[info.stage].sharding.mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    return math.prod(sizes.get(a, 1) for a in spec_axes(info.spec))


def _per_device(plan, role: str) -> tuple[float, float, int, int]:
    """(bytes in all, bytes per device, leaves split, leaves) of the inputs of `role`,
    per device on the fullest stage."""
    rows = [i for i in plan.inputs if i.role == role]
    total = sum(_nbytes(i) for i in rows)
    by_stage: dict[int, float] = {}
    for i in rows:
        by_stage[i.stage] = by_stage.get(i.stage, 0.0) + _nbytes(i) / _ways(plan, i)
    split = sum(1 for i in rows if spec_axes(i.spec))
    return total, max(by_stage.values(), default=0.0), split, len(rows)


def alternatives_lines(plan, alternatives) -> list[str]:
    """The chosen plan beside each alternative: time, ratio, memory per device."""
    chosen = plan.predicted_step_time
    memory = max(s.memory_per_device for s in plan.stages)
    rows = [("this plan", chosen, memory, "")]
    for alt in alternatives:
        if alt.plan is None:
            rows.append((alt.name, None, None, alt.reason))
        else:
            rows.append((alt.name, alt.step_time, alt.memory_per_device, ""))
    width = max(len(name) for name, *_ in rows)
    lines = ["compared with plans written by hand (predicted by the same cost model):"]
    for name, seconds, mem, reason in rows:
        if seconds is None:
            lines.append(f"  {name:<{width}}  not possible: {reason}")
            continue
        ratio = f" ({seconds / chosen:.2f}x)" if name != "this plan" and chosen > 0 else ""
        lines.append(f"  {name:<{width}}  {_time(seconds):>10}{ratio:<9} per step, "
                     f"{_bytes(mem)} per device")
    return lines


def choice_sentences(plan, alternatives=()) -> list[str]:
    """One sentence per big choice of `plan`, saying what it saves (or costs)."""
    out = []
    if plan.num_stages > 1:
        out.append(
            f"Pipeline: the layers run as {plan.num_stages} stages (a stage is a group of "
            f"consecutive layers on its own devices), so each device holds only its stage's "
            f"state; the price is idle time, {plan.bubble_fraction:.0%} of the step with "
            f"{plan.num_microbatches} microbatches under {plan.schedule}.")
    elif plan.num_microbatches > 1:
        out.append(
            f"Microbatches: the batch runs as {plan.num_microbatches} microbatches whose "
            f"gradients are summed (gradient accumulation), so activations are kept for "
            f"1/{plan.num_microbatches} of the batch at a time.")
    total, per_device, split, count = _per_device(plan, "param")
    if count and split:
        out.append(
            f"Weights: {split} of {count} parameter tensors are split over devices "
            f"(tensor parallelism), {_bytes(per_device)} of parameters per device instead "
            f"of {_bytes(total)} replicated; the splits cost "
            f"{_time(sum(s.sharding.cost.communication for s in plan.stages))} of "
            "communication per microbatch.")
    elif count:
        out.append(f"Weights: every parameter is replicated ({_bytes(total)} per device): "
                   "no gathers of weights, the most memory.")
    total, per_device, split, count = _per_device(plan, "opt_state")
    if count and split:
        out.append(
            f"Optimizer state: {split} of {count} leaves are split (as ZeRO does), "
            f"{_bytes(per_device)} per device instead of {_bytes(total)}.")
    if any(r != "none" for s in plan.stages for r in s.remat):
        extra = sum(s.recompute_time for s in plan.stages)
        out.append(f"Recomputation: some layers rerun their forward in the backward "
                   f"instead of keeping activations, +{_time(extra)} per microbatch.")
    costed = [a for a in alternatives if a.plan is not None]
    if costed:
        best = min(costed, key=lambda a: a.step_time)
        delta = best.step_time - plan.predicted_step_time
        memory = max(s.memory_per_device for s in plan.stages)
        if delta >= 0:
            out.append(
                f"Against the fastest of those ({best.name}): this plan saves "
                f"{_time(delta)} per step ({delta / best.step_time:.0%}), at "
                f"{_bytes(memory)} against {_bytes(best.memory_per_device)} per device.")
        else:
            out.append(
                f"{best.name} is predicted faster by {_time(-delta)} per step: the search "
                "was restricted (a fixed microbatch count, mesh or method), or it does not "
                "try that layout; pass it with plan= or loosen the options.")
    return [f"- {s}" for s in out]


def batch_lines(plan, graph=None) -> list[str]:
    """How each batch input is laid out, why two may differ, and a warning when the rows
    do not split over every device of the mesh."""
    batch = [i for i in plan.inputs if i.role == "batch"]
    if not batch:
        return []
    lines = ["batch layout:"]
    for i in batch:
        lines.append(f"  {i.path} {tuple(i.shape)}: {_layout(plan, i)}")
    if len({i.spec for i in batch}) > 1:
        readers = _first_readers(graph, plan) if graph is not None else {}
        named = ", ".join(f"{p} is first read by {r}" for p, r in readers.items())
        lines.append(
            "  The inputs are laid out differently because the planner places each where "
            "the first operation reading it wants it (moving it later costs communication)"
            + (f": {named}." if named else "."))
    lines += [f"  warning: {w}" for w in batch_warnings(plan)]
    return lines


def _layout(plan, info) -> str:
    mesh = plan.stages[info.stage].sharding.mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    parts = []
    for dim, axes in enumerate(info.spec):
        if not axes:
            continue
        ways = math.prod(sizes[a] for a in axes)
        what = "rows" if dim == 0 else f"dimension {dim}"
        parts.append(f"{what} split {ways} ways over mesh axes {', '.join(axes)}")
    if not parts:
        return f"whole on each of the {mesh.num_devices} devices (replicated)"
    return "; ".join(parts)


def batch_warnings(plan) -> list[str]:
    """A batch whose rows split over fewer devices than its mesh has because they do not
    divide evenly: the other devices compute the same rows again. One warning per
    (rows, ways, mesh), naming the inputs it holds for."""
    found: dict[tuple, list[str]] = {}
    for i in plan.inputs:
        if i.role != "batch" or not i.shape:
            continue
        mesh = plan.stages[i.stage].sharding.mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        ways = math.prod(sizes[a] for a in i.spec[0]) if i.spec else 1
        rows, n = i.shape[0], mesh.num_devices
        if ways < n and rows % n:
            found.setdefault((rows, ways, n), []).append(i.path)
    per = " per microbatch" if plan.runtime == "pipeline" else ""
    return [
        f"the batch ({', '.join(paths)}): {rows} rows{per} are split {ways} ways, not over "
        f"all {n} devices of the mesh ({rows} is not divisible by {n}), so devices hold "
        f"copies of the same rows and compute them twice. A batch divisible by {n} (e.g. "
        f"{max(n, rows - rows % n)} or {rows + n - rows % n}) uses every device."
        for (rows, ways, n), paths in found.items()
    ]


def _first_readers(graph, plan) -> dict[str, str]:
    """`{batch path: the primitive (and source line) that first reads it}`."""
    consumers = graph.consumers()
    paths = {i.path for i in plan.inputs if i.role == "batch"}
    out = {}
    for v in graph.invars:
        var = graph.vars[v]
        if var.path in paths and consumers[v]:
            node = graph.nodes[min(consumers[v])]
            out[var.path] = node.primitive + (f" ({node.source})" if node.source else "")
    return out


def planning_lines(timings: dict) -> list[str]:
    """Planning time in words, parts that add up, and the total once."""
    seconds = {k: v for k, v in timings.items() if isinstance(v, float)}
    if not seconds:
        return []
    total = seconds.get("trace", 0.0) + seconds.get("search", 0.0)
    shown = [f"{PHASE_WORDS.get(k, k.replace('_', ' '))} {v:.2f} s"
             for k, v in seconds.items() if k not in OVERLAPPING]
    line = "planning time: " + (f"{total:.2f} s in all (" if total else "(") + \
        ", ".join(shown) + ")"
    counts = {k: v for k, v in timings.items() if type(v) is int}
    lines = [line]
    if counts:
        lines.append("planning work: " + ", ".join(
            f"{v} {COUNT_WORDS.get(k, k)}" for k, v in counts.items()))
    return lines
