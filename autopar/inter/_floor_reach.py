"""The stages that can be part of a plan within the memory budget, by memory floors alone.

In: a `LayerCostTable`, the stage DP's layer count, submeshes and their logical mesh
shapes, the memory budget, the layer ranges a stage may take (`allowed`) and the stage
count asked for. Out: `FloorReach`, which says, before any layer ILP, whether a plan can
exist at all (`exists`), whether a stage of layers [start, end) on submesh `index` can be
a stage of one (`on_plan`), and whether layer k can be staged on a logical mesh of some
shape in one (`holds`). The stage DP (`autopar.inter._choose`) refuses a count without
such a plan before any ILP (`NoPlanWithinFloors`), and gives `_StageCosts` the rest: a
stage on no such plan is answered infeasible without its layers' costs, and the layers'
least work (`_stage_costs._least_work`) is taken over the shapes they can be staged on.

Why it is exact. A plan the DP returns slices layers [0, L) into contiguous stages, each
a range `allowed` takes on a submesh, whose device counts add up to the cluster's N
(`autopar.inter._stage_dp`), exactly `num_stages` of them when that is asked for; and each
stage fits the budget on its logical mesh at some memory level, with some recompute, in
its position. A stage's memory is at least its memory floor
(`autopar.inter._memory_bound.stage_memory_floor`, whose docstring proves it for the
model of memory `autopar.cost.stage_memory_parts` prices: state, gradient sums, kept
activations and the largest working memory, at any level, recompute or position). So
every stage of a feasible plan is a stage whose floor is within the budget on one of its
shapes, and the plan is a path of such stages from layer 0 to L using N devices: here,
the stages on some such path (`on_plan`; forward and backward reach over (layer, devices
used, stages used)). A stage on none is in no feasible plan, and answering it infeasible
changes no feasible plan's cost, so the DP's answer is the same; the least work taken
over fewer shapes is still at most a plan's own (every layer of a feasible plan sits on a
shape `holds` keeps), so the bounds it feeds stay lower bounds.
"""

from __future__ import annotations

import logging
import math

from autopar.inter._memory_bound import stage_memory_floor
from autopar.inter._submesh import logical_mesh_shapes

log = logging.getLogger("autopar")

# Above this many (layer range, submesh) pairs the reach is not computed (its floors
# would cost more than the stages it could rule out): nothing is ruled out then.
MAX_PAIRS = 20_000


class FloorReach:
    """See the module docstring. `shapes`: the logical mesh shapes the DP tries, one
    tuple for every submesh (each takes those of its device count), or None (each
    submesh its `logical_mesh_shapes`); `allowed(start, end)`: the ranges a stage may
    take (None: any); `num_stages`: the stage count asked for (None: any)."""

    def __init__(self, table, num_layers: int, submeshes, shapes, budget: float,
                 allowed=None, num_stages: int | None = None):
        self.table, self.num_layers, self.budget = table, num_layers, budget
        self.allowed = allowed or (lambda start, end: True)
        self.num_stages = num_stages
        self.devices = [sub.num_devices for sub in submeshes]
        self.shapes = [
            tuple(dict.fromkeys(tuple(s) for s in (shapes or logical_mesh_shapes(sub))
                                if math.prod(s) == sub.num_devices))
            for sub in submeshes
        ]
        self.total = table.cluster.num_devices
        self._fits: dict[tuple[int, int, int], tuple] = {}
        self._flips: dict[int, int] = {}
        forward = self._reach(forward=True)
        backward = self._reach(forward=False)
        self._forward, self._backward = forward, backward
        self.exists = self._meets(forward[num_layers], {0: 1}, 0)
        self._on_plan: dict[tuple[int, int, int], bool] = {}
        self._held: set[tuple[int, tuple[int, ...]]] | None = None

    def fitting_shapes(self, start: int, end: int, index: int) -> tuple:
        """The shapes of submesh `index` on which layers [start, end) have a memory floor
        within the budget (`stage_memory_floor`)."""
        key = (start, end, index)
        if key not in self._fits:
            self._fits[key] = tuple(
                s for s in self.shapes[index]
                if stage_memory_floor(self.table, range(start, end), s, self.budget)
                <= self.budget)
        return self._fits[key]

    def _step(self, masks: dict, d: int) -> dict:
        """`masks` (stages used -> bit set of devices used) one stage of d devices on."""
        full = (1 << (self.total + 1)) - 1
        out = {}
        for c, m in masks.items():
            c2 = c + 1 if self.num_stages is not None else 0
            if self.num_stages is not None and c2 > self.num_stages:
                continue
            moved = (m << d) & full
            if moved:
                out[c2] = out.get(c2, 0) | moved
        return out

    def _reach(self, forward: bool) -> list[dict]:
        """Per layer boundary b: stages used -> bit set of the devices used by stages
        that fit (by their floors) covering layers [0, b) (`forward`) or [b, L)."""
        L = self.num_layers
        reach: list[dict] = [{} for _ in range(L + 1)]
        reach[0 if forward else L] = {0: 1}
        bounds = range(L) if forward else range(L, 0, -1)
        for b in bounds:
            if not reach[b]:
                continue
            others = range(b + 1, L + 1) if forward else range(b - 1, -1, -1)
            for o in others:
                start, end = (b, o) if forward else (o, b)
                if not self.allowed(start, end):
                    continue
                for index, d in enumerate(self.devices):
                    moved = self._step(reach[b], d)
                    if all(m & ~reach[o].get(c, 0) == 0 for c, m in moved.items()):
                        continue  # nothing new reached: no floor needed
                    if not self.fitting_shapes(start, end, index):
                        continue
                    for c, m in moved.items():
                        reach[o][c] = reach[o].get(c, 0) | m
        return reach

    def _meets(self, before: dict, after: dict, d: int) -> bool:
        """Whether some devices used before (`before`), d, and some used after (`after`)
        add up to the cluster's devices, with the stage count asked for."""
        for c1, m1 in before.items():
            for c2, m2 in after.items():
                if self.num_stages is not None and c1 + c2 + (1 if d else 0) \
                        != self.num_stages:
                    continue
                # u + d + v = N for some u in m1 and v in m2: m1 << d meets N - v
                if (m1 << d) & self._flipped(m2):
                    return True
        return False

    def _flipped(self, mask: int) -> int:
        """The bit set {N - v : v in `mask`}."""
        if mask not in self._flips:
            bits = bin(mask)[2:].zfill(self.total + 1)  # bit N first
            self._flips[mask] = int(bits[::-1], 2) if bits else 0
        return self._flips[mask]

    def on_plan(self, start: int, end: int, index: int) -> bool:
        """Whether layers [start, end) on submesh `index` can be a stage of a plan whose
        every stage is within the budget by its floor."""
        key = (start, end, index)
        if key not in self._on_plan:
            self._on_plan[key] = (
                self.allowed(start, end) and bool(self._forward[start])
                and bool(self._backward[end])
                and bool(self.fitting_shapes(start, end, index))
                and self._meets(self._forward[start], self._backward[end],
                                self.devices[index]))
        return self._on_plan[key]

    def holds(self, layer: int, shape) -> bool:
        """Whether layer `layer` sits on a mesh of `shape` in some stage `on_plan` (within
        the budget there by its floor)."""
        if self._held is None:
            held = set()
            L = self.num_layers
            for start in range(L):
                for end in range(start + 1, L + 1):
                    for index in range(len(self.devices)):
                        if self.on_plan(start, end, index):
                            for s in self.fitting_shapes(start, end, index):
                                held.update((k, s) for k in range(start, end))
            self._held = held
        return (layer, tuple(shape)) in self._held

    def num_ruled_out(self) -> int:
        """How many (layer range, submesh) pairs `allowed` takes are on no plan."""
        return sum(1 for start in range(self.num_layers)
                   for end in range(start + 1, self.num_layers + 1)
                   if self.allowed(start, end)
                   for index in range(len(self.devices))
                   if not self.on_plan(start, end, index))


def floor_reach(table, num_layers: int, submeshes, shapes, budget: float, options,
                allowed=None) -> FloorReach | None:
    """The `FloorReach` of the DP's stages, or None where nothing is ruled out by floors:
    the budget is infinite, the options switch memory floors or lower bounds off (the
    unpruned reference search costs every stage), the table's plans are a caller's
    (`LayerCostTable.solve`), it keeps its layouts for other counts to price (what it
    solves is their reference: it solves what it would without the rule), or the pairs
    are too many (`MAX_PAIRS`)."""
    if (not math.isfinite(budget) or not options.memory_floors or not options.lower_bounds
            or not table.lower_bounds or table.solve is not None
            or getattr(table, "_layouts", None) is not None or not submeshes):
        return None
    if num_layers * (num_layers + 1) // 2 * len(submeshes) > MAX_PAIRS:
        return None
    return FloorReach(table, num_layers, submeshes, shapes, budget, allowed,
                      options.num_stages)
