"""`Plan`: stages, meshes, specs, schedule and predicted costs, as JSON-ready data.

A plan holds no JAX objects: device ids, axis names and specs as tuples of strings.
`plan.shardings(devices)` turns it into `NamedSharding`s for a hand-written `jax.jit`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from autopar.cluster._mesh import LogicalMesh, Spec, spec_str
from autopar.graph import OpGraph
from autopar.intra._sharding_plan import ShardingPlan

PLAN_FORMAT_VERSION = 1


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

    @property
    def mesh(self) -> LogicalMesh:
        return self.sharding.mesh

    def to_json(self) -> dict:
        return {"layers": list(self.layers), "sharding": self.sharding.to_json()}

    @staticmethod
    def from_json(d: dict) -> Stage:
        return Stage(tuple(d["layers"]), ShardingPlan.from_json(d["sharding"]))


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
    schedule: str = "1f1b"
    warnings: tuple[str, ...] = ()
    timings: dict = field(default_factory=dict)
    auto_layers: int | None = None  # layers cut automatically (no layer marks in the model)
    # "spmd": one jax.jit of the whole step; "pipeline": per-stage forward, backward and
    # update programs run by the pipeline runtime (microbatches, gradient accumulation)
    runtime: str = "spmd"

    # ---- derived ---------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def predicted_step_time(self) -> float:
        """Predicted seconds per step from the shared cost model."""
        if self.runtime == "spmd" and len(self.stages) == 1:
            return self.stages[0].sharding.cost.total
        # Each stage's cost is per microbatch; Alpa's pipeline latency (REFERENCES.md).
        times = [s.sharding.cost.total for s in self.stages]
        return sum(times) + (self.num_microbatches - 1) * max(times)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a GPipe/1F1B pipeline: (p - 1) / (m + p - 1)."""
        p, m = len(self.stages), self.num_microbatches
        return (p - 1) / (m + p - 1)

    def specs_by_path(self) -> dict[str, Spec]:
        return {i.path: i.spec for i in self.inputs}

    def check_graph(self, graph: OpGraph) -> None:
        """Raise ValueError naming the mismatch if this plan was made for another program."""
        if self.runtime == "spmd":
            self.stages[0].sharding.check_graph(graph)
        elif self.graph_fingerprint:
            from autopar.intra._sharding_plan import graph_fingerprint

            if graph_fingerprint(graph) != self.graph_fingerprint:
                raise ValueError(
                    "this plan was made for a different program (model code or shapes); "
                    "plan again for this function, or load the plan saved for it"
                )

    # ---- use ---------------------------------------------------------------------------

    def shardings(self, devices=None) -> dict[str, object]:
        """`NamedSharding` of every input, keyed by pytree path, for a plain `jax.jit`.

        **Example:**

        ```python
        sh = plan.shardings()
        state = jax.device_put(state, ...)  # place leaves with sh[path]
        ```
        """
        if len(self.stages) != 1:
            raise ValueError(
                "shardings() describes a one-stage plan; this plan has "
                f"{len(self.stages)} pipeline stages. Use stage.sharding per stage instead."
            )
        from jax.sharding import NamedSharding

        from autopar.cluster._mesh import to_partition_spec
        from autopar.lower import jax_mesh

        mesh = jax_mesh(self.stages[0].mesh, devices)
        return {i.path: NamedSharding(mesh, to_partition_spec(i.spec)) for i in self.inputs}

    def explain(self, detail: int = 1) -> str:
        from autopar.report import explain

        return explain(self, detail=detail)

    def diff(self, other: Plan) -> str:
        from autopar.report import diff_plans

        return diff_plans(self, other)

    # ---- JSON --------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "method": self.method,
            "cluster": self.cluster,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "graph_fingerprint": self.graph_fingerprint,
            "inputs": [i.to_json() for i in self.inputs],
            "stages": [s.to_json() for s in self.stages],
            "warnings": list(self.warnings),
            "timings": self.timings,
            "auto_layers": self.auto_layers,
            "runtime": self.runtime,
        }

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
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))

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
