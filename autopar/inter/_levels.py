"""Memory levels: leaner layer plans for stages whose fastest layer plans do not fit.

In: a `LayerCostTable` and a (layer, logical mesh shape, level). Out: the ILP(s) that plan
the layer at that level and its cost there (`level_steps`). The table's `memory_levels`
(`StageOptions.memory_levels`) says how a level is made leaner (a price on the
footprint, or a limit row); `autopar.inter._stage_fit` walks the levels of a stage's
layers until they fit together.
"""

from __future__ import annotations

# Memory levels of the layer plans a stage may use. Level 0 is each layer's fastest plan.
# The layer ILPs see one layer; a stage holds many, so the fastest plans of its layers may
# not fit together where leaner ones (state, gradients and activations split further) do.
# A leaner level trades latency for the layer's footprint on the stage (state, accumulated
# gradients, kept activations of the microbatches in flight: what `stage_memory` sums over
# the layers), in one of two ways (`StageOptions.memory_levels`, a `LayerCostTable`'s):
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
LEVEL_PRICES = (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0, 100.0, 1e4)
LEVEL_FRACTIONS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.12, 0.06, 0.02)
NUM_LEVELS = len(LEVEL_PRICES)
assert len(LEVEL_FRACTIONS) == NUM_LEVELS, "one footprint fraction per price level"
# A leaner level's peak may exceed its fastest plan's by rounding only (the same ILP
# measure, `peak_memory`, on both).
PEAK_TOLERANCE = 1e-9


def level_steps(table, layer: int, shape, level: int):
    """`table`'s layer at memory `level` on a mesh of `shape` (`LayerCostTable._level_steps`
    when no reference's layout prices it): a generator yielding the `PreparedILP`s of the
    level one at a time, sent each one's solution (or the exception its solve raised); it
    returns (cost, (plan, graph solved on)), or (None, None) when none fits.

    Level 0 is the layer's fastest plan. A leaner level prices (or limits, by the table's
    `memory_levels`) the layer's footprint at no higher peak than the fastest plan's; a
    layer that cannot get leaner keeps its plan of the level below."""
    if level == 0:
        return (yield from table._solve_steps(layer, shape, footprint_budget=None))
    if table.cost(layer, shape) is None or table.solve is not None:
        return None, None
    if level >= NUM_LEVELS:
        return None, None
    least, at_fastest = table.footprint_span(layer, shape)
    if least >= at_fastest * (1 - 1e-6):
        return table._level_as(layer, shape, 0)  # no leaner plan than the fastest
    # No higher peak than the fastest plan's: see `Footprint.peak_budget`.
    fastest = table.solved_plan(layer, shape, 0)[0]
    peak = fastest.cost.memory_per_device * (1 + PEAK_TOLERANCE)
    if table.memory_levels == "price":
        price = LEVEL_PRICES[level] * fastest.cost.total / (at_fastest - least)
        solved = yield from table._solve_steps(layer, shape, footprint_budget=None,
                                               price=price)
        if solved[0] is not None and solved[1][0].cost.memory_per_device > peak:
            # Leaner for the run but not at its peak: solve again under that peak
            # (memory rows: a MIP, for the few layers where it binds).
            solved = yield from table._solve_steps(
                layer, shape, footprint_budget=None, peak_budget=peak, price=price
            )
    else:
        budget = least + (at_fastest - least) * LEVEL_FRACTIONS[level]
        solved = yield from table._solve_steps(layer, shape, footprint_budget=budget,
                                               peak_budget=peak)
    if solved[0] is None:
        # The least footprint is a lower bound the peak memory may not allow: this
        # layer stays at its leanest feasible plan.
        return table._level_as(layer, shape, level - 1)
    return solved
