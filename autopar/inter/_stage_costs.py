"""The stage DP's cost of a stage: layers on a submesh at a position in the pipeline.

In: a `LayerCostTable`, the submeshes, the schedule, the number of microbatches and the
memory budget. Out: `_StageCosts`, the callback `plan_stages` asks: the fastest logical
mesh shape, memory level and remat choice at which a stage's layers fit (`StageCost`),
its transfer in and dispatch included. A plan known to exist (`_bound_by_even_plans`)
and the layers' least work (`_least_work`) cut off stages that cannot be part of a plan
as fast (`StageOptions.prune_by_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from autopar.cost import boundary_transfer_time, in_flight_microbatches, stage_dispatch_time
from autopar.inter import _stage_fit
from autopar.inter._layer_table import LayerCostTable
from autopar.inter._memory_bound import layer_time_floor, stage_memory_floor
from autopar.inter._range_cache import _prefetch, _range_cache_key
from autopar.inter._stage_dp import Pruned, StageCost
from autopar.inter._stage_dp_messages import OFF_PLAN, MemoryFloor
from autopar.inter._stage_fit import DOMINANCE_MARGIN
from autopar.inter._submesh import SubmeshShape, assign_devices, logical_mesh_shapes
from autopar.inter._submesh_cut import layer_fits


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
    # Cut off stages by a plan known to exist (`StageOptions.prune_by_bound`; False costs
    # every stage in full, to check that the pruned search finds the full one's plan).
    prune: bool = True

    # The pipeline latency (the DP's objective, `sum t + (B - 1) max t`) of a plan known
    # to exist (`_bound_by_even_plans`); inf: none known.
    bound: float = math.inf
    # Prefix sums over the layers of each layer's least work: its fastest plan's seconds
    # times the devices running it, least over every logical mesh the search may use
    # (`_least_work`); empty: not known (then only the stage's own latency bounds a plan).
    work: Sequence[float] = ()
    # Skip the shapes on which a stage's memory floor exceeds the budget
    # (`autopar.inter._memory_bound.stage_memory_floor`; `StageOptions.memory_floors`).
    floors: bool = True
    # The stages on some plan within the memory floors (`autopar.inter._floor_reach`):
    # the others are infeasible without a cost; None: no such rule.
    reach: object = None

    def __post_init__(self):
        # (range content, shapes) -> shapes by speed: layer ranges of equal content
        # (`LayerCostTable.range_key`) share one order (GPT-3 175B on 1,024 GPUs: 622k
        # entries by (start, end, index), 331 MB).
        self._orders: dict[tuple, list] = {}
        self._fixed: dict[tuple, float] = {}  # (start, whole, devices) -> `_fixed_seconds`
        # (start, end, index, shapes) beyond `bound` -> its answer (`Pruned`)
        self._hopeless: dict[tuple, StageCost] = {}
        self._shapes: dict[tuple, tuple] = {}  # (index, shapes asked) -> shapes to try
        self._prefix: dict[tuple, tuple] = {}  # shape -> prefix sums of level 0 (`_fastest`)
        self._time_floors: dict[tuple, list] = {}  # shape -> prefix sums (`_time_floor`)
        # (start, end, index, shapes) -> shapes skipped by their memory floor ({} none)
        self.floor_cuts: dict[tuple, dict] = {}
        self.floor_skipped: set[tuple] = set()  # those keys with every shape skipped

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
            # A layer alone over the budget on `shape` (`holds`) is taken as having no
            # plan there: no stage holding it can use `shape`; its ILP is not solved.
            held = [k for k in range(len(self.table.per_layer.stage_graphs))
                    if self.holds(k, shape)]
            _prefetch(self.table, held, shape, 0)
            sums, missing, unproven = [0.0], [0], [0]
            for k in range(len(self.table.per_layer.stage_graphs)):
                cost = self.table.cost(k, shape) if self.holds(k, shape) else None
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
        if unproven[end] - unproven[start] or not self.table.lower_bounds:
            return fastest, -math.inf
        return fastest, fastest * (1 - DOMINANCE_MARGIN)

    def _time_floor(self, start: int, end: int, shape) -> float:
        """A lower bound on the latency of layers [start, end) on `shape` at any memory
        level and recompute, from their ILPs built, not solved: the sum of their
        `layer_time_floor`s, less `DOMINANCE_MARGIN` for rounding (prefix sums per shape)."""
        if shape not in self._time_floors:
            sums = [0.0]
            for k in range(len(self.table.per_layer.stage_graphs)):
                sums.append(sums[-1] + layer_time_floor(self.table, k, shape))
            self._time_floors[shape] = sums
        sums = self._time_floors[shape]
        return (sums[end] - sums[start]) * (1 - DOMINANCE_MARGIN)

    def holds(self, layer: int, shape) -> bool:
        """False where layer `layer` alone is over the budget on `shape` by its memory floor
        (`autopar.inter._submesh_cut.layer_fits`): every stage holding it has a floor at
        least that (`stage_memory_floor`), so `_over_budget` would skip `shape` for it.
        True wherever `_over_budget` cuts nothing."""
        if not (self.floors and self.table.lower_bounds and self.table.solve is None
                and math.isfinite(self.budget)):
            return True
        if self.reach is not None and not self.reach.holds(layer, shape):
            return False  # on no plan within the memory floors (`_floor_reach`)
        return layer_fits(self.table, layer, tuple(shape), self.budget)

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
        if self.reach is not None and not self.reach.on_plan(start, end, index):
            # No plan within the memory floors holds this stage (`_floor_reach`).
            return StageCost(math.inf, False, math.inf, OFF_PLAN)
        shapes = self._shapes_to_try(index, shapes)
        key = (start, end, index, shapes)
        if key in self._hopeless:
            return self._hopeless[key]
        in_flight = in_flight_microbatches(self.schedule, self.num_microbatches, stages_from_here)
        whole = start == 0 and end == len(self.table.per_layer.stage_graphs)
        transfer = self._fixed_seconds(start, whole, sub.num_devices)
        # No plan as fast as `bound` holds this stage at or above `hopeless` latency; a
        # shape whose fastest plans (`_lower_bound`) reach it is not costed, at any position.
        hopeless = self.latency_cutoff(start, end, sub.num_devices) - transfer
        if shapes and math.isfinite(self.bound) and _time_floors_on(self.table):
            # First by the layers' time floors (`layer_time_floor`: no ILP solved): a
            # stage they already put at or above `hopeless` on every shape is answered
            # without its layers' fastest plans.
            lows = [self._time_floor(start, end, shape) for shape in shapes]
            if all(low >= hopeless for low in lows):
                self._hopeless[key] = StageCost(math.inf, False, math.inf, Pruned(
                    self.bound, max(0.0, min(lows) + transfer)))
                return self._hopeless[key]
        order = self._shape_order(start, end, shapes, key)
        if order and all(o[3] >= hopeless for o in order):
            self._hopeless[key] = StageCost(math.inf, False, math.inf, Pruned(
                self.bound, max(0.0, min(o[3] for o in order) + transfer)))
            return self._hopeless[key]
        layer_range = range(start, end)
        over = self._over_budget(layer_range, order, key)
        known = self._known_fit_latency(layer_range, [o for o in order if o[2] not in over],
                                        in_flight, hopeless)
        return self._fastest_fit(layer_range, order, in_flight, transfer,
                                 min(hopeless, known * (1 + BOUND_MARGIN)), hopeless, over)

    def _over_budget(self, layer_range, order, key) -> dict:
        """{shape: floor} of the shapes of `order` on which no stage of these layers fits
        the budget at any memory level or recompute: its memory floor
        (`stage_memory_floor`) exceeds it. Their leaner levels are never solved. Empty
        unless `floors`, the table's lower bounds are on and its own ILPs make its plans.
        The same for every position: computed once per `key`."""
        if key not in self.floor_cuts:
            over = {}
            if self.floors and self.table.lower_bounds and self.table.solve is None \
                    and math.isfinite(self.budget):
                for _, _, shape, _ in order:
                    floor = stage_memory_floor(self.table, layer_range, shape, self.budget)
                    if floor > self.budget:
                        over[shape] = floor
            self.floor_cuts[key] = over or _NO_CUTS  # one shared empty dict: most keys
            if over and len(over) == len(order):
                self.floor_skipped.add(key)
        return self.floor_cuts[key]

    def _shapes_to_try(self, index: int, shapes) -> tuple[tuple[int, ...], ...]:
        """The logical mesh shapes of submesh `index` a stage tries: `shapes` when given,
        else `logical_shapes`, else every shape of the submesh; those of another device
        count left out. The same for every layer range and position: cached."""
        sub = self.submeshes[index]
        asked = (index, None if shapes is None else tuple(map(tuple, shapes)))
        if asked not in self._shapes:
            tried = self.logical_shapes or logical_mesh_shapes(sub) if shapes is None else shapes
            self._shapes[asked] = tuple(
                tuple(s) for s in tried if math.prod(s) == sub.num_devices
            )
        return self._shapes[asked]

    def _shape_order(self, start: int, end: int, shapes, key) -> list:
        """(fastest latency, rank in `shapes`, shape, lower bound) of every shape on which
        each of layers [start, end) has a plan, by the layers' fastest plans (a lower
        bound on any fit there), so that a fitting shape is found early and the leaner
        levels of shapes that cannot beat it are not solved; among equally fast fits the
        first shape of `shapes` wins, as when they are tried in that order. The same for
        every position and range of equal content: computed once."""
        layer_range = range(start, end)
        content = _range_cache_key(self.table, "order", layer_range, (shapes,))
        order_key = key if content is None else content
        order = self._orders.get(order_key)
        if order is None:
            prefetch = getattr(self.table, "prefetch", None)  # a made-up table has none
            if prefetch is not None:
                # The fastest plans this order reads (with `work`, every layer's on each
                # shape not yet summed, `_fastest`), solved side by side: a reference's
                # `is_solved` would otherwise let them be solved one at a time where its
                # layouts do not apply.
                every = range(len(self.table.per_layer.stage_graphs))
                prefetch((k, shape, 0) for shape in shapes
                         if not self.work or shape not in self._prefix
                         for k in (every if self.work else layer_range)
                         if self.holds(k, shape))
            order = []
            for rank, shape in enumerate(shapes):
                if self.work:  # every layer's level 0 is solved on every shape
                    fastest, lower = self._fastest(start, end, shape)
                    if fastest is not None:
                        order.append((fastest, rank, shape, lower))
                    continue
                plain = [self.table.cost(k, shape) if self.holds(k, shape) else None
                         for k in layer_range]
                if all(c is not None for c in plain):
                    order.append((math.fsum(c.latency for c in plain), rank, shape,
                                  _stage_fit._lower_bound(self.table, layer_range, shape, 0)))
            order.sort(key=lambda o: o[:2])
            self._orders[order_key] = order
        return order

    def _known_fit_latency(self, layer_range, order, in_flight, hopeless: float) -> float:
        """The latency of the fastest fit the ILPs solved so far give (no solve; inf:
        none), as a cutoff for the walks that solve: a shape that cannot beat a fit on
        another is not walked further."""
        known = math.inf
        if self.prune and len(order) > 1:
            for _, _rank, shape, lower in order:
                if lower >= min(hopeless, known):
                    continue
                fit = _stage_fit._fitting_level(
                    self.table, layer_range, shape, in_flight, self.budget, self.remat,
                    min(hopeless, known), solved_only=True,
                )
                if fit is not None and fit.memory <= self.budget:
                    known = min(known, fit.latency)
        return known

    def _fastest_fit(self, layer_range, order, in_flight, transfer: float, limit: float,
                     hopeless: float, over=None) -> StageCost:
        """The fastest fit of the layers over the shapes of `order` (`_fitting_level`),
        each walk cut off at `limit` and at the best fit found so far; infeasible (with
        the least memory seen) when none fits. `over`: {shape: memory floor} of shapes
        that cannot fit (`_over_budget`): not walked, each taken as the walk would end
        there (cut off, or not fitting, its floor as its memory)."""
        best, best_rank = None, None
        least_memory = math.inf
        floor = False  # whether `least_memory` is a memory floor, not a fit's peak
        cut = []  # least latency of each shape cut off at `limit` (`Pruned`)
        for _, rank, shape, lower in order:
            if lower >= hopeless:
                cut.append(lower)
                continue
            # Once a shape fits, another must beat it (`least_memory` is then unused).
            cutoff = math.inf if best is None else best.latency - transfer
            cutoff = min(cutoff, limit)
            if over and shape in over:
                # As `_fitting_level` ends on it: level 0 does not fit, so cut off where
                # its fastest plans reach `cutoff`, else the leanest tried does not fit.
                if _stage_fit._lower_bound(self.table, layer_range, shape, 0) >= cutoff:
                    cut.append(max(lower, cutoff))
                elif over[shape] < least_memory:
                    least_memory, floor = over[shape], True
                continue
            fit = _stage_fit._fitting_level(
                self.table, layer_range, shape, in_flight, self.budget, self.remat, cutoff,
            )
            if fit is None:  # its fastest plans reach `cutoff` (every shape of `order` has some)
                cut.append(max(lower, cutoff))
                continue
            if fit.memory <= least_memory:
                least_memory, floor = fit.memory, False
            if fit.memory <= self.budget:
                latency = fit.latency + transfer
                if best is None or (latency, rank) < (best.latency, best_rank):
                    best = StageCost(latency, True, fit.memory, (shape, fit.level, fit.remat),
                                     fit.parts)
                    best_rank = rank
        if best is None:
            if cut and least_memory == math.inf and math.isfinite(self.bound):
                # Cut off by the bound on every shape, never measured: say so.
                return StageCost(math.inf, False, math.inf,
                                 Pruned(self.bound, max(0.0, min(cut) + transfer)))
            return StageCost(math.inf, False, least_memory, MemoryFloor() if floor else None)
        return best


_NO_CUTS: dict = {}  # `_StageCosts._over_budget`'s answer where nothing is over (never written)

# Bound stages and the layers' least work by the layers' time floors (`layer_time_floor`:
# from their ILPs built, not solved) before any of their fastest plans is solved. Off: only
# solved plans bound them (every layer's fastest plan on every logical mesh is solved
# first). Exact either way (`tests/test_planning_time_floor.py`), but off by default: on a
# quiet machine the floors' extra problem builds cost more than the solves they save
# (`python -m benchmarks planning_time --rows demo llama-8B@64`, 2 interleaved rounds: demo
# 6.4 / 6.3 s wall with them against 4.2 / 3.7 s without; llama-8B@64 55.3 / 59.6 against
# 52.6 / 48.6 s, 115 ILPs against 116).
TIME_FLOORS = False


def _time_floors_on(table) -> bool:
    """Whether `TIME_FLOORS` apply: the table's lower bounds are on and its own ILPs make
    its plans (a caller's `solve` has no problem to build)."""
    return TIME_FLOORS and table.lower_bounds and table.solve is None \
        and hasattr(table, "range_cache")


# `_StageCosts.latency_cutoff` cuts off only stages that would make a plan slower than the
# known one by more than this (relative), far above rounding.
BOUND_MARGIN = 1e-6


def _least_work(table: LayerCostTable, submeshes, logical_shapes,
                holds=None) -> list[float]:
    """Prefix sums (`_StageCosts.work`) of each layer's least work: its fastest plan's
    seconds (level 0) times the mesh's devices, least over every logical mesh of
    `submeshes` (`logical_shapes` when given) on which it may be staged (`holds(layer,
    shape)`, when given: `_StageCosts.holds`), times (1 - `DOMINANCE_MARGIN`) as
    `_lower_bound`; empty when one such plan is not a proven optimum (no bound then).
    With `TIME_FLOORS`, only the plans on one device (a trivial ILP) and those already
    solved are solved plans here; on every other mesh the layer's time floor
    (`layer_time_floor`) stands in for its fastest plan (no less work, so a bound too)."""
    holds = holds or (lambda k, shape: True)
    shapes = []
    for sub in submeshes:
        for shape in logical_shapes or logical_mesh_shapes(sub):
            shape = tuple(shape)
            if math.prod(shape) == sub.num_devices and shape not in shapes:
                shapes.append(shape)
    if table.solve is not None or not shapes or not table.lower_bounds:
        return []
    floors = _time_floors_on(table)
    solved = [s for s in shapes if not floors or math.prod(s) == 1]
    prefetch = getattr(table, "prefetch", None)  # a test's made-up table has none
    if prefetch is not None:
        num_layers = len(table.per_layer.stage_graphs)
        prefetch((k, shape, 0) for shape in solved for k in range(num_layers)
                 if holds(k, shape))
    sums = [0.0]
    for k in range(len(table.per_layer.stage_graphs)):
        least = math.inf
        for shape in shapes:
            if not holds(k, shape):
                continue
            if shape not in solved and not table.is_known(k, shape, 0):
                least = min(least, layer_time_floor(table, k, shape) * math.prod(shape))
                continue
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


def _even_cuts(num_layers: int, count: int) -> list[int] | None:
    """Cuts of `count` stages of (nearly) equal layer counts; None with more stages than
    layers."""
    if count > num_layers:
        return None
    return [round(i * num_layers / count) for i in range(count + 1)]


def _bound_by_even_plans(inner: _StageCosts, stage_cost, num_layers: int, num_hosts: int,
                         devices_per_host: int, submeshes, num_stages: int | None,
                         cuts_of=None) -> None:
    """Set `inner.bound` to the DP objective of the best "even" plan: S stages of
    (nearly) equal layer counts on S copies of one submesh (Megatron-LM's layout), for
    every submesh whose copies fill the cluster and pack (`assign_devices`), each stage
    costed by `stage_cost` at its position as the DP asks it. The plans are tried by
    their lower bound (their stages' fastest shapes) and each tightens the bound the next
    ones are costed under, so that few leaner levels are solved for plans that lose.
    `cuts_of(S)`: the S stages' cuts, None where there are none (default `_even_cuts`;
    `autopar.inter._share_bound` passes its own)."""
    total = num_hosts * devices_per_host
    b = inner.num_microbatches
    positions = inner.num_positions
    plans = []
    for index, sub in enumerate(submeshes):
        count, rest = divmod(total, sub.num_devices)
        if rest or (num_stages is not None and count != num_stages):
            continue
        cuts = (cuts_of or partial(_even_cuts, num_layers))(count)
        if cuts is None:
            continue
        try:
            assign_devices([sub] * count, num_hosts, devices_per_host)
        except ValueError:
            continue
        stages = []
        for i in range(count):
            args = [cuts[i], cuts[i + 1], index]
            if positions is not None:
                args.append(min(count - i, positions))
            stages.append(tuple(args))
        _prefetch_fastest(inner, index)
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


def _prefetch_fastest(inner: _StageCosts, index: int) -> None:
    """The fastest plans (level 0) `_fastest_stage` reads for an even plan on submesh
    `index`, solved side by side (`LayerCostTable.prefetch`) rather than one at a time as
    it asks them: the even plans' stages cover every layer, so it asks every layer held
    on every logical mesh of the submesh (all but the layers after one with no plan on a
    mesh, which its `all` skips). Nothing with `TIME_FLOORS` (it then reads floors, not
    plans, where they are not solved yet). The costs are those `cost` finds one at a
    time; only when they are solved changes (llama-8B@64: 71 of its 100 layer ILPs were
    solved here one at a time, the workers idle)."""
    prefetch = getattr(inner.table, "prefetch", None)  # a test's made-up table has none
    if prefetch is None or _time_floors_on(inner.table):
        return
    num_layers = len(inner.table.per_layer.stage_graphs)
    prefetch((k, shape, 0) for shape in inner._shapes_to_try(index, None)
             for k in range(num_layers) if inner.holds(k, shape))


def _fastest_stage(inner: _StageCosts, start: int, end: int, index: int) -> float:
    """A lower bound on the stage's latency on submesh `index` (`_lower_bound` on its
    fastest logical mesh; 0 where a plan there is not a proven optimum, inf where no
    mesh has a plan for every layer). With `TIME_FLOORS`, a mesh whose layers' fastest
    plans are not all in the table takes their time floors (`_StageCosts._time_floor`)."""
    sub = inner.submeshes[index]
    lows = []
    floors = _time_floors_on(inner.table)
    for shape in inner.logical_shapes or logical_mesh_shapes(sub):
        shape = tuple(shape)
        if math.prod(shape) != sub.num_devices:
            continue
        if not all(inner.holds(k, shape) for k in range(start, end)):
            continue
        if floors and not all(inner.table.is_known(k, shape, 0) for k in range(start, end)):
            lows.append(max(0.0, inner._time_floor(start, end, shape)))  # no ILP solved
            continue
        if all(inner.table.cost(k, shape) is not None for k in range(start, end)):
            lows.append(max(0.0, _stage_fit._lower_bound(inner.table, range(start, end),
                                                          shape, 0)))
    return min(lows, default=math.inf)
