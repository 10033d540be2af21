"""`autopar.plan`: trace a train step and search for a plan, without running anything."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from autopar._memo import search_scoped
from autopar._progress import phase
from autopar.graph import OpGraph, split_stacked, trace, without_annotations
from autopar.graph._collector import fewer_collections, heap_frozen
from autopar.inter import auto_layers, scan_layers
from autopar.intra import graph_fingerprint
from autopar.intra._pool import warm_up
from autopar.plan import Plan
from autopar.search._cache import PlanCache, cache_key, code_version
from autopar.search._feasibility import check_fits
from autopar.search._microbatch import microbatch_args
from autopar.search._microbatch_math import microbatch_change
from autopar.search._options import PlanOptions, options_from, resolve_cluster, takes_plan_options
from autopar.search._pipeline import _trace_microbatch, search_plan

log = logging.getLogger("autopar")


@takes_plan_options
def plan(fn: Callable, *args: Any, cluster: Any = None, cache: Any = None, **options: Any) -> Plan:
    """Plan `fn(*args)` on a cluster without running it (a dry run; no devices needed).

    **Arguments:**
    - `args`: arrays or `jax.ShapeDtypeStruct` pytrees, as `fn` takes them.
    - `cluster`: a `Cluster`, a profile name or path (`"dgx-a100-80g"`), or None for the
      local devices.
    - `cache`: a `PlanCache`, False for none, None for the default on-disk cache
      (``AUTOPAR_PLAN_CACHE=0`` turns it off).
    - `**options`: the `PlanOptions` (method, memory_budget, num_microbatches, schedule,
      mesh_shape, num_stages, submeshes, logical_shapes, ...), as `autoparallel` takes them.

    **Returns:** the `Plan`.

    **Example:**

    ```python
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    plan = autopar.plan(train_step, abstract_state, abstract_batch, cluster=cluster)
    print(plan.explain())
    ```
    """
    resolved = options_from("plan", options)
    result, _ = search(fn, args, resolve_cluster(cluster), resolved, cache)
    return result


@search_scoped
def search(fn: Callable, args: Sequence[Any], cluster, options: PlanOptions, cache=None,
           recorder=None, traces=None):
    """Trace and plan `fn(*args)`. Returns `(plan, graph)`, `graph` traced at the size the
    plan runs at (one microbatch for a pipelined plan, the whole batch otherwise).

    `recorder`: an object whose ``candidates(plans, chosen, errors)`` the pipeline search
    calls once with every candidate plan it priced (one per microbatch count and schedule
    it kept), the index of the one it chose, and ``{microbatch count: why no plan}``
    (`autopar.space` records the explored space so); it sees nothing on a cache hit, so
    pass ``cache=False`` with it.

    `traces`: ``{number of microbatches: the step traced at that microbatch size}`` as
    `megatron_grid_search(traces=...)` fills it: a step with `layer_boundary` marks is
    not traced again at those sizes (`autopar.space` runs the grid, then this search).

    `cache`: a `PlanCache` (None: the default on-disk cache, `False`: none). A hit skips the
    search; the key covers the traced program, the cluster, the options and autopar's code.
    """
    check_fits(fn, args, cluster, options)  # "cannot fit" in a second, not after a search
    if options.method == "auto":
        warm_up()  # the ILP workers start while the step is traced
    fn = for_annotations(fn, options)
    if options.annotations == "ignore":
        traces = None  # the step traced there kept its annotations
    timings: dict[str, float] = {}
    with phase("trace", timings):
        graph, microbatches = _search_graph(fn, args, cluster, options, traces)
    if cache is None:
        cache = PlanCache(version=code_version())
    key = None
    if cache:
        key = cache_key(
            graph_fingerprint(graph), cluster.to_json(), _options_key(options),
            code_version(),
        )
        cached = cache.get(key)
        if cached is not None:  # `PlanCache.get` logged the hit
            full = graph if microbatches == 1 else None
            cached = _checked_math(fn, args, cached, options, (graph,))
            return cached, graph_for_plan(fn, args, cached, options, full)
    with phase("search", timings), heap_frozen(), fewer_collections():
        result, run_graph = search_plan(fn, args, cluster, options, graph, dict(timings),
                                        microbatches, recorder=recorder, traces=traces)
    result.timings.update({k: v for k, v in timings.items() if k not in result.timings})
    result = _with_context_warnings(result, options)
    if cache and key is not None:
        cache.put(key, result)
    return _checked_math(fn, args, result, options, (graph, run_graph)), run_graph


def _checked_math(fn, args, result: Plan, options: PlanOptions, traced=()) -> Plan:
    """`result`, warning (or, with microbatch_check="strict", refusing) when its
    microbatches change the step's math (`autopar.search._microbatch_math`; `traced`: the
    search's graphs of `fn`, reused where their shapes match)."""
    if result.num_microbatches <= 1 or options.microbatch_check == "off":
        return result
    change = microbatch_change(fn, args, options.batch_argnums, result.num_microbatches,
                               traced)
    if change is None:
        return result
    if options.microbatch_check == "strict":
        raise ValueError(change + " (microbatch_check='strict' refuses such a plan)")
    return dataclasses.replace(result, warnings=(*result.warnings, change))


def for_annotations(fn: Callable, options: PlanOptions) -> Callable:
    """`fn` as the plan sees it: without its sharding annotations under
    `annotations="ignore"` (`autopar.graph.without_annotations`), else `fn`."""
    return without_annotations(fn) if options.annotations == "ignore" else fn


def _options_key(options: PlanOptions) -> dict:
    """The options as the cache key takes them (the pins by their text)."""
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    fields["constraints"] = None if options.constraints is None else repr(options.constraints)
    return fields


def _with_context_warnings(plan, options: PlanOptions):
    """The plan with a warning for each stage a forced `context_parallel` algorithm could
    not reach (a stage on one device has no sequence to split)."""
    mode = options.context_parallel
    if mode in ("auto", "none"):
        return plan
    missed = [i for i, stage in enumerate(plan.stages)
              if stage.sharding.context_parallel.algorithm != mode]
    if not missed:
        return plan
    warning = (
        f"context_parallel={mode!r}: stage(s) {missed} run attention without it (a stage "
        "on one device has no sequence to split); give the stages more devices "
        "(num_stages, submeshes) to split every stage's sequence"
    )
    return dataclasses.replace(plan, warnings=(*plan.warnings, warning))



def _search_graph(fn, args, cluster, options: PlanOptions,
                  traces=None) -> tuple[OpGraph, int]:
    """The graph a search starts from, and how many of it make the step: the whole step
    (1), or, for a pipeline search of a fixed count m > 1 on several devices, one
    microbatch (m), which is the graph that search plans: the step is then traced once
    rather than at the whole batch and again per microbatch (half of the demo's tracing).
    Where the batch does not split into m, the whole step, whose search says so.
    `traces`: graphs traced before, by microbatch count (`search`)."""
    traces = traces or {}
    count = options.num_microbatches
    if (options.method == "auto" and isinstance(count, int) and count > 1
            and cluster.num_devices > 1):
        try:
            microbatch_args(args, options.batch_argnums, count)
        except ValueError:
            pass  # the batch does not split: the whole step's search reports it
        else:
            if count in traces and _marked(traces[count]):
                return traces[count], count
            return _trace_microbatch(fn, args, options, count, None), count
    if 1 in traces:
        return traces[1], 1
    return trace(fn, *args, batch_argnums=options.batch_argnums), 1


def _marked(graph: OpGraph) -> bool:
    return any(n.primitive == "layer_boundary" for n in graph.nodes)


def graph_for_plan(fn, args, plan: Plan, options: PlanOptions, full_graph=None) -> OpGraph:
    """The graph a plan runs: the whole step, or one microbatch of it for the pipeline."""
    if plan.runtime == "spmd" and full_graph is not None:
        return full_graph
    fn = for_annotations(fn, options)
    run_args = args
    if plan.runtime == "pipeline":
        run_args = microbatch_args(args, options.batch_argnums, plan.num_microbatches)
    if plan.scan_ranges:
        with scan_layers(plan.scan_ranges, plan.scan_remat):
            graph = trace(fn, *run_args, batch_argnums=options.batch_argnums)
        graph = split_stacked(graph, plan.scan_ranges)
    else:
        with auto_layers(plan.auto_layers):
            graph = trace(fn, *run_args, batch_argnums=options.batch_argnums)
    plan.check_graph(graph)
    return graph
