"""Choosing stages: the stage DP over layer costs, then each chosen stage's plan.

In: a train step traced at microbatch size (with `layer_boundary` marks), its layers, a
cluster, the number of microbatches, the schedule and the single-mesh planner's options.
Out: `PipelineChoice`, the chosen stages (layer ranges on submeshes with logical mesh
shapes, memory levels and remat choices) and each stage's `ShardingPlan`.

Steps: layer costs per mesh shape (`LayerCostTable`), the cost of a stage on a submesh
(`_StageCosts`), Alpa's DP (`plan_stages`), each chosen stage's plan stitched from its
layers' plans (`_stage_plans`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.cluster import LogicalMesh
from autopar.cost import (
    boundary_transfer_time,
    memory_budget,
    stage_dispatch_time,
    stage_recompute_seconds,
)
from autopar.cost._units import format_gib
from autopar.graph import OpGraph, Role
from autopar.inter._floor_reach import floor_reach
from autopar.inter._layer_pricing import boundary_bytes
from autopar.inter._layer_table import LayerCostTable, layer_cost_table
from autopar.inter._memory_bound import hopeless_layer
from autopar.inter._options import StageOptions
from autopar.inter._share_bound import bound_by_share_plans
from autopar.inter._stage_costs import (
    _bound_by_even_plans,
    _least_work,
    _Restricted,
    _StageCosts,
)
from autopar.inter._stage_dp import NoPlanOfCount, StagePlan, plan_stages
from autopar.inter._submesh import (
    SubmeshShape,
    logical_mesh_shapes,
    splittable_shapes,
    submesh_shapes,
)
from autopar.inter._submesh_cut import usable_submeshes
from autopar.inter.passes._layers import LayerAssignment
from autopar.inter.passes._partition import Partition, partition
from autopar.intra import ShardingPlan

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
    # Per stage, per layer of the stage: its `Remat` choice; and per stage the seconds per
    # microbatch the recompute adds (part of `latency`, not of the stage plans' costs).
    stage_remat: tuple[tuple[str, ...], ...] = ()
    stage_recompute: tuple[float, ...] = ()
    # Per stage: seconds per microbatch of the transfer into it (`boundary_transfer_time`,
    # part of `latency` as the stage DP charges it; 0 for the first stage).
    stage_transfer: tuple[float, ...] = ()
    # Per stage: seconds per microbatch of launching its programs (`stage_dispatch_time`,
    # part of `latency` as the stage DP charges it).
    stage_dispatch: tuple[float, ...] = ()
    # Wall seconds of the search's parts (`PLANNING_PHASES`) and the layer cost look-ups
    # answered without a solve; not part of the choice's identity.
    timings: dict = field(default_factory=dict, compare=False)


# The parts of `choose_stages`, as `PipelineChoice.timings` names them: layers cut out as
# graphs of their own; the layer ILPs built and solved; the stage DP less the ILPs it
# asked for; the chosen stages' plans stitched from their layers' plans.
PLANNING_PHASES = ("layer clustering", "layer ILPs", "stage DP", "stage plans")


def choose_stages(
    graph: OpGraph,
    layers: LayerAssignment,
    cluster,
    num_microbatches: int,
    tied: Sequence[tuple[int, int]],
    options: StageOptions,
    *,
    allowed=None,
    range_shapes=None,
    table: LayerCostTable | None = None,
    stage_counts: dict | None = None,
) -> PipelineChoice:
    """Run the stage DP over layer costs, then plan each chosen stage on its submesh.

    Steps: layer costs per mesh shape (`LayerCostTable`), the cost of a stage on a submesh
    (`_StageCosts`), Alpa's DP (`plan_stages`), each chosen stage's plan stitched from its
    layers' plans (`_stage_plans`). `options` says how (`StageOptions`: the layer ILPs'
    options, the schedule, fixed stages, submeshes or shapes, remat, memory levels,
    pruning). `allowed(start, end) -> bool`, when given, rules out
    the stages whose layer range it rejects (e.g. uneven slices of a scanned stack);
    `range_shapes(start, end)`, when given, names the only logical mesh shapes a stage of
    those layers may take (None: any). `table`: the layer costs of an earlier call with
    the same arguments (`layer_cost_table`), so that a re-run with other restrictions
    solves no layer ILP twice. `stage_counts`: when given, filled with
    ``{count: PipelineChoice}``, the best plan of each stage count the stage DP's table
    holds (`best_per_stage_count`; no layer ILP solved for them), and ``{count:
    NoPlanOfCount}`` for each count it holds none of (why: pruned by the bound, or none fits).
    """
    schedule = options.schedule
    budget = memory_budget(cluster, options.shard.memory_budget)
    start_time = time.perf_counter()
    if table is None:
        table = layer_cost_table(graph, layers, cluster, num_microbatches, options, tied)
    before = (table.num_ilps, table.ilp_seconds, table.num_hits, table.num_priced)
    clustering = time.perf_counter() - start_time
    all_submeshes = list(options.submeshes) if options.submeshes else submesh_shapes(
        cluster.num_hosts, cluster.devices_per_host
    )
    all_submeshes, splittable = _splittable(table, all_submeshes, options)
    all_submeshes, splittable = usable_submeshes(  # memory floor and device-count cuts
        table, all_submeshes, splittable, options, budget, layers.num_layers)
    crossing = boundary_bytes(graph, layers)
    start_time = time.perf_counter()
    per_count = None if stage_counts is None else {}
    dp = _stage_dp(table, layers.num_layers, cluster, num_microbatches, options, budget,
                   all_submeshes, crossing, allowed, range_shapes, per_count, splittable)
    dp_seconds = time.perf_counter() - start_time
    _log_dp(table, dp, dp_seconds)
    ilp_seconds = table.ilp_seconds
    start_time = time.perf_counter()
    stage_layers = tuple((s, e) for s, e, _ in dp.stages)
    part = partition(graph, layers, list(stage_layers))
    stage_plans = _stage_plans(table, graph, part, dp, stage_layers, tied)
    stitching = time.perf_counter() - start_time - (table.ilp_seconds - ilp_seconds)
    timings = _call_timings(table, before, clustering, dp_seconds, ilp_seconds, stitching)
    for count, other in (per_count or {}).items():  # the explored space (`autopar.space`)
        if isinstance(other, NoPlanOfCount):  # why the table holds no plan of this count
            stage_counts[count] = other
            continue
        ranges = tuple((s, e) for s, e, _ in other.stages)
        if other.stages == dp.stages and other.stage_costs == dp.stage_costs:
            other_part, other_plans = part, stage_plans  # the chosen stages, stitched above
        else:
            other_part = partition(graph, layers, list(ranges))
            other_plans = _stage_plans(table, graph, other_part, other, ranges, tied)
        stage_counts[count] = _pipeline_choice(
            table, other, ranges, all_submeshes, other_plans, other_part,
            crossing, num_microbatches, schedule, num_layer_ilps=0, timings={})
    return _pipeline_choice(table, dp, stage_layers, all_submeshes, stage_plans, part,
                            crossing, num_microbatches, schedule,
                            num_layer_ilps=table.num_ilps - before[0], timings=timings)


def _stage_dp(table: LayerCostTable, num_layers: int, cluster, num_microbatches: int,
              options: StageOptions, budget: float, all_submeshes, crossing, allowed,
              range_shapes, stage_counts=None, splittable=None):
    """Alpa's stage DP (`plan_stages`) over `_StageCosts` of the table's layers (under
    `allowed` and `range_shapes`), after a bound search when `options.prune_by_bound`.
    `splittable`: the logical mesh shapes to try when the options name none (`_splittable`)."""
    logical_shapes = options.logical_shapes or splittable
    if logical_shapes is None and options.every_mesh_shape:
        # Each submesh has its own device count, so one list filtered by device count
        # (`_StageCosts`) gives each submesh its own shapes, in their order.
        logical_shapes = tuple(s for sub in all_submeshes
                               for s in logical_mesh_shapes(sub, every=True))
    if range_shapes is None:
        _refuse_hopeless(table, all_submeshes, logical_shapes, num_microbatches, budget,
                         refuse=table.lower_bounds)
    reach = _floor_reach(table, num_layers, all_submeshes, logical_shapes, budget, options,
                         allowed, num_microbatches)
    stage_cost = inner = _StageCosts(
        table, all_submeshes, logical_shapes, options.schedule, num_microbatches, budget,
        options.remat, crossing, prune=options.prune_by_bound, floors=options.memory_floors,
        reach=reach,
    )
    restricted = allowed is not None or range_shapes is not None
    if restricted:
        stage_cost = _Restricted(stage_cost, allowed, range_shapes)
    if options.prune_by_bound:
        _bound_search(inner, stage_cost, table, num_layers, cluster, all_submeshes,
                      logical_shapes, options.num_stages, restricted, allowed)
    try:
        return plan_stages(
            num_layers, cluster.num_hosts, cluster.devices_per_host, stage_cost,
            num_microbatches, submeshes=all_submeshes, num_stages=options.num_stages,
            memory_budget=budget, num_positions=stage_cost.num_positions,
            stage_counts=stage_counts,
        )
    finally:
        _log_floor_cuts(inner)


def _log_floor_cuts(inner: _StageCosts) -> None:
    """Log how many (layer range, submesh) pairs the stages' memory floors ruled out
    (every logical mesh of the submesh over the budget) and how many (range, logical
    mesh) pairs of the others, their leaner levels never solved (`_StageCosts._over_budget`)."""
    asked = inner.floor_cuts
    whole = len(inner.floor_skipped)
    some = sum(len(over) for key, over in asked.items() if key not in inner.floor_skipped)
    log.info("stage DP: %d of %d (layer range, submesh) pairs skipped by their memory floor "
             "(no logical mesh of theirs can hold the stage), and %d more (range, logical "
             "mesh) pairs", whole, len(asked), some)


class NoStageHoldsLayer(ValueError):
    """A layer no stage on any candidate mesh can hold within the memory budget, found by
    its memory floor before any ILP (`autopar.inter._memory_bound.hopeless_layer`)."""


def _refuse_hopeless(table: LayerCostTable, submeshes, logical_shapes,
                     num_microbatches: int, budget: float, refuse: bool = True) -> None:
    """Raise `NoStageHoldsLayer` when some layer's memory floor exceeds `budget` on every
    logical mesh a stage may take (each submesh's shapes as `_StageCosts` tries them):
    every pipeline plan has a stage holding that layer, so there is none, and no layer
    ILP need say so. Records the shapes on the table for its progress lines; refuses
    nothing unless `refuse` (the unpruned reference search solves every ILP)."""
    shapes = [tuple(s) for sub in submeshes
              for s in (logical_shapes or logical_mesh_shapes(sub))
              if math.prod(s) == sub.num_devices]
    table.candidate_shapes = tuple(dict.fromkeys(shapes))
    found = hopeless_layer(table, shapes, budget) if refuse else None
    if found is None:
        return
    layer, floors = found
    least_shape, least = min(floors, key=lambda f: f[1])
    why = (f"pipeline layer {layer} needs at least {format_gib(least)} per device on every "
           f"stage mesh (its least, on mesh {least_shape}, with every value at its smallest "
           f"split), against a memory budget of {format_gib(budget)}")
    log.info("%d microbatch(es): refused before any ILP: %s", num_microbatches, why)
    raise NoStageHoldsLayer(
        f"no pipeline plan of {num_microbatches} microbatch(es): {why}. Use more "
        "microbatches (smaller ones), more devices, or a larger memory budget")


class NoPlanWithinFloors(NoStageHoldsLayer):
    """No slicing of the layers into stages whose memory floors are all within the budget
    uses the cluster's devices (`autopar.inter._floor_reach`), found before any ILP."""


def _floor_reach(table: LayerCostTable, num_layers: int, submeshes, logical_shapes,
                 budget: float, options: StageOptions, allowed, num_microbatches: int):
    """The `FloorReach` of the DP's stages (None: nothing ruled out by it); raises
    `NoPlanWithinFloors` where it holds no plan at all."""
    start = time.perf_counter()
    reach = floor_reach(table, num_layers, submeshes, logical_shapes, budget, options,
                        allowed)
    if reach is None:
        return None
    if not reach.exists:
        why = (f"no slicing of the {num_layers} pipeline layers into stages "
               f"{'' if options.num_stages is None else f'({options.num_stages}) '}that "
               f"use all {table.cluster.num_devices} devices has every stage's memory floor "
               f"(every value at its smallest split) within the memory budget of "
               f"{format_gib(budget)}")
        log.info("%d microbatch(es): refused before any ILP: %s", num_microbatches, why)
        raise NoPlanWithinFloors(
            f"no pipeline plan of {num_microbatches} microbatch(es): {why}. Use more "
            "microbatches (smaller ones), more devices, or a larger memory budget")
    log.info("stage DP: %d (layer range, submesh) pairs on no plan within the memory "
             "floors, %.2f s", reach.num_ruled_out(), time.perf_counter() - start)
    return reach


def _splittable(table: LayerCostTable, submeshes, options: StageOptions):
    """(`submeshes`, None), or where some logical mesh shape has an axis that can only
    replicate one of the layers that hold parameters (`splittable_shapes`: it divides no
    tensor dimension of that layer), the submeshes with a shape left and those shapes (for
    `_StageCosts.logical_shapes`). A stage on such a shape runs that layer whole on every
    group of the axis (Megatron-LM's rule: each parallel degree divides what it splits).
    Only when the options leave the submeshes and shapes to the search, with its lower
    bounds on (`lower_bounds=False`, the unpruned reference, tries every shape) and the
    usual shapes (`every_mesh_shape=False`); and only where each submesh has a device
    count of its own (`_StageCosts` tells a submesh's shapes apart by it)."""
    if (options.submeshes is not None or options.logical_shapes is not None
            or options.every_mesh_shape or not options.lower_bounds):
        return submeshes, None
    counts = [sub.num_devices for sub in submeshes]
    if len(set(counts)) != len(counts):
        return submeshes, None
    # Per layer structure that holds parameters: the dimension sizes of the values its
    # nodes touch. (A layer without parameters, such as a loss cut out as a layer of its
    # own, whose values may be scalars, is light work whatever the mesh: no rule.)
    dims = []
    seen = set()
    for k, sub in enumerate(table.per_layer.stage_graphs):
        if table.fingerprints[k] in seen:
            continue
        seen.add(table.fingerprints[k])
        if not any(sub.vars[v].role is Role.PARAM for v in sub.invars):
            continue
        used = set(sub.invars) | set(sub.outvars)
        for node in sub.nodes:
            used.update(node.inputs)
            used.update(node.outputs)
        dims.append({d for v in used for d in sub.vars[v].shape})
    kept, shapes, cut = [], [], False
    for sub in submeshes:
        own = splittable_shapes(sub, *dims) if dims else logical_mesh_shapes(sub)
        cut = cut or len(own) < len(logical_mesh_shapes(sub))
        if own:
            kept.append(sub)
            shapes.extend(own)
    if not cut:
        return submeshes, None
    log.info("stage DP: %d of %d submeshes left out, and %d logical meshes in all: an axis "
             "of theirs divides no tensor dimension of some layer (it could only replicate "
             "it)", len(submeshes) - len(kept), len(submeshes),
             sum(len(logical_mesh_shapes(s)) for s in submeshes) - len(shapes))
    return kept, tuple(shapes)


def _call_timings(table: LayerCostTable, before: tuple, clustering: float, dp_seconds: float,
                  ilp_seconds: float, stitching: float) -> dict:
    """`choose_stages`'s seconds by planning phase and its layer-cost counts: this call's
    share (a table handed in has the ILPs of earlier calls in its counts; `before` holds
    them: ILPs, ILP seconds, hits, priced)."""
    ilps_before, ilp_seconds_before, hits_before, priced_before = before
    timings = dict(zip(PLANNING_PHASES, (
        clustering, table.ilp_seconds - ilp_seconds_before,
        dp_seconds - (ilp_seconds - ilp_seconds_before), stitching,
    )))
    timings.update({"layer ILPs solved": table.num_ilps - ilps_before,
                    "layer costs reused": table.num_hits - hits_before,
                    "layer costs priced": table.num_priced - priced_before})
    return timings


def _bound_search(inner: _StageCosts, stage_cost, table: LayerCostTable, num_layers: int,
                  cluster, submeshes, logical_shapes, num_stages: int | None,
                  restricted: bool, allowed=None) -> None:
    """A plan that exists bounds the answer: stages that cannot be part of a plan as fast
    are not costed at their leaner levels (`_StageCosts.bound`). The plans: even ones
    (`_bound_by_even_plans`), and under an `allowed` restriction (a scanned stack's
    shares) even ones with the end layers on the end stages (`_share_bound`)."""
    if not restricted:
        inner.work = _least_work(table, submeshes, logical_shapes, inner.holds)
    _bound_by_even_plans(
        inner, stage_cost, num_layers, cluster.num_hosts, cluster.devices_per_host,
        submeshes, num_stages,
    )
    bound_by_share_plans(inner, stage_cost, allowed, num_layers, cluster.num_hosts,
                         cluster.devices_per_host, submeshes, num_stages)
    log.info("stage DP: an even plan bounds the search at %.6g s (%d layer ILPs so far)",
             inner.bound, table.num_ilps)


def _log_dp(table: LayerCostTable, dp: StagePlan, dp_seconds: float) -> None:
    log.info(
        "stage DP: %d stage(s), %.4g s predicted, %d layer ILPs (%.2f s), %d cost look-ups "
        "answered from the table, %.2f s",
        len(dp.stages), dp.latency, table.num_ilps, table.ilp_seconds, table.num_hits,
        dp_seconds,
    )
    if table.reference is not None:
        log.info("stage DP: %d layer costs priced on the layouts of the %d-microbatch "
                 "search", table.num_priced, table.reference.num_microbatches)


def _pipeline_choice(table: LayerCostTable, dp: StagePlan, stage_layers, submeshes,
                     stage_plans, part, crossing, num_microbatches: int, schedule: str, *,
                     num_layer_ilps: int, timings: dict) -> PipelineChoice:
    """The DP's answer with each stage's plan, and what the DP charged each stage besides
    its plan: recompute, the transfer into it, launching its programs."""
    return PipelineChoice(
        stage_layers=stage_layers,
        submeshes=tuple(submeshes[i] for _, _, i in dp.stages),
        device_ids=tuple(dp.device_ids),
        logical_shapes=tuple(c.detail[0] for c in dp.stage_costs),
        latency=dp.latency,
        stage_plans=stage_plans,
        partition=part,
        dp=dp,
        num_layer_ilps=num_layer_ilps,
        timings=timings,
        stage_remat=tuple(c.detail[2] for c in dp.stage_costs),
        stage_recompute=tuple(
            recompute_time(table, range(*layers_), c.detail)
            for layers_, c in zip(stage_layers, dp.stage_costs)
        ),
        stage_transfer=tuple(
            boundary_transfer_time(crossing[start], table.cluster,
                                   submeshes[i].num_devices) if start > 0 else 0.0
            for start, _, i in dp.stages
        ),
        stage_dispatch=tuple(
            stage_dispatch_time(table.cluster, len(dp.stages), num_microbatches, schedule)
            for _ in dp.stages
        ),
    )


def recompute_time(table: LayerCostTable, layer_range, detail) -> float:
    """Seconds per microbatch the stage's recompute adds (`detail`: shape, level, remat;
    `stage_recompute_seconds`), the fused rerun every layer's backward does included
    (`LayerCostTable.fused_seconds`: in the layer costs, not in the stitched stage plan's
    cost)."""
    shape, level, remats = detail
    return stage_recompute_seconds(
        (table.remat_cost(k, shape, level, r).latency, table.cost(k, shape, level).latency,
         table.fused_seconds(k, shape, level))
        for k, r in zip(layer_range, remats)
    )


def plan_chosen_stages(
    graph: OpGraph,
    layers: LayerAssignment,
    cluster,
    num_microbatches: int,
    tied: Sequence[tuple[int, int]],
    options: StageOptions,
    stage_layers: Sequence[tuple[int, int]],
    chosen: PipelineChoice,
    *,
    stage_remat: Sequence[tuple[str, ...]] | None = None,
) -> PipelineChoice:
    """`chosen` (the DP's answer on another tracing of the same step) re-planned on
    `graph`, whose layers `stage_layers` are those of `chosen`'s stages: the same
    submeshes, logical mesh shapes and memory levels, each stage's plan stitched from
    `graph`'s layers (a scanned stack traced as one sub-scan per stage,
    `autopar.inter.passes.scan_layers`). `stage_remat`: per stage, per layer of `graph`,
    its remat choice (default: `chosen`'s); the recompute it adds is priced on `graph` (a
    sub-scan whose body is checkpointed has it in its own cost already)."""
    table = layer_cost_table(graph, layers, cluster, num_microbatches, options, tied)
    stage_layers = tuple(tuple(r) for r in stage_layers)
    part = partition(graph, layers, list(stage_layers))
    plans = _stage_plans(table, graph, part, chosen.dp, stage_layers, tied)
    changes = {}
    if stage_remat is not None:
        stage_remat = tuple(tuple(r) for r in stage_remat)
        changes = dict(stage_remat=stage_remat, stage_recompute=tuple(
            recompute_time(table, range(*layer_range), (c.detail[0], c.detail[1], remats))
            for layer_range, c, remats in zip(stage_layers, chosen.dp.stage_costs, stage_remat)
        ))
    return dataclasses.replace(
        chosen, stage_layers=stage_layers, stage_plans=plans, partition=part,
        num_layer_ilps=chosen.num_layer_ilps + table.num_ilps, **changes,
    )


def _stage_plans(table: LayerCostTable, graph, part, dp, stage_layers, tied) -> tuple:
    """Each chosen stage's plan, stitched from its layers' plans on its mesh."""
    plans = []
    for s, (ids, cost) in enumerate(zip(dp.device_ids, dp.stage_costs)):
        shape, level, _ = cost.detail
        mesh = LogicalMesh.create(shape, ids)
        plans.append(table.stage_plan(graph, part, s, stage_layers[s], shape, mesh, tied, level))
    return tuple(plans)
