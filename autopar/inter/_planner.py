"""The inter-operator planner: layers, stage DP, and each stage's intra-op plan.

In: a train step traced at microbatch size (with `layer_boundary` marks), a cluster, and
options. Out: the chosen stages (layer ranges on submeshes with logical mesh shapes) and
each stage's `ShardingPlan`.

Stage costs come from the intra-op planner (one cost model for everything): every layer is
planned on every candidate logical mesh, and a stage's per-microbatch latency is the sum of
its layers' predicted times on the best common logical mesh. Layers with the same
structure (same primitives, shapes and wiring, e.g. identical transformer blocks) are
solved once per mesh, never twice.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster._mesh import LogicalMesh
from autopar.cost import (
    LayerCost,
    in_flight_microbatches,
    memory_budget,
    stage_memory,
)
from autopar.graph import OpGraph, Role
from autopar.graph._opgraph import dtype_itemsize
from autopar.inter._stage_dp import StageCost, StagePlan, plan_stages
from autopar.inter._stitch import stitch
from autopar.inter._submesh import SubmeshShape, logical_mesh_shapes, submesh_shapes
from autopar.inter.passes._deferred import gradient_roots, stacked_layout, step_weights
from autopar.inter.passes._layers import LayerAssignment
from autopar.inter.passes._partition import Partition, partition
from autopar.intra._ilp import MemoryBudgetError
from autopar.intra._options import ShardOptions
from autopar.intra._planner import plan_on_mesh
from autopar.intra._problem import Footprint, unstacked_spec
from autopar.intra._sharding_plan import ShardingPlan

log = logging.getLogger("autopar")


@dataclass(frozen=True)
class PipelineChoice:
    """The stage DP's answer and every stage's plan."""

    stage_layers: tuple[tuple[int, int], ...]
    submeshes: tuple[SubmeshShape, ...]
    device_ids: tuple[tuple[int, ...], ...]
    logical_shapes: tuple[tuple[int, ...], ...]
    latency: float
    stage_plans: tuple[ShardingPlan, ...]
    partition: Partition
    dp: StagePlan
    num_layer_ilps: int


def structural_fingerprint(graph: OpGraph) -> str:
    """A hash of a sub-graph up to renaming of its variables."""
    names: dict[int, int] = {}

    def name(v: int) -> str:
        var = graph.vars[v]
        if var.role is Role.CONST:
            return f"c{var.shape}{var.dtype}"
        if v not in names:
            names[v] = len(names)
        return f"v{names[v]}"

    h = hashlib.sha256()
    for v in graph.invars:
        var = graph.vars[v]
        h.update(f"{name(v)}:{var.shape}{var.dtype}{var.role.value};".encode())
    for node in graph.nodes:
        ins = ",".join(name(v) for v in node.inputs)
        outs = ",".join(f"{name(v)}{graph.vars[v].shape}" for v in node.outputs)
        params = sorted(map(str, node.params.items()))
        h.update(f"{node.primitive}{params}({ins})->{outs};".encode())
    h.update(",".join(name(v) for v in graph.outvars).encode())
    return h.hexdigest()


def _tied_in(graph: OpGraph, tied) -> list[tuple[int, int]]:
    produced = {v for n in graph.nodes for v in n.outputs}
    invars = set(graph.invars)
    return [(o, i) for o, i in tied if o in produced and i in invars]


class LayerCostTable:
    """Predicted cost of every layer on every logical mesh, each structure solved once."""

    def __init__(
        self,
        graph,
        layers: LayerAssignment,
        cluster,
        options: ShardOptions,
        tied,
        *,
        num_microbatches: int = 1,
        solve=None,
        axis_names: tuple[str, ...] | None = None,
        in_flight=None,
    ):
        """Layers are planned per microbatch: what runs once per step (the update, the
        deferred gradient reductions) weighs 1/`num_microbatches`.
        `solve(sub_graph, mesh, ties, weights) -> ShardingPlan` replaces the free ILP
        (manual plans pin their inputs this way); `axis_names` names the logical mesh axes.
        `in_flight(shape) -> int`: microbatches whose kept activations a stage on a mesh of
        that shape holds at once (default 1), the weight of the kept activations in the
        footprint the leaner levels limit (see `cost`)."""
        self.cluster = cluster
        self.in_flight = in_flight or (lambda shape: 1)
        self.options = options
        self.solve = solve
        self.axis_names = axis_names
        self.num_microbatches = num_microbatches
        self.per_layer = partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)])
        self.tied = tied
        self.weights = []
        for k, sub in enumerate(self.per_layer.stage_graphs):
            phases = {i: layers.phase[full] for full, i in self.per_layer.node_index[k].items()}
            self.weights.append(
                step_weights(sub, phases, self.per_layer.deferrable, num_microbatches,
                             overlap=cluster.overlap)
            )
        self.fingerprints = [
            structural_fingerprint(g) + repr(sorted(w.items()))
            for g, w in zip(self.per_layer.stage_graphs, self.weights)
        ]
        self._cache: dict[tuple, LayerCost | None] = {}  # (fingerprint, shape, level)
        self._plans: dict[tuple, tuple[ShardingPlan, OpGraph]] = {}
        self.num_ilps = 0

    def cost(self, layer: int, shape: tuple[int, ...], level: int = 0) -> LayerCost | None:
        """The layer's cost on a mesh of `shape`; None when it cannot fit.

        Level 0 is the layer's fastest plan. At level L > 0 the layer's ILP also limits the
        layer's footprint on a stage (`footprint`: its state, accumulated gradients and
        the kept activations of the microbatches in flight) to
        least + `LEVEL_FRACTIONS`[L] x (fastest - least): a leaner plan for stages whose
        fastest layer plans together do not fit. A layer that cannot get leaner (no
        footprint to give up, or the limit infeasible under the peak memory) keeps its
        plan of the level below. Each (layer structure, shape, level) is solved once.
        """
        key = (self.fingerprints[layer], shape, level)
        if key not in self._cache:
            self._cache[key], plan = self._plan_level(layer, shape, level)
            if plan is not None:
                self._plans[key] = plan
        return self._cache[key]

    def _plan_level(self, layer: int, shape, level: int):
        """(cost, (plan, graph solved on)) of one level; (None, None) when none fits."""
        if level == 0:
            return self._solve(layer, shape, footprint_budget=None)
        if self.cost(layer, shape) is None or self.solve is not None:
            return None, None
        if level >= len(LEVEL_FRACTIONS):
            return None, None
        least, at_fastest = self.footprint_span(layer, shape)
        if least >= at_fastest * (1 - 1e-6):
            return self._level_as(layer, shape, 0)  # no leaner plan than the fastest
        budget = least + (at_fastest - least) * LEVEL_FRACTIONS[level]
        solved = self._solve(layer, shape, footprint_budget=budget)
        if solved[0] is None:
            # The least footprint is a lower bound the peak memory may not allow: this
            # layer stays at its leanest feasible plan.
            return self._level_as(layer, shape, level - 1)
        return solved

    def _level_as(self, layer: int, shape, level: int):
        """The cost and plan of `level` (solved if needed), to reuse at another level."""
        cost = self.cost(layer, shape, level)
        return cost, self._plans.get((self.fingerprints[layer], shape, level))

    def _solve(self, layer: int, shape, footprint_budget: float | None):
        """Plan the layer on a mesh of `shape` (one ILP, or the caller's `solve`)."""
        sub = self.per_layer.stage_graphs[layer]
        mesh = LogicalMesh.create(shape, axis_names=self.axis_names)
        self.num_ilps += 1
        ties = _tied_in(sub, self.tied) + self.chain_ties(layer)
        weights = self.weights[layer]
        try:
            if self.solve is not None:
                plan = self.solve(sub, mesh, ties, weights)
            else:
                plan = plan_on_mesh(
                    sub, self.cluster, mesh, self.options, ties, weights=weights,
                    footprint=self.footprint(layer, shape, footprint_budget),
                )
        except MemoryBudgetError:
            return None, None
        cost = LayerCost(
            plan.cost.total,
            plan.cost.memory_per_device,
            _activation_bytes(sub, plan, self.kept_for_backward(layer)),
            _state_bytes(sub, plan),
            _gradient_bytes(sub, plan, self.per_layer),
        )
        return cost, (plan, sub)

    def footprint_span(self, layer: int, shape: tuple[int, ...]) -> tuple[float, float]:
        """(least, fastest plan's) footprint of the layer on a mesh of `shape`, bytes per
        device; the least ignores costs and the peak memory (a lower bound)."""
        stats = self._plans[(self.fingerprints[layer], shape, 0)][0].stats
        return stats["least_footprint"], stats["footprint"]

    def footprint(self, layer: int, shape: tuple[int, ...], budget: float | None) -> Footprint:
        """What a stage on a mesh of `shape` holds of this layer for the whole step: its
        parameters and optimizer state, its accumulated gradients (deferred ones counted
        unreduced, at their partial-sum producer's layout without the summed axes) and
        the kept activations of `in_flight(shape)` microbatches."""
        part = self.per_layer
        sub = part.stage_graphs[layer]
        produced = {v for n in sub.nodes for v in n.outputs}
        held = {
            v: 1.0 for v in sub.invars if sub.vars[v].role in (Role.PARAM, Role.OPT_STATE)
        }
        unreduced: dict[int, float] = {}
        roots = gradient_roots(sub, part.deferrable)
        for g in set(part.grad_vars) & produced:
            if g not in roots:
                held[g] = held.get(g, 0.0) + 1.0
                continue
            for r in roots[g]:
                ratio = dtype_itemsize(sub.vars[g].dtype) / dtype_itemsize(sub.vars[r].dtype)
                unreduced[r] = unreduced.get(r, 0.0) + ratio / len(roots[g])
        in_flight = float(self.in_flight(shape))
        for v in self.kept_for_backward(layer):
            held[v] = held.get(v, 0.0) + in_flight
        return Footprint(held, unreduced, budget)

    def plan(self, layer: int, shape: tuple[int, ...], level: int = 0) -> ShardingPlan | None:
        """The layer's plan behind `cost(layer, shape, level)` (solved for a layer of the
        same structure; its variable ids are that layer's)."""
        if self.cost(layer, shape, level) is None:
            return None
        return self._plans[(self.fingerprints[layer], shape, level)][0]

    def kept_for_backward(self, layer: int) -> set[int]:
        """Values the layer's forward computes and its backward reads: what a microbatch
        in flight keeps on the stage."""
        part = self.per_layer
        return set(part.forward[layer].outputs) & set(part.backward[layer].inputs)

    def chain_ties(self, layer: int) -> list[tuple[int, int]]:
        """(output, input) activation pairs that chain identical layers.

        A layer hands the next one an activation shaped like the one it received (and, in
        the backward pass, a cotangent like the one it got). Tying each such output to its
        input's layout makes a layer's plan pay for leaving its successor a layout it can
        take, so that layers planned one at a time also fit together.
        """
        part = self.per_layer
        sub = part.stage_graphs[layer]
        leaving = set(sub.outvars)
        ties = []
        for segment in (part.forward[layer], part.backward[layer]):
            ins = [v for v in segment.inputs if sub.vars[v].role is Role.ACTIVATION]
            outs = [v for v in segment.outputs if v in leaving]
            used: set[int] = set()
            for v_in in ins:
                match = next(
                    (
                        o for o in outs
                        if o not in used
                        and sub.vars[o].shape == sub.vars[v_in].shape
                        and sub.vars[o].dtype == sub.vars[v_in].dtype
                    ),
                    None,
                )
                if match is not None:
                    used.add(match)
                    ties.append((match, v_in))
        return ties

    def stage_plan(self, graph, stage_part, stage: int, layer_range, shape, mesh, tied,
                   level: int = 0):
        """The plan of one stage stitched from its layers' plans on `shape` (at memory
        `level`, see `cost`)."""
        parts = []
        weights = {}
        handed_on = []
        stage_index = stage_part.node_index[stage]
        for k in range(*layer_range):
            handed_on.append(self.chain_ties(k))
            self.cost(k, shape, level)
            plan, solved_on = self._plans[(self.fingerprints[k], shape, level)]
            sub = self.per_layer.stage_graphs[k]
            parts.append((sub, self.per_layer.node_index[k], plan, solved_on))
            for full, i in self.per_layer.node_index[k].items():
                if i in self.weights[k]:
                    weights[stage_index[full]] = self.weights[k][i][0]
        stage_graph = stage_part.stage_graphs[stage]
        return stitch(
            stage_graph, stage_index, parts, mesh, self.cluster,
            _tied_in(stage_graph, self.tied), weights=weights,
            tie_weight=1.0 / self.num_microbatches, handed_on=handed_on,
        )


def _state_bytes(sub: OpGraph, plan: ShardingPlan) -> float:
    """Bytes per device of the parameters and optimizer state the layer reads."""
    from autopar.cost import bytes_per_device

    return sum(
        bytes_per_device(sub.vars[v].shape, sub.vars[v].dtype, plan.var_specs[v], plan.mesh)
        for v in sub.invars
        if sub.vars[v].role in (Role.PARAM, Role.OPT_STATE) and plan.var_specs[v] is not None
    )


def _gradient_bytes(sub: OpGraph, plan: ShardingPlan, part: Partition) -> float:
    """Bytes per device of the gradients the layer computes, as they are accumulated."""
    from autopar.cost import bytes_per_device

    stacked = stacked_layout(sub, plan, part.deferrable)
    produced = {v for n in sub.nodes for v in n.outputs}
    total = 0.0
    for v in set(part.grad_vars) & produced:
        var, spec = sub.vars[v], plan.var_specs[v]
        if spec is None or not var.shape:
            continue
        if v in stacked:
            spec = unstacked_spec(spec, stacked[v])
        total += bytes_per_device(var.shape, var.dtype, spec, plan.mesh)
    return total


def _activation_bytes(sub: OpGraph, plan: ShardingPlan, kept: set[int]) -> float:
    """Bytes per device the layer's forward keeps for its backward (one microbatch)."""
    from autopar.cost import bytes_per_device

    return sum(
        bytes_per_device(sub.vars[v].shape, sub.vars[v].dtype, plan.var_specs[v], plan.mesh)
        for v in kept
        if plan.var_specs[v] is not None and sub.vars[v].shape
    )


# Memory levels of the layer plans a stage may use. Level 0 is each layer's fastest plan;
# level L limits the layer's footprint on the stage (state, accumulated gradients, kept
# activations of the microbatches in flight: what `stage_memory` sums over the layers) to
# least + LEVEL_FRACTIONS[L] x (fastest - least). The layer ILPs see one layer; a stage
# holds many, so the fastest plans of its layers may not fit together where leaner ones
# (state, gradients and activations split further) do. `choose_stages` jumps to the level
# the stage's excess memory asks for, then steps down while the stage still does not fit.
LEVEL_FRACTIONS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.12, 0.06, 0.02)


def _fitting_level(table: LayerCostTable, layer_range, shape, in_flight: int, budget: float):
    """(level, layer costs, stage memory) of the fastest memory level at which the layers
    fit `budget` together on a mesh of `shape`, or of the leanest level tried when none
    does; None when a layer has no plan on that mesh.

    From level 0 it jumps to the level whose footprint limit removes the stage's excess
    (each layer giving up the same fraction of what it can give), then steps down.
    """
    costs = [table.cost(k, shape) for k in layer_range]
    if any(c is None for c in costs):
        return None
    memory = stage_memory(costs, in_flight)
    if memory <= budget or table.solve is not None:
        return 0, costs, memory
    spans = [table.footprint_span(k, shape) for k in layer_range]
    slack = math.fsum(fastest - least for least, fastest in spans)
    wanted = 1.0 - (memory - budget) / slack if slack > 0 else -1.0
    first = next((k for k, f in enumerate(LEVEL_FRACTIONS) if k and f <= wanted), None)
    if first is None:
        first = len(LEVEL_FRACTIONS) - 1  # the leanest: it may still fit (or tell how close)
    found = (0, costs, memory)
    for level in range(first, len(LEVEL_FRACTIONS)):
        costs = [table.cost(k, shape, level) for k in layer_range]
        if any(c is None for c in costs):
            break
        memory = stage_memory(costs, in_flight)
        if memory >= found[2]:
            break  # a tighter footprint no longer helps
        found = (level, costs, memory)
        if memory <= budget:
            break
    return found


def choose_stages(
    graph: OpGraph,
    layers: LayerAssignment,
    cluster,
    num_microbatches: int,
    schedule: str,
    options: ShardOptions,
    tied: Sequence[tuple[int, int]],
    *,
    num_stages: int | None = None,
    submeshes: Sequence[SubmeshShape] | None = None,
    logical_shapes: Sequence[tuple[int, ...]] | None = None,
) -> PipelineChoice:
    """Run the stage DP over layer costs, then plan each chosen stage on its submesh.

    Steps: layer costs per mesh shape (`LayerCostTable`), the cost of a stage on a submesh
    (`_StageCosts`), Alpa's DP (`plan_stages`), each chosen stage's plan stitched from its
    layers' plans (`_stage_plans`).
    """
    budget = memory_budget(cluster, options.memory_budget)

    def in_flight(shape) -> int:
        # The layer ILPs' estimate of the activations in flight (a weight in the footprint
        # their leaner levels limit; they do not know the stage's position): GPipe keeps all
        # microbatches, 1F1B at most one per stage that could follow on the devices left.
        # The stage DP's memory check uses each stage's exact position (`_StageCosts`).
        later = max(1, cluster.num_devices // math.prod(shape))
        return in_flight_microbatches(schedule, num_microbatches, later)

    table = LayerCostTable(
        graph, layers, cluster, options, tied, num_microbatches=num_microbatches,
        in_flight=in_flight,
    )
    all_submeshes = list(submeshes) if submeshes else submesh_shapes(
        cluster.num_hosts, cluster.devices_per_host
    )
    stage_cost = _StageCosts(
        table, all_submeshes, logical_shapes, schedule, num_microbatches, budget
    )
    start_time = time.perf_counter()
    dp = plan_stages(
        layers.num_layers, cluster.num_hosts, cluster.devices_per_host, stage_cost,
        num_microbatches, submeshes=all_submeshes, num_stages=num_stages,
        memory_budget=budget, num_positions=stage_cost.num_positions,
    )
    log.info(
        "stage DP: %d stage(s), %.4g s predicted, %d layer ILPs, %.2f s",
        len(dp.stages), dp.latency, table.num_ilps, time.perf_counter() - start_time,
    )
    stage_layers = tuple((s, e) for s, e, _ in dp.stages)
    shapes = tuple(c.detail[0] for c in dp.stage_costs)
    part = partition(graph, layers, list(stage_layers))
    return PipelineChoice(
        stage_layers=stage_layers,
        submeshes=tuple(all_submeshes[i] for _, _, i in dp.stages),
        device_ids=tuple(dp.device_ids),
        logical_shapes=shapes,
        latency=dp.latency,
        stage_plans=_stage_plans(table, graph, part, dp, stage_layers, tied),
        partition=part,
        dp=dp,
        num_layer_ilps=table.num_ilps,
    )


@dataclass
class _StageCosts:
    """The stage DP's cost of layers [start, end) on submesh `index` as the stage
    `stages_from_here` stages from the end (1: the last): the fastest logical mesh shape
    and memory level at which the layers, with the activations of the microbatches that
    position keeps in flight (`in_flight_microbatches`), fit the budget together."""

    table: LayerCostTable
    submeshes: list[SubmeshShape]
    logical_shapes: Sequence[tuple[int, ...]] | None
    schedule: str
    num_microbatches: int
    budget: float

    @property
    def num_positions(self) -> int | None:
        """Positions whose memory differs: under 1F1B stage i of S keeps min(B, S - i)
        microbatches, the same from S - i = B on; under GPipe every stage keeps B."""
        return self.num_microbatches if self.schedule == "1f1b" else None

    def __call__(self, start: int, end: int, index: int, stages_from_here: int = 1) -> StageCost:
        sub = self.submeshes[index]
        shapes = self.logical_shapes or logical_mesh_shapes(sub)
        shapes = [s for s in shapes if math.prod(s) == sub.num_devices]
        in_flight = in_flight_microbatches(self.schedule, self.num_microbatches, stages_from_here)
        best = None
        least_memory = math.inf
        for shape in shapes:
            shape = tuple(shape)
            found = _fitting_level(self.table, range(start, end), shape, in_flight, self.budget)
            if found is None:
                continue
            level, costs, memory = found
            least_memory = min(least_memory, memory)
            if memory <= self.budget:
                latency = sum(c.latency for c in costs)
                if best is None or latency < best.latency:
                    best = StageCost(latency, True, memory, (shape, level))
        if best is None:
            return StageCost(math.inf, False, least_memory, None)
        return best


def _stage_plans(table: LayerCostTable, graph, part, dp, stage_layers, tied) -> tuple:
    """Each chosen stage's plan, stitched from its layers' plans on its mesh."""
    plans = []
    for s, (ids, cost) in enumerate(zip(dp.device_ids, dp.stage_costs)):
        shape, level = cost.detail
        mesh = LogicalMesh.create(shape, ids)
        plans.append(table.stage_plan(graph, part, s, stage_layers[s], shape, mesh, tied, level))
    return tuple(plans)
