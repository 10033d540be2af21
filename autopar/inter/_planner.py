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

import dataclasses
import hashlib
import logging
import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.cluster._mesh import LogicalMesh
from autopar.cost import (
    LayerCost,
    StageMemory,
    boundary_transfer_time,
    bytes_per_device,
    full_recompute_cost,
    fused_rerun_seconds,
    in_flight_microbatches,
    memory_budget,
    rate_dtype,
    recompute_seconds,
    selective_recompute_cost,
    stage_dispatch_time,
    stage_memory_parts,
)
from autopar.graph import OpGraph, Role, fusion_traffic, stored_residuals, trace_jaxpr
from autopar.graph._opgraph import dtype_itemsize
from autopar.inter._stage_dp import StageCost, StagePlan, plan_stages
from autopar.inter._stitch import stitch
from autopar.inter._submesh import (
    SubmeshShape,
    assign_devices,
    logical_mesh_shapes,
    submesh_shapes,
)
from autopar.inter.passes._deferred import gradient_roots, stacked_layout, step_weights
from autopar.inter.passes._layers import LayerAssignment
from autopar.inter.passes._partition import Partition, partition
from autopar.inter.passes._remat import (
    STATE_ROLES,
    fused_recompute,
    in_core,
    recompute,
    scan_body,
    score_shapes,
)
from autopar.intra._ilp import MemoryBudgetError, solve
from autopar.intra._options import ShardOptions
from autopar.intra._planner import PreparedILP, finish_on_mesh, prepare_on_mesh, price_layout
from autopar.intra._pool import WorkerDied, jobs, solver_pool
from autopar.intra._problem import Footprint, chosen_layout, unstacked_spec
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
        reference: LayerCostTable | None = None,
        keep_layouts: bool = False,
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
        `num_microbatches="auto"` searches several counts)."""
        self.cluster = cluster
        self.in_flight = in_flight or (lambda shape: 1)
        if reference is not None and reference.per_layer.num_stages != layers.num_layers:
            reference = None  # other layers: nothing to share
        self.reference = reference
        # id(plan) -> (plan, its `chosen_layout`), for tables that use this one as theirs.
        self._layouts: dict[int, tuple[ShardingPlan, tuple]] | None = (
            {} if keep_layouts else None
        )
        self._repriced: dict[tuple, tuple] = {}  # (fingerprint, id(reference plan)) -> found
        self._matching: dict[int, bool] = {}  # layer -> `_matches_reference`
        self._priced_plans: set[int] = set()  # ids of the plans `_priced` made
        self.num_priced = 0  # layer costs found by pricing the reference's layouts
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
        self._remat_cache: dict[tuple, LayerCost] = {}
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
        self.num_hits = 0  # `cost` look-ups answered from the table
        self._driving = False  # inside `_drive` (nested solves count once in ilp_seconds)
        self._var_index: dict[int, dict[int, int]] = {}  # id(layer graph) -> `_compact`'s

    def cost(self, layer: int, shape: tuple[int, ...], level: int = 0) -> LayerCost | None:
        """The layer's cost on a mesh of `shape`; None when it cannot fit.

        Level 0 is the layer's fastest plan. At level L > 0 the layer's ILP also prices
        (or limits, `LEVELS`) the layer's footprint on a stage (`footprint`: its state,
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
        return self._cache[key]

    def is_solved(self, layer: int, shape: tuple[int, ...], level: int) -> bool:
        """Whether `cost(layer, shape, level)` is known without a solve (with a
        `reference`: known there, so found here by pricing its layout)."""
        if (self.fingerprints[layer], shape, level) in self._cache:
            return True
        return self.reference is not None and self.reference.is_solved(layer, shape, level)

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
            pending = [  # (those found while an earlier level was costed are left out)
                (key, self._level_steps(layer, shape, level))
                for key, (layer, shape, lv) in wanted.items()
                if lv == level and key not in self._cache
            ]
            results = self._drive([steps for _, steps in pending], parallel=True)
            for (key, _), (cost, plan) in zip(pending, results):
                if key not in self._cache:
                    self._cache[key] = cost
                    if plan is not None:
                        self._plans[key] = plan

    def _plan_level(self, layer: int, shape, level: int):
        """(cost, (plan, graph solved on)) of one level; (None, None) when none fits."""
        return self._drive([self._level_steps(layer, shape, level)], parallel=False)[0]

    def _drive(self, all_steps: list, parallel: bool) -> list:
        """Run `_level_steps` generators to their ends, solving the ILPs they yield (in
        the solver pool when `parallel`: every generator's next ILP is in flight at
        once); their results in order. The wall seconds count as `ilp_seconds`."""
        outermost = not self._driving
        self._driving = True
        start = time.perf_counter()
        results: list = [None] * len(all_steps)
        pool = solver_pool() if parallel else None
        try:
            # Each ILP goes to the pool as soon as it is built, so that building the next
            # overlaps solving this one.
            handles = {}
            for i, steps in enumerate(all_steps):
                self._advance(i, steps, None, handles, results, pool)
            while handles:
                asked, handles = handles, {}
                for i, handle in asked.items():
                    self._advance(i, all_steps[i], self._outcome(handle), handles, results,
                                  pool)
        finally:
            if outermost:
                self._driving = False
                self.ilp_seconds += time.perf_counter() - start
        return results

    def _advance(self, i: int, steps, outcome, handles: dict, results: list, pool) -> None:
        """Send `outcome` (a solution or the exception its solve raised) into generator
        `i`: its next ILP is started (`handles[i]`), or its result goes to `results`."""
        try:
            if isinstance(outcome, BaseException) and not isinstance(outcome, MemoryBudgetError):
                prepared = steps.throw(outcome)
            else:
                prepared = steps.send(outcome)
        except StopIteration as stop:
            results[i] = stop.value
            return
        handles[i] = self._start_solve(prepared, pool)

    @staticmethod
    def _start_solve(prepared: PreparedILP, pool) -> tuple:
        """(prepared, its solve's future in `pool`, or None: solved by `_outcome`)."""
        if pool is None or pool.broken:
            return prepared, None
        try:
            return prepared, pool.submit(prepared.problem, **prepared.solve_args)
        except OSError as err:  # no worker could start (then the pool is broken)
            log.warning("the sharding ILP pool failed (%s): solving here instead", err)
            return prepared, None

    @staticmethod
    def _outcome(handle: tuple):
        """The solution of a `_start_solve` handle, or the exception its solve raised."""
        prepared, future = handle
        try:
            if future is not None:
                try:
                    return future.result()
                except WorkerDied as err:
                    log.warning("%s: solving its ILP here instead", err)
            return solve(prepared.problem, **prepared.solve_args)
        except Exception as err:
            return err

    def _level_steps(self, layer: int, shape, level: int):
        """A generator yielding the `PreparedILP`s of one level (`_plan_level`) one at a
        time, sent each one's solution (or the exception its solve raised); it returns
        (cost, (plan, graph solved on)), or (None, None) when none fits."""
        if self.reference is not None and self.solve is None:
            found = self._priced(layer, shape, level)
            if found is not None:
                return found
        if level == 0:
            return (yield from self._solve_steps(layer, shape, footprint_budget=None))
        if self.cost(layer, shape) is None or self.solve is not None:
            return None, None
        if level >= NUM_LEVELS:
            return None, None
        least, at_fastest = self.footprint_span(layer, shape)
        if least >= at_fastest * (1 - 1e-6):
            return self._level_as(layer, shape, 0)  # no leaner plan than the fastest
        # No higher peak than the fastest plan's: see `Footprint.peak_budget`.
        fastest = self._plans[(self.fingerprints[layer], shape, 0)][0]
        peak = fastest.cost.memory_per_device * (1 + PEAK_TOLERANCE)
        if LEVELS == "price":
            price = LEVEL_PRICES[level] * fastest.cost.total / (at_fastest - least)
            solved = yield from self._solve_steps(layer, shape, footprint_budget=None,
                                                  price=price)
            if solved[0] is not None and solved[1][0].cost.memory_per_device > peak:
                # Leaner for the run but not at its peak: solve again under that peak
                # (memory rows: a MIP, for the few layers where it binds).
                solved = yield from self._solve_steps(
                    layer, shape, footprint_budget=None, peak_budget=peak, price=price
                )
        else:
            budget = least + (at_fastest - least) * LEVEL_FRACTIONS[level]
            solved = yield from self._solve_steps(layer, shape, footprint_budget=budget,
                                                  peak_budget=peak)
        if solved[0] is None:
            # The least footprint is a lower bound the peak memory may not allow: this
            # layer stays at its leanest feasible plan.
            return self._level_as(layer, shape, level - 1)
        return solved

    def _priced(self, layer: int, shape, level: int):
        """(cost, (plan, graph)) of the reference's plan at (`shape`, `level`) priced on
        this table's layer (`price_layout`); None where the reference has not solved it
        (an ILP here is as much work, and exact), has no plan, or its layout does not apply
        (then the ILP decides). A level the reference answered with a lower level's plan
        is priced once."""
        ref = self.reference
        if (not self._matches_reference(layer) or not ref.is_solved(layer, shape, level)
                or ref.cost(layer, shape, level) is None):
            return None
        ref_plan = ref._plans[(ref.fingerprints[layer], shape, level)][0]
        kept = ref._layouts.get(id(ref_plan)) if ref._layouts is not None else None
        if kept is None:
            return None
        key = (self.fingerprints[layer], id(ref_plan))
        if key not in self._repriced:
            sub = self.per_layer.stage_graphs[layer]
            mesh = LogicalMesh.create(shape, axis_names=self.axis_names)
            ties = _tied_in(sub, self.tied) + self.chain_ties(layer)
            plan = price_layout(
                sub, self.cluster, mesh, kept[1], self.options, ties,
                weights=self.weights[layer], footprint=self.footprint(layer, shape, None),
            )
            self._repriced[key] = None if plan is None else self._layer_cost(layer, sub, plan)
            if plan is not None:
                self.num_priced += 1
                self._priced_plans.add(id(plan))
        return self._repriced[key]

    def forget_priced(self) -> None:
        """Drop the reference and every cost found by pricing its layouts (and what was
        derived from them); the costs of this table's own ILPs stay. A stage DP run
        again on it then solves the ILPs the priced costs stood in for."""
        for key, (plan, _) in list(self._plans.items()):
            if id(plan) in self._priced_plans:
                del self._plans[key]
                del self._cache[key]
        self.reference, self._repriced, self._priced_plans = None, {}, set()
        self._remat_cache.clear()
        self._fused_by_level.clear()
        self.range_cache.clear()

    def _matches_reference(self, layer: int) -> bool:
        """Whether the layer's graph has the reference's layer's operations in the same
        order (a one-row microbatch traces to other ones: no layout of it applies)."""
        if layer not in self._matching:
            mine = self.per_layer.stage_graphs[layer]
            theirs = self.reference.per_layer.stage_graphs[layer]
            self._matching[layer] = (
                len(mine.invars) == len(theirs.invars)
                and [n.primitive for n in mine.nodes] == [n.primitive for n in theirs.nodes]
            )
        return self._matching[layer]

    def _layer_cost(self, layer: int, sub: OpGraph, plan: ShardingPlan):
        """(cost, (plan, sub)) of a plan of the layer solved (or priced) on `sub`."""
        # The backward reruns the kept values its forward made inside a fusion
        # (`fused_recompute`, what `with_remat` lowers for every layer): their FLOPs.
        fused = self._fused_seconds(layer, sub, plan)
        cost = LayerCost(
            plan.cost.total + fused,
            plan.cost.memory_per_device,
            _activation_bytes(sub, plan, self.kept_for_backward(layer)),
            _state_bytes(sub, plan),
            _gradient_bytes(sub, plan, self.per_layer),
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
        if self.solve is not None:
            try:
                plan = self.solve(sub, mesh, ties, weights)
            except MemoryBudgetError:
                return None, None
        else:
            prepared = prepare_on_mesh(
                sub, self.cluster, mesh, self.options, ties, weights=weights,
                footprint=self.footprint(layer, shape, footprint_budget, peak_budget, price),
            )
            solution = yield prepared
            if isinstance(solution, MemoryBudgetError):
                return None, None
            plan = finish_on_mesh(prepared, solution)
            if self._layouts is not None:
                self._layouts[id(plan)] = (plan, chosen_layout(prepared.built,
                                                               solution.choices))
        return self._layer_cost(layer, sub, plan)

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

    def _fused_seconds(self, layer: int, solved_on: OpGraph, plan: ShardingPlan) -> float:
        """`fused_rerun_seconds` of the layer's fused rerun under `plan` (solved on
        `solved_on`, a layer of the same structure): each rerun node's FLOPs at the share
        of its result a device holds."""
        sub = self.per_layer.stage_graphs[layer]
        to_solved = _var_map(sub, solved_on)
        work = []
        for n in self.fused_rerun(layer).nodes:
            node = sub.nodes[n]
            if not node.outputs or node.flops <= 0:
                continue
            out = sub.vars[node.outputs[0]]
            spec = plan.var_specs[to_solved.get(out.id, out.id)]
            share = 1.0
            if spec is not None and out.shape and out.nbytes > 0:
                share = bytes_per_device(out.shape, out.dtype, spec, plan.mesh) / out.nbytes
            work.append((node.flops * share, out.dtype))
        return fused_rerun_seconds(work, self.cluster)

    def fused_seconds(self, layer: int, shape: tuple[int, ...], level: int = 0) -> float:
        """Seconds per microbatch the layer's fused rerun adds at (`shape`, `level`),
        included in `cost(...).latency` (0 when the layer has no plan there)."""
        if self.cost(layer, shape, level) is None:
            return 0.0
        plan, solved_on = self._plans[(self.fingerprints[layer], shape, level)]
        key = (self.fingerprints[layer], shape, level)
        if key not in self._fused_by_level:
            self._fused_by_level[key] = self._fused_seconds(layer, solved_on, plan)
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
            self._remat_cache[key] = self._price_remat(layer, shape, level, remat, base)
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

    def _price_remat(self, layer, shape, level, remat, base: LayerCost) -> LayerCost:
        plan, solved_on = self._plans[(self.fingerprints[layer], shape, level)]
        rerun = self.recompute_of(layer, remat)
        if not rerun.nodes:
            return base
        # The plan was solved on a layer of the same structure: map this layer's ids onto
        # its graph by position (same fingerprint, same numbering of nodes and vars).
        sub = self.per_layer.stage_graphs[layer]
        to_solved = _var_map(sub, solved_on)
        to_node = {} if sub is solved_on else {
            a.id: b.id for a, b in zip(sub.nodes, solved_on.nodes)
        }

        def nbytes(v):
            var = sub.vars[v]
            spec = plan.var_specs[to_solved.get(v, v)]
            if spec is None or not var.shape:
                return float(var.nbytes)
            return bytes_per_device(var.shape, var.dtype, spec, plan.mesh)

        # Nodes the fused rerun already runs (priced in `base`) are not priced again.
        fused_nodes = set() if remat == "full" else set(self.fused_rerun(layer).nodes)
        seconds = rerun_seconds(solved_on, plan, [to_node.get(n, n) for n in rerun.nodes
                                                  if n not in fused_nodes], self.cluster)
        for n in rerun.nodes:  # a scan's body plan is no node strategy: priced by its work
            node = sub.nodes[n]
            if node.primitive == "scan":
                seconds += _scan_rerun_seconds(node, nbytes, sub, rerun.core_only, self.cluster)
        dropped = math.fsum(nbytes(v) for v in rerun.dropped)
        added = math.fsum(nbytes(v) for v in rerun.added)
        fused = self.fused_seconds(layer, shape, level)
        if remat == "full":  # it drops all it kept, and keeps what its forward reads
            inputs = math.fsum(
                nbytes(v) for v in rerun.reads if sub.vars[v].role not in STATE_ROLES
            )
            # The whole forward rerun replaces the fused rerun `base` has in its latency.
            return full_recompute_cost(base, max(0.0, seconds - fused), inputs)
        return selective_recompute_cost(base, seconds, dropped, added)

    def footprint_span(self, layer: int, shape: tuple[int, ...]) -> tuple[float, float]:
        """(least, fastest plan's) footprint of the layer on a mesh of `shape`, bytes per
        device; the least ignores costs and the peak memory (a lower bound)."""
        stats = self._plans[(self.fingerprints[layer], shape, 0)][0].stats
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
        return self._plans[(self.fingerprints[layer], shape, level)][0]

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
        """A key equal for contiguous layer ranges of equal content -- the same layer
        structures in the same order, sharing the same state at the same places -- whose
        costs, memory and remat choices are therefore equal (every per-layer figure is
        keyed by the layer's structure); None for a range that is not contiguous.
        O(shared state vars): the structures are compared by two polynomial hashes of
        the sequence (mod 2^61 - 1), not layer by layer."""
        if isinstance(layer_range, range):
            if layer_range.step != 1:
                return None
            start, end = layer_range.start, layer_range.stop
        else:
            layer_range = list(layer_range)
            if not layer_range:
                return ()
            start, end = layer_range[0], layer_range[-1] + 1
            if layer_range != list(range(start, end)):
                return None
        if end <= start:
            return ()
        if self._hashes is None:
            ids: dict[str, int] = {}
            codes = [ids.setdefault(f, len(ids)) + 1 for f in self.fingerprints]
            self._hashes = []
            for base in _HASH_BASES:
                prefix, power = [0], [1]
                for c in codes:
                    prefix.append((prefix[-1] * base + c) % _HASH_MOD)
                    power.append(power[-1] * base % _HASH_MOD)
                self._hashes.append((prefix, power))
        length = end - start
        key = [length]
        for prefix, power in self._hashes:
            key.append((prefix[end] - prefix[start] * power[length]) % _HASH_MOD)
        for v, ks in self.shared_readers().items():
            inside = [k for k in ks if start <= k < end]
            if len(inside) > 1:
                key.append(tuple((k - start, self._slots[(v, k)]) for k in inside))
        return tuple(key)

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
                plan, solved_on = self._plans[(self.fingerprints[k], shape, level)]
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


class _CompactSpecs(Sequence):
    """A plan's `var_specs` (a spec per variable id, None for most) stored as one tuple of
    the specs of the variables in `index` (var id -> position, shared by the plans of one
    layer graph); every other id reads None. Reads as the tuple it replaces."""

    __slots__ = ("_index", "_specs", "_length")

    def __init__(self, index: dict[int, int], specs: tuple, length: int):
        self._index, self._specs, self._length = index, specs, length

    @classmethod
    def of(cls, var_specs, index: dict[int, int]):
        """The compact form of `var_specs`; `var_specs` itself when a spec lies outside
        `index`."""
        specs = [None] * len(index)
        for v, spec in enumerate(var_specs):
            if spec is not None:
                at = index.get(v)
                if at is None:
                    return var_specs
                specs[at] = spec
        return cls(index, tuple(specs), len(var_specs))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, v):
        if isinstance(v, slice):
            return tuple(self[i] for i in range(*v.indices(self._length)))
        if v < 0:
            v += self._length
        if not 0 <= v < self._length:
            raise IndexError(f"variable {v} out of range ({self._length} variables)")
        at = self._index.get(v)
        return None if at is None else self._specs[at]

    def __iter__(self):
        get, specs = self._index.get, self._specs
        for v in range(self._length):
            at = get(v)
            yield None if at is None else specs[at]

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, list, _CompactSpecs)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"_CompactSpecs({tuple(self)!r})"


def _scan_rerun_seconds(node, nbytes, graph: OpGraph, core_only: bool, cluster) -> float:
    """Predicted seconds to rerun a scan's forward (`core_only`: only its body's attention
    core, the values shaped like the body's `score_shapes`): each body node's roofline time
    (`recompute_seconds`: its FLOPs, the bytes crossing its fusion's boundary,
    `autopar.graph.fusion_traffic`), `length` times, at the share of the work one device
    does, taken as the share of the scan's results a device holds (`nbytes(v)` per device
    over their whole size). A rerun body's tensor-parallel collectives are not counted."""
    body = trace_jaxpr(node.params["jaxpr"], name="scan body")
    scores = score_shapes(scan_body(node))
    traffic = fusion_traffic(body, cluster.fused_attention)
    whole = math.fsum(graph.vars[v].nbytes for v in node.outputs)
    share = math.fsum(nbytes(v) for v in node.outputs) / whole if whole > 0 else 1.0
    scale = node.params["length"] * share
    work = []
    for b in body.nodes:
        outs = [body.vars[v] for v in b.outputs]
        if core_only and not any(in_core(o.shape, scores) for o in outs):
            continue
        ins = [body.vars[v] for v in b.inputs]
        hbm = traffic.hbm_bytes(
            b.id, [0 if i.role is Role.CONST else i.nbytes for i in ins], [o.nbytes for o in outs]
        )
        dtype = rate_dtype(b.primitive, [i.dtype for i in ins],
                           outs[0].dtype if outs else "float32")
        work.append((b.flops * scale, hbm * scale, dtype))
    return recompute_seconds(work, cluster)


def rerun_seconds(graph: OpGraph, plan: ShardingPlan, node_ids, cluster) -> float:
    """Predicted seconds to rerun forward nodes `node_ids` of `graph` as `plan` runs them:
    each node's chosen strategy's compute (its FLOPs per device, at the rate of its operand
    dtypes, GEMMs by the efficiency table, bytes across fusion boundaries) and its own
    collectives (a row-parallel dot's all-reduce), plus the resharding of its operands the
    plan does (sequence parallelism's all-gathers): exactly what the forward cost, since a
    recompute reruns the forward as planned (Megatron-LM reissues the tensor-parallel
    collectives too; Korthikanti et al. 2022, section 5)."""
    from autopar.intra._reshard import reshard_time
    from autopar.intra._strategies import CostContext, node_signature, node_strategies

    ctx = CostContext(cluster, plan.mesh)
    wanted = set(node_ids)
    operand_specs = {(n, p): spec for n, p, spec in plan.operand_specs if n in wanted}
    # A layer is priced at several levels and remat choices on one mesh: each node's
    # strategies are costed once per (mesh, cluster).
    by_node = _RERUN_STRATEGIES.setdefault(graph, {})
    seconds = 0.0
    for n in node_ids:
        node = graph.nodes[n]
        key = (n, plan.mesh, cluster)
        if key not in by_node:
            costs = by_node[key] = {}
            for s in node_strategies(node, graph, node_signature(node, graph), ctx):
                costs.setdefault(s.name, s.compute_cost + s.comm_cost)  # the first of a name
        # No entry: an identity marker or a node planned without a rule.
        seconds += by_node[key].get(plan.node_strategies[n], 0.0)
        for p, v in enumerate(node.inputs):
            var = graph.vars[v]
            have, want = plan.var_specs[v], operand_specs.get((n, p))
            if want is not None and have is not None and want != have:
                seconds += reshard_time(var.shape, var.dtype, have, want, plan.mesh, cluster)
    return seconds


# graph -> {(node id, mesh, cluster): {strategy name: seconds}} for `rerun_seconds`;
# forgets graphs nothing else holds.
_RERUN_STRATEGIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _var_map(sub: OpGraph, solved_on: OpGraph) -> dict[int, int]:
    """Var ids of `sub` -> those of `solved_on`, a graph of the same structure, matched by
    position (invars, then node outputs in order); empty when they are the same graph."""
    if sub is solved_on:
        return {}
    pairs = dict(zip(sub.invars, solved_on.invars))
    for a, b in zip(sub.nodes, solved_on.nodes):
        pairs.update(zip(a.outputs, b.outputs))
    return pairs


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


# Memory levels of the layer plans a stage may use. Level 0 is each layer's fastest plan.
# The layer ILPs see one layer; a stage holds many, so the fastest plans of its layers may
# not fit together where leaner ones (state, gradients and activations split further) do.
# A leaner level trades latency for the layer's footprint on the stage (state, accumulated
# gradients, kept activations of the microbatches in flight: what `stage_memory` sums over
# the layers), in one of two ways (`LEVELS`):
# - "price" (the default): level L's ILP pays LEVEL_PRICES[L] x (fastest plan's seconds /
#   (fastest - least footprint)) per byte of footprint in its objective, no limit row
#   (`with_footprint_price`): at price 1, giving up the whole span is worth the layer's
#   whole latency; the last level all but minimises the footprint (a small layer whose
#   latency is collective latencies may need 10-100x its time to hold less). One
#   unconstrained solve per level, as cheap as level 0's (issue 18: gpt-39B on 64 GPUs
#   spent 165 of 180 ILP CPU seconds in 29 limit-row MIPs, 15 in 156 level-0 ILPs); the
#   levels are points of the lower convex hull of the latency/footprint trade-off,
#   leaner (never faster) as the price grows.
# - "limit": level L limits the footprint to least + LEVEL_FRACTIONS[L] x (fastest -
#   least) with a row; any point of the trade-off, each a harder MIP. `choose_stages`
#   jumps to the level the stage's excess memory asks for, then steps down while the
#   stage still does not fit.
LEVELS = "price"
LEVEL_PRICES = (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0, 100.0, 1e4)
LEVEL_FRACTIONS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.12, 0.06, 0.02)
NUM_LEVELS = len(LEVEL_PRICES)
assert len(LEVEL_FRACTIONS) == NUM_LEVELS
# A leaner level's peak may exceed its fastest plan's by rounding only (the same ILP
# measure, `peak_memory`, on both).
PEAK_TOLERANCE = 1e-9


def _lower_bound(table: LayerCostTable, layer_range, shape, level: int) -> float:
    """Below the latency of the layers at `level` or any leaner level, with any recompute,
    by `DOMINANCE_MARGIN`; -inf when a layer's plan there is not a proven optimum (its
    ILP stopped at the time limit) or a caller's `solve` made it."""
    if table.solve is not None:
        return -math.inf
    return _range_cached(table, "bound", layer_range, (shape, level),
                         lambda: _layers_lower_bound(table, layer_range, shape, level))


def _layers_lower_bound(table: LayerCostTable, layer_range, shape, level: int) -> float:
    total = []
    for k in layer_range:
        cost, plan = table.cost(k, shape, level), table.plan(k, shape, level)
        if cost is None or plan.stats.get("status") != "optimal":
            return -math.inf
        total.append(cost.latency)
    return math.fsum(total) * (1 - DOMINANCE_MARGIN)


@dataclass(frozen=True)
class _Fit:
    """A stage's layers at one memory level with one remat choice per layer."""

    level: int
    remat: tuple[str, ...]
    costs: tuple[LayerCost, ...]
    parts: StageMemory  # the stage's memory by part (`stage_memory_parts`)

    @property
    def memory(self) -> float:
        return self.parts.total

    @property
    def latency(self) -> float:
        return math.fsum(c.latency for c in self.costs)


def _stage_parts(table: LayerCostTable, layer_range, shape, level: int, costs,
                 in_flight) -> StageMemory:
    """`stage_memory_parts` of these layer costs, state the layers share counted once."""
    return stage_memory_parts(costs, in_flight,
                              table.shared_state_bytes(layer_range, shape, level))


# `range_key`'s hashes, and the entries `LayerCostTable.range_cache` holds before it is
# cleared (a fit holds a tuple of its layers' costs: a few hundred MB at most).
_HASH_MOD = (1 << 61) - 1
_HASH_BASES = (1_000_003, 998_244_353)
RANGE_CACHE_SIZE = 200_000


def _range_cache_key(table: LayerCostTable, what: str, layer_range, args: tuple):
    """The `range_cache` key of `what` for these layers and `args`; None when nothing is
    shared (a range that is not contiguous, or a table without `range_key`, e.g. a
    test's made-up numbers)."""
    range_key = getattr(table, "range_key", None)
    key = None if range_key is None else range_key(layer_range)
    return None if key is None else (what, key, *args)


def _range_cached(table: LayerCostTable, what: str, layer_range, args: tuple, compute):
    """`compute()`, shared by the layer ranges of equal content (`_range_cache_key`)."""
    key = _range_cache_key(table, what, layer_range, args)
    if key is None:
        return compute()
    cache = table.range_cache
    if key not in cache:
        if len(cache) >= RANGE_CACHE_SIZE:
            cache.clear()
        cache[key] = compute()
    return cache[key]


def _all_solved(table: LayerCostTable, layer_range, shape, level: int) -> bool:
    """Whether every layer's cost at `level` is known without a solve (a range once
    solved stays so: only that answer is shared)."""
    key = _range_cache_key(table, "solved", layer_range, (shape, level))
    if key is not None and key in table.range_cache:
        return True
    if not all(table.is_solved(k, shape, level) for k in layer_range):
        return False
    if key is not None:
        table.range_cache[key] = True
    return True


def _prefetch(table: LayerCostTable, layer_range, shape, level: int) -> None:
    """The range's layer ILPs at `level` solved side by side (`LayerCostTable.prefetch`)
    when some are not yet."""
    prefetch = getattr(table, "prefetch", None)  # a test's made-up table has none
    if prefetch is not None and not _all_solved(table, layer_range, shape, level):
        prefetch((k, shape, level) for k in layer_range)


def choose_remat(
    table: LayerCostTable, layer_range, shape, level: int, in_flight: int, budget: float,
    remat: str = "auto",
) -> _Fit | None:
    """The layers' costs at `level` with a remat choice per layer (`_choose_remat`), the
    same for every range of the same content."""
    return _range_cached(
        table, "fit", layer_range, (shape, level, in_flight, budget, remat),
        lambda: _choose_remat(table, layer_range, shape, level, in_flight, budget, remat),
    )


def _choose_remat(
    table: LayerCostTable, layer_range, shape, level: int, in_flight: int, budget: float,
    remat: str = "auto",
) -> _Fit | None:
    """The layers' costs at `level` with a remat choice per layer; None when a layer has
    no plan on that mesh.

    A fixed `remat` ("none", "selective", "full") applies to every layer. "auto" keeps
    everything while the layers fit `budget`; otherwise it recomputes greedily, per layer,
    the choice that saves the most kept bytes per second of rerun first (selective, whose
    rerun is small, before full), until the stage fits or every layer recomputes fully.
    Per layer rather than per stage: a stage that fits with a few layers recomputed does
    not pay for all of them, and the greedy pass is O(L log L) arithmetic per stage, no
    solve (Megatron-LM likewise recomputes only some layers of a stage).
    """
    layer_range = list(layer_range)
    _prefetch(table, layer_range, shape, level)
    if remat != "auto":
        costs = [table.remat_cost(k, shape, level, remat) for k in layer_range]
        if any(c is None for c in costs):
            return None
        chosen = tuple(remat if c is not table.cost(k, shape, level) else "none"
                       for k, c in zip(layer_range, costs))
        return _Fit(level, chosen, tuple(costs),
                    _stage_parts(table, layer_range, shape, level, costs, in_flight))
    costs = [table.cost(k, shape, level) for k in layer_range]
    if any(c is None for c in costs):
        return None
    chosen = ["none"] * len(costs)
    parts = _stage_parts(table, layer_range, shape, level, costs, in_flight)
    if parts.total <= budget:
        return _Fit(level, tuple(chosen), tuple(costs), parts)
    upgrades = []
    for i, k in enumerate(layer_range):
        for rank, option in enumerate(("selective", "full")):
            c = table.remat_cost(k, shape, level, option)
            saved = in_flight * (costs[i].activation_memory - c.activation_memory)
            if saved <= 0:
                continue
            extra = c.latency - costs[i].latency
            upgrades.append((extra / saved, rank, i, option, c))
    upgrades.sort(key=lambda u: u[:3])
    state = parts.state + parts.gradients  # recompute keeps them
    kept = math.fsum(c.activation_memory for c in costs)
    transient = max(c.transient_memory for c in costs)
    for _, _, i, option, c in upgrades:
        if chosen[i] == "full" or c.activation_memory >= costs[i].activation_memory:
            continue
        kept += c.activation_memory - costs[i].activation_memory
        transient = max(transient, c.transient_memory)
        costs[i], chosen[i] = c, option
        if state + in_flight * kept + transient <= budget:
            break
    return _Fit(level, tuple(chosen), tuple(costs),
                _stage_parts(table, layer_range, shape, level, costs, in_flight))


# A leaner memory level or a recompute never makes a stage faster than its layers' fastest
# plans (level 0: the same ILP without the footprint row; recompute adds work), up to the
# MIP's relative gap (`MIP_RELATIVE_GAP`, 1e-9); this margin, far above it, keeps the
# pruning below exact: a shape is skipped only when it would lose by more than rounding.
DOMINANCE_MARGIN = 1e-6


def _fitting_level(table: LayerCostTable, layer_range, shape, in_flight: int, budget: float,
                   remat: str = "auto", cutoff: float = math.inf,
                   solved_only: bool = False) -> _Fit | None:
    """The fastest (memory level, remat per layer) at which the layers fit `budget`
    together on a mesh of `shape`, or the leanest tried when none does; None when a layer
    has no plan on that mesh.

    From level 0 (each layer's fastest plan, with `choose_remat`) it walks the leaner
    levels in order (price levels, `LEVELS`), or jumps to the level whose footprint limit
    removes the stage's excess without recompute (limit levels: each layer giving up the
    same fraction of what it can give) and steps down from there, while it does not fit;
    every level visited is also tried with recompute, and the fastest fit wins (a leaner
    sharding costs communication, recompute costs forward work).

    `cutoff`: the latency of the best stage found on another shape. When the layers'
    fastest plans already take at least that long, no level or recompute here can win
    (see `DOMINANCE_MARGIN`): None, without solving the leaner levels' ILPs. The walk to
    leaner levels also stops once the next one cannot beat `cutoff` or a fit already
    found (a leaner level is never faster); what it skips would not have been chosen.
    `solved_only`: stop the walk at the first level not solved yet (no ILP is solved; a
    fit found is one the full walk also reaches or beats).
    """
    first_fit = choose_remat(table, layer_range, shape, 0, in_flight, budget, remat)
    if first_fit is None:
        return None
    unchanged = remat != "auto" or all(r == "none" for r in first_fit.remat)
    if first_fit.memory <= budget and unchanged:
        return first_fit
    if table.solve is not None:
        return first_fit
    if _lower_bound(table, layer_range, shape, 0) >= cutoff:
        return None
    if LEVELS == "price":
        return _priced_fit(table, layer_range, shape, in_flight, budget, remat, cutoff,
                           solved_only, first_fit)
    plain = [table.cost(k, shape) for k in layer_range]
    memory = _stage_parts(table, layer_range, shape, 0, plain, in_flight).total
    spans = [table.footprint_span(k, shape) for k in layer_range]
    slack = math.fsum(fastest - least for least, fastest in spans)
    wanted = 1.0 - (memory - budget) / slack if slack > 0 else -1.0
    first = next((k for k, f in enumerate(LEVEL_FRACTIONS) if k and f <= wanted), None)
    if first is None:
        first = NUM_LEVELS - 1  # the leanest: it may still fit (or tell how close)
    tried = [first_fit]
    least = memory
    for level in range(first, NUM_LEVELS):
        if solved_only and not _all_solved(table, layer_range, shape, level):
            break
        costs = [table.cost(k, shape, level) for k in layer_range]
        if any(c is None for c in costs):
            break
        memory = _stage_parts(table, layer_range, shape, level, costs, in_flight).total
        if memory >= least:
            break  # a tighter footprint no longer helps
        least = memory
        fit = choose_remat(table, layer_range, shape, level, in_flight, budget, remat)
        tried.append(fit)
        if fit.memory <= budget and all(r == "none" for r in fit.remat):
            break
        # A leaner level is no faster than this one: stop once it cannot win.
        bound = _lower_bound(table, layer_range, shape, level)
        fastest_fit = min((f.latency for f in tried if f.memory <= budget), default=math.inf)
        if bound >= cutoff or bound >= fastest_fit:
            break
    fitting = [f for f in tried if f.memory <= budget]
    if fitting:
        return min(fitting, key=lambda f: f.latency)  # first of equals: the faster level
    return min(tried, key=lambda f: f.memory)


def _priced_fit(table: LayerCostTable, layer_range, shape, in_flight: int, budget: float,
                remat: str, cutoff: float, solved_only: bool, first_fit: _Fit) -> _Fit:
    """`_fitting_level` over price levels, which are ever leaner and never faster: the
    leanest level first (when even it does not fit, no level does), then a bisection for
    the first level that fits with recompute, then up from there while recompute is
    needed and a leaner level can still be faster (at most the walk's answer, from about
    log2(levels) + a few solves instead of up to every level)."""
    tried = [first_fit]

    def fit_at(level: int) -> _Fit | None:
        """The fit at `level`; None when a layer has no plan or, with `solved_only`, it
        is not solved yet."""
        if solved_only and not _all_solved(table, layer_range, shape, level):
            return None
        fit = choose_remat(table, layer_range, shape, level, in_flight, budget, remat)
        if fit is not None:  # None: a layer has no plan at this level
            tried.append(fit)
        return fit

    def result() -> _Fit:
        fitting = [f for f in tried if f.memory <= budget]
        if fitting:
            return min(fitting, key=lambda f: (f.latency, f.level))
        return min(tried, key=lambda f: f.memory)

    def hopeless(level: int) -> bool:  # no level from here on can win
        fastest = min((f.latency for f in tried if f.memory <= budget), default=math.inf)
        bound = _lower_bound(table, layer_range, shape, level)
        return bound >= cutoff or bound >= fastest

    lo, hi = 0, NUM_LEVELS - 1  # the first fitting level is in (lo, hi]
    if first_fit.memory > budget:
        top = fit_at(hi)
        if top is None or top.memory > budget:
            return result()
        while hi - lo > 1:
            mid = (lo + hi) // 2
            fit = fit_at(mid)
            if fit is None:
                return result()
            if fit.memory <= budget:
                hi = mid
            else:
                if hopeless(mid):
                    return result()
                lo = mid
    else:
        hi = 0  # level 0 fits with recompute
    level = hi
    while level + 1 < NUM_LEVELS:
        fit = next(f for f in reversed(tried) if f.level == level)
        if all(r == "none" for r in fit.remat) or hopeless(level):
            break
        level += 1
        if fit_at(level) is None:
            break
    return result()


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
    allowed=None,
    range_shapes=None,
    remat: str = "auto",
    table: LayerCostTable | None = None,
) -> PipelineChoice:
    """Run the stage DP over layer costs, then plan each chosen stage on its submesh.

    Steps: layer costs per mesh shape (`LayerCostTable`), the cost of a stage on a submesh
    (`_StageCosts`), Alpa's DP (`plan_stages`), each chosen stage's plan stitched from its
    layers' plans (`_stage_plans`). `allowed(start, end) -> bool`, when given, rules out
    the stages whose layer range it rejects (e.g. uneven slices of a scanned stack);
    `range_shapes(start, end)`, when given, names the only logical mesh shapes a stage of
    those layers may take (None: any). `table`: the layer costs of an earlier call with
    the same arguments (`layer_cost_table`), so that a re-run with other restrictions
    solves no layer ILP twice.
    """
    budget = memory_budget(cluster, options.memory_budget)
    start_time = time.perf_counter()
    if table is None:
        table = layer_cost_table(
            graph, layers, cluster, num_microbatches, schedule, options, tied
        )
    ilps_before, ilp_seconds_before = table.num_ilps, table.ilp_seconds
    hits_before, priced_before = table.num_hits, table.num_priced
    clustering = time.perf_counter() - start_time
    all_submeshes = list(submeshes) if submeshes else submesh_shapes(
        cluster.num_hosts, cluster.devices_per_host
    )
    crossing = boundary_bytes(graph, layers)
    stage_cost = inner = _StageCosts(
        table, all_submeshes, logical_shapes, schedule, num_microbatches, budget, remat,
        crossing,
    )
    restricted = allowed is not None or range_shapes is not None
    if restricted:
        stage_cost = _Restricted(stage_cost, allowed, range_shapes)
    start_time = time.perf_counter()
    if PRUNE_BY_BOUND:
        # A plan that exists bounds the answer: stages that cannot be part of a plan as
        # fast are not costed at their leaner levels (`_StageCosts.bound`).
        if not restricted:
            inner.work = _least_work(table, all_submeshes, logical_shapes)
        _bound_by_even_plans(
            inner, stage_cost, layers.num_layers, cluster.num_hosts,
            cluster.devices_per_host, all_submeshes, num_stages,
        )
        log.info("stage DP: an even plan bounds the search at %.6g s (%d layer ILPs so far)",
                 inner.bound, table.num_ilps)
    dp = plan_stages(
        layers.num_layers, cluster.num_hosts, cluster.devices_per_host, stage_cost,
        num_microbatches, submeshes=all_submeshes, num_stages=num_stages,
        memory_budget=budget, num_positions=stage_cost.num_positions,
    )
    dp_seconds = time.perf_counter() - start_time
    log.info(
        "stage DP: %d stage(s), %.4g s predicted, %d layer ILPs (%.2f s), %d cost look-ups "
        "answered from the table, %.2f s",
        len(dp.stages), dp.latency, table.num_ilps, table.ilp_seconds, table.num_hits,
        dp_seconds,
    )
    if table.reference is not None:
        log.info("stage DP: %d layer costs priced on the layouts of the %d-microbatch "
                 "search", table.num_priced, table.reference.num_microbatches)
    ilp_seconds = table.ilp_seconds
    start_time = time.perf_counter()
    stage_layers = tuple((s, e) for s, e, _ in dp.stages)
    shapes = tuple(c.detail[0] for c in dp.stage_costs)
    part = partition(graph, layers, list(stage_layers))
    stage_remat = tuple(c.detail[2] for c in dp.stage_costs)
    stage_plans = _stage_plans(table, graph, part, dp, stage_layers, tied)
    stitching = time.perf_counter() - start_time - (table.ilp_seconds - ilp_seconds)
    # This call's share (a table handed in has the ILPs of earlier calls in its counts).
    timings = dict(zip(PLANNING_PHASES, (
        clustering, table.ilp_seconds - ilp_seconds_before,
        dp_seconds - (ilp_seconds - ilp_seconds_before), stitching,
    )))
    timings.update({"layer ILPs solved": table.num_ilps - ilps_before,
                    "layer costs reused": table.num_hits - hits_before,
                    "layer costs priced": table.num_priced - priced_before})
    return PipelineChoice(
        stage_layers=stage_layers,
        submeshes=tuple(all_submeshes[i] for _, _, i in dp.stages),
        device_ids=tuple(dp.device_ids),
        logical_shapes=shapes,
        latency=dp.latency,
        stage_plans=stage_plans,
        partition=part,
        dp=dp,
        num_layer_ilps=table.num_ilps - ilps_before,
        timings=timings,
        stage_remat=stage_remat,
        stage_recompute=tuple(
            recompute_time(table, range(*layers_), c.detail)
            for layers_, c in zip(stage_layers, dp.stage_costs)
        ),
        stage_transfer=tuple(
            boundary_transfer_time(crossing[start], table.cluster,
                                   all_submeshes[i].num_devices) if start > 0 else 0.0
            for start, _, i in dp.stages
        ),
        stage_dispatch=tuple(
            stage_dispatch_time(table.cluster, len(dp.stages), num_microbatches, schedule)
            for _ in dp.stages
        ),
    )


def recompute_time(table: LayerCostTable, layer_range, detail) -> float:
    """Seconds per microbatch the stage's recompute adds (`detail`: shape, level, remat),
    the fused rerun every layer's backward does included (`LayerCostTable.fused_seconds`:
    in the layer costs, not in the stitched stage plan's cost)."""
    shape, level, remats = detail
    return math.fsum(
        table.remat_cost(k, shape, level, r).latency - table.cost(k, shape, level).latency
        + table.fused_seconds(k, shape, level)
        for k, r in zip(layer_range, remats)
    )


def layer_cost_table(graph, layers, cluster, num_microbatches, schedule, options, tied, *,
                     reference=None, keep_layouts=False):
    """The `LayerCostTable` `choose_stages` plans with (hand it back to re-run the DP);
    `reference` and `keep_layouts` as `LayerCostTable` takes them."""

    def in_flight(shape) -> int:
        # The layer ILPs' estimate of the activations in flight (a weight in the footprint
        # their leaner levels limit; they do not know the stage's position): GPipe keeps all
        # microbatches, 1F1B at most one per stage that could follow on the devices left.
        # The stage DP's memory check uses each stage's exact position (`_StageCosts`).
        later = max(1, cluster.num_devices // math.prod(shape))
        return in_flight_microbatches(schedule, num_microbatches, later)

    return LayerCostTable(
        graph, layers, cluster, options, tied, num_microbatches=num_microbatches,
        in_flight=in_flight, reference=reference, keep_layouts=keep_layouts,
    )


def plan_chosen_stages(
    graph: OpGraph,
    layers: LayerAssignment,
    cluster,
    num_microbatches: int,
    schedule: str,
    options: ShardOptions,
    tied: Sequence[tuple[int, int]],
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
    table = layer_cost_table(graph, layers, cluster, num_microbatches, schedule, options, tied)
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


@dataclass
class _Restricted:
    """A stage cost function that rules out the layer ranges `allowed` rejects and, where
    `shapes(start, end)` names logical mesh shapes, every other shape (None: no rule)."""

    stage_cost: _StageCosts
    allowed: object = None
    shapes: object = None

    @property
    def num_positions(self) -> int | None:
        return self.stage_cost.num_positions

    @property
    def monotone_in_position(self) -> bool:
        return self.stage_cost.monotone_in_position

    def __call__(self, start: int, end: int, index: int, *rest) -> StageCost:
        if self.allowed is not None and not self.allowed(start, end):
            return StageCost(math.inf, False, math.inf, None)
        only = None if self.shapes is None else self.shapes(start, end)
        return self.stage_cost(start, end, index, *rest, shapes=only)


@dataclass
class _StageCosts:
    """The stage DP's cost of layers [start, end) on submesh `index` as the stage
    `stages_from_here` stages from the end (1: the last): the fastest logical mesh shape
    and memory level at which the layers, with the activations of the microbatches that
    position keeps in flight (`in_flight_microbatches`), fit the budget together, with a
    remat choice per layer (`choose_remat`, by the `remat` option)."""

    table: LayerCostTable
    submeshes: list[SubmeshShape]
    logical_shapes: Sequence[tuple[int, ...]] | None
    schedule: str
    num_microbatches: int
    budget: float
    remat: str = "auto"
    # Per layer k: bytes of the forward values crossing into layer k from earlier layers,
    # moved to a stage starting at k once per microbatch (`boundary_transfer_time`).
    boundary: Sequence[float] = ()

    # The pipeline latency (the DP's objective, `sum t + (B - 1) max t`) of a plan known
    # to exist (`_bound_by_even_plans`); inf: none known.
    bound: float = math.inf
    # Prefix sums over the layers of each layer's least work: its fastest plan's seconds
    # times the devices running it, least over every logical mesh the search may use
    # (`_least_work`); empty: not known (then only the stage's own latency bounds a plan).
    work: Sequence[float] = ()

    def __post_init__(self):
        # (range content, shapes) -> shapes by speed: layer ranges of equal content
        # (`LayerCostTable.range_key`) share one order (GPT-3 175B on 1,024 GPUs: 622k
        # entries by (start, end, index), 331 MB).
        self._orders: dict[tuple, list] = {}
        self._fixed: dict[tuple, float] = {}  # (start, whole, devices) -> `_fixed_seconds`
        self._hopeless: set[tuple] = set()  # (start, end, index, shapes) beyond `bound`
        self._shapes: dict[tuple, tuple] = {}  # (index, shapes asked) -> shapes to try
        self._prefix: dict[tuple, tuple] = {}  # shape -> prefix sums of level 0 (`_fastest`)

    @property
    def num_positions(self) -> int | None:
        """Positions whose memory differs: under 1F1B stage i of S keeps min(B, S - i)
        microbatches, the same from S - i = B on; under GPipe every stage keeps B."""
        return self.num_microbatches if self.schedule == "1f1b" else None

    # A stage further from the last keeps at least as many microbatches in flight, so its
    # fit is never faster, and once it does not fit it never does: the stage DP may ask
    # a few positions and infer those between (`autopar.inter._stage_dp._evaluate`).
    monotone_in_position = True

    def _fastest(self, start: int, end: int, shape) -> tuple[float | None, float]:
        """(sum of the layers' fastest plans on `shape`, `_lower_bound` of it) from prefix
        sums over the layers (None: a layer has no plan there); the lower bound is -inf
        when a plan is not a proven optimum. Rounding differs from a sum over the range by
        far less than `DOMINANCE_MARGIN`, which the lower bound keeps."""
        if shape not in self._prefix:
            _prefetch(self.table, range(len(self.table.per_layer.stage_graphs)), shape, 0)
            sums, missing, unproven = [0.0], [0], [0]
            for k in range(len(self.table.per_layer.stage_graphs)):
                cost = self.table.cost(k, shape)
                sums.append(sums[-1] + (0.0 if cost is None else cost.latency))
                missing.append(missing[-1] + (cost is None))
                unproven.append(unproven[-1] + (
                    cost is not None
                    and self.table.plan(k, shape).stats.get("status") != "optimal"
                ))
            self._prefix[shape] = (sums, missing, unproven)
        sums, missing, unproven = self._prefix[shape]
        if missing[end] - missing[start]:
            return None, -math.inf
        fastest = sums[end] - sums[start]
        if unproven[end] - unproven[start]:
            return fastest, -math.inf
        return fastest, fastest * (1 - DOMINANCE_MARGIN)

    def _fixed_seconds(self, start: int, whole: bool, num_devices: int) -> float:
        """A stage's fixed seconds per microbatch: the activations moved in at its first
        layer (`boundary_transfer_time`) and launching its programs -- one per step for
        the whole model on one stage, else its tasks per microbatch and its update
        (`stage_dispatch_time`). The same for every range starting at `start`: cached."""
        key = (start, whole, num_devices)
        if key not in self._fixed:
            seconds = 0.0
            if start > 0 and self.boundary:
                seconds = boundary_transfer_time(
                    self.boundary[start], self.table.cluster, num_devices
                )
            self._fixed[key] = seconds + stage_dispatch_time(
                self.table.cluster, 1 if whole else 2, self.num_microbatches, self.schedule
            )
        return self._fixed[key]

    def latency_cutoff(self, start: int, end: int, num_devices: int) -> float:
        """A stage latency at or above which layers [start, end) on `num_devices` devices
        cannot be a stage of a plan as fast as `bound` (inf: any may).

        A plan holding this stage (latency t) spends `sum t + (B - 1) max t`. The other
        stages run the other layers on the other N - d devices: their stage latencies
        times devices add up to at least those layers' least work W (a layer's latency on a
        stage is at least its fastest plan's there), so the slowest of them takes at least
        R = W / (N - d), and so does their sum. The plan thus spends at least
        f(t) = t + R + (B - 1) max(t, R), increasing in t; the cutoff is where f reaches
        `bound` (up to `BOUND_MARGIN`, far above rounding, so that the known plan's own
        stages are never cut off)."""
        if not math.isfinite(self.bound):
            return math.inf
        limit = self.bound * (1 + BOUND_MARGIN)
        rest = 0.0
        total_devices = self.table.cluster.num_devices
        if self.work and num_devices < total_devices:
            outside = self.work[-1] - (self.work[end] - self.work[start])
            rest = max(0.0, outside) / (total_devices - num_devices)
        b = self.num_microbatches
        if b * rest >= limit:
            return -math.inf
        if (b + 1) * rest <= limit:
            return (limit - rest) / b
        return limit - b * rest

    def __call__(self, start: int, end: int, index: int, stages_from_here: int = 1,
                 shapes=None) -> StageCost:
        """`shapes`: the logical mesh shapes to try (default: `logical_shapes`, else every
        shape of the submesh); those of another device count are skipped."""
        sub = self.submeshes[index]
        asked = (index, None if shapes is None else tuple(map(tuple, shapes)))
        if asked not in self._shapes:  # the same for every layer range and position
            tried = self.logical_shapes or logical_mesh_shapes(sub) if shapes is None else shapes
            self._shapes[asked] = tuple(
                tuple(s) for s in tried if math.prod(s) == sub.num_devices
            )
        shapes = self._shapes[asked]
        key = (start, end, index, shapes)
        if key in self._hopeless:
            return StageCost(math.inf, False, math.inf, None)
        in_flight = in_flight_microbatches(self.schedule, self.num_microbatches, stages_from_here)
        best = None
        least_memory = math.inf
        whole = start == 0 and end == len(self.table.per_layer.stage_graphs)
        transfer = self._fixed_seconds(start, whole, sub.num_devices)
        # Shapes by their layers' fastest plans (a lower bound on any fit there), so that
        # a fitting shape is found early and the leaner levels of shapes that cannot beat
        # it are not solved; among equally fast fits the first shape of `shapes` wins, as
        # when they are tried in that order.
        layer_range = range(start, end)
        content = _range_cache_key(self.table, "order", layer_range, (shapes,))
        order_key = key if content is None else content
        order = self._orders.get(order_key)
        if order is None:  # the same for every position and equal range: computed once
            order = []
            for rank, shape in enumerate(shapes):
                if self.work:  # every layer's level 0 is solved on every shape
                    fastest, lower = self._fastest(start, end, shape)
                    if fastest is not None:
                        order.append((fastest, rank, shape, lower))
                    continue
                plain = [self.table.cost(k, shape) for k in layer_range]
                if all(c is not None for c in plain):
                    order.append((math.fsum(c.latency for c in plain), rank, shape,
                                  _lower_bound(self.table, layer_range, shape, 0)))
            order.sort(key=lambda o: o[:2])
            self._orders[order_key] = order
        # No plan as fast as `bound` holds this stage at or above `hopeless` latency; a
        # shape whose fastest plans (`_lower_bound`) reach it is not costed, at any position.
        hopeless = self.latency_cutoff(start, end, sub.num_devices) - transfer
        if order and all(o[3] >= hopeless for o in order):
            self._hopeless.add(key)
            return StageCost(math.inf, False, math.inf, None)
        best_rank = None
        # First the fits the ILPs solved so far give (no solve), as a cutoff for the walks
        # that solve: a shape that cannot beat a fit on another is not walked further.
        known = math.inf
        if PRUNE_BY_BOUND and len(order) > 1:
            for _, _rank, shape, lower in order:
                if lower >= min(hopeless, known):
                    continue
                fit = _fitting_level(self.table, layer_range, shape, in_flight, self.budget,
                                     self.remat, min(hopeless, known), solved_only=True)
                if fit is not None and fit.memory <= self.budget:
                    known = min(known, fit.latency)
        for _, rank, shape, lower in order:
            if lower >= hopeless:
                continue
            # Once a shape fits, another must beat it (`least_memory` is then unused).
            cutoff = math.inf if best is None else best.latency - transfer
            cutoff = min(cutoff, hopeless, known * (1 + BOUND_MARGIN))
            fit = _fitting_level(
                self.table, layer_range, shape, in_flight, self.budget, self.remat, cutoff,
            )
            if fit is None:
                continue
            least_memory = min(least_memory, fit.memory)
            if fit.memory <= self.budget:
                latency = fit.latency + transfer
                if best is None or (latency, rank) < (best.latency, best_rank):
                    best = StageCost(latency, True, fit.memory, (shape, fit.level, fit.remat),
                                     fit.parts)
                    best_rank = rank
        if best is None:
            return StageCost(math.inf, False, least_memory, None)
        return best


# Prune the stage DP's stages by a plan known to exist (`_StageCosts.bound`); the tests
# switch it off to check that the pruned search finds the plan of the full one.
PRUNE_BY_BOUND = True
# `_StageCosts.latency_cutoff` cuts off only stages that would make a plan slower than the
# known one by more than this (relative), far above rounding.
BOUND_MARGIN = 1e-6


def _least_work(table: LayerCostTable, submeshes, logical_shapes) -> list[float]:
    """Prefix sums (`_StageCosts.work`) of each layer's least work: its fastest plan's
    seconds (level 0) times the mesh's devices, least over every logical mesh of
    `submeshes` (`logical_shapes` when given), times (1 - `DOMINANCE_MARGIN`) as
    `_lower_bound`; empty when one such plan is not a proven optimum (no bound then)."""
    shapes = []
    for sub in submeshes:
        for shape in logical_shapes or logical_mesh_shapes(sub):
            shape = tuple(shape)
            if math.prod(shape) == sub.num_devices and shape not in shapes:
                shapes.append(shape)
    if table.solve is not None or not shapes:
        return []
    prefetch = getattr(table, "prefetch", None)  # a test's made-up table has none
    if prefetch is not None:
        num_layers = len(table.per_layer.stage_graphs)
        prefetch((k, shape, 0) for shape in shapes for k in range(num_layers))
    sums = [0.0]
    for k in range(len(table.per_layer.stage_graphs)):
        least = math.inf
        for shape in shapes:
            cost = table.cost(k, shape)
            if cost is None:
                continue
            if table.plan(k, shape).stats.get("status") != "optimal":
                return []
            least = min(least, cost.latency * math.prod(shape))
        if not math.isfinite(least):
            return []
        sums.append(sums[-1] + least * (1 - DOMINANCE_MARGIN))
    return sums


def _bound_by_even_plans(inner: _StageCosts, stage_cost, num_layers: int, num_hosts: int,
                         devices_per_host: int, submeshes, num_stages: int | None) -> None:
    """Set `inner.bound` to the DP objective of the best "even" plan: S stages of
    (nearly) equal layer counts on S copies of one submesh (Megatron-LM's layout), for
    every submesh whose copies fill the cluster and pack (`assign_devices`), each stage
    costed by `stage_cost` at its position as the DP asks it. The plans are tried by
    their lower bound (their stages' fastest shapes) and each tightens the bound the next
    ones are costed under, so that few leaner levels are solved for plans that lose."""
    total = num_hosts * devices_per_host
    b = inner.num_microbatches
    positions = inner.num_positions
    plans = []
    for index, sub in enumerate(submeshes):
        count, rest = divmod(total, sub.num_devices)
        if rest or count > num_layers or (num_stages is not None and count != num_stages):
            continue
        try:
            assign_devices([sub] * count, num_hosts, devices_per_host)
        except ValueError:
            continue
        cuts = [round(i * num_layers / count) for i in range(count + 1)]
        stages = []
        for i in range(count):
            args = [cuts[i], cuts[i + 1], index]
            if positions is not None:
                args.append(min(count - i, positions))
            stages.append(tuple(args))
        lows = [_fastest_stage(inner, s[0], s[1], index) for s in stages]
        plans.append((math.fsum(lows) + (b - 1) * max(lows), index, stages))
    plans.sort(key=lambda p: p[:2])
    for low, _, stages in plans:
        if low >= inner.bound:
            break
        costs = []
        for args in stages:
            cost = stage_cost(*args)
            if not cost.feasible:
                break
            costs.append(cost.latency)
        else:
            inner.bound = min(inner.bound, math.fsum(costs) + (b - 1) * max(costs))


def _fastest_stage(inner: _StageCosts, start: int, end: int, index: int) -> float:
    """A lower bound on the stage's latency on submesh `index` (`_lower_bound` on its
    fastest logical mesh; 0 where a plan there is not a proven optimum, inf where no
    mesh has a plan for every layer)."""
    sub = inner.submeshes[index]
    lows = []
    for shape in inner.logical_shapes or logical_mesh_shapes(sub):
        shape = tuple(shape)
        if math.prod(shape) != sub.num_devices:
            continue
        if all(inner.table.cost(k, shape) is not None for k in range(start, end)):
            lows.append(max(0.0, _lower_bound(inner.table, range(start, end), shape, 0)))
    return min(lows, default=math.inf)


def boundary_bytes(graph, layers: LayerAssignment) -> list[float]:
    """Per layer k (0..num_layers), bytes of the forward values made in layers before k and
    read in layer k or later: what a stage starting at layer k receives per microbatch
    (its gradients go back the same size)."""
    made: dict[int, int] = {}
    for node in graph.nodes:
        if layers.phase[node.id] == "forward" and layers.layer[node.id] is not None:
            made.update((v, layers.layer[node.id]) for v in node.outputs)
    crossing: list[set[int]] = [set() for _ in range(layers.num_layers + 1)]
    for node in graph.nodes:
        k = layers.layer[node.id]
        if layers.phase[node.id] != "forward" or k is None:
            continue
        for v in node.inputs:
            if made.get(v, k) < k:
                for b in range(made[v] + 1, k + 1):
                    crossing[b].add(v)
    return [float(sum(graph.vars[v].nbytes for v in vs)) for vs in crossing]


def _stage_plans(table: LayerCostTable, graph, part, dp, stage_layers, tied) -> tuple:
    """Each chosen stage's plan, stitched from its layers' plans on its mesh."""
    plans = []
    for s, (ids, cost) in enumerate(zip(dp.device_ids, dp.stage_costs)):
        shape, level, _ = cost.detail
        mesh = LogicalMesh.create(shape, ids)
        plans.append(table.stage_plan(graph, part, s, stage_layers[s], shape, mesh, tied, level))
    return tuple(plans)
