"""`ShardingPlan`: the intra-operator planner's answer for one graph on one mesh.

Plain data with a JSON round trip: a spec for every variable, the chosen strategy of every
node, the variables the lowering pins with `with_sharding_constraint`, and the predicted
costs. Specs are tuples of mesh-axis-name tuples (see `autopar.cluster.Spec`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from autopar.cluster import LogicalMesh, Spec
from autopar.graph import ANNOTATION_PRIMITIVES, OpGraph, Role
from autopar.intra._context import NO_CONTEXT, ContextSplit
from autopar.intra._rules_annotations import user_sharding


@dataclass(frozen=True)
class PredictedCost:
    """Predicted time per step (seconds) and peak memory per device (bytes)."""

    compute: float
    communication: float  # collectives issued by nodes (partial-sum reductions)
    resharding: float  # collectives between nodes (spec changes on edges)
    memory_per_device: float
    # kind -> (count, bytes per device) per planned unit (a pipeline stage: per microbatch,
    # with once-per-step collectives counted 1/microbatches)
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.resharding

    def to_json(self) -> dict:
        return {
            "compute": self.compute,
            "communication": self.communication,
            "resharding": self.resharding,
            "memory_per_device": self.memory_per_device,
            "collectives": {k: list(v) for k, v in sorted(self.collectives.items())},
        }

    @staticmethod
    def from_json(d: dict) -> PredictedCost:
        return PredictedCost(
            d["compute"],
            d["communication"],
            d["resharding"],
            d["memory_per_device"],
            {k: (float(v[0]), float(v[1])) for k, v in d.get("collectives", {}).items()},
        )


@dataclass(frozen=True)
class BodyPlan:
    """The layouts inside one `scan` node's body, planned once for every iteration.

    Ids are those of the body's own graph (`autopar.intra._scan.opened_body`): a spec per
    body variable (None for constants), operands the body reshards (node, operand index,
    spec), and the layout each body result is returned in (a carry: its layout on entry).
    `strategies`: (body node, strategy name) for the nodes whose strategy the lowering
    needs beyond their specs (an expert-parallel grouped GEMM run in chunks,
    `autopar.intra._strategies_moe.OVERLAPPED`, or priced with its own exchange,
    `PER_GEMM`).
    """

    node: int
    var_specs: tuple[Spec | None, ...]
    operand_specs: tuple[tuple[int, int, Spec], ...]
    out_specs: tuple[Spec | None, ...]
    strategies: tuple[tuple[int, str], ...] = ()

    @property
    def constrained(self) -> tuple[int, ...]:
        """Body variables the lowering pins: every one with a spec, scalars aside."""
        return tuple(v for v, spec in enumerate(self.var_specs) if spec)

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "var_specs": [_spec_json(s) for s in self.var_specs],
            "operand_specs": [[n, p, _spec_json(s)] for n, p, s in self.operand_specs],
            "out_specs": [_spec_json(s) for s in self.out_specs],
            # additive: bodies without such nodes read and write as before
            **({"strategies": [[n, name] for n, name in self.strategies]}
               if self.strategies else {}),
        }

    @staticmethod
    def from_json(d: dict) -> BodyPlan:
        return BodyPlan(
            int(d["node"]),
            tuple(_spec_from_json(s) for s in d["var_specs"]),
            tuple((int(n), int(p), _spec_from_json(s)) for n, p, s in d["operand_specs"]),
            tuple(_spec_from_json(s) for s in d["out_specs"]),
            tuple((int(n), str(name)) for n, name in d.get("strategies", ())),
        )


def _spec_json(spec: Spec | None):
    return None if spec is None else [list(d) for d in spec]


def _spec_from_json(spec) -> Spec | None:
    return None if spec is None else tuple(tuple(d) for d in spec)


@dataclass(frozen=True)
class ShardingPlan:
    mesh: LogicalMesh
    var_specs: tuple[Spec | None, ...]  # by variable id; None for constants
    node_strategies: tuple[str, ...]  # by node id
    constrained: tuple[int, ...]  # variable ids pinned in the lowering
    cost: PredictedCost
    graph_fingerprint: str
    # (output var, spec): results returned with another layout than computed (state that
    # keeps its input layout across steps)
    output_overrides: tuple[tuple[int, Spec], ...] = ()
    # (node id, operand index, spec): operands the chosen strategy takes in another layout
    # than they were produced in (the lowering reshards them there)
    operand_specs: tuple[tuple[int, int, Spec], ...] = ()
    warnings: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict)
    # the plans inside scan bodies (scanned layers), one per planned scan node
    scan_bodies: tuple[BodyPlan, ...] = ()
    # the context parallelism its attention runs with (`autopar.intra._context`)
    context_parallel: ContextSplit = NO_CONTEXT

    def input_specs(self, graph: OpGraph) -> list[Spec | None]:
        return [self.var_specs[v] for v in graph.invars]

    def output_specs(self, graph: OpGraph) -> list[Spec | None]:
        overrides = dict(self.output_overrides)
        return [overrides.get(v, self.var_specs[v]) for v in graph.outvars]

    def specs_by_path(self, graph: OpGraph) -> dict[str, Spec]:
        """Spec of every named graph input, keyed by its pytree path."""
        return {
            graph.vars[v].path: self.var_specs[v]
            for v in graph.invars
            if graph.vars[v].path is not None and self.var_specs[v] is not None
        }

    def check_graph(self, graph: OpGraph) -> None:
        """Raise ValueError if this plan was made for a different graph."""
        found = graph_fingerprint(graph)
        if found != self.graph_fingerprint:
            raise ValueError(
                "this sharding plan was made for a different program: "
                f"{_describe_mismatch(self, graph)}. Plan again for this function and these "
                "argument shapes, or load the plan that was saved for them."
            )

    def to_json(self, *, timings: bool = False) -> dict:
        """JSON-ready data; `timings` keeps the wall-clock entries of `stats` (keys ending
        in "_time"), left out by default so equal plans give equal JSON."""
        stats = {
            k: v for k, v in self.stats.items() if timings or not k.endswith(TIMING_SUFFIX)
        }
        return {
            "mesh": self.mesh.to_json(),
            "var_specs": [None if s is None else [list(d) for d in s] for s in self.var_specs],
            "node_strategies": list(self.node_strategies),
            "constrained": list(self.constrained),
            "output_overrides": [[v, [list(d) for d in s]] for v, s in self.output_overrides],
            "operand_specs": [[n, p, [list(d) for d in s]] for n, p, s in self.operand_specs],
            "cost": self.cost.to_json(),
            "graph_fingerprint": self.graph_fingerprint,
            "num_vars": len(self.var_specs),
            "warnings": list(self.warnings),
            "stats": stats,
            **_bodies_json(self.scan_bodies),
            # additive: plans without context parallelism read and write as before
            **({"context_parallel": self.context_parallel.to_json()}
               if self.context_parallel != NO_CONTEXT else {}),
        }

    @staticmethod
    def from_json(d: dict) -> ShardingPlan:
        return ShardingPlan(
            mesh=LogicalMesh.from_json(d["mesh"]),
            var_specs=tuple(
                None if s is None else tuple(tuple(dim) for dim in s) for s in d["var_specs"]
            ),
            node_strategies=tuple(d["node_strategies"]),
            constrained=tuple(d["constrained"]),
            output_overrides=tuple(
                (int(v), tuple(tuple(dim) for dim in s)) for v, s in d.get("output_overrides", ())
            ),
            operand_specs=tuple(
                (int(n), int(p), tuple(tuple(dim) for dim in s))
                for n, p, s in d.get("operand_specs", ())
            ),
            cost=PredictedCost.from_json(d["cost"]),
            graph_fingerprint=d["graph_fingerprint"],
            warnings=tuple(d.get("warnings", ())),
            stats=d.get("stats", {}),
            scan_bodies=tuple(BodyPlan.from_json(b) for b in d.get("scan_bodies", ())),
            context_parallel=(ContextSplit.from_json(d["context_parallel"])
                              if "context_parallel" in d else NO_CONTEXT),
        )


def _bodies_json(bodies: tuple[BodyPlan, ...]) -> dict:
    """The "scan_bodies" entry, left out when empty (plans without scans read as before)."""
    return {"scan_bodies": [b.to_json() for b in bodies]} if bodies else {}


# `ShardingPlan.stats` entries whose key ends so are wall-clock measurements.
TIMING_SUFFIX = "_time"


def graph_fingerprint(graph: OpGraph) -> str:
    """A hash of the graph's structure: primitives, shapes, dtypes, roles and wiring."""
    h = hashlib.sha256()
    for v in graph.invars:
        var = graph.vars[v]
        h.update(f"in {var.shape} {var.dtype} {var.role.value} {var.path};".encode())
    for node in graph.nodes:
        shapes = [(graph.vars[v].shape, graph.vars[v].dtype) for v in node.outputs]
        h.update(f"{node.primitive} {node.inputs} {shapes};".encode())
        if node.primitive in ANNOTATION_PRIMITIVES:  # the user's spec steers the plan
            h.update(f"{user_sharding(node.params)};".encode())
    h.update(f"out {graph.outvars}".encode())
    return h.hexdigest()[:16]


def _describe_mismatch(plan: ShardingPlan, graph: OpGraph) -> str:
    if len(plan.var_specs) != len(graph.vars):
        return (
            f"the plan covers {len(plan.var_specs)} variables, the traced program has "
            f"{len(graph.vars)}"
        )
    for v in graph.invars:
        var = graph.vars[v]
        spec = plan.var_specs[v]
        if var.role is not Role.CONST and spec is not None and len(spec) != len(var.shape):
            return f"input {var.path or v} has shape {var.shape} but the plan has spec {spec}"
    return "the operator graphs differ (different model code or shapes)"
