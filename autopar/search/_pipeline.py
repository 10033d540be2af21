"""The pipeline search (method "auto"): stages, their meshes and the microbatch count.

In: the step, its arguments, the graph traced at full batch, a cluster and `PlanOptions`.
Out: a `Plan` (runtime "pipeline") and the graph traced at one microbatch, which it runs;
or the one-mesh plan when the step has no gradient boundary or the cluster one device.

Steps: for each candidate microbatch count, trace one microbatch (`_trace_microbatch`) and
run the stage DP (`inter.choose_stages`); pick the fastest (`_pick`); assemble the `Plan`
(`_pipeline_plan`).

A model whose layers are a scan over stacked parameters (and that has no layer marks) is
traced with the scan run one iteration per sub-scan (`inter.scan_layers`), its stacked
leaves cut into one piece per iteration (`graph.split_stacked`): the DP sees L identical
layers between the embeddings and the head, planned by one ILP per mesh, and may cut the
stack anywhere a stage gets an equal share of it (`_even_shares`). The chosen cut is then
traced again with one sub-scan per stage (`_regroup`), so that each stage holds, runs and
updates its slice ``w[a:b]`` of every stacked leaf; the plan records the ranges
(`Plan.scan_ranges`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from dataclasses import dataclass

from autopar.choices import Schedule
from autopar.cost import DEFAULT_PHASE_SHARES, pipelined_step_time
from autopar.graph import OpGraph, split_stacked, tied_state, trace
from autopar.inter import (
    PipelineChoice,
    SubmeshShape,
    assign_layers,
    auto_layers,
    choose_stages,
    layer_cost_table,
    layer_scan,
    plan_chosen_stages,
    scan_layers,
)
from autopar.inter.passes import per_iteration, phase_times
from autopar.intra._sharding_plan import graph_fingerprint
from autopar.plan import Plan, Stage, input_infos
from autopar.search._microbatch import batch_size, microbatch_args
from autopar.search._options import PlanOptions
from autopar.search._single_mesh import plan_one_mesh, shard_options

log = logging.getLogger("autopar")

NO_BOUNDARY_WARNING = (
    "pipeline stages not searched: the step does not use autopar.value_and_grad "
    "or autopar.grad, so its gradient boundary is unknown"
)


MESH_SHAPE_WARNING = (
    "mesh_shape={} applies to one-mesh plans and method='auto' searches pipeline stages, "
    "whose meshes it does not fix: pass logical_shapes=[...] to fix the stage mesh shapes, "
    "or method='shard' for one mesh of that shape"
)


class _NotALayerStack(Exception):
    """The step's scan over stacked inputs is not run by the differentiated loss function
    (`scan_layers` found nothing to cut there)."""


@dataclass(frozen=True)
class _Candidate:
    choice: PipelineChoice
    graph: OpGraph  # traced at one microbatch
    num_microbatches: int
    schedule: Schedule = "1f1b"
    latency: float = 0.0  # predicted seconds per step under `schedule`


def search_plan(fn, args, cluster, options: PlanOptions, graph: OpGraph, timings: dict,
                graph_microbatches: int = 1):
    """The plan for `fn(*args)` and the graph it runs (see the module docstring).

    `graph_microbatches`: `graph` is one of that many microbatches of the step rather
    than the whole step (a search of that fixed count traced it so; `autopar.search._api`).
    """
    options.check_cluster(cluster)
    if graph_microbatches > 1 and (options.method != "auto" or cluster.num_devices == 1
                                   or options.num_microbatches != graph_microbatches):
        raise ValueError(
            f"search_plan got one microbatch of {graph_microbatches} but plans "
            f"method={options.method!r}, num_microbatches={options.num_microbatches!r} on "
            f"{cluster.num_devices} device(s); trace the whole step for it"
        )
    if options.method != "auto":
        return _one_mesh(graph, cluster, options, timings), graph
    has_boundary = any(n.primitive == "grad_boundary" for n in graph.nodes)
    if not has_boundary and options.num_microbatches not in ("auto", 1):
        raise ValueError(
            f"num_microbatches={options.num_microbatches} needs the step's gradient boundary, "
            "and this step computes its gradients with something autopar cannot see (e.g. "
            "jax.value_and_grad); compute them with autopar.value_and_grad or autopar.grad "
            "(the same functions on one device), or drop num_microbatches"
        )
    if not has_boundary or cluster.num_devices == 1:
        plan = _one_mesh(graph, cluster, options, timings)
        if cluster.num_devices > 1:
            plan = dataclasses.replace(plan, warnings=(*plan.warnings, NO_BOUNDARY_WARNING))
        return plan, graph
    if options.mesh_shape is not None:
        warnings.warn(MESH_SHAPE_WARNING.format(options.mesh_shape), stacklevel=4)
    has_marks = any(n.primitive == "layer_boundary" for n in graph.nodes)
    stack = None if has_marks else layer_scan(graph)
    scan_length = None if stack is None else stack.params["length"]
    num_auto_layers = None if has_marks or stack is not None else options.num_layers
    rows = batch_size(graph)
    pretraced = {}
    if graph_microbatches > 1:
        rows = None if rows is None else rows * graph_microbatches
        if has_marks:  # `_trace_microbatch`'s graph (no automatic marks), as it is
            pretraced[graph_microbatches] = graph
    try:
        candidates = _stage_choices(fn, args, cluster, options, rows, num_auto_layers,
                                    timings, scan_length, pretraced)
    except _NotALayerStack:  # the scan is not in the loss function: layers cut as usual
        scan_length, num_auto_layers = None, options.num_layers
        candidates = _stage_choices(fn, args, cluster, options, rows, num_auto_layers,
                                    timings)
    scan_ranges = ()
    if scan_length is None:
        best = _pick(candidates)
    else:
        best, scan_ranges = _pick_regrouped(candidates, fn, args, cluster, options,
                                            scan_length)
    plan = _pipeline_plan(best, cluster, options, num_auto_layers, timings, scan_ranges)
    if options.mesh_shape is not None:
        warning = MESH_SHAPE_WARNING.format(options.mesh_shape)
        plan = dataclasses.replace(plan, warnings=(*plan.warnings, warning))
    return plan, best.graph


def _one_mesh(graph, cluster, options, timings) -> Plan:
    plan = plan_one_mesh(graph, cluster, options)
    plan.timings.update(timings)
    return plan


def _trace_microbatch(fn, args, options: PlanOptions, num_microbatches, num_auto_layers,
                      scan_ranges=None, scan_remat=()):
    """One microbatch of the step: layers marked automatically (`num_auto_layers`), or,
    with `scan_ranges`, from the layer scan run as one sub-scan per range (recomputing as
    `scan_remat` says), its stacked leaves cut into those ranges."""
    mb_args = microbatch_args(args, options.batch_argnums, num_microbatches)
    if scan_ranges is not None:
        with scan_layers(scan_ranges, scan_remat):
            graph = trace(fn, *mb_args, batch_argnums=options.batch_argnums)
        return split_stacked(graph, scan_ranges)
    with auto_layers(num_auto_layers):
        return trace(fn, *mb_args, batch_argnums=options.batch_argnums)


def _even_shares(length: int, max_stages: int, share: int | None = None):
    """`allowed(start, end)` for the DP over a stack of `length` iterations traced one
    layer per iteration (layer 0 before the stack, layer `length` + 1 after it): a stage
    holds none of the stack, or `length` / d iterations for a d that divides `length`
    (only `share` iterations when given). (A leaf held in pieces is handed back as one
    array sharded over the stages, which needs pieces of one length; `_regroup` checks
    that the chosen ones are, and `_one_layout` re-runs a DP that mixed shares.)"""
    shares = {0} | {length // d for d in range(1, max_stages + 1) if length % d == 0}
    if share is not None:
        shares = {0, share} & shares

    def allowed(start: int, end: int) -> bool:
        return max(0, min(end, length + 1) - max(start, 1)) in shares

    return allowed


def _pieces(choice, length: int) -> list[tuple[int, tuple[int, ...]]]:
    """(iterations, logical mesh shape) of each piece of the stack a chosen stage holds
    (see `_regroup`)."""
    found = []
    for (start, end), shape in zip(choice.stage_layers, choice.logical_shapes):
        a, b = max(start, 1) - 1, min(end, length + 1) - 1
        if b > a:
            found.append((b - a, tuple(shape)))
    return found


def _piece_lengths(choice, length: int) -> set[int]:
    """The lengths of the pieces of the stack the chosen stages hold."""
    return {n for n, _ in _pieces(choice, length)}


def _holds_stack(length: int, shape: tuple[int, ...]):
    """`range_shapes` for the stage DP: a stage holding any of the stack's iterations
    (layers 1..`length`) takes the logical mesh `shape`; the others any shape."""

    def only(start: int, end: int):
        return [shape] if max(start, 1) < min(end, length + 1) else None

    return only


def _one_layout(choice, length: int, options, cluster, num_micro: int, rerun):
    """A stage DP choice whose pieces of the stack have one length on one logical mesh
    shape, for a `choice` that mixed lengths or shapes (the DP prices each stage on its
    own and cannot see that they must agree: llama-70B on 32 H100s was cut 10/10/20/20/20,
    then into 4 x 20 on meshes (2, 4) and (4, 2)). The DP again, `rerun(allowed=...,
    range_shapes=...)` on the same layer cost table, with each mixed length as the only
    share, and where that still mixes shapes, with each of them as the only shape for the
    stages holding the stack; the fastest that finds a plan. Not the best of every uniform
    cut, only of the lengths and shapes the unrestricted DP chose."""
    pieces = _pieces(choice, length)
    if len(set(pieces)) <= 1:
        return choice
    max_stages = options.num_stages or cluster.num_devices
    found, tried, last_error = [], {}, None
    spent = dict(choice.timings)  # every run's search time, the first's included

    def attempt(share: int, shape=None):
        nonlocal last_error
        if (share, shape) not in tried:
            again = None
            try:
                again = rerun(allowed=_even_shares(length, max_stages, share),
                              range_shapes=None if shape is None else _holds_stack(length, shape))
            except ValueError as err:
                last_error = err
            tried[share, shape] = again
            if again is not None:
                for name, value in again.timings.items():
                    spent[name] = spent.get(name, 0) + value
                if len(set(_pieces(again, length))) <= 1:
                    latency = _schedule_for(again, num_micro, options, cluster)[1]
                    log.info("%d microbatch(es): the stack in pieces of %d iteration(s)%s: "
                             "%d stage(s), predicted %.4g s", num_micro, share,
                             "" if shape is None else f" on meshes {shape}",
                             len(again.stage_layers), latency)
                    found.append((latency, share, shape or (), again))
        return tried[share, shape]

    lengths = sorted({n for n, _ in pieces})
    for share in lengths:
        again = choice if len(lengths) == 1 else attempt(share)
        if again is None or len(set(_pieces(again, length))) <= 1:
            continue
        for shape in sorted({s for _, s in _pieces(again, length) + pieces}):
            attempt(share, shape)
    if not found:
        raise last_error or ValueError(
            f"no stage DP choice holds the scanned stack of {length} layers in pieces of one "
            "length on meshes of one shape: pass num_stages= a divisor of "
            f"{length} and logical_shapes=[...]"
        )
    best = min(found, key=lambda f: f[:3])[3]
    log.info("%d microbatch(es): the stage DP cut the stack into %s; kept the fastest "
             "uniform cut", num_micro, ", ".join(f"{n} on {s}" for n, s in pieces))
    # The re-runs' search time (ILPs, DP) is the kept choice's: the phases sum them all.
    return dataclasses.replace(best, timings=spent)


def _regroup(best: _Candidate, fn, args, cluster, options, length: int):
    """The candidate traced with one sub-scan per stage (see the module docstring), and
    the iteration ranges of those sub-scans."""
    choice = best.choice
    ranges, stage_of_piece = [], []
    for s, (start, end) in enumerate(choice.stage_layers):
        a, b = max(start, 1) - 1, min(end, length + 1) - 1
        if b > a:
            ranges.append((a, b))
            stage_of_piece.append(s)
    lengths = {b - a for a, b in ranges}
    shapes = {choice.logical_shapes[s] for s in stage_of_piece}
    if len(lengths) > 1 or len(shapes) > 1:
        raise ValueError(
            f"the stage DP cut the scanned stack of {length} layers into pieces {ranges} on "
            f"stage meshes {sorted(shapes)}; a stacked leaf held in pieces is handed back as "
            "one array sharded over the stages, which needs pieces of one length on meshes "
            f"of one shape: pass num_stages= a divisor of {length} (and logical_shapes=[...] "
            "to fix the stage mesh shape)"
        )
    ranges = tuple(ranges)
    piece_remat = _piece_remat(choice, ranges, length)

    def new_layer(old: int) -> int:
        if old == 0:
            return 0
        if old > length:
            return len(ranges) + 1
        return 1 + next(k for k, (a, b) in enumerate(ranges) if a <= old - 1 < b)

    stage_layers = [
        (new_layer(start), new_layer(end - 1) + 1) for start, end in choice.stage_layers
    ]
    # A stage's layer at new index k holds range k - 1 of the stack (its sub-scan,
    # recomputing as `piece_remat` says), or the embeddings / the head, as chosen.
    old_remat = _remat_by_layer(choice)
    stage_remat = [
        tuple(piece_remat[k - 1] if 1 <= k <= len(ranges)
              else old_remat.get(0 if k == 0 else length + 1, "none") for k in range(a, b))
        for a, b in stage_layers
    ]
    graph = _trace_microbatch(fn, args, options, best.num_microbatches, None, ranges,
                              piece_remat)
    regrouped = plan_chosen_stages(
        graph, assign_layers(graph), cluster, best.num_microbatches, _dp_schedule(best.schedule),
        shard_options(options, cluster), tied_state(graph, options.donate_argnums),
        stage_layers, choice, stage_remat=stage_remat,
    )
    return dataclasses.replace(best, choice=regrouped, graph=graph), ranges


REMAT_ORDER = ("none", "selective", "full")


def _piece_remat(choice, ranges, length: int) -> tuple[str, ...]:
    """Per piece of the stack (one sub-scan, one body): the most its iterations recompute
    in the stage DP's choice (it chose per iteration, and a sub-scan has one body; the
    regrouped plan is timed with it). Iteration i of the stack is the DP's layer i + 1."""
    per_layer = _remat_by_layer(choice)
    return tuple(
        max((per_layer.get(i + 1, "none") for i in range(a, b)), key=REMAT_ORDER.index)
        for a, b in ranges
    )


def _remat_by_layer(choice) -> dict[int, str]:
    """The stage DP's remat choice of every layer, by layer index."""
    per_layer: dict[int, str] = {}
    for (start, end), remats in zip(choice.stage_layers, choice.stage_remat):
        per_layer.update(zip(range(start, end), remats))
    return per_layer


def _stage_choices(fn, args, cluster, options, rows, num_auto_layers, timings,
                   scan_length=None, pretraced=None):
    """The stage DP's choice for each microbatch count that has a plan; raises the last
    count's error when none has.

    With several counts (`num_microbatches="auto"`) the layer ILPs are solved for one
    count (`_reference_first`; issue 18): the other counts' layer costs are that search's
    layouts priced on their own shapes (`LayerCostTable(reference=...)`; an ILP of their
    own where the reference has not solved that layer, shape and level or its layout does
    not apply), each the cost of a feasible plan, which a search of the count's own
    layouts would match or beat. Whichever count `_pick` then takes is searched again on
    its own table less the priced costs before it is kept: a plan of priced layouts is
    never the answer. (What this can miss: a count whose own layouts would beat the
    winner though its priced ones did not.)

    `pretraced`: microbatch graphs already traced, by count, as `_trace_microbatch`
    traces them."""
    submeshes = None
    if options.submeshes is not None:
        submeshes = [SubmeshShape(h, d) for h, d in options.submeshes]
    single = shard_options(options, cluster)
    dp_cluster, num_stages = cluster, options.num_stages
    interleaved = options.schedule == "interleaved_1f1b" and options.virtual_stages > 1
    if interleaved:
        dp_cluster, single, num_stages, submeshes = _interleaved_search(cluster, single, options)
    # The stage DP's memory model: 1F1B's activations in flight for the schedules that
    # keep as many (zero bubble; "auto" chooses among those) and for the chunks of an
    # interleaved pipeline searched as p·v stages.
    dp_schedule = _dp_schedule(options.schedule)
    errors: dict[int, ValueError] = {}
    allowed, remat = None, options.remat
    if scan_length is not None:
        allowed = _even_shares(scan_length, options.num_stages or cluster.num_devices)
        if options.schedule == "interleaved_1f1b":
            raise ValueError(
                "schedule='interleaved_1f1b' is not supported yet for a scanned layer stack "
                "cut into pipeline stages; use schedule='1f1b', 'zero_bubble' or 'auto'"
            )

    # count -> (its graph, layers, layer cost table)
    traced: dict[int, tuple] = {m: (g, None, None) for m, g in (pretraced or {}).items()}

    def search(num_micro: int, reference, keep_layouts: bool):
        """(the count's candidates, its layer cost table or None); a count without a plan
        gives no candidates and its error in `errors`. A count searched before on priced
        layouts is searched again on its own table, less the priced costs."""
        if interleaved and num_micro % options.num_stages:
            # Interleaved 1F1B runs microbatches in rounds of the device groups.
            errors[num_micro] = ValueError(
                f"schedule='interleaved_1f1b' runs microbatches in rounds of the "
                f"{options.num_stages} device groups; {num_micro} microbatches is not a "
                f"multiple of {options.num_stages}: pass num_microbatches as one"
            )
            return [], None
        start = time.perf_counter()
        mb_graph, layers, table = traced.get(num_micro, (None, None, None))
        if mb_graph is None:
            mb_graph = _trace_microbatch(
                fn, args, options, num_micro, num_auto_layers,
                None if scan_length is None else per_iteration(scan_length),
            )
        timings["trace"] = timings.get("trace", 0.0) + time.perf_counter() - start
        start = time.perf_counter()
        try:
            if layers is None:
                layers = assign_layers(mb_graph)
            if scan_length is not None and layers.num_layers != scan_length + 2:
                raise _NotALayerStack()
            tied = tied_state(mb_graph, options.donate_argnums)
            if table is None:
                table = layer_cost_table(mb_graph, layers, dp_cluster, num_micro,
                                         dp_schedule, single, tied, reference=reference,
                                         keep_layouts=keep_layouts)
                if reference is not None:
                    traced[num_micro] = (mb_graph, layers, table)
            else:
                table.forget_priced()
            stage_dp = functools.partial(
                choose_stages, mb_graph, layers, dp_cluster, num_micro, dp_schedule,
                single, tied, num_stages=num_stages, submeshes=submeshes,
                logical_shapes=options.logical_shapes, remat=remat,
            )
            choice = stage_dp(allowed=allowed, table=table)
            if interleaved:
                choice = _fold(choice, options.num_stages, cluster.num_devices)
            if scan_length is not None:
                choice = _one_layout(choice, scan_length, options, cluster, num_micro,
                                     functools.partial(stage_dp, table=table))
        except ValueError as err:
            errors[num_micro] = err
            log.info("%d microbatch(es): no plan (%s)", num_micro, str(err).split(";")[0])
            return [], table
        finally:
            timings["stage_dp_and_ilps"] = (
                timings.get("stage_dp_and_ilps", 0.0) + time.perf_counter() - start
            )
        for name, value in choice.timings.items():  # the search's parts, summed over counts
            timings[name] = timings.get(name, 0) + value
        schedule, latency = _schedule_for(choice, num_micro, options, cluster)
        log.info("%d microbatch(es): %d stage(s), predicted %.4g s%s%s",
                 num_micro, len(choice.stage_layers), latency,
                 _stitch_note(choice, num_micro, options, cluster, latency),
                 "" if not choice.timings.get("layer costs priced") else
                 f" ({choice.timings['layer costs priced']} layer costs from the layouts of "
                 f"the {reference.num_microbatches}-microbatch search, priced)")
        found = [_Candidate(choice, mb_graph, num_micro, schedule, latency)]
        if options.schedule == "auto" and scan_length is None:
            start = time.perf_counter()
            found += _interleaved_candidates(
                mb_graph, layers, cluster, num_micro, options, len(choice.stage_layers),
                reference,
            )
            timings["stage_dp_and_ilps"] += time.perf_counter() - start
        return found, table

    counts = options.microbatch_counts(rows)
    share = SHARE_LAYOUTS and len(counts) > 1
    found: dict[int, list[_Candidate]] = {}
    full: set[int] = set()  # counts whose candidates priced no other count's layout
    reference = None
    for num_micro in _reference_first(counts, rows, cluster) if share else counts:
        found[num_micro], table = search(num_micro, reference,
                                         keep_layouts=share and reference is None)
        if reference is None:
            reference = table if share else None
        if not any(c.choice.timings.get("layer costs priced") for c in found[num_micro]):
            full.add(num_micro)
    while True:
        candidates = [c for n in counts for c in found[n]]
        if not candidates:
            unsearched = [n for n in counts if n not in full]
            if not unsearched:
                raise errors[max(errors)]  # the largest count's, as searched last
            pick = unsearched[0]  # no priced plan fits: search the counts in full
        else:
            pick = _pick(candidates).num_microbatches
            if pick in full:
                return candidates
        log.info("%d microbatch(es): searching its own layer layouts (the priced plan of "
                 "another count's layouts %s)", pick,
                 "is the fastest" if candidates else "did not fit")
        errors.pop(pick, None)
        found[pick], _ = search(pick, None, keep_layouts=False)
        full.add(pick)


def _reference_first(counts: list[int], rows: int | None, cluster) -> list[int]:
    """The counts in the order `_stage_choices` searches them: first the one whose layer
    ILPs the others price, then the rest, largest first.

    The reference is the largest count whose microbatch rows divide over one host's
    devices, where the layouts differ most (tensor against data parallelism over the
    fast links): no layout inside a host that a count of larger microbatches could take is
    ruled out there for want of rows. A smaller microbatch leaves only tensor-parallel
    layouts, which price poorly on a large one: the demo's 2-row microbatches priced its
    16-row one at 1.7x its own search. Without such a count, the count of the largest
    microbatch. (A count of smaller microbatches than the reference's falls back to its
    own ILP wherever a reference layout does not divide its rows.)"""
    per_host = cluster.devices_per_host
    whole = [n for n in counts if rows is None or (rows // n) % per_host == 0]
    first = max(whole) if whole else min(counts)
    return [first, *sorted((n for n in counts if n != first), reverse=True)]


SHARE_LAYOUTS = True
"""With several microbatch counts, solve the layer ILPs of one count and price its layouts
for the others (`_stage_choices`); False searches every count in full (to compare)."""


def _dp_schedule(schedule: str) -> str:
    """The schedule whose activations in flight the stage DP's memory model counts:
    1F1B's for the schedules that keep as many (zero bubble; "auto" chooses among those)
    and for the chunks of an interleaved pipeline searched as p·v stages."""
    return "1f1b" if schedule in ("auto", "zero_bubble", "interleaved_1f1b") else schedule


def _stage_times(choice: PipelineChoice) -> list[float]:
    """Seconds per microbatch of each chosen stage as its plan predicts it
    (`Stage.time_per_microbatch`): the stitched sharding plan's cost, recompute and the
    transfer into the stage. The stage DP adds up its layers' costs instead; the stitched
    plan adds what joining them costs (a value resharded where one layer hands it to the
    next in another layout). Launching the stage's programs is left out: it depends on the
    schedule, and `_schedule_for` adds it per schedule (`pipelined_step_time`, as
    `Plan.predicted_step_time` does)."""
    transfer = choice.stage_transfer or (0.0,) * len(choice.stage_plans)
    return [sp.cost.total + r + t for sp, r, t in
            zip(choice.stage_plans, choice.stage_recompute, transfer)]


def _stage_dp_times(choice: PipelineChoice) -> list[float]:
    """Seconds per microbatch of each stage as the stage DP added them up (its layers'
    costs), launching its programs left out as in `_stage_times`."""
    dispatch = choice.stage_dispatch or (0.0,) * len(choice.stage_plans)
    return [c.latency - d for c, d in zip(choice.dp.stage_costs, dispatch)]


def _stitch_note(choice: PipelineChoice, num_micro: int, options, cluster,
                 latency: float) -> str:
    """Where the plan's predicted time differs from the stage DP's: says by how much."""
    _, dp_latency = _schedule_for(choice, num_micro, options, cluster,
                                  _stage_dp_times(choice))
    if abs(latency - dp_latency) <= 1e-9 * max(latency, 1e-30):
        return ""
    return (f" (the stage DP's sum of layer costs {dp_latency:.4g} s; joining the layers' "
            f"plans and the stage boundaries {latency - dp_latency:+.4g} s)")


def _schedule_for(choice: PipelineChoice, num_micro: int, options, cluster,
                  times: list[float] | None = None) -> tuple[Schedule, float]:
    """The schedule the plan runs and its predicted step time (`pipelined_step_time` of
    the stages' `times`, by default `_stage_times`, with each schedule's cost of launching
    the stages' programs and the stages' split into forward, input-gradient and
    weight-gradient passes, `phase_shares`: what `Plan.predicted_step_time` computes):
    the option's, or with "auto" the fastest of 1F1B and zero bubble (the same activations
    in flight, so both fit wherever the stage DP's 1F1B plan fits; ties go to 1F1B);
    "auto" weighs interleaving too, as candidates of their own (`_interleaved_candidates`)."""
    times = _stage_times(choice) if times is None else times
    shares = phase_shares(choice, cluster)
    shape = {"group_devices": [len(sp.mesh.device_ids) for sp in choice.stage_plans],
             "returned_bytes": [c.memory_parts.gradients if c.memory_parts else 0.0
                                for c in choice.dp.stage_costs]}
    if options.schedule == "interleaved_1f1b":
        groups = len(times) // options.virtual_stages
        return "interleaved_1f1b", pipelined_step_time(
            times, cluster, num_micro, "interleaved_1f1b", groups, shares, **shape
        )
    names = ("1f1b", "zero_bubble") if options.schedule == "auto" else (options.schedule,)
    predicted = [(pipelined_step_time(times, cluster, num_micro, n, phase_shares=shares,
                                      **shape), n)
                 for n in reversed(names)]
    if len(predicted) > 1 and len(times) > 1:
        log.info("%d microbatch(es), %d stage(s): %s predicted (F/B/W shares %s)", num_micro,
                 len(times), ", ".join(f"{n} {t:.4g} s" for t, n in predicted), shares)
    latency, name = min(predicted)
    return name, latency


def phase_shares(choice: PipelineChoice, cluster) -> tuple[float, float, float]:
    """The chosen stages' forward, input-gradient and weight-gradient shares of their
    time (`phase_times`, the cost model's roofline per node), rounded to 6 digits so that
    plans save the same on every machine; a third each when the graph times nothing."""
    times = phase_times(choice.partition, cluster)
    total = sum(times)
    if total <= 0:
        return DEFAULT_PHASE_SHARES
    return tuple(round(t / total, 6) for t in times)


AUTO_VIRTUAL_STAGES = (2, 4)
"""The virtual stages per device group that `schedule="auto"` weighs for interleaved 1F1B
(Megatron-LM's runs use 2 to 4 chunks per device; each doubling halves the bubble again
and doubles the stage-boundary transfers)."""


def _interleaved_candidates(mb_graph, layers, cluster, num_micro, options,
                            num_groups, reference=None) -> list[_Candidate]:
    """With `schedule="auto"`: interleaved 1F1B on the `num_groups` device groups the
    1F1B search chose (or `num_stages`), one candidate per v of `AUTO_VIRTUAL_STAGES`
    that fits, each planned by the stage DP as interleaving is (p·v stages, so each
    boundary's transfer is charged; a 1/v share of the memory budget per chunk) and timed
    by `pipeline_latency` with its bubble. `_pick` then takes the fastest of these and
    the 1F1B / zero-bubble candidates by predicted step time. `reference`: a layer cost
    table whose layouts the DP prices instead of solving ILPs (`_stage_choices`)."""
    p = options.num_stages or num_groups
    found = []
    for v in AUTO_VIRTUAL_STAGES:
        if p < 2 or num_micro % p or p * v > layers.num_layers:
            continue
        chosen = dataclasses.replace(options, schedule="interleaved_1f1b", virtual_stages=v,
                                     num_stages=p)
        try:
            dp_cluster, single, num_stages, submeshes = _interleaved_search(
                cluster, shard_options(chosen, cluster), chosen
            )
            tied = tied_state(mb_graph, options.donate_argnums)
            table = None if reference is None else layer_cost_table(
                mb_graph, layers, dp_cluster, num_micro, "1f1b", single, tied,
                reference=reference,
            )
            choice = choose_stages(
                mb_graph, layers, dp_cluster, num_micro, "1f1b", single, tied,
                num_stages=num_stages, submeshes=submeshes,
                logical_shapes=options.logical_shapes, remat=options.remat, table=table,
            )
            choice = _fold(choice, p, cluster.num_devices)
        except ValueError as err:
            log.info("%d microbatch(es), interleaved v=%d: no plan (%s)", num_micro, v,
                     str(err).split(";")[0])
            continue
        schedule, latency = _schedule_for(choice, num_micro, chosen, cluster)
        log.info("%d microbatch(es), interleaved v=%d: predicted %.4g s", num_micro, v, latency)
        found.append(_Candidate(choice, mb_graph, num_micro, schedule, latency))
    return found


def _interleaved_search(cluster, single, options):
    """The stage DP's problem for interleaved 1F1B: p·v stages of equal submeshes on a
    cluster v times as large, each stage with a 1/v share of the memory budget (a device
    holds v of them); `_fold` then puts stage s on the devices of stage s mod p."""
    v, p = options.virtual_stages, options.num_stages
    if p is None:
        raise ValueError(
            "schedule='interleaved_1f1b' with virtual_stages needs num_stages=p, the "
            "pipeline's device groups (the plan has p * virtual_stages stages)"
        )
    per_group, rest = divmod(cluster.num_devices, p)
    per_host = cluster.devices_per_host
    if rest or (per_group > per_host and per_group % per_host):
        raise ValueError(
            f"num_stages={p} device groups cannot split the {cluster.num_devices} devices "
            f"evenly into whole hosts or parts of one; use a num_stages dividing "
            f"{cluster.num_devices}"
        )
    shape = (1, per_group) if per_group <= per_host else (per_group // per_host, per_host)
    virtual = dataclasses.replace(cluster, num_hosts=cluster.num_hosts * v)
    single = dataclasses.replace(single, memory_budget=single.memory_budget / v)
    return virtual, single, p * v, [SubmeshShape(*shape)]


def _fold(choice: PipelineChoice, num_groups: int, num_devices: int) -> PipelineChoice:
    """Stage s of the p·v stages the DP placed on a v times larger cluster, moved to the
    devices of stage s mod p."""
    groups = choice.device_ids[:num_groups]
    assert sorted(d for ids in groups for d in ids) == list(range(num_devices)), (
        f"the first {num_groups} stages must cover the devices once, got {groups}"
    )
    plans = tuple(
        dataclasses.replace(
            sp, mesh=dataclasses.replace(sp.mesh, device_ids=groups[s % num_groups])
        )
        for s, sp in enumerate(choice.stage_plans)
    )
    device_ids = tuple(groups[s % num_groups] for s in range(len(plans)))
    return dataclasses.replace(choice, stage_plans=plans, device_ids=device_ids)


def _pick_regrouped(candidates, fn, args, cluster, options, scan_length):
    """For a scanned stack: every candidate re-planned on the stack cut back into scans
    (`_regroup`) and timed as that plan runs, then `_pick`. The stage plans stitched on the
    step with the stack split into iterations are not what runs, and their time can be far
    off (llama-8B on one DGX H100: 272 s stitched, 45 s regrouped), so candidates are
    compared after regrouping. **Returns:** (the candidate, its scan ranges)."""
    ranges_of = {}
    regrouped = []
    for candidate in candidates:
        again, ranges = _regroup(candidate, fn, args, cluster, options, scan_length)
        schedule, latency = _schedule_for(again.choice, again.num_microbatches, options,
                                          cluster)
        again = dataclasses.replace(again, schedule=schedule, latency=latency)
        log.info("%d microbatch(es), the stack cut back into scans: predicted %.4g s",
                 again.num_microbatches, latency)
        ranges_of[id(again)] = ranges
        regrouped.append(again)
    best = _pick(regrouped)
    return best, ranges_of[id(best)]


def _pick(candidates: list[_Candidate]) -> _Candidate:
    """The fastest candidate; when it is one stage and one microbatch also gives one stage,
    that one (no pipeline, so no microbatches either: the whole batch at once). A number of
    microbatches the user fixed is the only candidate, so one stage keeps them (gradient
    accumulation, as asked)."""
    best = min(candidates, key=lambda c: c.latency)  # first of equals: fewer microbatches
    single = next((c for c in candidates if c.num_microbatches == 1), None)
    if (len(best.choice.stage_layers) == 1 and best.num_microbatches > 1
            and single is not None and len(single.choice.stage_layers) == 1):
        return single
    return best


def _pipeline_plan(best: _Candidate, cluster, options, num_auto_layers, timings,
                   scan_ranges=()) -> Plan:
    choice = best.choice
    stages = tuple(
        Stage(layers, sp, remat if any(r != "none" for r in remat) else (), seconds,
              cost.memory, transfer, memory_parts=cost.memory_parts)
        for layers, sp, remat, seconds, cost, transfer in zip(
            choice.stage_layers, choice.stage_plans, choice.stage_remat,
            choice.stage_recompute, choice.dp.stage_costs,
            choice.stage_transfer or (0.0,) * len(choice.stage_plans),
        )
    )
    warnings = tuple(dict.fromkeys(w for sp in choice.stage_plans for w in sp.warnings))
    return Plan(
        method="auto",
        cluster=cluster.to_json(),
        stages=stages,
        inputs=input_infos(best.graph, lambda s: choice.stage_plans[s], choice.partition.home),
        graph_fingerprint=graph_fingerprint(best.graph),
        num_microbatches=best.num_microbatches,
        schedule=best.schedule,
        warnings=warnings,
        timings=dict(timings),
        auto_layers=num_auto_layers,
        runtime="pipeline",
        arg_names=best.graph.arg_names,
        scan_ranges=tuple(scan_ranges),
        phase_shares=phase_shares(choice, cluster),
    )
