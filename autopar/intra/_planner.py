"""The intra-operator planner: an `OpGraph` and a device set in, a `ShardingPlan` out.

For each candidate logical mesh shape of the devices ((8,), (2, 4), (4, 2), ...), build
the ILP (`_problem.py`), solve it (`_ilp.py`), and keep the plan with the least predicted
step time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Mapping, Sequence

from autopar._memo import declare
from autopar.cluster import LogicalMesh, Spec, replicated
from autopar.graph import OpGraph
from autopar.intra._context import NO_CONTEXT, describe_context, sequence_length
from autopar.intra._edges import operands
from autopar.intra._ilp import (
    MemoryBudgetError,
    Solution,
    SolveStats,
    evaluate,
    footprint_total,
    least_footprint,
    peak_memory,
    solve,
    with_footprint_price,
)
from autopar.intra._options import ShardOptions
from autopar.intra._price_layout import layout_problem
from autopar.intra._problem import (
    BuiltProblem,
    Footprint,
    LayoutMismatch,
    build_problem,
    layout_choices,
)
from autopar.intra._reshard import reshard_collectives
from autopar.intra._ring_strategies import chose_ring, ring_dots
from autopar.intra._rules_annotations import AnnotationMismatch
from autopar.intra._scan import collapse_plan
from autopar.intra._sharding_plan import PredictedCost, ShardingPlan, graph_fingerprint
from autopar.intra._strategies import node_signature

log = logging.getLogger("autopar")
DEFAULT_OPTIONS = ShardOptions()
# A node replicated for lack of a sharding rule is named, with its size, in the plan's
# warnings when its results take more than this per device: a candidate for a rule.
LARGE_REPLICATED_BYTES = 1 << 20


def mesh_shapes(num_devices: int) -> list[tuple[int, ...]]:
    """Logical mesh shapes to try: (n,) and every 2-D factorisation with both sides > 1."""
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for a in range(2, num_devices):
        if num_devices % a == 0 and num_devices // a > 1:
            shapes.append((a, num_devices // a))
    return shapes


def plan_on_mesh(
    graph: OpGraph,
    cluster,
    mesh: LogicalMesh,
    options: ShardOptions = DEFAULT_OPTIONS,
    tied: Sequence[tuple[int, int]] = (),
    fixed: Mapping[int, Spec] | None = None,
    weights: Mapping[int, tuple[float, float]] | None = None,
    footprint: Footprint | None = None,
) -> ShardingPlan:
    """Solve the sharding ILP of `graph` on one logical mesh.

    `fixed` pins input variables to specs, `weights` weighs node costs, `footprint` limits
    memory held for the whole run (see `build_problem`); with a footprint the plan's stats
    give its "footprint" and the "least_footprint" any plan reaches (bytes per device).
    The same as `prepare_on_mesh`, `solve` of its problem, then `finish_on_mesh` (which a
    caller solving many ILPs side by side does itself: `autopar.intra._pool`).
    """
    prepared = prepare_on_mesh(graph, cluster, mesh, options, tied, fixed, weights, footprint)
    solution = solve(prepared.problem, **prepared.solve_args)
    plan = finish_on_mesh(prepared, solution)
    ring = exact_ring_problem(prepared, plan, fixed, weights)
    if ring is not None:
        try:
            ring_solution = solve(ring.problem, **ring.solve_args)
        except MemoryBudgetError:  # no ring within the budget on this mesh
            return plan
        if ring_solution.objective < plan.stats["objective"]:
            return finish_on_mesh(ring, ring_solution)
    return plan


def exact_ring_problem(prepared: PreparedILP, plan: ShardingPlan, fixed=None, weights=None
                       ) -> PreparedILP | None:
    """Under "auto", the ILP of `prepared`'s graph with every dot of attention on the ring
    (its exact price, `autopar.intra._ring_strategies`), to solve beside `plan` (the auto
    ILP's solution; `fixed` and `weights` as `prepared` was given them); None where it is
    not wanted or the ring cannot run. The auto ILP offers the ring only on the score
    dot, at an upper bound (mixing twins would price half a ring), so a mesh's plan is
    the cheaper of the two solutions (`plan_on_mesh`; the pipeline's layer tables alike,
    `autopar.inter._layer_table`).

    The exact ring is solved only where the sequence split already paid: the auto ILP
    chose a context-parallel split (the all-gather's layouts, or the ring's upper bound
    on its score dot). A plan that keeps attention's sequence whole found every split
    dearer than none; the ring's exact price is a split too, so it is not solved there
    (one ILP per mesh instead of two for every attention model).

    The ring's plan is wanted only when its objective is below `plan`'s, so its solve is
    given that as `cutoff` (`solve`): where its optimum is not below, the tie-break among
    its equal-cost optima is skipped (demo: its one ring ILP, 31% dearer than the auto
    plan; `python -m benchmarks planning_time --rows demo`). Callers compare the
    solution's objective before making its plan (`finish_on_mesh`, not needed for a
    loser)."""
    options, graph, mesh = prepared.options, prepared.graph, prepared.mesh
    if (options.context_parallel != "auto" or mesh.num_devices == 1
            or plan.context_parallel == NO_CONTEXT
            or not ring_dots(graph, sequence_length(graph))):
        return None
    ring_options = dataclasses.replace(options, context_parallel="ring")
    try:
        ring = prepare_on_mesh(graph, prepared.cluster, mesh, ring_options, prepared.tied,
                               fixed, weights, prepared.footprint)
    except MemoryBudgetError:  # ContextParallelError too: no ring on this mesh
        return None
    return dataclasses.replace(
        ring, solve_args={**ring.solve_args, "cutoff": plan.stats["objective"]})


@dataclasses.dataclass(frozen=True)
class PreparedILP:
    """A sharding ILP built and ready to solve: `solve(problem, **solve_args)` (in this
    process or another: both are plain data), then `finish_on_mesh` with the solution."""

    problem: object  # ShardingProblem
    solve_args: dict
    graph: OpGraph
    mesh: LogicalMesh
    cluster: object
    options: ShardOptions
    tied: tuple
    footprint: Footprint | None
    built: BuiltProblem
    build_time: float


def prepare_on_mesh(
    graph: OpGraph,
    cluster,
    mesh: LogicalMesh,
    options: ShardOptions = DEFAULT_OPTIONS,
    tied: Sequence[tuple[int, int]] = (),
    fixed: Mapping[int, Spec] | None = None,
    weights: Mapping[int, tuple[float, float]] | None = None,
    footprint: Footprint | None = None,
) -> PreparedILP:
    """The ILP `plan_on_mesh` solves, built (memoised per graph: `_built_problem`)."""
    start = time.perf_counter()
    built = _built_problem(graph, mesh, cluster, options, tied, fixed, weights, footprint)
    problem = built.problem
    if footprint is not None and footprint.price:
        problem = with_footprint_price(problem, footprint.price)
    return PreparedILP(
        problem, {"time_limit": options.time_limit, "solver": options.solver}, graph, mesh,
        cluster, options, tuple(tied), footprint, built, time.perf_counter() - start,
    )


def finish_on_mesh(prepared: PreparedILP, solution) -> ShardingPlan:
    """The `ShardingPlan` of a solution of `prepared.problem`."""
    graph, mesh, built = prepared.graph, prepared.mesh, prepared.built
    plan = _to_plan(graph, mesh, prepared.cluster, built, solution.choices, prepared.tied,
                    prepared.options.context_parallel)
    stats = dict(plan.stats)
    stats.update(
        build_time=prepared.build_time,
        solve_time=solution.stats.solve_time,
        objective=solution.objective,
        status=solution.status,
        num_ilp_nodes=solution.stats.num_nodes,
        num_ilp_nodes_after_merge=solution.stats.num_nodes_after_merge,
        num_variables_before_merge=solution.stats.num_variables_before_merge,
        num_variables=solution.stats.num_variables,
        solver=solution.stats.solver,
        tie_break=solution.stats.tie_break,
    )
    if prepared.footprint is not None:
        stats.update(
            footprint=footprint_total(built.problem, solution.choices),
            least_footprint=least_footprint(built.problem),
        )
    object.__setattr__(plan, "stats", stats)
    warnings = plan.warnings + large_replicated_warnings(graph)
    object.__setattr__(
        plan, "warnings", warnings + _solve_warnings(solution, mesh, prepared.options)
    )
    return plan


def price_layout(
    graph: OpGraph,
    cluster,
    mesh: LogicalMesh,
    layout: Sequence[tuple],
    options: ShardOptions = DEFAULT_OPTIONS,
    tied: Sequence[tuple[int, int]] = (),
    weights: Mapping[int, tuple[float, float]] | None = None,
    footprint: Footprint | None = None,
    whole: bool = False,
) -> ShardingPlan | None:
    """The plan of `graph` on `mesh` that takes `layout`, a solution chosen for another
    graph of the same structure (`autopar.intra._problem.chosen_layout`: the same layer
    traced at another microbatch size), priced by the same cost model on this graph's
    shapes; no ILP is solved. None when the layout does not apply here (other ILP nodes,
    or a split these shapes do not divide) or does not fit the memory budget. `whole`:
    read the layout out of the graph's whole problem (`_whole_layout`, the slower way to
    the same plan, kept to check the other against).
    """
    start = time.perf_counter()
    try:
        if whole:
            built, choices = _whole_layout(graph, cluster, mesh, layout, options, tied,
                                           weights, footprint)
        else:
            # Only the layout's strategies (`autopar.intra._price_layout`: the same as the
            # whole problem's, read out as `_whole_layout` does, without building the
            # rest), under the limits of the problem that reads them.
            built, agree = layout_problem(graph, mesh, cluster, options, tied, weights,
                                          footprint, layout)
            if agree:
                built = _with_limits(built, footprint)
            choices = (0,) * len(built.ilp_nodes)
    except LayoutMismatch as err:
        log.debug("layout not priced on mesh %s: %s", tuple(mesh.shape), err)
        return None
    problem = built.problem
    peak = peak_memory(problem, choices)
    if problem.memory_budget is not None and peak > problem.memory_budget:
        return None
    build_time = time.perf_counter() - start
    n = len(choices)
    stats = SolveStats(
        num_nodes=n, num_nodes_after_merge=n, num_ilp_nodes=0, num_variables_before_merge=n,
        num_variables=0, num_constraints=0, build_time=build_time, solve_time=0.0,
        solver="none (a layout priced)", formulation="none", tie_break="none",
    )
    prepared = PreparedILP(
        problem, {}, graph, mesh, cluster, options, tuple(tied), footprint, built, build_time
    )
    plan = finish_on_mesh(prepared, Solution(choices, evaluate(problem, choices), "optimal",
                                             stats))
    if footprint is not None:  # a layout is the only plan priced: the least footprint is its
        plan.stats["least_footprint"] = plan.stats["footprint"]
    return plan


def _whole_layout(graph, cluster, mesh, layout, options, tied, weights, footprint):
    """(problem, choices) of `layout` in the problem of the graph built once for every
    layout priced on this mesh and for its own ILPs (`_built_problem`); a layout whose
    followers disagree with their leaders there (`evaluate`'s check) is read from a
    problem built for it (`build_problem(..., layout=...)`)."""
    try:
        built = _built_problem(graph, mesh, cluster, options, tied, None, weights, footprint)
        choices = layout_choices(built, layout)
        peak_memory(built.problem, choices)
    except LayoutMismatch:
        raise
    except ValueError:  # a follower off its leader's strategy
        built = build_problem(graph, mesh, cluster, options, tied, None, weights, footprint,
                              layout=layout)
        choices = (0,) * len(built.ilp_nodes)
    return built, choices


def _built_problem(graph, mesh, cluster, options, tied, fixed, weights, footprint,
                   cache: _BuiltProblems | None = None):
    """`build_problem`, memoised per graph in `cache` (None: the search's `_BUILT`): the
    stage DP plans a layer on one mesh at several footprint limits (its memory levels),
    which differ only in `ShardingProblem.footprint_budget` (issue 18: rebuilding took
    most of the search)."""
    if cache is None:
        cache = _BUILT
    key = (
        mesh, cluster, options, tuple(tied),
        tuple(sorted((fixed or {}).items())),
        tuple(sorted((weights or {}).items())),
        None if footprint is None else (
            tuple(sorted(footprint.held.items())), tuple(sorted(footprint.unreduced.items()))
        ),
    )
    built = cache.get(graph, key)
    if built is None:
        built = build_problem(graph, mesh, cluster, options, tied, fixed, weights, footprint)
        cache.keep(graph, key, built)
    return _with_limits(built, footprint)


def _with_limits(built: BuiltProblem, footprint: Footprint | None) -> BuiltProblem:
    """`built` under `footprint`'s limits (its budget, and its peak budget below the
    problem's memory budget)."""
    if footprint is None:
        return built
    limits = {"footprint_budget": footprint.budget}
    peak = built.problem.memory_budget
    if footprint.peak_budget is not None:
        peak = footprint.peak_budget if peak is None else min(peak, footprint.peak_budget)
        limits["memory_budget"] = peak
    if any(getattr(built.problem, k) != v for k, v in limits.items()):
        built = dataclasses.replace(built, problem=dataclasses.replace(built.problem, **limits))
    return built


class _BuiltProblems:
    """graph -> {what it was built with: BuiltProblem}; forgets graphs nothing else holds,
    and the least recently used problems past `limit` bytes (a large search builds
    thousands: GPT-3 175B on 1,024 GPUs, 1,545 of 0.1-8 MB of arrays each, about four times
    that with their strategy objects). Its hits come soon after the build: in that search,
    1,462 of 1,515 came within 256 MB of arrays of other problems used since (issue 18).

    Entries are numbered, and each graph's weak reference forgets its entry by number
    through a method of this object: a graph freed while the interpreter shuts down (one a
    script keeps in a global) hashes no key and reads no module's globals, which may be
    cleared by then (hashing the key's `Cluster` there called a cleared
    `dataclasses.fields`, and Python printed "Exception ignored" at exit).
    """

    def __init__(self, limit: float):
        self.limit = limit
        # graph -> {key: (BuiltProblem, entry number)}
        self.by_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # entry number -> (weak reference to the graph, key, bytes), least recently used
        # first.
        self.order: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0
        self._numbers = itertools.count()

    def get(self, graph, key):
        """The problem built for `graph` and `key` (now the most recently used), or None."""
        held = self.by_graph.get(graph, {}).get(key)
        if held is None:
            return None
        built, number = held
        if number in self.order:
            self.order.move_to_end(number)
        return built

    def keep(self, graph, key, built) -> None:
        """Keep `built` and count it, dropping the least recently used past the limit."""
        number = next(self._numbers)
        size = _problem_bytes(built)
        self.by_graph.setdefault(graph, {})[key] = (built, number)
        ref = weakref.ref(graph, functools.partial(self._forget, number))
        self.order[number] = (ref, key, size)
        self.bytes += size
        while self.bytes > self.limit and len(self.order) > 1:
            _, (old_ref, old_key, old_size) = self.order.popitem(last=False)
            self.bytes -= old_size
            old_graph = old_ref()
            if old_graph is not None:
                self.by_graph.get(old_graph, {}).pop(old_key, None)

    def __len__(self) -> int:
        return len(self.order)

    def clear(self) -> None:
        """Forget every problem (the end of a search: `autopar._memo`)."""
        self.by_graph.clear()
        self.order.clear()
        self.bytes = 0

    def _forget(self, number: int, _ref) -> None:
        """Stop counting entry `number`, whose graph was freed."""
        held = self.order.pop(number, None)
        if held is not None:
            self.bytes -= held[2]


BUILT_CACHE_BYTES = 512 << 20
_BUILT = declare(_BuiltProblems(BUILT_CACHE_BYTES), "intra.built_problems",
                 "graph -> {(mesh, cluster, options): BuiltProblem}, LRU by bytes")
# Python objects per ILP node and per strategy (a walk of gpt-1.3B's built layer problems
# with `benchmarks/investigations/planner_memory.py`'s `_deep_size`: 1.4 kB per node, 0.3 kB per
# strategy, counting what they share with other problems too).
NODE_OBJECT_BYTES = 1400
STRATEGY_OBJECT_BYTES = 300


def _problem_bytes(built) -> int:
    """The bytes a built problem holds: its arrays and an estimate of its objects."""
    problem = built.problem
    arrays = (*problem.node_costs, *problem.edge_costs, *problem.node_memory,
              *problem.footprint)
    strategies = sum(len(n.strategies) for n in built.ilp_nodes)
    return (sum(a.nbytes for a in arrays) + NODE_OBJECT_BYTES * len(built.ilp_nodes)
            + STRATEGY_OBJECT_BYTES * strategies)


def large_replicated_warnings(
    graph: OpGraph, threshold: float = LARGE_REPLICATED_BYTES
) -> tuple[str, ...]:
    """One warning per node that no sharding rule covers whose results, replicated, take
    more than `threshold` bytes per device, largest first: what to write a rule for.
    The same on every mesh, so computed once per graph (the stage DP plans a graph on many
    meshes)."""
    by_threshold = _LARGE_REPLICATED.setdefault(graph, {})
    if threshold not in by_threshold:
        by_threshold[threshold] = _large_replicated(graph, threshold)
    return by_threshold[threshold]


# graph -> {threshold: warnings}; forgets graphs nothing else holds.
_LARGE_REPLICATED: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.large_replicated",
    "graph -> {threshold: warnings}")


def _large_replicated(graph: OpGraph, threshold: float) -> tuple[str, ...]:
    large = []
    for node in graph.nodes:
        nbytes = sum(graph.vars[v].nbytes for v in node.outputs)
        if nbytes > threshold and node_signature(node, graph) is None:
            large.append((nbytes, node))
    large.sort(key=lambda item: (-item[0], item[1].id))
    return tuple(_large_replicated_message(graph, node, nbytes) for nbytes, node in large)


def _large_replicated_message(graph: OpGraph, node, nbytes: float) -> str:
    results = ", ".join(
        f"{graph.vars[v].dtype}[{','.join(map(str, graph.vars[v].shape))}]" for v in node.outputs
    )
    where = f" at {node.source}" if node.source else ""
    return (
        f"no sharding rule for primitive '{node.primitive}': node #{node.id}{where} "
        f"({results}) is replicated, {nbytes / 2**20:.1f} MiB per device; a rule "
        "registered with autopar.intra.register lets the planner split it"
    )


def _solve_warnings(solution, mesh: LogicalMesh, options: ShardOptions) -> tuple[str, ...]:
    """What the user should know about how the ILP solve ended."""
    where = f"the sharding ILP on mesh {tuple(mesh.shape)}"
    limit = f"{options.time_limit:g} s time limit"
    fix = "raise the ILP time limit (ilp_time_limit, or ShardOptions.time_limit)"
    if solution.status == "time_limit":
        return (f"{where} stopped at its {limit}; the plan may not be optimal: {fix}",)
    if solution.stats.tie_break == "incomplete":
        return (
            f"{where} found an optimal plan but its tie-break among equal-cost plans stopped "
            f"at the {limit}; another solver or version may pick another plan of the same "
            f"cost: {fix}",
        )
    return ()


def plan_sharding(
    graph: OpGraph,
    cluster,
    device_ids: Sequence[int] | None = None,
    options: ShardOptions = DEFAULT_OPTIONS,
    tied: Sequence[tuple[int, int]] = (),
    mesh_shape: tuple[int, ...] | None = None,
    fixed: Mapping[int, Spec] | None = None,
) -> ShardingPlan:
    """Plan `graph` on `device_ids`, trying each logical mesh shape; the cheapest wins.

    **Arguments:**
    - `device_ids`: cluster device ids (default: all of the cluster's devices).
    - `mesh_shape`: try only this logical shape.

    **Returns:** the `ShardingPlan` with the least predicted step time. Raises
    `MemoryBudgetError` when no mesh shape fits the budget, naming the least memory per
    device that would.
    """
    if device_ids is None:
        device_ids = range(cluster.num_devices)
    device_ids = tuple(device_ids)
    shapes = [tuple(mesh_shape)] if mesh_shape is not None else mesh_shapes(len(device_ids))
    best: ShardingPlan | None = None
    errors: list[MemoryBudgetError] = []
    mismatches: list[str] = []
    for shape in shapes:
        mesh = LogicalMesh.create(shape, device_ids)
        try:
            # `fixed` may depend on the mesh (the user's pins, `autopar.search._pins`).
            fixed_here = fixed(mesh) if callable(fixed) else fixed
            plan = plan_on_mesh(graph, cluster, mesh, options, tied, fixed_here)
        except MemoryBudgetError as err:
            errors.append(err)
            continue
        except AnnotationMismatch as err:  # the user's shardings rule this mesh out
            mismatches.append(f"mesh {shape}: {err}")
            continue
        log.info(
            "mesh %s: predicted %.4g s (compute %.3g, comm %.3g, reshard %.3g)",
            shape, plan.cost.total, plan.cost.compute, plan.cost.communication,
            plan.cost.resharding,
        )
        if best is None or plan.cost.total < best.cost.total:
            best = plan
    if best is None and not errors:
        raise AnnotationMismatch(
            "no logical mesh can hold the user's shardings (the step's sharding "
            "annotations or the pins):\n  " + "\n  ".join(mismatches) + "\nFix the spec "
            "or its mesh, pass mesh_shape= the shape of the user's mesh, or plan with "
            "annotations='hint' or 'ignore'"
        )
    if best is None:
        least = min(errors, key=lambda e: getattr(e, "least_memory", float("inf")))
        raise least
    return best


def once_per_layout(keys: Sequence[tuple]) -> list[bool]:
    """Which operand edges pay their resharding: per (value, layout it is taken in,
    weight), the first edge only.

    The ILP charges every consumer edge its resharding (its objective is a sum over edges),
    so a value that k nodes take in the same new layout pays the collective k times there;
    the program XLA compiles does it once (the same resharding of the same value is one
    collective after CSE). The plan's predicted cost charges it once: an accounting after
    the ILP, which leaves the ILP's choice as it was (its objective over-counts such
    values; its error is at most (k - 1) reshardings per value). Edges of different
    weights (per microbatch, once per step) run in different programs and each pay.

    **Example:** ``once_per_layout([(7, s, 1.0), (7, s, 1.0), (7, t, 1.0)])`` is
    ``[True, False, True]``.
    """
    seen: set = set()
    charged = []
    for key in keys:
        charged.append(key not in seen)
        seen.add(key)
    return charged


def _to_plan(graph: OpGraph, mesh, cluster, built: BuiltProblem, choices, tied,
             cp_mode: str = "auto") -> ShardingPlan:
    # the ring's twins share the all-gather's score layouts: their names tell them apart
    if chose_ring(n.strategies[c].name for n, c in zip(built.ilp_nodes, choices)):
        cp_mode = "ring"
    if built.expansion is None:
        plan = _graph_plan(graph, mesh, cluster, built, choices, tied)
        return dataclasses.replace(
            plan, context_parallel=describe_context(graph, plan.var_specs, mesh, cp_mode))
    expansion = built.expansion
    plan = _graph_plan(expansion.graph, mesh, cluster, built, choices, expansion.tied)
    context = describe_context(expansion.graph, plan.var_specs, mesh, cp_mode)
    return dataclasses.replace(collapse_plan(plan, expansion), context_parallel=context)


def _graph_plan(graph: OpGraph, mesh, cluster, built: BuiltProblem, choices, tied):
    """The `ShardingPlan` of the ILP's `choices` on `graph`: every variable's spec, each
    node's strategy, the operands resharded along edges, returned state in its input's
    layout (`tied`), and the predicted cost with its collectives."""
    chosen = [n.strategies[c] for n, c in zip(built.ilp_nodes, choices)]
    var_specs, node_strategies = _chosen_specs(graph, built, chosen)
    compute = sum(s.compute_cost for s in chosen)
    communication = sum(s.comm_cost for s in chosen)
    collectives = _CollectiveTally()
    for s in chosen:
        for c in s.collectives:
            collectives.add(c)
    problem = built.problem
    operand_specs, resharding = _operand_resharding(graph, mesh, built, choices, chosen,
                                                    var_specs, collectives)
    # Returned state takes its input's layout, so that the next step needs no resharding;
    # the ILP charged this move on the tie edge.
    for out_var, in_var in tied:
        var = graph.vars[out_var]
        producer = built.ilp_nodes[built.source_of[out_var][0]].node
        for c in reshard_collectives(
            var.shape, var.dtype, var_specs[out_var], var_specs[in_var], mesh
        ):
            collectives.add(c, built.weight(producer))
    output_specs = {out_var: var_specs[in_var] for out_var, in_var in tied}
    constrained = tuple(
        v
        for node in graph.nodes
        for v in node.outputs
        if len(graph.vars[v].shape) > 0
    )
    cost = PredictedCost(
        compute=compute,
        communication=communication,
        resharding=resharding,
        memory_per_device=float(peak_memory(problem, choices)),
        collectives=collectives.totals(),
    )
    return ShardingPlan(
        mesh=mesh,
        var_specs=tuple(var_specs),
        output_overrides=tuple(sorted(output_specs.items())),
        operand_specs=tuple(operand_specs),
        node_strategies=tuple(node_strategies),
        constrained=constrained,
        cost=cost,
        graph_fingerprint=graph_fingerprint(graph),
        warnings=tuple(built.warnings),
    )


def _chosen_specs(graph: OpGraph, built: BuiltProblem, chosen) -> tuple[list, list[str]]:
    """Each variable's spec as its producer's chosen strategy makes it, and each graph
    node's strategy name."""
    var_specs: list = [None] * len(graph.vars)
    for v, (index, k) in built.source_of.items():
        var_specs[v] = chosen[index].out_specs[k]
    node_strategies = [""] * len(graph.nodes)
    for ilp_node, strategy in zip(built.ilp_nodes, chosen):
        if ilp_node.node is not None:
            node_strategies[ilp_node.node] = strategy.name
    return var_specs, node_strategies


class _CollectiveTally:
    """Collectives by kind: ``[count, bytes]`` per planned unit (a collective run once per
    step in a stage planned per microbatch counts 1/microbatches: its `weight`)."""

    def __init__(self):
        self.by_kind: dict[str, list] = {}

    def add(self, c, weight: float = 1.0) -> None:
        weight *= c.weight
        entry = self.by_kind.setdefault(c.kind, [0.0, 0.0])
        entry[0] += weight
        entry[1] += weight * c.nbytes

    def totals(self) -> dict[str, tuple[float, float]]:
        return {k: (n, b) for k, (n, b) in self.by_kind.items()}


def _operand_resharding(graph: OpGraph, mesh, built: BuiltProblem, choices, chosen,
                        var_specs, collectives: _CollectiveTally) -> tuple[list, float]:
    """Spec changes along edges: the lowering pins each resharded operand, and their
    collectives are predicted for the check against compiled HLO. A value several nodes
    take in the same new layout is resharded once (`once_per_layout`). **Returns:** the
    (node, operand, spec) pins and the seconds of resharding the ILP's edges charge, the
    tie edges included; adds the operands' collectives to `collectives`."""
    problem = built.problem
    operand_specs = []
    edge_seconds = [float(m[choices[u], choices[v]])
                    for (u, v), m in zip(problem.edges, problem.edge_costs)]
    operand_edges = list(operands(graph, built.ilp_nodes))
    keys = []
    for index, ilp_node, p, var in operand_edges:
        dst = chosen[index].in_specs[p] or replicated(len(var.shape))
        if dst != var_specs[var.id]:
            operand_specs.append((ilp_node.node, p, dst))
        keys.append((var.id, dst, built.weight(ilp_node.node)))
    assert len(keys) <= len(edge_seconds), "the ILP's edges start with the operand edges"
    charged = once_per_layout(keys)
    resharding = sum(
        seconds for e, seconds in enumerate(edge_seconds)
        if e >= len(keys) or charged[e]  # tie edges (after the operands) always count
    )
    for e, (_, ilp_node, _, var) in enumerate(operand_edges):
        if not charged[e]:
            continue
        dst = keys[e][1]
        for c in reshard_collectives(var.shape, var.dtype, var_specs[var.id], dst, mesh):
            collectives.add(c, built.weight(ilp_node.node))
    return operand_specs, resharding
