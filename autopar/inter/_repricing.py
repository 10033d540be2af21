"""Layer costs found on another microbatch count's layouts, without an ILP.

In: a `LayerCostTable` made with a `reference` (the table of the same layers at another
microbatch count, made with `keep_layouts=True`). Out: where the reference has solved a
layer at (shape, level), this table's cost there: the reference plan's layout priced on
this table's layer graph (`price_layout`, the same cost model on these shapes). Issue 18:
`num_microbatches="auto"` searches several counts.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cluster import LogicalMesh
from autopar.inter._layer_graphs import _tied_in
from autopar.inter._one_row import row_map
from autopar.intra._planner import price_layout


def priced(table, layer: int, shape, level: int):
    """(cost, (plan, graph)) of the reference's plan at (`shape`, `level`) priced on
    this table's layer (`price_layout`); None where the reference has not solved it
    (an ILP here is as much work, and exact), has no plan, or its layout does not apply
    (then the ILP decides). A layer traced at one-row microbatches, whose operations
    differ from the reference's, is priced on the layout carried onto it
    (`autopar.inter._one_row`; `price_layout` checks it as any other). A level the
    reference answered with a lower level's plan is priced once."""
    ref = table.reference
    matching = _matches_reference(table, layer)
    if (not matching or not ref.is_solved(layer, shape, level)
            or ref.cost(layer, shape, level) is None):
        return None
    ref_plan = ref.solved_plan(layer, shape, level)[0]
    kept = ref._layouts.get(id(ref_plan)) if ref._layouts is not None else None
    if kept is None:
        return None
    key = (table.fingerprints[layer], id(ref_plan))
    layout = kept[1] if matching is True else matching.layout(kept[1])
    if layout is None:
        table._repriced[key] = None
    if key not in table._repriced:
        sub = table.per_layer.stage_graphs[layer]
        mesh = LogicalMesh.create(shape, axis_names=table.axis_names)
        ties = _tied_in(sub, table.tied) + table.chain_ties(layer)
        options = table.options
        if options.context_parallel == "auto" and ref_plan.context_parallel.algorithm == "ring":
            # the ring's exact ILP made this layout (`exact_ring_problem`): price it so
            options = replace(options, context_parallel="ring")
        plan = price_layout(
            sub, table.cluster, mesh, layout, options, ties,
            weights=table.weights[layer], footprint=table.footprint(layer, shape, None),
        )
        table._repriced[key] = None if plan is None else table._layer_cost(layer, sub, plan)
        if plan is not None:
            table.num_priced += 1
            table._priced_plans.add(id(plan))
    return table._repriced[key]


def forget_priced(table) -> None:
    """Drop the reference and every cost found by pricing its layouts (and what was
    derived from them); the costs of this table's own ILPs stay. A stage DP run
    again on it then solves the ILPs the priced costs stood in for."""
    for key, (plan, _) in list(table._plans.items()):
        if id(plan) in table._priced_plans:
            del table._plans[key]
            del table._cache[key]
    table.reference, table._repriced, table._priced_plans = None, {}, set()
    table._remat_cache.clear()
    table._fused_by_level.clear()
    table.range_cache.clear()


def _matches_reference(table, layer: int):
    """True where the layer's graph has the reference's layer's operations in the same
    order; else the `RowMap` that carries the reference's layouts onto it where it is
    that layer traced at one-row microbatches (`autopar.inter._one_row`); else None (no
    layout of the reference applies)."""
    if layer not in table._matching:
        mine = table.per_layer.stage_graphs[layer]
        theirs = table.reference.per_layer.stage_graphs[layer]
        same = (len(mine.invars) == len(theirs.invars)
                and [n.primitive for n in mine.nodes] == [n.primitive for n in theirs.nodes])
        table._matching[layer] = True if same else row_map(mine, theirs)
    return table._matching[layer]
