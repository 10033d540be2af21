"""`Plan`: stages, meshes, specs, schedule and predicted costs, as JSON-ready data.

A plan holds no JAX objects: device ids, axis names and specs as tuples of strings. It
imports nothing downstream of it: turning it into `NamedSharding`s is
`autopar.lower.plan_shardings`, explaining and diffing it `autopar.report.explain` and
`autopar.report.diff_plans`. The methods `shardings`, `explain` and `diff` are
conveniences that look those functions up when called (`_downstream`), so the plan part
never imports them.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from autopar.choices import Remat, Runtime, Schedule
from autopar.cluster import LogicalMesh, Spec, spec_str
from autopar.cost import (
    DEFAULT_PHASE_SHARES,
    StageMemory,
    bubble_fraction,
    pipelined_step_time,
)
from autopar.graph import OpGraph, Role
from autopar.intra import ShardingPlan, graph_fingerprint

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the memory/time Pareto frontier of a plan's explored space
    (`autopar.space.explore`): the fastest plan whose peak memory per device is at most
    `memory`, so `memory` is also the least budget that buys it.

    `label` names the plan (``auto: 2 stage(s) x (1, 8), 4 mb, 1f1b`` or a Megatron
    configuration), `source` is ``"auto"`` or ``"megatron"``, `chosen` marks the plan
    itself."""

    memory: float  # peak bytes per device
    step_time: float  # predicted seconds per step
    label: str
    source: str
    chosen: bool = False

    def to_json(self) -> dict:
        return {"memory": self.memory, "step_time": self.step_time, "label": self.label,
                "source": self.source, "chosen": self.chosen}

    @staticmethod
    def from_json(d: dict) -> FrontierPoint:
        return FrontierPoint(float(d["memory"]), float(d["step_time"]), d["label"],
                             d["source"], bool(d.get("chosen", False)))


@dataclass(frozen=True)
class InputInfo:
    """One flat input of the train step, as reports show it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    spec: Spec
    stage: int = 0  # the pipeline stage whose devices hold it

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "role": self.role,
            "spec": [list(d) for d in self.spec],
            "stage": self.stage,
        }

    @staticmethod
    def from_json(d: dict) -> InputInfo:
        return InputInfo(
            d["path"], tuple(d["shape"]), d["dtype"], d["role"],
            tuple(tuple(x) for x in d["spec"]), d.get("stage", 0),
        )


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: a range of layers [start, end) on a submesh with its sharding."""

    layers: tuple[int, int]
    sharding: ShardingPlan
    # What each layer of the stage recomputes in its backward (a `Remat` per layer, in
    # layer order; empty: nothing), and the seconds per microbatch that adds on top of
    # `sharding.cost` (autopar.cost.full_recompute_cost / selective_recompute_cost), with
    # the elementwise values every backward reruns inside its fusions whatever the choice
    # (autopar.cost.fused_rerun_seconds).
    remat: tuple[Remat, ...] = ()
    recompute_time: float = 0.0
    # Bytes per device the planner predicted for the stage with the microbatches its
    # schedule keeps in flight (`autopar.cost.stage_memory`); 0 when not recorded. A
    # figure for reports, not part of the plan's identity; its JSON keeps it as the
    # total of `memory_parts`.
    predicted_memory: float = field(default=0.0, compare=False)
    # Seconds per microbatch to bring the activations crossing into this stage from the
    # one before, and their gradients back (`autopar.cost.boundary_transfer_time`, what
    # the stage DP charges the stage); 0 for the first stage and one-stage plans.
    transfer_time: float = 0.0
    # `predicted_memory` by part (`autopar.cost.StageMemory`: state, gradient sums, kept
    # activations of the microbatches in flight, working memory of the layer running),
    # when the planner recorded it; saved in the JSON (additive) and restored with
    # `predicted_memory` on load, so reports compare a run with its plan part by part.
    memory_parts: StageMemory | None = field(default=None, compare=False)

    @property
    def mesh(self) -> LogicalMesh:
        return self.sharding.mesh

    @property
    def memory_per_device(self) -> float:
        """Predicted bytes per device: the planner's figure for the whole stage
        (`predicted_memory`, what it checked against the budget) when recorded, else the
        sharding plan's peak. A stage stitched from layer plans has as its sharding plan's
        peak the sum of its layers' peaks, an upper bound that counts every layer's
        working memory at once, where one layer runs at a time (`autopar.cost.stage_memory`)."""
        return self.predicted_memory or self.sharding.cost.memory_per_device

    @property
    def time_per_microbatch(self) -> float:
        """Predicted seconds per microbatch: the sharding plan's cost, recompute and the
        transfer into the stage."""
        return self.sharding.cost.total + self.recompute_time + self.transfer_time

    def to_json(self, *, timings: bool = False) -> dict:
        data = {"layers": list(self.layers), "sharding": self.sharding.to_json(timings=timings)}
        if any(r != "none" for r in self.remat):  # additive: plans without remat unchanged
            data["remat"] = list(self.remat)
        if self.recompute_time:  # with or without remat: the fused rerun's seconds
            data["recompute_time"] = self.recompute_time
        if self.transfer_time:  # additive: first stages and one-stage plans unchanged
            data["transfer_time"] = self.transfer_time
        if self.memory_parts is not None:  # additive: plans without it unchanged
            data["memory"] = self.memory_parts.to_json()
        return data

    @staticmethod
    def from_json(d: dict) -> Stage:
        parts = StageMemory.from_json(d["memory"]) if "memory" in d else None
        return Stage(
            tuple(d["layers"]), ShardingPlan.from_json(d["sharding"]),
            tuple(d.get("remat", ())), float(d.get("recompute_time", 0.0)),
            predicted_memory=parts.total if parts is not None else 0.0,
            transfer_time=float(d.get("transfer_time", 0.0)),
            memory_parts=parts,
        )


@dataclass(frozen=True)
class Plan:
    """How a train step runs: one stage per submesh, with a schedule.

    A one-stage plan is an intra-operator (SPMD) plan: the whole step is one `jax.jit`.
    """

    method: str
    cluster: dict  # the cluster's JSON (name, hosts, devices per host, links ...)
    stages: tuple[Stage, ...]
    inputs: tuple[InputInfo, ...]
    graph_fingerprint: str
    num_microbatches: int = 1
    schedule: Schedule = "1f1b"
    warnings: tuple[str, ...] = ()
    # Wall-clock seconds of the search's phases: a measurement, not part of the plan's
    # identity, so `to_json` leaves it out unless asked (plans save byte-identically).
    timings: dict = field(default_factory=dict, compare=False)
    auto_layers: int | None = None  # layers cut automatically (no layer marks in the model)
    # "spmd": one jax.jit of the whole step; "pipeline": per-stage forward, backward and
    # update programs run by the pipeline runtime (microbatches, gradient accumulation)
    runtime: Runtime = "spmd"
    # The step's positional parameter names, after which the input paths are named.
    arg_names: tuple[str, ...] = ()
    # A scanned layer stack cut over stages: the iteration ranges of its pieces (one
    # sub-scan each); its stacked leaves are inputs ``<path>[a:b]``, one per range
    # (`split_inputs`). Empty: no stack is cut.
    scan_ranges: tuple[tuple[int, int], ...] = ()
    # How a stage's time per microbatch splits into its forward, input-gradient and
    # weight-gradient passes (`autopar.inter.passes.phase_times`), which the cost model's
    # schedule simulation takes (`autopar.cost.pipeline_latency`). Empty: a third each
    # (`autopar.cost.DEFAULT_PHASE_SHARES`).
    phase_shares: tuple[float, ...] = ()
    # The memory/time frontier of the space explored around this plan
    # (`autopar.space.explore` attaches it; `frontier()`), by memory; empty otherwise.
    # Not part of the plan's identity.
    frontier_points: tuple[FrontierPoint, ...] = field(default=(), compare=False)

    # ---- derived ---------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def predicted_step_time(self) -> float:
        """Predicted seconds per step: `autopar.cost.pipelined_step_time` of the stages'
        costs (`pipeline_latency` of the device groups' times).

        Each stage is costed per microbatch (its sharding plan's cost plus its recompute;
        one microbatch is the whole batch when `num_microbatches` is 1), so this holds for
        every runtime: one stage accumulating B microbatches takes B times its cost, a
        pipeline Alpa's latency. Each stage also pays for launching its programs
        (`autopar.cost.stage_dispatch_time`, the profile's `dispatch_overhead` per task).
        On XLA:CPU profiles, a pipeline's backward tasks also pay for returning their
        weight gradients, and the devices share the host's cores
        (`autopar.cost.pipelined_step_time`).
        """
        return pipelined_step_time(
            [stage.time_per_microbatch for stage in self.stages], self.cluster,
            self.num_microbatches, self.schedule, self.num_device_groups,
            self.phase_shares or DEFAULT_PHASE_SHARES,
            group_devices=[len(stage.mesh.device_ids) for stage in self.stages],
            returned_bytes=[stage.memory_parts.gradients if stage.memory_parts else 0.0
                            for stage in self.stages],
        )

    @property
    def num_device_groups(self) -> int:
        """Distinct stage meshes: the stages, or stages / v under interleaved 1F1B."""
        return len({tuple(s.sharding.mesh.device_ids) for s in self.stages})

    @property
    def virtual_stages(self) -> int:
        """Stages per device group (more than 1 only under interleaved 1F1B)."""
        return len(self.stages) // self.num_device_groups

    @property
    def stage_remat(self) -> tuple[tuple[str, ...], ...]:
        """Per stage, per layer: what it recomputes ("none" throughout without remat)."""
        return tuple(
            s.remat or ("none",) * (s.layers[1] - s.layers[0]) for s in self.stages
        )

    @property
    def scan_remat(self) -> tuple[str, ...]:
        """Per piece of a scanned stack cut over stages (`scan_ranges`): what its sub-scan
        recomputes, the choice of the stage layer that runs it (layer k + 1 runs piece k;
        lowered by a `jax.checkpoint` around the sub-scan's body)."""
        remat = {}
        for stage, remats in zip(self.stages, self.stage_remat):
            remat.update(zip(range(*stage.layers), remats))
        return tuple(remat.get(k + 1, "none") for k in range(len(self.scan_ranges)))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipeline under its schedule (`autopar.cost.bubble_fraction`,
        equal stages with the plan's `phase_shares`)."""
        return bubble_fraction(
            self.num_device_groups, self.num_microbatches, self.schedule, self.virtual_stages,
            self.phase_shares or DEFAULT_PHASE_SHARES,
        )

    def split_inputs(self) -> dict[str, tuple[InputInfo, ...]]:
        """The caller's leaves held in pieces (a scanned stack cut over stages): path ->
        the pieces' inputs (paths ``<path>[a:b]``), in range order."""
        found: dict[str, list[InputInfo]] = {}
        if not self.scan_ranges:
            return {}
        suffixes = [f"[{a}:{b}]" for a, b in self.scan_ranges]
        for info in self.inputs:
            for suffix in suffixes:
                if info.path.endswith(suffix):
                    found.setdefault(info.path[: -len(suffix)], []).append(info)
        return {
            path: tuple(pieces) for path, pieces in found.items()
            if len(pieces) == len(suffixes)
        }

    def caller_inputs(self) -> tuple[InputInfo, ...]:
        """`inputs` as the caller passes them: a leaf held in pieces appears once, whole
        (its leading dim the stack's length), with its first piece's spec and stage."""
        split = self.split_inputs()
        piece_paths = {i.path for pieces in split.values() for i in pieces}
        infos = [i for i in self.inputs if i.path not in piece_paths]
        for path, pieces in split.items():
            first = pieces[0]
            shape = (sum(p.shape[0] for p in pieces), *first.shape[1:])
            infos.append(InputInfo(path, shape, first.dtype, first.role, first.spec, first.stage))
        return tuple(infos)

    def specs_by_path(self) -> dict[str, Spec]:
        return {i.path: i.spec for i in self.inputs}

    def check_graph(self, graph: OpGraph) -> None:
        """Raise ValueError naming the mismatch if this plan was made for another program."""
        if self.runtime == "spmd":
            self.stages[0].sharding.check_graph(graph)
        elif self.graph_fingerprint:
            if graph_fingerprint(graph) != self.graph_fingerprint:
                raise ValueError(
                    "this plan was made for a different program (model code or shapes); "
                    "plan again for this function, or load the plan saved for it"
                )

    # ---- use (conveniences over functions of later parts) -----------------------------

    def shardings(self, like=None, devices=None) -> tuple:
        """One pytree of `NamedSharding` per positional argument, shaped like `like` (the
        step's arguments, or their `jax.ShapeDtypeStruct`s): `autopar.lower.plan_shardings`.
        Usable as ``jax.jit(step, in_shardings=plan.shardings(like=(state, batch)))``."""
        if like is None:
            raise TypeError(
                "plan.shardings() needs the arguments' pytree structure, which a plan does "
                "not keep: pass like=(state, batch) (arrays or jax.ShapeDtypeStruct), or call "
                "train_step.shardings() on the decorated step; plan.shardings_by_path() "
                "gives them keyed by path"
            )
        return _downstream("lower").plan_shardings(self, like, devices)

    def shardings_by_path(self, devices=None) -> dict[str, object]:
        """`NamedSharding` of every input keyed by its pytree path
        (`autopar.lower.shardings_by_path`)."""
        return _downstream("lower").shardings_by_path(self, devices)

    def frontier(self) -> tuple[FrontierPoint, ...]:
        """The memory/time Pareto frontier around this plan, by memory: per point the
        least budget (peak bytes per device) and the fastest predicted step time it buys.
        Filled by `autopar.space.explore` (``space.plan.frontier()``); a plan from
        `autopar.plan` has none and says how to get it."""
        if not self.frontier_points:
            raise ValueError(
                "this plan carries no frontier: it comes from autopar.space.explore(step, "
                "*args, cluster=...), whose .plan has it (or the command autopar space)"
            )
        return self.frontier_points

    def explain(self, detail: int = 1) -> str:
        """`autopar.report.explain(self, detail)`."""
        return _downstream("report").explain(self, detail=detail)

    def diff(self, other: Plan) -> str:
        """`autopar.report.diff_plans(self, other)`."""
        return _downstream("report").diff_plans(self, other)

    # ---- JSON --------------------------------------------------------------------------

    def to_json(self, *, timings: bool = False) -> dict:
        """The plan as JSON-ready data; `timings` adds the search's wall-clock phases
        (measurements, left out by default so equal plans give equal JSON)."""
        data = {
            "format_version": PLAN_FORMAT_VERSION,
            "method": self.method,
            "cluster": self.cluster,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "graph_fingerprint": self.graph_fingerprint,
            "inputs": [i.to_json() for i in self.inputs],
            "stages": [s.to_json(timings=timings) for s in self.stages],
            "warnings": list(self.warnings),
            "auto_layers": self.auto_layers,
            "runtime": self.runtime,
            "arg_names": list(self.arg_names),
        }
        if self.scan_ranges:
            data["scan_ranges"] = [list(r) for r in self.scan_ranges]
        if self.phase_shares:
            data["phase_shares"] = list(self.phase_shares)
        if self.frontier_points:  # additive: plans without it unchanged
            data["frontier"] = [p.to_json() for p in self.frontier_points]
        if timings:
            data["timings"] = self.timings
        return data

    @staticmethod
    def from_json(d: dict) -> Plan:
        version = d.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"plan format version {version!r} is not supported (this autopar reads "
                f"version {PLAN_FORMAT_VERSION}); plan again to write a current file"
            )
        return Plan(
            method=d["method"],
            cluster=d["cluster"],
            stages=tuple(Stage.from_json(s) for s in d["stages"]),
            inputs=tuple(InputInfo.from_json(i) for i in d["inputs"]),
            graph_fingerprint=d["graph_fingerprint"],
            num_microbatches=d.get("num_microbatches", 1),
            schedule=d.get("schedule", "1f1b"),
            warnings=tuple(d.get("warnings", ())),
            timings=d.get("timings", {}),
            auto_layers=d.get("auto_layers"),
            runtime=d.get("runtime", "spmd"),
            arg_names=tuple(d.get("arg_names", ())),
            scan_ranges=tuple(tuple(r) for r in d.get("scan_ranges", ())),
            phase_shares=tuple(d.get("phase_shares", ())),
            frontier_points=tuple(FrontierPoint.from_json(p) for p in d.get("frontier", ())),
        )

    def save(self, path: str | Path, *, timings: bool = False) -> None:
        """Write the plan as sorted JSON; equal plans give byte-identical files (the
        search's `timings` are left out unless `timings=True`)."""
        Path(path).write_text(json.dumps(self.to_json(timings=timings), indent=1, sort_keys=True))

    @staticmethod
    def load(path: str | Path) -> Plan:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"no plan file at {path}; save one with plan.save(path)") from None
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} is not a valid plan file ({err}); save it again with plan.save(path)"
            ) from None
        try:
            return Plan.from_json(data)
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"{path} is missing plan field {err}; it was not written by plan.save()"
            ) from None

    def __str__(self) -> str:
        specs = ", ".join(f"{i.path}={spec_str(i.spec)}" for i in self.inputs[:3])
        return (
            f"Plan({self.method}, {self.num_stages} stage(s), "
            f"{self.predicted_step_time * 1e3:.3f} ms predicted, {specs}, ...)"
        )


def _downstream(part: str):
    """A later part of autopar, imported when a convenience method is called (the plan part
    itself imports nothing downstream; see the module docstring)."""
    return importlib.import_module(f"autopar.{part}")


def input_infos(
    graph: OpGraph, specs_of, home: dict[int, int] | None = None
) -> tuple[InputInfo, ...]:
    """`InputInfo` of every non-constant input of `graph`.

    **Arguments:**
    - `specs_of`: the `ShardingPlan` holding every input (one-mesh plans), or a function
      from a stage index to that stage's `ShardingPlan` (pipelines).
    - `home`: the stage holding each input var (default: stage 0).
    """
    home = home or {}
    infos = []
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is Role.CONST:
            continue
        stage = home.get(v, 0)
        sharding = specs_of(stage) if callable(specs_of) else specs_of
        spec = sharding.var_specs[v] or ((),) * len(var.shape)
        infos.append(InputInfo(
            var.path or f"input{v}", var.shape, var.dtype, var.role.value, spec, stage
        ))
    return tuple(infos)
