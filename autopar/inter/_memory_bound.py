"""Lower bounds on a layer's memory per device, before any ILP is solved.

In: a `LayerCostTable`, a layer and the number of devices of a stage mesh. Out:
`layer_memory_floor`, bytes per device below which no plan of the layer on any mesh of
that many devices can hold its forward and backward (at any memory level, with any
recompute, priced from another count's layouts or solved); `hopeless_layer`, a layer
whose floor exceeds the memory budget on every mesh the stage DP may give it, so that a
microbatch count with such a layer has no pipeline plan (every plan has a stage holding
it) and is refused before any ILP (`autopar.search._pipeline`).

Why it is a bound. `LayerCostTable` prices a layer's memory as ``min(ILP model, liveness
peak) + fresh gradients`` (`LayerCostTable._layer_cost`); a recompute only adds to it
(`autopar.cost.recomputed_layer_cost`), and a stage holds at least one layer's memory less
the state it shares with other layers of the stage (`autopar.cost.stage_memory_parts`:
the state, gradient sums and kept activations of every layer plus the largest working
memory). Both models are sums of per-device sizes of values live together:

- the liveness peak (`autopar.intra._liveness`): walked here with every value at its
  whole size over the device count (no layout puts less on a device), the same values
  fused away or free, pass-through markers sharing buffers, and no temporaries (a
  resharded copy or a slice only adds bytes; a value read through a slice made where it
  is produced is replaced by that slice, no smaller than the floor of the value, over the
  same span). The layer's per-device state inputs are live throughout, as the walk counts
  them;
- the ILP's model (`autopar.intra._problem._memory_groups`): each memory group's sum of
  the chosen strategies' output bytes (`node_memory`), whose least per group is the
  least output bytes of each strategy list: a bound computed from the problem itself,
  only where the liveness floor alone would refuse the layer (it builds the problem, not
  the solve; the build is memoised for the ILP that follows when the layer is not refused).

The floor is the smaller of the two, less the bytes of the layer's state that other
layers read (a tied embedding: a stage counts it once, at the least size among its
readers).
"""

from __future__ import annotations

import dataclasses
import math

from autopar.graph import OpGraph, Role
from autopar.intra._liveness import FUSIBLE, PASS_THROUGH

STATE_ROLES = (Role.PARAM, Role.OPT_STATE)


def liveness_floor(graph: OpGraph, num_devices: int, split: int | None = None,
                   free=frozenset()) -> float:
    """The least peak live bytes per device of `graph`'s nodes before `split` (all of
    them by default) under any layouts on `num_devices` devices: `peak_live_bytes`'s walk
    with every value at ``nbytes / num_devices`` (a scalar whole), no temporaries, no
    combined reductions (see the module docstring). `free`: values counted as 0 bytes (the
    fused attention kernel's core, as the table's walk frees them)."""
    if num_devices < 1:
        raise ValueError(f"liveness_floor needs num_devices >= 1, got {num_devices}")
    end = len(graph.nodes) if split is None else split
    returned = set(graph.outvars)
    buffer: dict[int, int] = {}
    for node in graph.nodes:
        if node.primitive in PASS_THROUGH:
            for operand, result in zip(node.inputs, node.outputs):
                buffer[result] = buffer.get(operand, operand)
    consumers: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in dict.fromkeys(node.inputs):
            consumers.setdefault(v, []).append(node.id)
    fused = set()
    for node in graph.nodes:
        if node.primitive not in FUSIBLE:
            continue
        for v in node.outputs:
            readers = consumers.get(v, ())
            if v not in returned and len(readers) == 1 \
                    and graph.nodes[readers[0]].primitive in FUSIBLE:
                fused.add(v)
    last_use: dict[int, int] = {}
    for node in graph.nodes:
        for v in node.inputs:
            b = buffer.get(v, v)
            last_use[b] = max(last_use.get(b, -1), node.id)
    for v in returned:
        last_use[buffer.get(v, v)] = len(graph.nodes)

    def floor(v: int) -> float:
        if v in free:
            return 0.0
        var = graph.vars[v]
        return float(var.nbytes) if not var.shape else var.nbytes / num_devices

    always = math.fsum(floor(v) for v in dict.fromkeys(graph.invars)
                       if graph.vars[v].role is not Role.CONST)
    live: dict[int, float] = {}
    current = peak = 0.0
    for node in graph.nodes:
        if node.id >= end:
            break
        for v in node.outputs:
            if v in last_use and v not in fused and v not in live:
                live[v] = floor(v)
                current += live[v]
        peak = max(peak, current)
        for v in dict.fromkeys(buffer.get(u, u) for u in (*node.inputs, *node.outputs)):
            if v in live and last_use.get(v, -1) <= node.id:
                current -= live.pop(v)
    return always + peak


def ilp_model_floor(problem) -> float:
    """The least `peak_memory(problem, choices)` over all choices: per memory group, the
    sum of each member's least strategy output bytes; the largest group's."""
    least = [float(m.min()) if len(m) else 0.0 for m in problem.node_memory]
    return max((math.fsum(least[v] for v in g) for g in problem.memory_groups), default=0.0)


def shared_state_full(table, layer: int) -> float:
    """Whole bytes of the layer's state inputs that other layers also read (at most what
    a stage's count of the layer's state exceeds its share of the stage's state by)."""
    sub = table.per_layer.stage_graphs[layer]
    shared = table.shared_readers()
    return math.fsum(float(sub.vars[v].nbytes) for v in dict.fromkeys(sub.invars)
                     if v in shared and layer in shared[v])


def layer_liveness_floor(table, layer: int, num_devices: int) -> float:
    """`liveness_floor` of the layer's forward and backward (before its update) on
    `num_devices` devices, as `LayerCostTable._layer_cost` walks it; memoised per
    structure."""
    key = ("floor", table.fingerprints[layer], num_devices)
    cache = table.range_cache
    if key not in cache:
        sub = table.per_layer.stage_graphs[layer]
        cache[key] = liveness_floor(sub, num_devices, table._update_start(layer, sub),
                                    table._attention_core(sub))
    return cache[key]


def ilp_floor_on_mesh(table, layer: int, shape: tuple[int, ...]) -> float:
    """`ilp_model_floor` of the layer's ILP on a mesh of `shape`, built as its level-0
    solve builds it (`LayerCostTable._solve_steps`; the build is memoised for that solve);
    0 where the mesh takes no plan of the layer at all (a pin or a forced context
    parallelism it cannot hold: that is for the ILP to say)."""
    key = ("ilp floor", table.fingerprints[layer], shape)
    if key not in table.range_cache:
        table.range_cache[key] = _ilp_floors(table, layer, shape)[0]
    return table.range_cache[key]


def layer_time_floor(table, layer: int, shape: tuple[int, ...]) -> float:
    """A lower bound on the layer's latency (`LayerCost.latency`) on a mesh of `shape`, at
    any memory level and with any recompute, from its ILP built, not solved: each ILP
    node's cheapest strategy (compute plus the collectives it issues), summed.

    Why it is a bound. A plan's predicted time is the sum of its chosen strategies'
    compute and communication plus the resharding on its edges (`PredictedCost.total`,
    `autopar.intra._planner._graph_plan`); resharding, the fused reruns
    (`LayerCostTable._layer_cost`) and a recompute only add. Every memory level solves
    (or prices a layout of) the same problem with a footprint limit or price that the
    plan's time leaves out, and under "auto" a plan may be the exact ring's ILP's (other
    strategies), so the floor is the smaller of the two problems'. 0 where the mesh takes
    no plan of the layer (`ilp_floor_on_mesh`)."""
    return _ilp_floors(table, layer, shape)[1]


def _ilp_time_floor(built) -> float:
    """Sum over `built`'s ILP nodes of their cheapest strategy's compute and communication."""
    return math.fsum(min((s.compute_cost + s.comm_cost for s in node.strategies), default=0.0)
                     for node in built.ilp_nodes)


def _ilp_floors(table, layer: int, shape: tuple[int, ...]) -> tuple[float, float]:
    """(`ilp_floor_on_mesh`, `layer_time_floor`) of one build; memoised per structure."""
    from autopar.cluster import LogicalMesh
    from autopar.inter._layer_graphs import _tied_in
    from autopar.intra import MemoryBudgetError
    from autopar.intra._context import sequence_length
    from autopar.intra._planner import prepare_on_mesh
    from autopar.intra._ring_strategies import ring_dots
    from autopar.intra._rules_annotations import AnnotationMismatch

    key = ("ilp floors", table.fingerprints[layer], shape)
    if key not in table.range_cache:
        layer = table._representative[table.fingerprints[layer]]
        sub = table.per_layer.stage_graphs[layer]
        mesh = LogicalMesh.create(shape, axis_names=table.axis_names)
        try:
            prepared = prepare_on_mesh(
                sub, table.cluster, mesh, table.options,
                _tied_in(sub, table.tied) + table.chain_ties(layer),
                fixed=table._pins_on(sub, mesh), weights=table.weights[layer],
                footprint=table.footprint(layer, shape, None, None, 0.0))
            floor = ilp_model_floor(prepared.problem)
            seconds = _ilp_time_floor(prepared.built)
            options = table.options
            if options.context_parallel == "auto" and mesh.num_devices > 1 \
                    and ring_dots(sub, sequence_length(sub)):
                # The layer's plan may be the exact ring's ILP's (`exact_ring_problem`):
                # other strategies, so its floors too.
                try:
                    ring = prepare_on_mesh(
                        sub, table.cluster, mesh,
                        dataclasses.replace(options, context_parallel="ring"),
                        prepared.tied, table._pins_on(sub, mesh), table.weights[layer],
                        prepared.footprint)
                    floor = min(floor, ilp_model_floor(ring.problem))
                    seconds = min(seconds, _ilp_time_floor(ring.built))
                except MemoryBudgetError:
                    pass
            table.range_cache[key] = (floor, seconds)
        except (MemoryBudgetError, AnnotationMismatch):
            table.range_cache[key] = (0.0, 0.0)
    return table.range_cache[key]


def hopeless_layer(table, shapes, budget: float):
    """(layer, why) of a layer that no stage on any of the logical mesh `shapes` can hold
    within `budget` bytes per device (see the module docstring), or None. Liveness floors
    first (no build); the ILP model's floor only for a layer the liveness floor refuses
    everywhere, largest meshes first (where it most likely fits)."""
    if table.solve is not None or not shapes:
        return None
    shapes = sorted({tuple(s) for s in shapes}, key=lambda s: -math.prod(s))
    counts = sorted({math.prod(s) for s in shapes}, reverse=True)
    seen = set()
    for k in range(len(table.fingerprints)):
        if table.fingerprints[k] in seen:
            continue
        seen.add(table.fingerprints[k])
        shared = shared_state_full(table, k)
        if layer_liveness_floor(table, k, counts[0]) - shared <= budget:
            continue  # cheap: fits the largest mesh by the liveness floor
        if any(layer_liveness_floor(table, k, n) - shared <= budget for n in counts):
            continue
        floors = []
        for shape in shapes:
            floor = min(layer_liveness_floor(table, k, math.prod(shape)),
                        ilp_floor_on_mesh(table, k, shape)) - shared
            if floor <= budget:
                break
            floors.append((shape, floor))
        else:
            return k, floors
    return None


def _whole_over(var, num_devices: int) -> float:
    """The least bytes of `var` any layout puts on one of `num_devices` devices: its
    whole size over the devices (a scalar whole), as `liveness_floor` counts it."""
    return float(var.nbytes) if not var.shape else var.nbytes / num_devices


def held_floors(table, layer: int, num_devices: int) -> tuple[float, float]:
    """(state, gradients): the least bytes per device of the layer's parameters and
    optimizer state (`LayerCost.state_memory`: every state input has a layout, at least
    its whole size over the devices) and of the gradients it accumulates
    (`LayerCost.gradient_memory`: each at its running sum's layout, a deferred one's
    unreduced partial sum no smaller), under any plan on `num_devices` devices; the
    state counts the inputs other layers also read (`stage_memory_floor` counts those
    once). Memoised per structure."""
    key = ("held floor", table.fingerprints[layer], num_devices)
    cache = table.range_cache
    if key not in cache:
        sub = table.per_layer.stage_graphs[layer]
        state = math.fsum(_whole_over(sub.vars[v], num_devices)
                          for v in dict.fromkeys(sub.invars)
                          if sub.vars[v].role in STATE_ROLES)
        produced = {v for node in sub.nodes for v in node.outputs}
        grads = math.fsum(sub.vars[v].nbytes / num_devices
                          for v in set(table.per_layer.grad_vars) & produced
                          if sub.vars[v].shape)
        cache[key] = (state, grads)
    return cache[key]


def stage_memory_floor(table, layer_range, shape: tuple[int, ...], budget: float) -> float:
    """A lower bound on the memory per device of any stage holding layers `layer_range` on
    a mesh of `shape` (at any memory level, with any recompute, in any position), as
    `autopar.cost.stage_memory_parts` prices it.

    Why it is a bound. The stage holds every layer's state (each input several layers
    read, once), gradient sums and kept activations (at least one microbatch's), and the
    largest transient memory, a layer's memory (`LayerCost.memory`) less its own state,
    gradients and kept activations. So for each layer k it holds at least k's memory plus
    the other layers' state and gradients: k's memory is at least its floor
    (`layer_liveness_floor`, or the ILP model's, `ilp_floor_on_mesh`) plus, with several
    microbatches, its fresh gradients (`LayerCostTable._layer_cost`); the others' state
    and gradients at least their `held_floors`, a state input k also reads not counted
    again, and k's state other layers also read taken off at its whole size
    (`shared_state_full`: the stage counts it once, at its least size). Kept
    activations count 0 beyond that (a full recompute keeps little).

    Where the liveness floors alone leave the stage within `budget`, that figure; else
    the layers that put it over are refined by their ILP model's floor (which builds
    their problems). Shared by ranges of equal content."""
    from autopar.inter._range_cache import _range_cached

    return _range_cached(table, "stage floor", layer_range, (tuple(shape), budget),
                         lambda: _stage_memory_floor(table, list(layer_range), tuple(shape),
                                                     budget))


def _stage_memory_floor(table, layers: list[int], shape: tuple[int, ...],
                        budget: float) -> float:
    if not layers:
        return 0.0
    n = math.prod(shape)
    graph_vars = table.per_layer.stage_graphs[layers[0]].vars  # the whole step's table
    inside = set(layers)
    held = 0.0  # every layer's state (each input once) and gradients at their floors
    for k in layers:
        state, grads = held_floors(table, k, n)
        held += state + grads
    for v, readers in table.shared_readers().items():
        extra = sum(1 for k in readers if k in inside) - 1
        if extra > 0:
            held -= extra * _whole_over(graph_vars[v], n)
    fresh = table.num_microbatches > 1
    rest = []  # per layer: its memory floor beyond its own held floors, less shared state
    for k in layers:
        state, grads = held_floors(table, k, n)
        beyond = (grads if fresh else 0.0) - shared_state_full(table, k) - state - grads
        rest.append((layer_liveness_floor(table, k, n) + beyond, k, beyond))
    rest.sort(reverse=True)
    if held + rest[0][0] <= budget:
        return held + max(0.0, rest[0][0])
    # The liveness floors put the stage over: take the ILP model's floor where it is the
    # smaller, for the layers that put it over, largest first.
    best = 0.0
    for live, k, beyond in rest:
        if held + live <= budget or live <= best:
            break
        best = max(best, min(live, ilp_floor_on_mesh(table, k, shape) + beyond))
        if held + best > budget:
            break
    return held + best
