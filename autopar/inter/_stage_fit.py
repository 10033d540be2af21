"""A stage's layers fitted to the memory budget: a memory level and a remat choice.

In: a `LayerCostTable`, a range of its layers, a logical mesh shape, the microbatches the
stage keeps in flight and the memory budget. Out: `_Fit`, the layers' costs at one memory
level (`autopar.inter._levels`) with a remat choice per layer (`choose_remat`), and the
fastest such fit under the budget (`_fitting_level`), pruned by lower bounds on the
layers' latency (`_lower_bound`) so that levels that cannot win are not solved.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autopar.cost import LayerCost, StageMemory, stage_memory_parts
from autopar.inter._layer_table import LayerCostTable
from autopar.inter._levels import LEVEL_FRACTIONS, NUM_LEVELS
from autopar.inter._range_cache import _ASK, _all_solved, _prefetch, _range_cached, range_content


def _lower_bound(table: LayerCostTable, layer_range, shape, level: int,
                 content=_ASK) -> float:
    """Below the latency of the layers at `level` or any leaner level, with any recompute,
    by `DOMINANCE_MARGIN`; -inf when a layer's plan there is not a proven optimum (its
    ILP stopped at the time limit), a caller's `solve` made it, or the table's search
    uses no bounds (`StageOptions.lower_bounds`)."""
    if table.solve is not None or not table.lower_bounds:
        return -math.inf
    return _range_cached(table, "bound", layer_range, (shape, level),
                         lambda: _layers_lower_bound(table, layer_range, shape, level),
                         content)


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

    # Both computed once per fit: the walks over levels (`_priced_fit`, `_limited_fit`)
    # and the stage DP's callback read a cached fit's figures many times.
    @functools.cached_property
    def memory(self) -> float:
        return self.parts.total

    @functools.cached_property
    def latency(self) -> float:
        return math.fsum(c.latency for c in self.costs)


def _stage_parts(table: LayerCostTable, layer_range, shape, level: int, costs,
                 in_flight) -> StageMemory:
    """`stage_memory_parts` of these layer costs, state the layers share counted once."""
    return stage_memory_parts(costs, in_flight,
                              table.shared_state_bytes(layer_range, shape, level))


def choose_remat(
    table: LayerCostTable, layer_range, shape, level: int, in_flight: int, budget: float,
    remat: str = "auto", content=_ASK,
) -> _Fit | None:
    """The layers' costs at `level` with a remat choice per layer (`_choose_remat`), the
    same for every range of the same content (`content`: the range's `range_content`,
    when the caller has it)."""
    return _range_cached(
        table, "fit", layer_range, (shape, level, in_flight, budget, remat),
        lambda: _choose_remat(table, layer_range, shape, level, in_flight, budget, remat),
        content,
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
    update = parts.update  # the optimizer update's, after the activations are freed
    for _, _, i, option, c in upgrades:
        if chosen[i] == "full" or c.activation_memory >= costs[i].activation_memory:
            continue
        kept += c.activation_memory - costs[i].activation_memory
        transient = max(transient, c.transient_memory)
        costs[i], chosen[i] = c, option
        if state + max(in_flight * kept + transient, update) <= budget:
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
    levels in order (price levels, the table's `memory_levels`), or jumps to the level
    whose footprint limit removes the stage's excess without recompute (limit levels:
    each layer giving up the same fraction of what it can give) and steps down from
    there, while it does not fit;
    every level visited is also tried with recompute, and the fastest fit wins (a leaner
    sharding costs communication, recompute costs forward work).

    `cutoff`: the latency of the best stage found on another shape. When the layers'
    fastest plans already take at least that long, no level or recompute here can win
    (see `DOMINANCE_MARGIN`): None, without solving the leaner levels' ILPs. The walk to
    leaner levels also stops once the next one cannot beat `cutoff` or a fit already
    found (a leaner level is never faster); what it skips would not have been chosen.
    `solved_only`: stop the walk at the first level not solved yet (no ILP is solved; a
    fit found is one the full walk also reaches or beats).

    A walk is shared by the ranges of equal content and by every `cutoff` that compares
    alike (`_Cutoff`): the stage DP asks the same walk for each position, range and shape
    of equal content under cutoffs that differ by a stage's transfer and bound
    (GPT-3 175B on 1,024 GPUs: 281k walks asked; llama-8B@64: 10,186 asked, 3,429 taken;
    gpt-175B@1024's "stage DP" CPU 35.3 -> 28.6 s, the same 436 ILPs, by `python -m
    benchmarks planning_time --rows gpt-175B@1024` on a loaded 2-core machine). A
    `solved_only` walk takes a shared one's answer too: the levels that walk read are
    solved since, so it would take the same steps; it is shared itself only where it met
    no level unsolved.
    """
    # The range's content key, read once for the walk's cached figures (`range_content`).
    content = range_content(table, layer_range)
    if content is None:
        return _walk(table, layer_range, shape, in_flight, budget, remat, _Cutoff(cutoff),
                     solved_only, content)
    walks = _range_cached(table, "walk", layer_range, (shape, in_flight, budget, remat),
                          list, content)
    for low, high, fit in walks:
        if low < cutoff <= high:
            return fit
    probe = _Cutoff(cutoff)
    fit = _walk(table, layer_range, shape, in_flight, budget, remat, probe, solved_only,
                content)
    if not probe.unsolved:
        walks.append((probe.low, probe.high, fit))
    return fit


class _Cutoff:
    """A walk's `cutoff`, compared only through `reached`, which records the cutoffs that
    compare alike: every c in (`low`, `high`] gives each comparison made the same outcome.
    `unsolved`: whether a `solved_only` walk stopped at a level not solved yet.

    Why a walk may be shared over that interval. `_walk` reads `cutoff` nowhere else: its
    every other figure (fits and lower bounds, keyed by the range's content) depends on
    the range's content, shape, in-flight count, budget and remat option alone, and a
    table's answers are the same whenever they are asked (a walk solves what it reads;
    `LayerCostTable.forget_priced`, which drops answers, clears the range cache). Two
    cutoffs giving every comparison the same outcome thus take the same steps to the same
    fit. A comparison ``x >= c`` is True exactly for c <= x and False exactly for c > x,
    so the cutoffs giving the outcomes seen are those in (max of the x found False, min
    of the x found True]. A `solved_only` walk differs from a full one only where it
    stops at a level not solved: one that did not (`unsolved` False) took the full walk's
    steps; and once a full walk has read a level, that level is solved, so a later
    `solved_only` walk under a cutoff comparing alike takes its steps too."""

    __slots__ = ("value", "low", "high", "unsolved")

    def __init__(self, value: float):
        self.value, self.low, self.high = value, -math.inf, math.inf
        self.unsolved = False

    def reached(self, x: float) -> bool:
        """Whether ``x >= cutoff`` (a latency or lower bound at or past the cutoff)."""
        if x >= self.value:
            self.high = min(self.high, x)
            return True
        self.low = max(self.low, x)
        return False

    def stops_unsolved(self, table, layer_range, shape, level: int, solved_only: bool,
                       content) -> bool:
        """Whether a `solved_only` walk stops at `level` (not solved yet)."""
        if solved_only and not _all_solved(table, layer_range, shape, level, content):
            self.unsolved = True
        return self.unsolved


def _walk(table: LayerCostTable, layer_range, shape, in_flight: int, budget: float,
          remat: str, cutoff: _Cutoff, solved_only: bool, content) -> _Fit | None:
    """`_fitting_level`'s walk, every comparison with the cutoff through `cutoff`."""
    first_fit = choose_remat(table, layer_range, shape, 0, in_flight, budget, remat,
                             content)
    if first_fit is None:
        return None
    unchanged = remat != "auto" or all(r == "none" for r in first_fit.remat)
    if first_fit.memory <= budget and unchanged:
        return first_fit
    if table.solve is not None:
        return first_fit
    if cutoff.reached(_lower_bound(table, layer_range, shape, 0, content)):
        return None
    if table.memory_levels == "price":
        return _priced_fit(table, layer_range, shape, in_flight, budget, remat, cutoff,
                           solved_only, first_fit, content)
    return _limited_fit(table, layer_range, shape, in_flight, budget, remat, cutoff,
                        solved_only, first_fit, content)


def _limited_fit(table: LayerCostTable, layer_range, shape, in_flight: int, budget: float,
                 remat: str, cutoff: _Cutoff, solved_only: bool, first_fit: _Fit,
                 content=_ASK) -> _Fit:
    """`_fitting_level` over limit levels: from the level whose footprint limit removes
    the stage's excess without recompute (each layer giving up the same fraction of what
    it can give), leaner levels in order while the stage does not fit and a leaner level
    can still win."""
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
        if cutoff.stops_unsolved(table, layer_range, shape, level, solved_only, content):
            break
        costs = [table.cost(k, shape, level) for k in layer_range]
        if any(c is None for c in costs):
            break
        memory = _stage_parts(table, layer_range, shape, level, costs, in_flight).total
        if memory >= least:
            break  # a tighter footprint no longer helps
        least = memory
        fit = choose_remat(table, layer_range, shape, level, in_flight, budget, remat,
                           content)
        tried.append(fit)
        if fit.memory <= budget and all(r == "none" for r in fit.remat):
            break
        # A leaner level is no faster than this one: stop once it cannot win.
        bound = _lower_bound(table, layer_range, shape, level, content)
        fastest_fit = min((f.latency for f in tried if f.memory <= budget), default=math.inf)
        if cutoff.reached(bound) or bound >= fastest_fit:
            break
    fitting = [f for f in tried if f.memory <= budget]
    if fitting:
        return min(fitting, key=lambda f: f.latency)  # first of equals: the faster level
    return min(tried, key=lambda f: f.memory)


def _priced_fit(table: LayerCostTable, layer_range, shape, in_flight: int, budget: float,
                remat: str, cutoff: _Cutoff, solved_only: bool, first_fit: _Fit,
                content=_ASK) -> _Fit:
    """`_fitting_level` over price levels, which are ever leaner and never faster: the
    leanest level first (when even it does not fit, no level does), then a bisection for
    the first level that fits with recompute, then up from there while recompute is
    needed and a leaner level can still be faster (at most the walk's answer, from about
    log2(levels) + a few solves instead of up to every level)."""
    tried = [first_fit]

    def fit_at(level: int) -> _Fit | None:
        """The fit at `level`; None when a layer has no plan or, with `solved_only`, it
        is not solved yet."""
        if cutoff.stops_unsolved(table, layer_range, shape, level, solved_only, content):
            return None
        fit = choose_remat(table, layer_range, shape, level, in_flight, budget, remat,
                           content)
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
        bound = _lower_bound(table, layer_range, shape, level, content)
        return cutoff.reached(bound) or bound >= fastest

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
