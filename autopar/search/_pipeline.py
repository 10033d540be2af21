"""The pipeline search (method "auto"): stages, their meshes and the microbatch count.

In: the step, its arguments, the graph traced at full batch, a cluster and `PlanOptions`.
Out: a `Plan` (runtime "pipeline") and the graph traced at one microbatch, which it runs;
or the one-mesh plan when the step has no gradient boundary or the cluster one device.

One flow: `search_plan` resolves the options against the cluster once, into a
`_PipelineSearch` that lives for this search alone (its traced graphs, layer cost tables and
errors are dropped with it). For each candidate microbatch count it traces one microbatch
(`_trace_microbatch`) and runs the stage DP (`inter.choose_stages`), which plans each
layer's meshes with the intra-operator planner; it picks the fastest (`schedules.pick`)
and assembles the `Plan` (`_PipelineSearch.plan_of`). Nothing downstream calls back into
the search.

A model whose layers are a scan over stacked parameters (and that has no layer marks) is
traced with the scan run one iteration per sub-scan (`inter.scan_layers`), its stacked
leaves cut into one piece per iteration (`graph.split_stacked`): the DP sees L identical
layers between the embeddings and the head, planned by one ILP per mesh, and may cut the
stack anywhere a stage gets an equal share of it (`_stack.even_shares`). The chosen cut is
then traced again with one sub-scan per stage (`_PipelineSearch.regroup`), so that each
stage holds, runs and updates its slice ``w[a:b]`` of every stacked leaf; the plan records
the ranges (`Plan.scan_ranges`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import time
import warnings
from dataclasses import dataclass

from autopar._progress import Countdown
from autopar.choices import Schedule
from autopar.graph import ANNOTATION_PRIMITIVES, OpGraph, split_stacked, tied_state, trace
from autopar.inter import (
    PipelineChoice,
    StageOptions,
    SubmeshShape,
    assign_layers,
    auto_layers,
    choose_stages,
    layer_cost_table,
    layer_scan,
    plan_chosen_stages,
    scan_layers,
)
from autopar.inter._choose import NoStageHoldsLayer
from autopar.inter._stage_dp import NoPlanOfCount
from autopar.inter._stitch import fingerprint_of
from autopar.inter.passes import per_iteration
from autopar.intra._context import ContextParallelError
from autopar.plan import Plan, Stage, input_infos
from autopar.search._microbatch import batch_size, microbatch_args
from autopar.search._options import PlanOptions
from autopar.search._pins import resolve_pins
from autopar.search._schedules import (
    AUTO_VIRTUAL_STAGES,
    dp_schedule,
    fold,
    interleaved_search,
    phase_shares,
    pick,
    schedule_for,
    stitch_note,
)
from autopar.search._single_mesh import plan_one_mesh, shard_options
from autopar.search._stack import (
    even_shares,
    one_layout,
    regrouped_layers,
    stack_ranges,
)

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
                graph_microbatches: int = 1, recorder=None, traces=None):
    """The plan for `fn(*args)` and the graph it runs (see the module docstring).

    `graph_microbatches`: `graph` is one of that many microbatches of the step rather
    than the whole step (a search of that fixed count traced it so; `autopar.search._api`).
    `recorder`: told every candidate the pipeline search priced (`autopar.search.search`);
    `traces`: the step traced before at microbatch sizes, by count (used when it is marked).
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
    if users_shardings(graph, options) and options.share_layouts:
        # The user's shardings hold in every layer ILP (pins mapped onto each stage's
        # mesh by `LayerCostTable(fixed=...)`); another count's layouts, priced, may not.
        options = dataclasses.replace(options, share_layouts=False)
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
    search = _PipelineSearch(fn, args, cluster, options, timings)
    search.recorder = recorder
    search.shared_traces = traces or {}
    plan, run_graph = search.run(graph, graph_microbatches)
    if options.mesh_shape is not None:
        warning = MESH_SHAPE_WARNING.format(options.mesh_shape)
        plan = dataclasses.replace(plan, warnings=(*plan.warnings, warning))
    return plan, run_graph


def _largest(unheld: list[str], shown: int = 2) -> str:
    """The distinct reasons of `LayerCostTable.pin_errors`, those of the largest meshes
    first (a one-device mesh's reason says least), at most `shown` of them."""
    distinct = list(dict.fromkeys(unheld))
    distinct.sort(key=lambda line: -math.prod(
        int(n) for n in re.findall(r"\d+", line.split(":")[0])))
    more = f"; and {len(distinct) - shown} more" if len(distinct) > shown else ""
    return "; ".join(distinct[:shown]) + more


def users_shardings(graph: OpGraph, options: PlanOptions) -> str:
    """What of the user's own shardings the plan must hold ("" for nothing): pins, and
    the step's sharding annotations unless `annotations="ignore"`."""
    held = []
    if options.constraints is not None:
        held.append("pins (constraints=)")
    if options.annotations != "ignore" and any(
            n.primitive in ANNOTATION_PRIMITIVES for n in graph.nodes):
        held.append(f"the step's sharding annotations (annotations={options.annotations!r})")
    return " and ".join(held)


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


def _stage_choices(fn, args, cluster, options, rows, num_auto_layers, timings,
                   scan_length=None, pretraced=None) -> list[_Candidate]:
    """The stage DP's candidates for each microbatch count that has a plan (see
    `_PipelineSearch.stage_choices`), in a search of their own."""
    search = _PipelineSearch(fn, args, cluster, options, timings)
    search.num_auto_layers, search.scan_length = num_auto_layers, scan_length
    return search.stage_choices(rows, pretraced)


def _reference_first(counts: list[int], rows: int | None, cluster) -> list[int]:
    """The counts in the order `stage_choices` searches them: first the one whose layer
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


class _PipelineSearch:
    """One pipeline search: the step, its cluster and options resolved once, and what the
    search keeps while it runs (graphs traced per microbatch count, their layer cost
    tables, each count's error). Made by `search_plan`, dropped when it returns."""

    def __init__(self, fn, args, cluster, options: PlanOptions, timings: dict):
        self.fn, self.args, self.cluster, self.options = fn, args, cluster, options
        self.timings = timings
        self.single = shard_options(options, cluster)  # the stage plans' ILP options
        # The stage DP's problem: interleaved 1F1B is searched as p·v stages on a cluster
        # v times as large (`interleaved_search`), each stage with 1/v of the budget.
        self.interleaved = options.schedule == "interleaved_1f1b" and options.virtual_stages > 1
        dp_single, num_stages, submeshes = self.single, options.num_stages, None
        if options.submeshes is not None:
            submeshes = [SubmeshShape(h, d) for h, d in options.submeshes]
        self.dp_cluster = cluster
        if self.interleaved:
            self.dp_cluster, dp_single, num_stages, submeshes = interleaved_search(
                cluster, self.single, options.virtual_stages, options.num_stages)
        # The stage DP's options. Its memory model: 1F1B's activations in flight for the
        # schedules that keep as many (zero bubble; "auto" chooses among those) and for the
        # chunks of an interleaved pipeline searched as p·v stages (`dp_schedule`).
        self.stage_options = StageOptions(
            shard=dp_single, schedule=dp_schedule(options.schedule), num_stages=num_stages,
            submeshes=submeshes, logical_shapes=options.logical_shapes, remat=options.remat,
            memory_levels=options.memory_levels, prune_by_bound=options.prune_by_bound,
            lower_bounds=options.lower_bounds, every_mesh_shape=options.every_mesh_shape,
        )
        self.num_auto_layers: int | None = None
        self.scan_length: int | None = None
        self.errors: dict[int, ValueError] = {}
        self.table = None  # the layer cost table of the count being searched
        # count -> (its graph, layers, layer cost table), kept for a second search of it
        self.traced: dict[int, tuple] = {}
        self.recorder = None  # told the candidates (`search_plan`)
        # count -> {stage count: PipelineChoice}, the stage DP's best per stage count, kept
        # for the recorder (`autopar.space`) when it asks for them
        self.stage_counts: dict[int, dict] = {}
        self.shared_traces: dict = {}  # graphs traced before, by count (`search_plan`)

    # -- the flow ---------------------------------------------------------------------

    def run(self, graph: OpGraph, graph_microbatches: int) -> tuple[Plan, OpGraph]:
        """The plan and the graph it runs, from the step's `graph` (one of
        `graph_microbatches` microbatches of the step, or the whole step)."""
        options = self.options
        has_marks = any(n.primitive == "layer_boundary" for n in graph.nodes)
        stack = None if has_marks else layer_scan(graph)
        self.scan_length = None if stack is None else stack.params["length"]
        self.num_auto_layers = None if has_marks or stack is not None else options.num_layers
        rows = batch_size(graph)
        pretraced = {}
        if graph_microbatches > 1:
            rows = None if rows is None else rows * graph_microbatches
            if has_marks:  # `_trace_microbatch`'s graph (no automatic marks), as it is
                pretraced[graph_microbatches] = graph
        if has_marks:  # traced by a caller as `_trace_microbatch` does (no automatic marks)
            for count, traced in self.shared_traces.items():
                if isinstance(count, int):  # (count, cp) keys trace a split sequence
                    pretraced.setdefault(count, traced)
        try:
            candidates = self.stage_choices(rows, pretraced)
        except _NotALayerStack:  # the scan is not in the loss function: layers cut as usual
            self.scan_length, self.num_auto_layers = None, options.num_layers
            self.traced.clear()
            candidates = self.stage_choices(rows)
        scan_ranges = ()
        if self.scan_length is None:
            best = pick(candidates)
        else:
            best, scan_ranges = self.pick_regrouped(candidates)
        chosen = self.plan_of(best, scan_ranges)
        if self.recorder is not None:  # the explored space (`autopar.space`)
            plans = [chosen if c is best else self.plan_of(c) for c in candidates]
            self.recorder.candidates(plans, next((i for i, c in enumerate(candidates)
                                                  if c is best), None),
                                     {m: str(err) for m, err in self.errors.items()})
            if hasattr(self.recorder, "stage_counts"):
                self.recorder.stage_counts(self.stage_count_plans())
            if hasattr(self.recorder, "stage_count_gaps"):
                self.recorder.stage_count_gaps(self.stage_count_gaps())
        return chosen, best.graph

    def stage_count_plans(self) -> list[Plan]:
        """The stage DP's best plan per stage count of each microbatch count searched (as
        the count's last search left them), each timed under this search's schedule."""
        plans = []
        for num_micro, choices in sorted(self.stage_counts.items()):
            graph = self.traced[num_micro][0]
            fingerprint = fingerprint_of(graph)  # once per graph, for all its stage counts
            for _, choice in sorted(choices.items()):
                if isinstance(choice, NoPlanOfCount):  # `stage_count_gaps`
                    continue
                schedule, latency = self.schedule_for(choice, num_micro)
                plans.append(self.plan_of(_Candidate(choice, graph, num_micro, schedule,
                                                     latency), fingerprint=fingerprint))
        return plans

    def stage_count_gaps(self) -> list[tuple[int, int, NoPlanOfCount]]:
        """(microbatch count, stage count, why) for each stage count of each microbatch
        count searched that the stage DP's table holds no plan of (`NoPlanOfCount`: pruned
        by the bound, with the least objective its plans can have, or none fits)."""
        return [(num_micro, count, why)
                for num_micro, choices in sorted(self.stage_counts.items())
                for count, why in sorted(choices.items()) if isinstance(why, NoPlanOfCount)]

    def stage_choices(self, rows: int | None, pretraced=None) -> list[_Candidate]:
        """The stage DP's choice for each microbatch count that has a plan; raises the last
        count's error when none has.

        With several counts (`num_microbatches="auto"`) the layer ILPs are solved for one
        count (`_reference_first`; when it has no plan, the next by the same rule among
        the counts left, until one has): the
        other counts' layer costs are that search's layouts
        priced on their own shapes (`LayerCostTable(reference=...)`; an ILP of their own
        where the reference has not solved that layer, shape and level or its layout does
        not apply), each the cost of a feasible plan, which a search of the count's own
        layouts would match or beat. Whichever count `pick` then takes is searched again on
        its own table less the priced costs before it is kept: a plan of priced layouts is
        never the answer. (What this can miss: a count whose own layouts would beat the
        winner though its priced ones did not.) `options.share_layouts=False` searches
        every count in full.

        `pretraced`: microbatch graphs already traced, by count, as `_trace_microbatch`
        traces them."""
        if self.scan_length is not None and self.options.schedule == "interleaved_1f1b":
            raise ValueError(
                "schedule='interleaved_1f1b' is not supported yet for a scanned layer stack "
                "cut into pipeline stages; use schedule='1f1b', 'zero_bubble' or 'auto'"
            )
        self.traced.update({m: (g, None, None) for m, g in (pretraced or {}).items()})
        counts = self.options.microbatch_counts(rows)
        share = self.options.share_layouts and len(counts) > 1
        found: dict[int, list[_Candidate]] = {}
        full: set[int] = set()  # counts whose candidates priced no other count's layout
        reference = None
        order = _reference_first(counts, rows, self.cluster) if share else counts
        progress = Countdown("microbatch counts", order)  # what is left, on the log
        left = list(order)
        while left:
            num_micro = left.pop(0)
            progress.start(num_micro, "microbatch(es)")
            found[num_micro], table = self.search_count(
                num_micro, reference, keep_layouts=share and reference is None)
            # A count refused by its memory floor took no ILP: no measure of the pace.
            progress.done(num_micro, paced=not isinstance(self.errors.get(num_micro),
                                                          NoStageHoldsLayer))
            # A count without a plan is no reference: its layouts are those of layers
            # that do not fit, and priced here they answer few costs (every count priced
            # on them is searched again, in full, when it wins). The next count is
            # searched in full and keeps its layouts for the rest instead.
            if reference is None and found[num_micro]:
                reference = table if share else None
            elif share and reference is None and left:
                # The next reference by the same rule among the counts left (where none
                # divides over a host: the largest microbatch, the likely winner, whose
                # layouts the others are priced on rather than it on theirs).
                left = _reference_first(left, rows, self.cluster)
            if not any(c.choice.timings.get("layer costs priced") for c in found[num_micro]):
                full.add(num_micro)
        return self._searched_in_full(counts, found, full, progress)

    def _searched_in_full(self, counts, found, full, progress) -> list[_Candidate]:
        """The candidates, once the count `pick` takes is one searched on its own layouts
        (searching the fastest priced count again until it is)."""
        while True:
            candidates = [c for n in counts for c in found[n]]
            if not candidates:
                unsearched = [n for n in counts if n not in full]
                if not unsearched:
                    raise self.errors[max(self.errors)]  # the largest count's, searched last
                chosen = unsearched[0]  # no priced plan fits: search the counts in full
            else:
                chosen = pick(candidates).num_microbatches
                if chosen in full:
                    return candidates
            log.info("%d microbatch(es): searching its own layer layouts (the priced plan of "
                     "another count's layouts %s)", chosen,
                     "is the fastest" if candidates else "did not fit")
            self.errors.pop(chosen, None)
            progress.again(chosen, "microbatch(es), again on its own layer layouts")
            found[chosen], _ = self.search_count(chosen, None, keep_layouts=False)
            progress.done(chosen)
            full.add(chosen)

    def search_count(self, num_micro: int, reference, keep_layouts: bool):
        """(the count's candidates, its layer cost table or None); a count without a plan
        gives no candidates and its error in `errors`. A count searched before on priced
        layouts is searched again on its own table, less the priced costs."""
        options = self.options
        if self.interleaved and num_micro % options.num_stages:
            # Interleaved 1F1B runs microbatches in rounds of the device groups.
            self.errors[num_micro] = ValueError(
                f"schedule='interleaved_1f1b' runs microbatches in rounds of the "
                f"{options.num_stages} device groups; {num_micro} microbatches is not a "
                f"multiple of {options.num_stages}: pass num_microbatches as one"
            )
            return [], None
        mb_graph = self._microbatch_graph(num_micro)
        start = time.perf_counter()
        # The count's layer cost table once made: the reference for the other counts even
        # when this count finds no plan.
        self.table = self.traced[num_micro][2]
        try:
            choice, layers, table = self._stage_dp(num_micro, mb_graph, reference,
                                                   keep_layouts)
        except ValueError as err:
            unheld = getattr(self.table, "pin_errors", None)
            if unheld and not isinstance(err, ContextParallelError):
                # The user's shardings ruled meshes out: say which and why.
                err = ValueError(
                    f"no pipeline plan of {num_micro} microbatch(es) holds the user's "
                    f"shardings: no stage mesh left could take them ({_largest(unheld)}). "
                    "Fix the pin or its mesh, or plan with method='shard' on one mesh of its "
                    f"shape. ({err})")
            blocked = getattr(self.table, "context_errors", None)
            if blocked and not isinstance(err, ContextParallelError):
                # The forced CP ruled layers out on some meshes: name the tensor first.
                err = ContextParallelError(f"{blocked[0]}. No pipeline plan without those "
                                           f"meshes: {err}")
            self.errors[num_micro] = err
            log.info("%d microbatch(es): no plan (%s)", num_micro, str(err).split(";")[0])
            return [], self.table
        finally:
            self._add_time("stage_dp_and_ilps", time.perf_counter() - start)
        for name, value in choice.timings.items():  # the search's parts, summed over counts
            self.timings[name] = self.timings.get(name, 0) + value
        schedule, latency = self.schedule_for(choice, num_micro)
        log.info("%d microbatch(es): %d stage(s), predicted %.4g s%s%s",
                 num_micro, len(choice.stage_layers), latency,
                 stitch_note(choice, num_micro, options.schedule, options.virtual_stages,
                             self.cluster, latency),
                 "" if not choice.timings.get("layer costs priced") else
                 f" ({choice.timings['layer costs priced']} layer costs from the layouts of "
                 f"the {reference.num_microbatches}-microbatch search, priced)")
        found = [_Candidate(choice, mb_graph, num_micro, schedule, latency)]
        if options.schedule == "auto" and self.scan_length is None \
                and not users_shardings(mb_graph, options):  # its tables hold no pins
            start = time.perf_counter()
            found += self.interleaved_candidates(mb_graph, layers, num_micro,
                                                 len(choice.stage_layers), reference)
            self._add_time("stage_dp_and_ilps", time.perf_counter() - start)
        return found, table

    def _microbatch_graph(self, num_micro: int) -> OpGraph:
        """The step traced at one of `num_micro` microbatches (once per count)."""
        start = time.perf_counter()
        mb_graph = self.traced.setdefault(num_micro, (None, None, None))[0]
        if mb_graph is None:
            mb_graph = _trace_microbatch(
                self.fn, self.args, self.options, num_micro, self.num_auto_layers,
                None if self.scan_length is None else per_iteration(self.scan_length),
            )
            self.traced[num_micro] = (mb_graph, None, None)
        self._add_time("trace", time.perf_counter() - start)
        return mb_graph

    def _stage_dp(self, num_micro: int, mb_graph: OpGraph, reference, keep_layouts: bool):
        """The stage DP's choice for one count: (choice, layers, layer cost table)."""
        options = self.options
        _, layers, table = self.traced[num_micro]
        if layers is None:
            layers = assign_layers(mb_graph)
        if self.scan_length is not None and layers.num_layers != self.scan_length + 2:
            raise _NotALayerStack()
        tied = tied_state(mb_graph, options.donate_argnums)
        if table is None:
            table = layer_cost_table(mb_graph, layers, self.dp_cluster, num_micro,
                                     self.stage_options, tied, reference=reference,
                                     keep_layouts=keep_layouts,
                                     fixed=resolve_pins(mb_graph, options.constraints))
            if reference is not None:
                self.traced[num_micro] = (mb_graph, layers, table)
        else:
            table.forget_priced()
        self.table = table
        stage_dp = functools.partial(choose_stages, mb_graph, layers, self.dp_cluster,
                                     num_micro, tied, self.stage_options, table=table)
        allowed = None
        if self.scan_length is not None:
            allowed = even_shares(self.scan_length, options.num_stages or self.cluster.num_devices)
        per_count = None  # the best plan per stage count, for the explored space's rows
        if self.scan_length is None and not self.interleaved \
                and hasattr(self.recorder, "stage_counts"):
            per_count = self.stage_counts[num_micro] = {}
        choice = stage_dp(allowed=allowed, stage_counts=per_count)
        if self.interleaved:
            choice = fold(choice, options.num_stages, self.cluster.num_devices)
        if self.scan_length is not None:
            choice = self.one_layout(choice, num_micro, stage_dp)
        return choice, layers, table

    def _add_time(self, name: str, seconds: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + seconds

    def schedule_for(self, choice: PipelineChoice, num_micro: int,
                     options: PlanOptions | None = None) -> tuple[Schedule, float]:
        """The schedule `choice` runs under the options (this search's by default) and its
        predicted step time (`schedules.schedule_for`)."""
        options = options or self.options
        return schedule_for(choice, num_micro, options.schedule, options.virtual_stages,
                            self.cluster)

    # -- interleaving ----------------------------------------------------------------

    def interleaved_candidates(self, mb_graph, layers, num_micro, num_groups,
                               reference=None) -> list[_Candidate]:
        """With `schedule="auto"`: interleaved 1F1B on the `num_groups` device groups the
        1F1B search chose (or `num_stages`), one candidate per v of `AUTO_VIRTUAL_STAGES`
        that fits, each planned by the stage DP as interleaving is (p·v stages, so each
        boundary's transfer is charged; a 1/v share of the memory budget per chunk) and
        timed by `pipeline_latency` with its bubble. `pick` then takes the fastest of these
        and the 1F1B / zero-bubble candidates by predicted step time. `reference`: a layer
        cost table whose layouts the DP prices instead of solving ILPs (`stage_choices`)."""
        options, cluster = self.options, self.cluster
        p = options.num_stages or num_groups
        found = []
        for v in AUTO_VIRTUAL_STAGES:
            if p < 2 or num_micro % p or p * v > layers.num_layers:
                continue
            chosen = dataclasses.replace(options, schedule="interleaved_1f1b",
                                         virtual_stages=v, num_stages=p)
            try:
                dp_cluster, single, num_stages, submeshes = interleaved_search(
                    cluster, self.single, v, p)
                stage_options = dataclasses.replace(
                    self.stage_options, shard=single, schedule="1f1b", num_stages=num_stages,
                    submeshes=submeshes,
                )
                tied = tied_state(mb_graph, options.donate_argnums)
                table = None if reference is None else layer_cost_table(
                    mb_graph, layers, dp_cluster, num_micro, stage_options, tied,
                    reference=reference,
                )
                choice = choose_stages(mb_graph, layers, dp_cluster, num_micro, tied,
                                       stage_options, table=table)
                choice = fold(choice, p, cluster.num_devices)
            except ValueError as err:
                log.info("%d microbatch(es), interleaved v=%d: no plan (%s)", num_micro, v,
                         str(err).split(";")[0])
                continue
            schedule, latency = self.schedule_for(choice, num_micro, chosen)
            log.info("%d microbatch(es), interleaved v=%d: predicted %.4g s", num_micro, v,
                     latency)
            found.append(_Candidate(choice, mb_graph, num_micro, schedule, latency))
        return found

    # -- a scanned layer stack --------------------------------------------------------

    def one_layout(self, choice, num_micro: int, rerun):
        """`_stack.one_layout` of `choice`, each re-run timed under this search's schedule."""
        max_stages = self.options.num_stages or self.cluster.num_devices
        return one_layout(choice, self.scan_length, max_stages, num_micro, rerun,
                          lambda again: self.schedule_for(again, num_micro)[1])

    def regroup(self, best: _Candidate):
        """The candidate traced with one sub-scan per stage (see the module docstring), and
        the iteration ranges of those sub-scans."""
        choice, length = best.choice, self.scan_length
        ranges, _ = stack_ranges(choice, length)
        stage_layers, stage_remat, piece_remat = regrouped_layers(choice, ranges, length)
        graph = _trace_microbatch(self.fn, self.args, self.options, best.num_microbatches,
                                  None, ranges, piece_remat)
        stage_options = dataclasses.replace(self.stage_options, shard=self.single,
                                            schedule=dp_schedule(best.schedule))
        regrouped = plan_chosen_stages(
            graph, assign_layers(graph), self.cluster, best.num_microbatches,
            tied_state(graph, self.options.donate_argnums), stage_options, stage_layers,
            choice, stage_remat=stage_remat,
        )
        return dataclasses.replace(best, choice=regrouped, graph=graph), ranges

    def pick_regrouped(self, candidates):
        """For a scanned stack: every candidate re-planned on the stack cut back into scans
        (`regroup`) and timed as that plan runs, then `pick`. The stage plans stitched on
        the step with the stack split into iterations are not what runs, and their time can
        be far off (llama-8B on one DGX H100: 272 s stitched, 45 s regrouped), so
        candidates are compared after regrouping. **Returns:** (the candidate, its scan
        ranges)."""
        ranges_of = {}
        regrouped = []
        for candidate in candidates:
            again, ranges = self.regroup(candidate)
            schedule, latency = self.schedule_for(again.choice, again.num_microbatches)
            again = dataclasses.replace(again, schedule=schedule, latency=latency)
            log.info("%d microbatch(es), the stack cut back into scans: predicted %.4g s",
                     again.num_microbatches, latency)
            ranges_of[id(again)] = ranges
            regrouped.append(again)
        best = pick(regrouped)
        return best, ranges_of[id(best)]

    # -- the plan --------------------------------------------------------------------

    def plan_of(self, best: _Candidate, scan_ranges=(), fingerprint: str | None = None
                ) -> Plan:
        """The `Plan` of the chosen candidate (`fingerprint`: its graph's, if known)."""
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
            cluster=self.cluster.to_json(),
            stages=stages,
            inputs=input_infos(best.graph, lambda s: choice.stage_plans[s],
                               choice.partition.home),
            graph_fingerprint=fingerprint or fingerprint_of(best.graph),
            num_microbatches=best.num_microbatches,
            schedule=best.schedule,
            warnings=warnings,
            timings=dict(self.timings),
            auto_layers=self.num_auto_layers,
            runtime="pipeline",
            arg_names=best.graph.arg_names,
            scan_ranges=tuple(scan_ranges),
            phase_shares=phase_shares(choice, self.cluster),
        )
