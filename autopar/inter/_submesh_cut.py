"""Submeshes and logical meshes no stage of a plan can use, cut before any layer ILP.

In: the stage DP's submeshes and their logical mesh shapes (`_choose._splittable`'s), a
`LayerCostTable`, the memory budget, the layer count and the stage count asked for. Out:
the submeshes and shapes left (`usable_submeshes`). The stage DP then prices, bounds and
prefetches (level 0 of every layer on every shape, `_stage_costs._least_work`) only on
those. Two rules, each exact (it removes only what no plan the DP could return uses):

- **Memory floor.** Every stage holds at least one layer k, and a stage holding k on a
  mesh of `shape` needs at least ``F(k, shape)`` bytes per device, the floor of the stage
  made of k alone (`autopar.inter._memory_bound.stage_memory_floor`; its docstring proves
  that a stage holding more layers needs at least that much: the other layers only add
  their state and gradients, a state input read by several counted once). A shape with
  ``F(k, shape) > budget`` for every layer k holds no stage: it is cut, and a submesh with
  no shape left is cut. The liveness floors are tried first (no ILP built); a shape they
  put over the budget for every layer is refined by the ILP model's floor (built, the
  build memoised for the solve that follows).
- **Device count.** A plan's stages use exactly the cluster's N devices, at most L stages
  (one layer each at least) and exactly `num_stages` when that is asked for
  (`autopar.inter._stage_dp`). A submesh of d devices is cut when N - d is not a sum of
  the kept submeshes' device counts over a count of stages the plan may still have
  (between the fewest and the most stages, less one). Cuts repeat until none is left,
  the kept sizes shrinking with each.

Nothing is cut where the table's lower bounds are off (the unpruned reference search
tries every mesh) or its costs are priced from another count's layouts (its ILPs are not
its own, `LayerCostTable.solve`), or where every submesh would go (the caller's
`NoStageHoldsLayer` then says which layer no mesh can hold).
"""

from __future__ import annotations

import logging
import math

from autopar.inter._memory_bound import (
    held_floors,
    layer_liveness_floor,
    shared_state_full,
    stage_memory_floor,
)
from autopar.inter._submesh import SubmeshShape, logical_mesh_shapes

log = logging.getLogger("autopar")


def _liveness_single(table, k: int, n: int) -> float:
    """`stage_memory_floor` of layer k alone on n devices from its liveness floor only
    (no ILP built): its liveness floor, plus its fresh gradients with several microbatches,
    less its state other layers also read."""
    _, grads = held_floors(table, k, n)
    fresh = grads if table.num_microbatches > 1 else 0.0
    return layer_liveness_floor(table, k, n) + fresh - shared_state_full(table, k)


def layer_fits(table, layer: int, shape: tuple[int, ...], budget: float) -> bool:
    """Whether a stage of layer `layer` alone on a mesh of `shape` has a memory floor
    within `budget` (`stage_memory_floor`: the liveness floor, refined by the ILP model's
    where that is over); where not, no stage holding the layer fits on `shape` (see the
    module docstring). Shared by layers of equal content."""
    return stage_memory_floor(table, range(layer, layer + 1), shape, budget) <= budget


def shape_holds_a_layer(table, shape: tuple[int, ...], budget: float) -> bool:
    """Whether some layer alone has a stage floor within `budget` on a mesh of `shape`
    (see the module docstring): liveness floors first, the ILP model's where they all
    exceed it."""
    n = math.prod(shape)
    layers = range(len(table.fingerprints))
    seen: set = set()
    distinct = []  # one layer per (structure, shared state): the floor depends on both
    for k in layers:
        key = (table.fingerprints[k], shared_state_full(table, k))
        if key not in seen:
            seen.add(key)
            distinct.append(k)
    if any(_liveness_single(table, k, n) <= budget for k in distinct):
        return True
    return any(layer_fits(table, k, shape, budget) for k in distinct)


def fillable_sizes(total: int, sizes, fewest_others: int, most_others: int) -> set[int]:
    """The device counts d of `sizes` for which ``total - d`` is a sum of between
    `fewest_others` and `most_others` counts of `sizes` (repeats allowed)."""
    sizes = sorted(set(sizes))
    if most_others < 0:
        return set()
    mask = (1 << (most_others + 1)) - 1
    # reach[s]: bit c set when s is a sum of c counts of `sizes`
    reach = [0] * (total + 1)
    reach[0] = 1
    for s in range(1, total + 1):
        bits = 0
        for d in sizes:
            if d > s:
                break
            bits |= reach[s - d] << 1
        reach[s] = bits & mask
    wanted = mask & ~((1 << fewest_others) - 1) if fewest_others > 0 else mask
    return {d for d in sizes if d <= total and reach[total - d] & wanted}


def usable_submeshes(table, submeshes, shapes, options, budget: float, num_layers: int):
    """(submeshes, shapes) less those no stage can use (see the module docstring).

    **Arguments:**
    - `submeshes`: the DP's submeshes; `shapes`: their logical mesh shapes as one tuple
      (each submesh takes those of its device count), or None (each its
      `logical_mesh_shapes`).
    - `options`: the `StageOptions`; only when they leave the submeshes and their usual
      shapes to the search with its lower bounds on (as `_choose._splittable`) is
      anything cut, and its `num_stages` bounds the stage count.
    - `budget`: bytes per device; `num_layers`: the DP's layers.

    **Returns:**
    ``(submeshes, shapes)`` as given, or the kept ones; where each submesh has a device
    count of its own (so that one shape list says which shapes each keeps), `shapes` is
    then a tuple of the kept shapes, else only whole submeshes are cut."""
    if (options.submeshes is not None or options.logical_shapes is not None
            or options.every_mesh_shape or not options.lower_bounds
            or table.solve is not None or not table.lower_bounds or not submeshes):
        return submeshes, shapes
    num_stages = options.num_stages
    logical = len({s.num_devices for s in submeshes}) == len(submeshes)

    def own(sub: SubmeshShape):
        tried = shapes if shapes is not None else logical_mesh_shapes(sub)
        return [tuple(s) for s in tried if math.prod(s) == sub.num_devices]

    kept, kept_shapes, by_memory = [], [], 0
    for sub in submeshes:
        held = own(sub)
        if math.isfinite(budget):
            held = [s for s in held if shape_holds_a_layer(table, s, budget)]
        if held:
            kept.append(sub)
            kept_shapes.append(held)
        else:
            by_memory += 1
    cut_shapes = sum(len(own(s)) for s in submeshes) - sum(map(len, kept_shapes))
    total = table.cluster.num_devices
    fewest, most = (num_stages, num_stages) if num_stages else (1, min(num_layers, total))
    by_count = 0
    while kept:
        fits = fillable_sizes(total, [s.num_devices for s in kept], fewest - 1, most - 1)
        left = [i for i, s in enumerate(kept) if s.num_devices in fits]
        if len(left) == len(kept):
            break
        by_count += len(kept) - len(left)
        kept = [kept[i] for i in left]
        kept_shapes = [kept_shapes[i] for i in left]
    if not kept or len(kept) == len(submeshes) and not (logical and cut_shapes):
        return submeshes, shapes
    log.info("stage DP: %d of %d submeshes left out before any ILP: %d whose every logical "
             "mesh holds no layer within the memory budget, %d whose device count no plan "
             "of %s stage(s) filling the cluster can use; %d logical meshes left",
             len(submeshes) - len(kept), len(submeshes), by_memory, by_count,
             num_stages or f"1..{most}", sum(map(len, kept_shapes)))
    if logical:
        return kept, tuple(s for held in kept_shapes for s in held)
    return kept, shapes
