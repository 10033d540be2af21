"""Layer costs: every layer planned on every candidate logical mesh, each structure once.

In: a train step traced at microbatch size, its layers (`LayerAssignment`), a cluster and
the single-mesh planner's options. Out: `LayerCostTable`, the predicted `LayerCost` of
each layer on each logical mesh shape at each memory level (`autopar.inter._levels`), with
or without recompute, and the plan behind it; `stage_plan` stitches a stage's plan from
its layers' plans.

Stage costs come from the intra-op planner (one cost model for everything): a stage's
per-microbatch latency is the sum of its layers' predicted times on the best common
logical mesh. Layers with the same structure (same primitives, shapes and wiring, e.g.
identical transformer blocks) are solved once per mesh, never twice.
"""

from __future__ import annotations

import math
import time

from autopar.choices import MEMORY_LEVELS, MemoryLevels, check_choice
from autopar.cluster import LogicalMesh
from autopar.cost import LayerCost, bytes_per_device, in_flight_microbatches
from autopar.graph import OpGraph, Role, attention_core, dtype_itemsize, stored_residuals
from autopar.inter import _progress, _range_cache, _repricing
from autopar.inter._compact_specs import _CompactSpecs
from autopar.inter._ilp_driver import drive
from autopar.inter._layer_graphs import _tied_in, structural_fingerprint
from autopar.inter._layer_pricing import (
    _activation_bytes,
    _gradient_bytes,
    _state_bytes,
    _var_map,
    layer_fused_seconds,
    price_remat,
)
from autopar.inter._levels import level_steps
from autopar.inter._options import StageOptions
from autopar.inter._stitch import stitch
from autopar.inter.passes._deferred import gradient_roots, step_weights
from autopar.inter.passes._layers import LayerAssignment
from autopar.inter.passes._partition import partition
from autopar.inter.passes._remat import STATE_ROLES, fused_recompute, recompute
from autopar.intra import (
    ContextParallelError,
    MemoryBudgetError,
    ShardingPlan,
    ShardOptions,
)
from autopar.intra._liveness import split_peak_live_bytes
from autopar.intra._planner import exact_ring_problem, finish_on_mesh, prepare_on_mesh
from autopar.intra._pool import jobs, solver_pool
from autopar.intra._problem import Footprint, chosen_layout
from autopar.intra._ring_strategies import ring_buffer_temporaries
from autopar.intra._rules_annotations import AnnotationMismatch


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
        reference: LayerCostTable | None = None,
        keep_layouts: bool = False,
        memory_levels: MemoryLevels = "price",
        fixed=None,
        lower_bounds: bool = True,
    ):
        """Layers are planned per microbatch: what runs once per step (the update, the
        deferred gradient reductions) weighs 1/`num_microbatches`.
        `solve(sub_graph, mesh, ties, weights) -> ShardingPlan` replaces the free ILP
        (manual plans pin their inputs this way); `axis_names` names the logical mesh axes.
        `in_flight(shape) -> int`: microbatches whose kept activations a stage on a mesh of
        that shape holds at once (default 1), the weight of the kept activations in the
        footprint the leaner levels limit (see `cost`).

        `reference`: the table of the same layers at another microbatch count, made with
        `keep_layouts=True` (it keeps each solved plan's `chosen_layout`). Where the
        reference has solved a layer at (shape, level), this table's cost there is that
        plan's layout priced on this table's graph (`price_layout`: the same cost model on
        these shapes), no ILP; it solves its own ILP where the reference has not (as much
        work, and exact) or the layout does not apply (a split these shapes do not divide,
        other operations, or over the memory budget). A priced cost is a feasible plan's,
        so no less than the ILP's optimum here; `forget_priced` drops them (issue 18:
        `num_microbatches="auto"` searches several counts).

        `memory_levels`: how a leaner level is made (`StageOptions.memory_levels`,
        `autopar.inter._levels`). `lower_bounds`: whether the stage DP may skip what its
        layers' fastest plans show cannot win (`StageOptions.lower_bounds`)."""
        check_choice("memory_levels", memory_levels, MEMORY_LEVELS)
        self.memory_levels = memory_levels
        self.lower_bounds = lower_bounds
        self.cluster = cluster
        self.in_flight = in_flight or (lambda shape: 1)
        self.options = options
        self.solve = solve
        self.axis_names = axis_names
        self.num_microbatches = num_microbatches
        self.tied = tied
        # A forced `context_parallel` no layout of a layer meets on a mesh: that (layer,
        # mesh) has no plan; the first such error names the tensor for the caller.
        self.context_errors: list[ContextParallelError] = []
        self._init_reference(reference, layers.num_layers, keep_layouts)
        self._init_layers(graph, layers)
        self._init_pins(fixed)
        # The first layer of each structure: every ILP (and priced layout) of the
        # structure is built on its graph, so that the memoised problem
        # (`autopar.intra._planner._built_problem`, per graph) serves each of its memory
        # levels whichever layer of the structure the stage DP asks about.
        self._representative = {}
        for k, f in enumerate(self.fingerprints):
            self._representative.setdefault(f, k)
        self._init_caches()

    def _init_reference(self, reference: LayerCostTable | None, num_layers: int,
                        keep_layouts: bool) -> None:
        """What pricing the `reference` table's layouts needs (`__init__`)."""
        if reference is not None and reference.per_layer.num_stages != num_layers:
            reference = None  # other layers: nothing to share
        self.reference = reference
        # id(plan) -> (plan, its `chosen_layout`), for tables that use this one as theirs.
        self._layouts: dict[int, tuple[ShardingPlan, tuple]] | None = (
            {} if keep_layouts else None
        )
        self._repriced: dict[tuple, tuple] = {}  # (fingerprint, id(reference plan)) -> found
        self._matching: dict[int, object] = {}  # layer -> `_matches_reference`
        self._priced_plans: set[int] = set()  # ids of the plans `_priced` made
        self.num_priced = 0  # layer costs found by pricing the reference's layouts

    def _init_layers(self, graph, layers: LayerAssignment) -> None:
        """Each layer's sub-graph, its nodes' weights per microbatch (what runs once per
        step weighs 1/`num_microbatches`), and its structure's fingerprint."""
        self.per_layer = partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)])
        self.weights = []
        for k, sub in enumerate(self.per_layer.stage_graphs):
            phases = {i: layers.phase[full] for full, i in self.per_layer.node_index[k].items()}
            self.weights.append(
                step_weights(sub, phases, self.per_layer.deferrable, self.num_microbatches,
                             overlap=self.cluster.overlap)
            )
        self.fingerprints = [
            structural_fingerprint(g) + repr(sorted(w.items()))
            for g, w in zip(self.per_layer.stage_graphs, self.weights)
        ]

    def _init_pins(self, fixed) -> None:
        """The user's pins and what a layer's ILP could not take for them."""
        # The user's pins (`autopar.search._pins.resolve_pins`: logical mesh -> {input
        # var: spec}; None: none). A layer reading a pinned input has an ILP of its own
        # (the pins name variables, which layers of the same structure do not share).
        self.fixed = fixed
        # Meshes a layer's ILP could not take for the user's shardings (pins, kept
        # annotations): "mesh (shape): why", the first named when no stage plan is left.
        self.pin_errors: list[str] = []
        if fixed is not None:
            pinned = {pin.var for pin in getattr(fixed, "pins", ())}
            self.fingerprints = [
                f"{f}/pinned layer {k}" if pinned & set(g.invars) or not pinned else f
                for k, (f, g) in enumerate(zip(self.fingerprints, self.per_layer.stage_graphs))
            ]

    def _init_caches(self) -> None:
        """The table's memo tables and counters, empty."""
        self._cache: dict[tuple, LayerCost | None] = {}  # (fingerprint, shape, level)
        self._plans: dict[tuple, tuple[ShardingPlan, OpGraph]] = {}
        self._remat_cache: dict[tuple, LayerCost] = {}
        # (layer range, mesh, ids of its layers' plans) -> what `stage_plan` stitched
        self._stitched: dict[tuple, tuple] = {}
        self._recomputes: dict[tuple, object] = {}
        self._kept: dict[int, frozenset[int]] = {}
        self._shared: dict[int, list[int]] | None = None  # state var -> layers reading it
        self._slots: dict[tuple[int, int], int] = {}  # (shared var, layer) -> input slot
        self._hashes: list | None = None  # `range_key`'s prefix hashes and powers
        # (`range_key`, ...) -> a `choose_remat` fit or a `_lower_bound`; cleared when full.
        self.range_cache: dict[tuple, object] = {}
        self._fused_reruns: dict[int, object] = {}  # layer -> its `fused_recompute`
        self._fused_by_level: dict[tuple, float] = {}  # (fingerprint, shape, level)
        self.num_ilps = 0
        self.ilp_seconds = 0.0  # wall seconds in `_drive`
        # The logical mesh shapes the stage DP may ask about (`choose_stages` sets them),
        # for the progress lines' count of level-0 ILPs left (`autopar.inter._progress`).
        self.candidate_shapes: tuple = ()
        self.progress_at = time.perf_counter()  # when the last progress line was logged
        self.num_hits = 0  # `cost` look-ups answered from the table
        self._driving = False  # inside `_drive` (nested solves count once in ilp_seconds)
        self._var_index: dict[int, dict[int, int]] = {}  # id(layer graph) -> `_compact`'s

    def cost(self, layer: int, shape: tuple[int, ...], level: int = 0) -> LayerCost | None:
        """The layer's cost on a mesh of `shape`; None when it cannot fit.

        Level 0 is the layer's fastest plan. At level L > 0 the layer's ILP also prices
        (or limits, by `memory_levels`) the layer's footprint on a stage (`footprint`: its state,
        accumulated gradients and the kept activations of the microbatches in flight):
        a leaner plan for stages whose fastest layer plans together do not fit, at a peak
        no higher than the fastest plan's. A layer that cannot get leaner (no footprint
        to give up, or the limit infeasible under that peak) keeps its plan of the level
        below. Each (layer structure, shape, level) is solved once.
        """
        key = (self.fingerprints[layer], shape, level)
        if key in self._cache:
            self.num_hits += 1
            return self._cache[key]
        self._cache[key], plan = self._plan_level(layer, shape, level)
        if plan is not None:
            self._plans[key] = plan
        _progress.report(self)
        return self._cache[key]

    def is_solved(self, layer: int, shape: tuple[int, ...], level: int) -> bool:
        """Whether `cost(layer, shape, level)` is known without a solve (with a
        `reference`: known there, so found here by pricing its layout)."""
        if (self.fingerprints[layer], shape, level) in self._cache:
            return True
        return self.reference is not None and self.reference.is_solved(layer, shape, level)

    def is_known(self, layer: int, shape: tuple[int, ...], level: int) -> bool:
        """Whether `cost(layer, shape, level)` is in this table already (no pricing of a
        reference's layout, which may not apply and then solves, one ILP at a time)."""
        return (self.fingerprints[layer], shape, level) in self._cache

    def prefetch(self, requests) -> None:
        """Solve the ILPs of the (layer, shape, level) costs in `requests` not known yet,
        side by side in the solver pool (`autopar.intra._pool`; nothing when it has one
        worker or there is one ILP); `cost` then answers from the table. Level by level,
        lowest first: a leaner level starts from the plans of level 0. The costs are
        those `cost` finds one at a time."""
        if self.solve is not None or jobs() <= 1:
            return
        wanted: dict[tuple, tuple[int, tuple, int]] = {}
        for layer, shape, level in requests:
            shape = tuple(shape)
            key = (self.fingerprints[layer], shape, level)
            if key not in self._cache:
                wanted.setdefault(key, (layer, shape, level))
            if level and (self.fingerprints[layer], shape, 0) not in self._cache:
                wanted.setdefault((self.fingerprints[layer], shape, 0), (layer, shape, 0))
        if len(wanted) < 2:
            return
        for level in sorted({lv for _, _, lv in wanted.values()}):
            # (those found while an earlier level was costed are left out; the likely
            # slowest ILPs first, `solve_order`)
            pending = [
                (key, self._level_steps(layer, shape, level))
                for key, (layer, shape, lv) in solve_order(wanted)
                if lv == level and key not in self._cache
            ]
            results = self._drive([steps for _, steps in pending], parallel=True)
            for (key, _), (cost, plan) in zip(pending, results):
                if key not in self._cache:
                    self._cache[key] = cost
                    if plan is not None:
                        self._plans[key] = plan
            _progress.report(self)

    def _plan_level(self, layer: int, shape, level: int):
        """(cost, (plan, graph solved on)) of one level; (None, None) when none fits."""
        return self._drive([self._level_steps(layer, shape, level)], parallel=False)[0]

    def _drive(self, all_steps: list, parallel: bool) -> list:
        """Run `_level_steps` generators to their ends, solving the ILPs they yield (in
        the solver pool when `parallel`: every generator's next ILP is in flight at
        once, `autopar.inter._ilp_driver`); their results in order. The wall seconds
        count as `ilp_seconds`."""
        outermost = not self._driving
        self._driving = True
        start = time.perf_counter()
        pool = solver_pool() if parallel else None
        try:
            return drive(all_steps, pool, finished=lambda done, total: _progress.report(
                self, batch=(done, total), seconds=time.perf_counter() - start))
        finally:
            if outermost:
                self._driving = False
                self.ilp_seconds += time.perf_counter() - start

    def _level_steps(self, layer: int, shape, level: int):
        """A generator yielding the `PreparedILP`s of one level (`_plan_level`) one at a
        time, sent each one's solution (or the exception its solve raised); it returns
        (cost, (plan, graph solved on)), or (None, None) when none fits. With a
        `reference`, its layout priced here where it applies (`_priced`), else the
        level's own ILPs (`autopar.inter._levels.level_steps`). Solved on the first layer
        of the structure (`_representative`)."""
        layer = self._representative[self.fingerprints[layer]]
        if self.reference is not None and self.solve is None:
            found = self._priced(layer, shape, level)
            if found is not None:
                return found
        return (yield from level_steps(self, layer, shape, level))

    def _priced(self, layer: int, shape, level: int):
        """(cost, (plan, graph)) of the reference's plan at (`shape`, `level`) priced on
        this layer (`autopar.inter._repricing.priced`); None where it does not apply."""
        return _repricing.priced(self, layer, shape, level)

    def forget_priced(self) -> None:
        """Drop the reference and every cost found by pricing its layouts (and what was
        derived from them); the costs of this table's own ILPs stay. A stage DP run
        again on it then solves the ILPs the priced costs stood in for."""
        _repricing.forget_priced(self)

    def _layer_cost(self, layer: int, sub: OpGraph, plan: ShardingPlan):
        """(cost, (plan, sub)) of a plan of the layer solved (or priced) on `sub`."""
        # The backward reruns the kept values its forward made inside a fusion
        # (`fused_recompute`, what `with_remat` lowers for every layer): their FLOPs.
        fused = layer_fused_seconds(self, layer, sub, plan)
        # The layer's peak as XLA holds it (`peak_live_bytes`: values die after their last
        # reader, fused ones are never written, a fused attention kernel's scores never
        # exist), not the ILP's linear bound (every value materialised at once), which
        # for an 8k-token attention layer counts every (s, s) tensor of its forward and
        # backward together.
        # The forward and backward's peak apart from the optimizer update's: the update
        # runs once per step after every microbatch's backward (`split_peak_live_bytes`).
        peak, update_peak = split_peak_live_bytes(
            sub, plan.var_specs, plan.mesh, self._update_start(layer, sub),
            operand_specs=plan.operand_specs, free=self._attention_core(sub),
            extra=ring_buffer_temporaries(sub, plan.var_specs, plan.node_strategies,
                                          plan.mesh))
        state = _state_bytes(sub, plan)
        gradients = _gradient_bytes(sub, plan, self.per_layer)
        # With several microbatches a backward's fresh gradients are held beside the
        # running sums (`gradients`, the step's accumulators: the runtime adds the task's
        # results into them after it), so the walk's gradients of one microbatch are
        # working memory on top of the sums. The update's peak used to hide this.
        fresh = gradients if self.num_microbatches > 1 else 0.0
        cost = LayerCost(
            plan.cost.total + fused,
            min(plan.cost.memory_per_device, peak) + fresh,
            _activation_bytes(sub, plan, self.kept_for_backward(layer),
                              getattr(self.cluster, "fused_attention", False)),
            state,
            gradients,
            max(0.0, update_peak - state - gradients),
        )
        if self.solve is None:
            object.__setattr__(plan, "var_specs", self._compact(sub, plan.var_specs))
        return cost, (plan, sub)

    def _level_as(self, layer: int, shape, level: int):
        """The cost and plan of `level` (solved if needed), to reuse at another level."""
        cost = self.cost(layer, shape, level)
        return cost, self._plans.get((self.fingerprints[layer], shape, level))

    def _solve_steps(self, layer: int, shape, footprint_budget: float | None,
                     peak_budget: float | None = None, price: float = 0.0):
        """Plan the layer on a mesh of `shape`: one ILP, yielded to be solved (or the
        caller's `solve`, run here)."""
        sub = self.per_layer.stage_graphs[layer]
        mesh = LogicalMesh.create(shape, axis_names=self.axis_names)
        self.num_ilps += 1
        ties = _tied_in(sub, self.tied) + self.chain_ties(layer)
        weights = self.weights[layer]
        try:
            pinned = self._pins_on(sub, mesh)
        except AnnotationMismatch as err:  # this mesh cannot hold a pin: no plan here
            self.pin_errors.append(f"mesh {shape}: {err}")
            return None, None
        if self.solve is not None:
            try:
                plan = self.solve(sub, mesh, ties, weights)
            except MemoryBudgetError as err:
                if isinstance(err, ContextParallelError):
                    self.context_errors.append(err)
                return None, None
        else:
            try:
                prepared = prepare_on_mesh(
                    sub, self.cluster, mesh, self.options, ties, fixed=pinned,
                    weights=weights,
                    footprint=self.footprint(layer, shape, footprint_budget, peak_budget,
                                             price),
                )
            except ContextParallelError as err:  # no plan on this mesh; others may have
                self.context_errors.append(err)
                return None, None
            except AnnotationMismatch as err:  # a kept annotation this mesh cannot hold
                self.pin_errors.append(f"mesh {shape}: {err}")
                return None, None
            solution = yield prepared
            if isinstance(solution, MemoryBudgetError):
                return None, None
            plan = finish_on_mesh(prepared, solution)
            # Under "auto", the ring's exact price where the ILP split attention's
            # sequence (its score dot saw the ring's upper bound): as `plan_on_mesh`.
            ring = exact_ring_problem(prepared, plan, pinned, weights)
            if ring is not None:
                ring_solution = yield ring
                if (not isinstance(ring_solution, MemoryBudgetError)
                        and ring_solution.objective < plan.stats["objective"]):
                    prepared, solution = ring, ring_solution
                    plan = finish_on_mesh(ring, ring_solution)
            if self._layouts is not None:
                self._layouts[id(plan)] = (plan, chosen_layout(prepared.built,
                                                               solution.choices))
        return self._layer_cost(layer, sub, plan)

    def _pins_on(self, sub: OpGraph, mesh: LogicalMesh):
        """The user's pins of `sub`'s inputs on `mesh` ({var: spec}; None without pins);
        raises `AnnotationMismatch` when the mesh cannot hold one of them."""
        if self.fixed is None:
            return None
        inputs = set(sub.invars)
        return {v: spec for v, spec in self.fixed(mesh).items() if v in inputs} or None

    def _compact(self, sub: OpGraph, var_specs):
        """`var_specs` as `_CompactSpecs` over the variables `sub`'s nodes touch: a layer
        graph keeps the whole step's variable table, so a plain tuple per layer plan is
        mostly None (GPT-3 175B on 1,024 GPUs: 3,060 plans of ~50,000 entries)."""
        index = self._var_index.get(id(sub))
        if index is None:
            used = set(sub.invars) | set(sub.outvars)
            for node in sub.nodes:
                used.update(node.inputs)
                used.update(node.outputs)
            index = self._var_index[id(sub)] = {v: i for i, v in enumerate(sorted(used))}
        return _CompactSpecs.of(var_specs, index)

    def fused_rerun(self, layer: int):
        """The layer's `fused_recompute` (ids of its per-layer graph): the kept values its
        forward makes inside a fusion, rerun in its backward whatever the remat choice
        but "full" (which reruns the whole forward)."""
        if layer not in self._fused_reruns:
            part = self.per_layer
            sub = part.stage_graphs[layer]
            fwd, bwd = part.forward[layer], part.backward[layer]
            bwd_inputs = set(bwd.inputs)
            leaving = set(sub.outvars)
            leaving.update(v for v in fwd.outputs if v not in bwd_inputs)
            self._fused_reruns[layer] = fused_recompute(
                sub, fwd.nodes, set(fwd.outputs) & bwd_inputs, leaving, bwd.nodes
            )
        return self._fused_reruns[layer]

    def fused_seconds(self, layer: int, shape: tuple[int, ...], level: int = 0) -> float:
        """Seconds per microbatch the layer's fused rerun adds at (`shape`, `level`),
        included in `cost(...).latency` (0 when the layer has no plan there)."""
        if self.cost(layer, shape, level) is None:
            return 0.0
        plan, solved_on = self.solved_plan(layer, shape, level)
        key = (self.fingerprints[layer], shape, level)
        if key not in self._fused_by_level:
            self._fused_by_level[key] = layer_fused_seconds(self, layer, solved_on, plan)
        return self._fused_by_level[key]

    def remat_cost(
        self, layer: int, shape: tuple[int, ...], level: int, remat: str
    ) -> LayerCost | None:
        """The layer's cost at (`shape`, `level`) with `remat` ("none", "selective",
        "full"; see `autopar.inter.passes._remat`), priced by `autopar.cost`'s recompute
        formulas on the layer's plan: the rerun nodes' roofline seconds and the bytes per
        device of what it drops and keeps. A layer with nothing to drop (no attention core
        for "selective", or the user's own `jax.checkpoint`) costs as with "none"."""
        base = self.cost(layer, shape, level)
        if base is None or remat == "none":
            return base
        key = (self.fingerprints[layer], shape, level, remat)
        if key not in self._remat_cache:
            self._remat_cache[key] = price_remat(self, layer, shape, level, remat, base)
        return self._remat_cache[key]

    def recompute_of(self, layer: int, remat: str):
        """The layer's `Recompute` for `remat` (ids of its per-layer graph)."""
        key = (layer, remat)
        if key not in self._recomputes:
            sub = self.per_layer.stage_graphs[layer]
            forward = self.per_layer.forward[layer].nodes
            backward = self.per_layer.backward[layer].nodes
            self._recomputes[key] = recompute(
                sub, forward, self.kept_for_backward(layer), remat, backward
            )
        return self._recomputes[key]

    def footprint_span(self, layer: int, shape: tuple[int, ...]) -> tuple[float, float]:
        """(least, fastest plan's) footprint of the layer on a mesh of `shape`, bytes per
        device; the least ignores costs and the peak memory (a lower bound)."""
        stats = self.solved_plan(layer, shape, 0)[0].stats
        return stats["least_footprint"], stats["footprint"]

    def footprint(self, layer: int, shape: tuple[int, ...], budget: float | None,
                  peak_budget: float | None = None, price: float = 0.0) -> Footprint:
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
        return Footprint(held, unreduced, budget, peak_budget, price)

    def plan(self, layer: int, shape: tuple[int, ...], level: int = 0) -> ShardingPlan | None:
        """The layer's plan behind `cost(layer, shape, level)` (solved for a layer of the
        same structure; its variable ids are that layer's)."""
        if self.cost(layer, shape, level) is None:
            return None
        return self.solved_plan(layer, shape, level)[0]

    def solved_plan(self, layer: int, shape: tuple[int, ...], level: int = 0):
        """(plan, graph it was solved on) behind `cost(layer, shape, level)`, which must
        have found one (the graph is a layer of the same structure)."""
        return self._plans[(self.fingerprints[layer], shape, level)]

    def _update_start(self, layer: int, sub: OpGraph) -> int:
        """The first node of the layer's optimizer update in its per-layer graph (its apply
        fragments; the graph's length when it has none), every forward and backward node
        before it. `sub` is the layer's graph or one of the same structure."""
        part = self.per_layer
        update = [n for seg in part.apply if seg.stage == layer for n in seg.nodes]
        if not update:
            return len(sub.nodes)
        start = min(update)
        per_microbatch = (*part.forward[layer].nodes, *part.backward[layer].nodes)
        if per_microbatch and max(per_microbatch) >= start:
            return len(sub.nodes)  # interleaved: no clean cut, the whole graph as one
        return start

    def _attention_core(self, sub: OpGraph) -> frozenset[int]:
        """The values a fused attention kernel never writes (`attention_core`), on a
        cluster that runs one (`Cluster.fused_attention`); else none."""
        if not getattr(self.cluster, "fused_attention", False):
            return frozenset()
        return attention_core(sub, outputs=True)

    def kept_for_backward(self, layer: int) -> set[int]:
        """What a microbatch in flight keeps on the stage for the layer's backward: of the
        values its forward computes and its backward reads, those the forward writes to
        memory, and for the others (made inside a forward fusion) what the backward's
        fusion recomputes them from (`autopar.graph.stored_residuals`)."""
        if layer not in self._kept:
            part = self.per_layer
            sub = part.stage_graphs[layer]
            fwd, bwd_inputs = part.forward[layer], set(part.backward[layer].inputs)
            leaving = set(sub.outvars)
            leaving.update(v for v in fwd.outputs if v not in bwd_inputs)
            self._kept[layer] = frozenset(stored_residuals(
                sub, fwd.nodes, set(fwd.outputs) & bwd_inputs, leaving,
                free=lambda v: sub.vars[v].role in STATE_ROLES,
                core=self._attention_core(sub),
            ))
        return set(self._kept[layer])

    def shared_readers(self) -> dict[int, list[int]]:
        """State vars read by several layers -> those layers, in order."""
        if self._shared is None:
            readers: dict[int, list[int]] = {}
            for k, sub in enumerate(self.per_layer.stage_graphs):
                for v in sub.invars:  # ids of the whole graph: sub-graphs share its vars
                    if sub.vars[v].role in (Role.PARAM, Role.OPT_STATE):
                        readers.setdefault(v, []).append(k)
            self._shared = {v: ks for v, ks in readers.items() if len(ks) > 1}
            self._slots = {
                (v, k): self.per_layer.stage_graphs[k].invars.index(v)
                for v, ks in self._shared.items() for k in ks
            }
        return self._shared

    def range_key(self, layer_range) -> tuple | None:
        """A key equal for contiguous layer ranges of equal content, whose costs, memory
        and remat choices are therefore equal; None for a range that is not contiguous
        (`autopar.inter._range_cache.range_key`)."""
        return _range_cache.range_key(self, layer_range)

    def shared_state_bytes(self, layer_range, shape: tuple[int, ...], level: int = 0) -> float:
        """Bytes per device of parameters and optimizer state that several of the layers
        read (a tied embedding, read by the first and the last layer), beyond one copy:
        each reader's `LayerCost.state_memory` counts them, the stage holds them once
        (the runtime keeps one array per input and stage). A shared value counts at its
        smallest size among its readers' layouts."""
        layer_range = range(layer_range[0], layer_range[-1] + 1) if len(layer_range) else ()
        excess = []
        for v, ks in self.shared_readers().items():
            inside = [k for k in ks if k in layer_range]
            if len(inside) < 2:
                continue
            sizes = []
            for k in inside:
                if self.cost(k, shape, level) is None:
                    return 0.0
                plan, solved_on = self.solved_plan(k, shape, level)
                spec = plan.var_specs[_var_map(self.per_layer.stage_graphs[k], solved_on)
                                      .get(v, v)]
                var = self.per_layer.stage_graphs[k].vars[v]
                if spec is not None:  # as `_state_bytes` counts it
                    sizes.append(bytes_per_device(var.shape, var.dtype, spec, plan.mesh))
            if len(sizes) > 1:
                excess.append(math.fsum(sizes) - min(sizes))
        return math.fsum(excess)

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
            plan, solved_on = self.solved_plan(k, shape, level)
            sub = self.per_layer.stage_graphs[k]
            parts.append((sub, self.per_layer.node_index[k], plan, solved_on))
        stage_graph = stage_part.stage_graphs[stage]
        # The same layers' plans on the same mesh stitched onto the same stage sub-graph
        # (another split sharing this stage, e.g. another stage count of the explored
        # space) give the same plan: stitched once.
        key = (tuple(layer_range), mesh, tuple((id(p[2]), id(p[3])) for p in parts))
        held = self._stitched.get(key)
        if held is not None and _same_stage(held[0], stage_graph, stage_index):
            return held[2]
        for k in range(*layer_range):
            for full, i in self.per_layer.node_index[k].items():
                if i in self.weights[k]:
                    weights[stage_index[full]] = self.weights[k][i][0]
        plan = stitch(
            stage_graph, stage_index, parts, mesh, self.cluster,
            _tied_in(stage_graph, self.tied), weights=weights,
            tie_weight=1.0 / self.num_microbatches, handed_on=handed_on,
        )
        # The parts are kept so that the ids in the key stay theirs.
        self._stitched[key] = ((stage_graph, stage_index), parts, plan)
        return plan


def solve_order(wanted: dict) -> list:
    """The items of `wanted` ({key: (layer, mesh shape, level)}) in the order their ILPs
    go to the solver pool: the likely slowest first (meshes with more axes of size > 1,
    then more devices; `drive` builds and submits them in this order, so that the longest
    solves start while the rest are built and the last ILPs built are the quick ones: on
    the demo the layer ILPs on the 2-D meshes take most of the solve time). The order
    changes when a cost is known, never what it is (each ILP is solved alone)."""
    def slowest_first(item):
        _, (layer, shape, level) = item
        return -sum(d > 1 for d in shape), -math.prod(shape)
    return sorted(wanted.items(), key=slowest_first)


def _same_stage(held, stage_graph, stage_index) -> bool:
    """Whether `stage_graph` (with full node id -> its node id `stage_index`) is the
    stage sub-graph `held` (graph, index) is, but for its name: the same step's variables,
    the same nodes numbered alike (so the same node list), inputs and outputs."""
    graph, index = held
    return graph is stage_graph or (
        graph.vars is stage_graph.vars and graph.invars == stage_graph.invars
        and graph.outvars == stage_graph.outvars
        and len(graph.nodes) == len(stage_graph.nodes) and index == stage_index)


def layer_cost_table(graph, layers, cluster, num_microbatches, options: StageOptions, tied, *,
                     reference=None, keep_layouts=False, fixed=None):
    """The `LayerCostTable` `choose_stages` plans with under `options` (hand it back to
    re-run the DP); `reference` and `keep_layouts` as `LayerCostTable` takes them."""
    schedule = options.schedule

    def in_flight(shape) -> int:
        # The layer ILPs' estimate of the activations in flight (a weight in the footprint
        # their leaner levels limit; they do not know the stage's position): GPipe keeps all
        # microbatches, 1F1B at most one per stage that could follow on the devices left.
        # The stage DP's memory check uses each stage's exact position (`_StageCosts`).
        later = max(1, cluster.num_devices // math.prod(shape))
        return in_flight_microbatches(schedule, num_microbatches, later)

    return LayerCostTable(
        graph, layers, cluster, options.shard, tied, num_microbatches=num_microbatches,
        in_flight=in_flight, reference=reference, keep_layouts=keep_layouts,
        memory_levels=options.memory_levels, fixed=fixed, lower_bounds=options.lower_bounds,
    )
