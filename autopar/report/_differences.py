"""Why two plans of one step differ: time splits, layouts per layer group, ranked savings.

In: two `Plan`s of the same train step (typically the best Megatron-style plan and
autopar's), optionally the graphs they run (the step traced at each plan's microbatch
size) and the cluster's devices per host. Out: text an engineer reads to see where the
seconds go.

The predicted step time of a plan is Alpa's pipeline latency over its stages' costs per
microbatch (`autopar.cost.pipeline_latency`): ``sum_i t_i + (m - 1) max_j t_j``. It splits
exactly into the slowest stage's work for all m microbatches, ``m * max_j t_j``, and the
pipeline's fill and drain, ``sum_i t_i - max_j t_j`` (the bubble). The slowest stage's
work splits into compute, recompute and communication; a plan records its collectives'
bytes per kind, not their seconds, so the communication time (node collectives and
resharding) is shared out among kinds in proportion to bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster import spec_str
from autopar.report._explain import _fmt_bytes, _fmt_time, _group, _short


@dataclass(frozen=True)
class TimeSplit:
    """A plan's predicted step time in parts (seconds per step) and its memory."""

    total: float
    compute: float
    recompute: float
    communication: dict[str, float]  # collective kind -> seconds (shared out by bytes)
    bubble: float
    memory_per_device: float  # bytes, the largest stage

    def parts(self) -> dict[str, float]:
        """``{part name: seconds}``: compute, recompute, one per collective kind, bubble."""
        parts = {"compute": self.compute, "recompute": self.recompute}
        parts.update({f"communication: {k}": s for k, s in self.communication.items()})
        parts["pipeline bubble"] = self.bubble
        return parts


@dataclass(frozen=True)
class Difference:
    """One part of the step time: `saved` seconds (> 0: the second plan is faster there)."""

    part: str
    first: float
    second: float
    why: str

    @property
    def saved(self) -> float:
        return self.first - self.second


def time_split(plan) -> TimeSplit:
    """Split `plan.predicted_step_time` into compute, recompute, communication by kind and
    bubble (see the module docstring); the parts sum to the total."""
    m = plan.num_microbatches
    times = [s.sharding.cost.total for s in plan.stages]
    slowest = max(range(len(times)), key=lambda i: times[i])
    cost = plan.stages[slowest].sharding.cost
    recompute = m * float(plan.stages[slowest].sharding.stats.get("recompute_time", 0.0))
    compute = m * cost.compute - recompute
    comm = m * (cost.communication + cost.resharding)
    nbytes = {k: b for k, (_, b) in cost.collectives.items() if b > 0}
    total_bytes = sum(nbytes.values())
    if total_bytes > 0:
        by_kind = {k: comm * b / total_bytes for k, b in sorted(nbytes.items())}
    else:
        by_kind = {"collectives": comm} if comm > 0 else {}
    bubble = plan.predicted_step_time - m * times[slowest]
    return TimeSplit(
        total=plan.predicted_step_time,
        compute=compute,
        recompute=recompute,
        communication=by_kind,
        bubble=max(bubble, 0.0),
        memory_per_device=max(s.memory_per_device for s in plan.stages),
    )


def differences(first, second, *, first_graph=None, second_graph=None,
                devices_per_host: int | None = None) -> list[Difference]:
    """Every part of the step time of two plans, largest saving by `second` first.

    **Arguments:**
    - `first`, `second`: `Plan`s of the same step (e.g. Megatron's, then autopar's).
    - `first_graph`, `second_graph`: the graphs they run, to name the weights split
      across hosts (optional).
    - `devices_per_host`: the cluster's (default: from the plans' cluster).

    **Returns:** a `Difference` per part either plan has, sorted by seconds saved
    (largest first; a negative saving means the first plan is faster there).
    """
    a, b = time_split(first), time_split(second)
    pa, pb = a.parts(), b.parts()
    hosts = devices_per_host or int(first.cluster.get("devices_per_host", 0)) or None
    across = [_across_hosts(p, g, hosts) for p, g in ((first, first_graph),
                                                       (second, second_graph))]
    diffs = []
    for part in dict.fromkeys([*pa, *pb]):
        ta, tb = pa.get(part, 0.0), pb.get(part, 0.0)
        if ta == 0.0 and tb == 0.0:
            continue
        why = _why(part, first, second, across)
        diffs.append(Difference(part, ta, tb, why))
    diffs.sort(key=lambda d: (-d.saved, d.part))
    return diffs


def _across_hosts(plan, graph, devices_per_host) -> list[str] | None:
    """The matmul weights `plan` splits across hosts; None when that cannot be told."""
    if graph is None or not devices_per_host:
        return None
    from autopar.report._hosts import weights_split_across_hosts

    return weights_split_across_hosts(plan, graph, devices_per_host)


def _why(part, first, second, across) -> str:
    if part == "pipeline bubble":
        return "; ".join(
            f"{_label(p)}: {p.num_stages} stage(s), {p.num_microbatches} microbatch(es), "
            f"{100 * p.bubble_fraction:.1f}% idle"
            for p in (first, second)
        )
    if part.startswith("communication"):
        if first.num_stages == 1 and second.num_stages == 1 and \
                tuple(first.stages[0].mesh.shape) == tuple(second.stages[0].mesh.shape):
            return _with_layouts(f"both one mesh {tuple(first.stages[0].mesh.shape)}",
                                 first, second)
        texts = []
        for p, split in zip((first, second), across):
            text = f"{_label(p)}: {_meshes(p)}"
            if split:
                text += (f", {len(split)} matmul weight(s) split across hosts "
                         "(tensor parallelism over the inter-host links)")
            elif split is not None:
                text += ", no matmul weight split across hosts"
            texts.append(text)
        return "; ".join(texts)
    if part == "recompute":
        return "activations recomputed in the backward pass"
    text = "; ".join(f"{_label(p)}: {_meshes(p)}, {p.num_microbatches} microbatch(es)"
                     for p in (first, second))
    return _with_layouts(text, first, second)


_ROLES = (("param", "parameters"), ("opt_state", "optimizer state"), ("batch", "batch"))


def layout_changes(first, second) -> list[str]:
    """Per role of inputs (parameters, optimizer state, batch) whose layouts differ between
    two plans: how many leaves and the most common layout of each, e.g. ``parameters
    (17 of 17 leaves): yours P('x', None) -> shard P(None, None)``."""
    def common(infos):
        counts: dict = {}
        for i in infos:
            counts[spec_str(i.spec)] = counts.get(spec_str(i.spec), 0) + 1
        return max(sorted(counts), key=lambda k: counts[k]) if counts else "-"

    b_specs = {i.path: i for i in second.inputs}
    lines = []
    for role, name in _ROLES:
        ours = [i for i in first.inputs if i.role == role and i.path in b_specs]
        moved = [i for i in ours if i.spec != b_specs[i.path].spec]
        if moved:
            lines.append(f"{name} ({len(moved)} of {len(ours)} leaves): {_label(first)} "
                         f"{common(moved)} -> {_label(second)} "
                         f"{common([b_specs[i.path] for i in moved])}")
    return lines


def _with_layouts(text: str, first, second) -> str:
    """`text`, with the inputs' layout changes where both plans run one mesh of one
    shape (so the same leaves are compared on the same axes)."""
    if first.num_stages != 1 or second.num_stages != 1 or \
            tuple(first.stages[0].mesh.shape) != tuple(second.stages[0].mesh.shape):
        return text
    changed = layout_changes(first, second)
    return text + ("; layouts changed: " + "; ".join(changed) if changed else "")


def _label(plan) -> str:
    return plan.method.split("(")[0] if plan.method.startswith("megatron") else plan.method


def _meshes(plan) -> str:
    shapes = [tuple(s.mesh.shape) for s in plan.stages]
    unique = list(dict.fromkeys(shapes))
    mesh = str(unique[0]) if len(unique) == 1 else " | ".join(map(str, shapes))
    return f"{plan.num_stages} stage(s) x mesh {mesh}"


def layer_groups(plan, graph=None, *, num_weights: int = 3, num_activations: int = 2
                 ) -> list[str]:
    """Per pipeline stage (a group of layers): its mesh and devices, the specs of its
    largest weights and, with the `graph` it runs, of its largest matmul results."""
    import numpy as np

    from autopar.graph import dtype_itemsize

    lines = []
    for s, stage in enumerate(plan.stages):
        mesh = stage.mesh
        axes = " x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.shape))
        ids = list(mesh.device_ids)
        lines.append(f"  stage {s}: layers {stage.layers[0]}..{stage.layers[1] - 1}, "
                     f"mesh {axes}, devices {ids[0]}-{ids[-1]}")
        params = [i for i in plan.inputs if i.role == "param" and i.stage == s
                  and len(i.shape) >= 2]

        def size(info):
            return int(np.prod(info.shape, dtype=np.int64)) * dtype_itemsize(info.dtype)

        seen = set()
        for info in sorted(params, key=lambda i: (-size(i), i.path)):
            key = (_short(info.path), info.spec)
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"    weight {_short(info.path):<28} {str(info.shape):<16} "
                         f"{spec_str(info.spec)}  ({_group(info.path)})")
            if len(seen) >= num_weights:
                break
        if graph is None:
            continue
        specs = stage.sharding.var_specs
        found = []
        for node in graph.nodes:
            if node.primitive != "dot_general":
                continue
            for v in node.outputs:
                if v < len(specs) and specs[v] is not None:
                    found.append((-graph.vars[v].nbytes, v))
        shown = set()
        for _, v in sorted(found):
            var = graph.vars[v]
            key = (var.shape, specs[v])
            if key in shown:
                continue
            shown.add(key)
            lines.append(f"    activation {'matmul result':<24} {str(var.shape):<16} "
                         f"{spec_str(specs[v])}")
            if len(shown) >= num_activations:
                break
    return lines


def explain_differences(first, second, *, first_graph=None, second_graph=None,
                        devices_per_host: int | None = None, top: int = 3) -> str:
    """The report `autopar compare` prints under its table: per plan its layer groups and
    time split, then the `top` largest differences ranked by seconds saved.

    **Arguments:** as `differences`; `top`: how many differences to rank (at least 3
    where the plans differ in that many parts).

    **Returns:** the text.
    """
    lines = []
    for plan, graph in ((first, first_graph), (second, second_graph)):
        split = time_split(plan)
        lines.append(f"{plan.method}: predicted {_fmt_time(split.total)} per step, "
                     f"{_fmt_bytes(split.memory_per_device)} per device")
        lines.append("  time: " + ", ".join(
            f"{name} {_fmt_time(seconds)}" for name, seconds in split.parts().items()
            if seconds > 0 or name in ("compute", "pipeline bubble")))
        lines.extend(layer_groups(plan, graph))
    diffs = differences(first, second, first_graph=first_graph, second_graph=second_graph,
                        devices_per_host=devices_per_host)
    total = first.predicted_step_time - second.predicted_step_time
    lines.append(f"largest differences ({_label(second)} vs {_label(first)}: "
                 f"{_signed(total)} per step in all; + means {_label(second)} is faster):")
    for rank, d in enumerate(_ranked(diffs, top), 1):
        lines.append(f"  {rank}. {d.part}: {_signed(d.saved)} "
                     f"({_fmt_time(d.first)} -> {_fmt_time(d.second)}); {d.why}")
    mem_a, mem_b = time_split(first).memory_per_device, time_split(second).memory_per_device
    lines.append(f"  memory per device: {_fmt_bytes(mem_a)} -> {_fmt_bytes(mem_b)}")
    return "\n".join(lines)


def _ranked(diffs: Sequence[Difference], top: int) -> list[Difference]:
    """The `top` differences largest in size (gains and losses), in order of saving."""
    chosen = sorted(diffs, key=lambda d: -abs(d.saved))[:top]
    return sorted(chosen, key=lambda d: -d.saved)


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "-") + _fmt_time(abs(seconds))
