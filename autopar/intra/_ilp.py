"""The intra-operator sharding ILP: one strategy per node, least total cost (numbers only).

In: a `ShardingProblem` (node cost vectors, edge resharding matrices, memory, followers).
Out: a `Solution` (a strategy index per node and its exact cost). The solver knows nothing
of JAX. It follows Alpa's formulation (Zheng et al. 2022, REFERENCES.md): minimise
sum_v c_v[s_v] + sum_(u,v) R_uv[s_u, s_v] with one strategy per node, the bytes of every
memory group under the budget, and followers sharing their leader's choice.

Before the ILP is built the problem is reduced, exactly (`merge_followers`, `reduce_graph`):
1. followers are merged into their leaders and parallel edges summed;
2. dominated strategies are dropped: b goes when some a is never worse whatever the
   neighbours pick and needs no more memory;
3. single-strategy nodes become constants;
4. nodes with at most two neighbours and no memory term are eliminated by min-plus
   products and recovered after the solve (bucket elimination);
5. each edge matrix is shifted by its row and column minima (so it is >= 0 with a zero in
   every row and column), and all costs are scaled so the largest coefficient is 1.
Edges are linearised with Alpa's marginal constraints.

With HiGHS, a model is first solved as an LP (dual simplex), memory rows included: an
integral relaxation is the optimum; a fractional one gives an incumbent (rounded, then
improved node by node within the memory budget) and duals, and the MIP runs only over the
strategies that reduced-cost fixing keeps for plans as cheap as the incumbent
(`_solve_within_incumbent`; the whole MIP when no incumbent fits the budget).

Equal-cost optima are common (symmetric layers, a matrix sharded along either of two equal
dimensions), and which one a MILP solver returns depends on its version and search. So the
plan is made canonical by a lexicographic second solve (`_break_ties`): the same model with
the row "cost <= optimum found (plus `TIE_RELATIVE_TOLERANCE`)", minimising a weighted sum
of strategy indices whose minimiser is unique (`tie_break_weights`), started from the first
solve's plan. To keep it small, strategies that LP duals prove too dear for any such plan
are left out first (reduced-cost fixing, `plans_within`), in rounds (`_tie_strategies`):
the first solve's own simplex duals, on a large model a second simplex round, then
interior-point duals of the smaller LP left. Half the demo's layer ILPs then have one plan
left, and no second solve runs.
Eliminated nodes are recovered by the lowest index of least cost given their neighbours,
so the whole plan is a function of the problem alone, not of the solver or its version.
The second solve is skipped when no ILP is left, and when the first stopped at its time
limit.

The code is split by stage; this module holds the entry points `solve` and `least_memory`
and re-exports the names of the others, so `from autopar.intra._ilp import X` works for all:
- `_ilp_problem.py`: `ShardingProblem`, `Solution`, `SolveStats`, `MemoryBudgetError`,
  validation, `resolve_followers`, `evaluate`, `peak_memory`;
- `_ilp_reduce.py`: steps 1-4 (follower merging, memory groups, pruning, elimination);
- `_ilp_model.py`: step 5, the MILP model and running it (HiGHS through highspy, CBC through pulp).

The slow reference used by the tests is `autopar.intra._ilp_reference.solve_brute_force`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.intra._ilp_model import (
    CHOSEN_THRESHOLD,
    MIP_ABSOLUTE_GAP,
    MIP_RELATIVE_GAP,
    SOLVER_RANDOM_SEED,
    SOLVER_THREADS,
    TIE_ABSOLUTE_TOLERANCE,
    TIE_RELATIVE_TOLERANCE,
    Formulation,
    SolverName,
    build_solver_model,
    least_memory_model,
    lp_row_duals,
    node_choices,
    plans_within,
    resolve_solver,
    run_model,
    sharding_model,
    tie_break_costs,
    tie_break_weights,
    vertex_row_duals,
    with_cost_bound,
    without_presolve,
)
from autopar.intra._ilp_problem import (
    MemoryBudgetError,
    ShardingProblem,
    Solution,
    SolveStats,
    evaluate,
    footprint_total,
    least_footprint,
    node_name,
    peak_memory,
    resolve_followers,
    with_footprint_price,
)
from autopar.intra._ilp_reduce import (
    CostGraph,
    MemoryGroup,
    binding_groups,
    merge_followers,
    merged_footprint_group,
    merged_memory_groups,
    reduce_graph,
    restrict_strategies,
)

__all__ = [
    "CHOSEN_THRESHOLD",
    "MIP_ABSOLUTE_GAP",
    "MIP_RELATIVE_GAP",
    "SOLVER_RANDOM_SEED",
    "SOLVER_THREADS",
    "TIE_ABSOLUTE_TOLERANCE",
    "TIE_RELATIVE_TOLERANCE",
    "Formulation",
    "MemoryBudgetError",
    "ShardingProblem",
    "Solution",
    "SolveStats",
    "SolverName",
    "evaluate",
    "footprint_total",
    "least_footprint",
    "least_memory",
    "node_name",
    "peak_memory",
    "resolve_followers",
    "solve",
    "with_footprint_price",
]

# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------


def _limit(problem: ShardingProblem) -> float | None:
    """The budget every memory group (the footprint scaled to it) must fit in."""
    if problem.memory_budget is not None:
        return problem.memory_budget
    return problem.footprint_budget


def _budget_groups(problem: ShardingProblem, root, strategy_of, solver) -> list[MemoryGroup]:
    """The memory groups the budgets constrain; raises if one can never fit."""
    budget = problem.memory_budget
    groups = []
    if budget is not None:
        groups = binding_groups(merged_memory_groups(problem, root, strategy_of), budget)
        if any(group.constant > budget for group in groups):
            raise MemoryBudgetError(budget, least_memory(problem, solver=solver))
    if problem.footprint_budget is not None:
        limit = _limit(problem)
        scale = limit / problem.footprint_budget
        footprint = merged_footprint_group(problem, root, strategy_of, scale)
        if footprint.constant > limit * (1 + 1e-9):
            raise MemoryBudgetError(problem.footprint_budget, least_footprint(problem), "footprint")
        groups += binding_groups([footprint], limit)
    return groups


def _infeasible(problem: ShardingProblem, solver) -> MemoryBudgetError:
    """The error of a problem the solver found infeasible: the footprint's if it alone
    cannot fit, else the peak memory's."""
    if problem.footprint_budget is not None:
        least = least_footprint(problem)
        if least > problem.footprint_budget:
            return MemoryBudgetError(problem.footprint_budget, least, "footprint")
    if problem.memory_budget is None:
        return MemoryBudgetError(problem.footprint_budget, least_footprint(problem), "footprint")
    return MemoryBudgetError(problem.memory_budget, least_memory(problem, solver=solver))


def _check_options(time_limit: float, formulation: str,
                   vertex_round_columns: int | None = None) -> int:
    """The options checked; returns `vertex_round_columns` (None: the default)."""
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}.")
    if formulation not in ("marginal", "product"):
        raise ValueError(f'formulation must be "marginal" or "product", got {formulation!r}.')
    if vertex_round_columns is None:
        return VERTEX_ROUND_COLUMNS
    if not (isinstance(vertex_round_columns, int) and vertex_round_columns >= 0):
        raise ValueError("vertex_round_columns must be a non-negative number of columns, "
                         f"got {vertex_round_columns!r}; pass None for the default.")
    return vertex_round_columns


def solve(
    problem: ShardingProblem,
    *,
    time_limit: float = 60.0,
    solver: SolverName = "auto",
    msg: bool = False,
    formulation: Formulation = "marginal",
    vertex_round_columns: int | None = None,
    cutoff: float | None = None,
) -> Solution:
    """Choose one strategy per node minimising total cost under the memory budget.

    **Arguments:**
    - `problem`: the numbers (see `ShardingProblem`).
    - `time_limit`: seconds for the solve and its tie-break: the tie-break gets what the
      first solve left in CPU seconds of this process, and HiGHS's own wall-clock limit is
      `WALL_CLOCK_BACKSTOP` times it (CBC: wall-clock seconds), so that a loaded machine
      gets the same plan; past it the best plan found so far is returned with status
      "time_limit".
    - `solver`: "highs" (highspy, its arrays passed whole), "cbc" (pulp's bundled CBC)
      or "auto" (HiGHS when highspy is installed, else CBC).
    - `msg`: print the solver's log.
    - `formulation`: edge linearisation, "marginal" (Alpa's, the default: fastest in
      benchmarks/investigations/ilp_scaling.py) or "product".
    - `vertex_round_columns`: HiGHS's tie-break runs a second, simplex round of fixing on
      an LP left with more columns than this (`_tie_strategies`); None for
      `VERTEX_ROUND_COLUMNS`. It changes how much each round excludes, never the plan.
    - `cutoff`: the caller wants the plan only if its objective is below this (the exact
      ring's ILP against the auto plan's objective, `autopar.intra._planner`): when the
      first solve's optimum is not (`_cannot_undercut`), its plan is returned without the
      tie-break (`SolveStats.tie_break` "cutoff"), an optimum but maybe not the canonical
      one. None: always the canonical plan.

    **Returns:** a `Solution` whose choices honour followers and the budget.

    **Raises:** `MemoryBudgetError` if no choice fits the budget; `RuntimeError` if the
    solver found no plan within the time limit.

    Example: two nodes, one edge; node 1 prefers strategy 1 but resharding costs 5:
    ``solve(ShardingProblem(([0., 1.], [2., 0.]), [(0, 1)], [[[0., 5.], [5., 0.]]]))``
    picks (1, 1) with objective 1: node 0 takes its dearer strategy to avoid resharding.
    """
    vertex_round_columns = _check_options(time_limit, formulation, vertex_round_columns)
    solver_name = resolve_solver(solver)
    start = time.perf_counter()
    built = _build(problem, solver, solver_name, formulation)
    build_time = time.perf_counter() - start
    start = time.perf_counter()
    ilp_choice, status, tie_break, tie_break_time = _run(
        problem, built, solver, time_limit, msg, formulation, vertex_round_columns, cutoff)
    solve_time = time.perf_counter() - start
    choices = _original_choices(problem, built, ilp_choice)
    stats = SolveStats(
        num_nodes=problem.num_nodes, num_nodes_after_merge=built.num_merged,
        num_ilp_nodes=len(built.model.node_columns),
        num_variables_before_merge=_alpa_variable_count(problem),
        num_variables=len(built.model.cost), num_constraints=built.model.num_rows,
        build_time=build_time, solve_time=solve_time,
        solver=solver_name if built.model.cost else "none", formulation=formulation,
        tie_break=tie_break, tie_break_time=tie_break_time,
    )
    return Solution(choices, evaluate(problem, choices), status, stats)


def _original_choices(problem: ShardingProblem, built: _Built, ilp_choice) -> tuple[int, ...]:
    """The strategy of every node of `problem` given the ILP nodes' `ilp_choice`: the
    reduction's choices recovered, equal-cost ones moved to lower indices, followers'
    read off their roots."""
    choice = built.reduction.recover(ilp_choice)
    _prefer_lower_indices(built.graph, built.groups, built.budget, choice)
    return tuple(int(built.strategy_of[v][choice[int(built.root[v])]])
                 for v in range(problem.num_nodes))


# `_cannot_undercut`'s margin, relative: far above the first solve's distance from the
# optimum (`MIP_RELATIVE_GAP`, the tie-break's window `TIE_RELATIVE_TOLERANCE`: 1e-9).
CUTOFF_MARGIN = 1e-6


def _cannot_undercut(problem: ShardingProblem, built: _Built, ilp_choice, cutoff: float
                     ) -> bool:
    """Whether no plan of `problem` costs less than `cutoff`, given the first solve's
    optimal `ilp_choice`.

    Why skipping the tie-break then changes nothing for a caller that takes the plan only
    when its objective is below `cutoff` (`_planner.plan_on_mesh`, the layer tables): the
    tie-break picks among the plans within `TIE_RELATIVE_TOLERANCE` of the first solve's
    cost, each of which costs at least the optimum, and the optimum is at least that
    cost less the solver's gap (`MIP_RELATIVE_GAP` 1e-9 relative, `MIP_ABSOLUTE_GAP` on
    the scaled objective). Asking the first solve's cost (summed exactly, `evaluate`) to
    exceed `cutoff` by `CUTOFF_MARGIN` (1e-6, relative) covers that gap a thousand times
    over: every plan the tie-break could return costs at least `cutoff`, and the caller
    discards it, as it discards the plan returned instead."""
    cost = evaluate(problem, _original_choices(problem, built, ilp_choice))
    return cost - CUTOFF_MARGIN * abs(cost) >= cutoff


@dataclass(frozen=True)
class _Built:
    """`solve`'s model of a problem: followers resolved (`root`, `strategy_of`) and merged
    into `graph` (`num_merged` nodes), the memory `budget` and its `groups`, the graph
    `reduction`, the ILP `model` and the solver's own model of it (`built`; None for a
    model without variables)."""

    root: Any
    strategy_of: Any
    graph: CostGraph
    num_merged: int
    budget: float | None
    groups: list[MemoryGroup]
    reduction: Any
    model: Any
    built: Any
    solver_name: str


def _build(problem: ShardingProblem, solver: SolverName, solver_name: str,
           formulation: Formulation) -> _Built:
    """Followers merged, the graph reduced under the budget, the ILP built."""
    root, strategy_of = resolve_followers(problem)
    graph = merge_followers(problem, root, strategy_of)
    budget = _limit(problem)
    groups = _budget_groups(problem, root, strategy_of, solver)
    reduction = reduce_graph(graph, groups, budget)
    model = sharding_model(reduction.graph, reduction.groups, budget, formulation)
    built = build_solver_model(model, solver_name) if model.cost else None
    return _Built(root, strategy_of, graph, len(graph.node_cost), budget, groups, reduction,
                  model, built, solver_name)


def _run(problem: ShardingProblem, built: _Built, solver: SolverName, time_limit: float,
         msg: bool, formulation: Formulation, vertex_round_columns: int,
         cutoff: float | None = None) -> tuple[dict, str, str, float]:
    """The ILP solved within `time_limit` CPU seconds of this process, then its ties broken
    canonically in what is left (not where no plan undercuts `cutoff`, `solve`).
    **Returns:** (the reduced graph's choice, the solver's status, how ties were broken,
    the tie-break's seconds)."""
    cpu_start = time.process_time()
    reduction, model, solver_name, budget = (built.reduction, built.model, built.solver_name,
                                             built.budget)

    def within_incumbent(relaxed, duals):
        remaining = time_limit - (time.process_time() - cpu_start)
        return _solve_within_incumbent(reduction, model, relaxed, duals, solver_name,
                                       remaining, msg, budget, formulation)

    values, status = run_model(built.built, time_limit, msg, fractional=within_incumbent)
    if status == "infeasible":
        assert built.groups, "a sharding ILP without memory constraints is always feasible"
        raise _infeasible(problem, solver)
    if status == "no_solution":
        raise RuntimeError(
            f"the {solver_name} solver found no plan within time_limit={time_limit} s "
            f"({len(model.cost)} variables); pass a larger time_limit to solve()."
        )
    ilp_choice = node_choices(model, values)
    tie_break, tie_break_time = "canonical", 0.0
    if built.built is not None and status == "time_limit":
        tie_break = "skipped"
    elif (built.built is not None and cutoff is not None
          and _cannot_undercut(problem, built, ilp_choice, cutoff)):
        tie_break = "cutoff"
    elif built.built is not None:
        tie_start = time.perf_counter()
        remaining = time_limit - (time.process_time() - cpu_start)  # CPU s, as HiGHS's
        ilp_choice, tie_break = _break_ties(
            reduction, model, built.built, ilp_choice, solver_name, remaining, msg, budget,
            formulation, vertex_round_columns
        )
        tie_break_time = time.perf_counter() - tie_start
    return ilp_choice, status, tie_break, tie_break_time


def _prefer_lower_indices(
    graph: CostGraph, groups: list[MemoryGroup], budget: float | None, choice: dict[int, int]
) -> None:
    """After the canonical solve: in node order, move each node of the merged graph to the
    lowest strategy that costs no more with its neighbours fixed and keeps every memory
    group within budget. The reduced graph the tie-break ILP sees has dropped strategies
    that are never cheaper but need more memory (a replicated weight beside its equally
    cheap sharded twin); this puts such nodes back on the lower index, deterministically
    (a function of the canonical choice)."""
    groups_of: dict[int, list[MemoryGroup]] = {}
    for group in groups:
        for v, _ in group.terms:
            groups_of.setdefault(v, []).append(group)

    def fits(v: int) -> bool:
        return all(
            group.constant + math.fsum(float(t[choice[w]]) for w, t in group.terms) <= budget
            for group in groups_of.get(v, ())
        )

    for v in sorted(graph.node_cost):
        local, current = graph.local_cost(v, choice), choice[v]
        for k in range(current):
            if local[k] <= local[current]:
                choice[v] = k
                if fits(v):
                    break
                choice[v] = current


# Sweeps of `_local_descent` at most (each moves every node that can improve alone; the
# demo's fractional ILPs settle in under 10).
_MAX_DESCENT_SWEEPS = 100


def _solve_within_incumbent(
    reduction, model, relaxed: np.ndarray, duals: np.ndarray, solver, time_limit: float, msg,
    budget: float | None, formulation: Formulation,
):
    """The first solve of a model whose LP relaxation (`relaxed`, row `duals`) is
    fractional: the MIP over the strategies that some plan as cheap as an incumbent may use.

    The incumbent is the relaxation rounded (each node's largest value) and improved node
    by node (`_local_descent`); reduced-cost fixing with `duals` (`plans_within`, exact)
    keeps every strategy of every plan that costs no more than it, so the optimum is among
    them, and the MIP over them, started from the incumbent, is an optimum of `model`.
    Issue 18: the demo's one fractional layer ILP (16,653 columns) went from 0.94 CPU s
    to 0.33 s (6,921 columns left), the same optimum.

    **Returns:** (column values of `model`, or None; status), as `run_model`.
    """
    relaxed_choice = {v: int(np.argmax(relaxed[c])) for v, c in model.node_columns.items()}
    incumbent = _local_descent(reduction.graph, relaxed_choice, reduction.groups, budget)
    if incumbent is None:  # no plan within the memory budget found: the whole MIP
        return build_solver_model(model, solver).run(time_limit, msg, None, MIP_RELATIVE_GAP)
    everything = {v: np.arange(len(c)) for v, c in reduction.graph.node_cost.items()}
    cost = model.objective_of(incumbent)
    window = TIE_RELATIVE_TOLERANCE * abs(cost) + TIE_ABSOLUTE_TOLERANCE
    keep = _fixed_by_duals(model, duals, incumbent, window, everything)
    if keep is everything:
        whole = build_solver_model(model, solver)
        without_presolve(whole)
        return run_model(whole, time_limit, msg, start=model.values_of(incumbent))
    graph, groups = restrict_strategies(reduction.graph, reduction.groups, budget, keep)
    restricted = sharding_model(graph, groups, budget, formulation)
    if not restricted.node_columns:  # the incumbent is the only plan left: optimal
        return model.values_of(incumbent), "optimal"
    position = {v: int(np.searchsorted(keep[v], incumbent[v])) for v in restricted.node_columns}
    restricted_built = build_solver_model(restricted, solver)
    without_presolve(restricted_built)
    values, status = run_model(restricted_built, time_limit, msg,
                               start=restricted.values_of(position))
    if values is None:
        return None, status
    found = node_choices(restricted, values)
    choice = {v: int(keep[v][found[v]]) if v in found else int(keep[v][0]) for v in keep}
    return model.values_of(choice), status


def _local_descent(graph: CostGraph, choice: dict[int, int],
                   groups: list[MemoryGroup] = (), budget: float | None = None,
                   ) -> dict[int, int] | None:
    """`choice` improved one node at a time: in node order, each node moves to the lowest
    strategy of least cost given its neighbours when that is cheaper, until no node moves.
    Deterministic; a local optimum, used only as an incumbent. With memory `groups`, a
    node moves only to a strategy that keeps them within `budget` (`_descent_in_budget`),
    and None is returned when the plan does not fit."""
    if groups:
        return _descent_in_budget(graph, choice, groups, budget)
    choice = dict(choice)
    for _ in range(_MAX_DESCENT_SWEEPS):
        moved = False
        for v in sorted(graph.node_cost):
            local = graph.local_cost(v, choice)
            best = int(np.argmin(local))
            if local[best] < local[choice[v]]:
                choice[v], moved = best, True
        if not moved:
            break
    return choice


def _within_budget(groups: list[MemoryGroup], budget: float, choice: Mapping[int, int]) -> bool:
    """Whether every memory group's bytes at `choice` are within `budget`, summed exactly
    (as `_prefer_lower_indices` checks them)."""
    return all(group.constant + math.fsum(float(t[choice[v]]) for v, t in group.terms)
               <= budget for group in groups)


def _descent_in_budget(graph: CostGraph, choice: dict[int, int], groups: list[MemoryGroup],
                       budget: float) -> dict[int, int] | None:
    """`_local_descent` under memory groups: in node order, each node moves to its
    cheapest strategy (lowest index among equals) that is cheaper given its neighbours
    and keeps every group it is in within `budget` (running totals), until no node moves.
    **Returns:** the plan, or None when it (checked exactly at the end, `_within_budget`)
    does not fit: the relaxation's rounding was over budget and no descent mended it."""
    choice = dict(choice)
    terms_of: dict[int, list[tuple[int, np.ndarray]]] = {}
    totals = []
    for g, group in enumerate(groups):
        totals.append(group.constant + sum(float(t[choice[v]]) for v, t in group.terms))
        for v, t in group.terms:
            terms_of.setdefault(v, []).append((g, t))
    for _ in range(_MAX_DESCENT_SWEEPS):
        moved = False
        for v in sorted(graph.node_cost):
            local, current = graph.local_cost(v, choice), choice[v]
            terms = terms_of.get(v, ())
            for k in np.argsort(local, kind="stable").tolist():
                if not local[k] < local[current]:
                    break
                if all(totals[g] - t[current] + t[k] <= budget for g, t in terms):
                    for g, t in terms:
                        totals[g] += float(t[k] - t[current])
                    choice[v], moved = k, True
                    break
        if not moved:
            break
    return choice if _within_budget(groups, budget, choice) else None


# Below this many seconds left of the time limit the tie-break solve is not started.
_LEAST_TIE_BREAK_TIME = 0.01


def _break_ties(
    reduction, model, built, choice: dict[int, int], solver, time_limit: float, msg,
    budget: float | None, formulation: Formulation, vertex_round_columns: int,
) -> tuple[dict[int, int], str]:
    """The canonical plan among those as cheap as `choice`, an optimum of `model` (the ILP
    of `reduction.graph`, built for the solver as `built`): the second, lexicographic solve.

    The tie set is every plan whose scaled cost is within `TIE_RELATIVE_TOLERANCE` (plus
    `TIE_ABSOLUTE_TOLERANCE`) of the cost of `choice`, computed exactly. Its plans use few
    strategies: those reduced-cost fixing with LP duals cannot exclude (`_tie_strategies`,
    exact whatever the duals, so a solver's choice of duals only changes how much is
    excluded). The tie-break ILP is the reduced graph restricted to those strategies
    (`restrict_strategies`), with the row "cost <= bound" and the objective
    `tie_break_costs`, whose minimiser over the tie set is unique; `choice` is feasible
    and is the start. The weights are those of every node of `reduction.graph`, not only
    of the nodes left, so that they do not depend on the fixing either. The relative gap
    is 0: tie-break values are a few units apart and must be told apart exactly. When the
    fixing leaves one strategy per node (the optimum is unique: half the demo's layer
    ILPs), or `choice` takes every node's lowest strategy left (`_lowest_kept`), no
    tie-break ILP is built.

    **Returns:** (ILP choice, "canonical" or "incomplete": the solver stopped at the time
    limit or failed, and the best plan it had, still of optimal cost, is returned).
    """
    if time_limit < _LEAST_TIE_BREAK_TIME:
        return choice, "incomplete"
    deadline = time.process_time() + time_limit  # CPU seconds, as `run_model` counts them
    cost = model.objective_of(choice)
    window = TIE_RELATIVE_TOLERANCE * abs(cost) + TIE_ABSOLUTE_TOLERANCE
    keep = _tie_strategies(reduction, model, built, choice, window, solver, time_limit, msg,
                           budget, formulation, vertex_round_columns)
    if _lowest_kept(choice, keep):  # `choice` is canonical
        return choice, "canonical"
    graph, groups = restrict_strategies(reduction.graph, reduction.groups, budget, keep)
    tie_model = sharding_model(graph, groups, budget, formulation)
    if not tie_model.node_columns:  # one plan left: `choice`
        return choice, "canonical"
    remaining = deadline - time.process_time()
    if remaining < _LEAST_TIE_BREAK_TIME:
        return choice, "incomplete"
    position = {v: int(np.searchsorted(keep[v], choice[v])) for v in tie_model.node_columns}
    index = {v: reduction.kept[v][keep[v]] for v in tie_model.node_columns}
    secondary = tie_break_costs(tie_model, tie_break_weights(reduction.graph.node_cost), index)
    bound = tie_model.objective_of(position) + window * model.scale / tie_model.scale
    tie_built = build_solver_model(tie_model, solver)
    with_cost_bound(tie_built, bound, secondary)
    values, status = run_model(
        tie_built, remaining, msg, start=tie_model.values_of(position), gap_rel=0.0
    )
    if values is None:
        return choice, "incomplete"
    found = node_choices(tie_model, values)
    canonical = {v: int(keep[v][found[v]]) if v in found else int(keep[v][0]) for v in keep}
    return canonical, "canonical" if status == "optimal" else "incomplete"


def _tie_strategies(
    reduction, model, built, choice: dict[int, int], window: float, solver, time_limit: float,
    msg, budget: float | None, formulation: Formulation, vertex_round_columns: int,
) -> dict[int, np.ndarray]:
    """The strategies (indices into `reduction.graph`'s) of every node that a plan within
    `window` (scaled units of `model`) of the cost of `choice` may use, by reduced-cost
    fixing (`plans_within`) in rounds, each exact, each on the LP of the graph restricted
    to what the rounds before kept (its edges shrink with both ends):

    1. with the duals of `model`'s LP relaxation that the first solve left (a simplex
       vertex's, free: `vertex_row_duals`; memory rows included, issue 45: the CLI
       line's largest, 200k columns, kept 3,239 strategies of its 478 nodes, the tie-break
       took 0.4 CPU s against 11.6 s of interior point on the whole model). They are
       degenerate and keep some 40 % of the strategies of the demo's largest models (a
       third of their columns);
    2. when that LP still has more than `vertex_round_columns` columns, a simplex vertex's
       duals of it (dual simplex, a few hundredths of a CPU second), which keep about a
       third of its columns again;
    3. interior-point duals (strictly complementary: they keep little more than the tie
       set). Issue 18: the interior point on the whole model was 1.6 of the demo's 5.5
       CPU s; in rounds the fixing takes a fifth of that.

    A round whose LP fails, or whose rounding would exclude `choice` itself, keeps
    everything it was given.
    """
    everything = {v: np.arange(len(c)) for v, c in reduction.graph.node_cost.items()}
    keep = _fixed_by_duals(model, vertex_row_duals(built), choice, window, everything)
    restricted, restricted_built = model, built
    for last_round in (False, True):
        if _lowest_kept(choice, keep):  # no later round can change the answer
            return keep
        if restricted is model and keep is everything:
            break
        graph, groups = restrict_strategies(reduction.graph, reduction.groups, budget, keep)
        restricted = sharding_model(graph, groups, budget, formulation)
        if not restricted.node_columns:  # one plan left: `choice`
            return keep
        restricted_built = build_solver_model(restricted, solver)
        if last_round or len(restricted.cost) <= vertex_round_columns:
            break
        keep = _fixed_within(keep, restricted, choice, window * model.scale / restricted.scale,
                             vertex_row_duals(restricted_built, time_limit, msg))
    if _lowest_kept(choice, keep):
        return keep
    duals = lp_row_duals(restricted_built, time_limit, msg)
    return _fixed_within(keep, restricted, choice, window * model.scale / restricted.scale, duals)


def _lowest_kept(choice: Mapping[int, int], keep: Mapping[int, np.ndarray]) -> bool:
    """Whether `choice` takes every node's lowest strategy in `keep` (ascending indices
    that hold it). Then it is the tie-break's answer, proved without a solve: the
    tie-break objective (positive weights times strategy indices, `tie_break_weights`) is
    least at `choice` over every plan of the kept strategies, a superset of the tie set,
    and further fixing only removes other strategies. Issue 45: a fifth of the
    tie-breaks of llama-8B@64's layer ILPs end here."""
    return all(choice[v] == kept[0] for v, kept in keep.items())


# An LP left with more columns than this after the first round of fixing gets a second,
# simplex round before the interior point (on the demo: 5-6k columns, 0.07 -> 0.045 CPU s
# for both rounds; below ~1,000 columns the extra round costs more than it saves).
VERTEX_ROUND_COLUMNS = 2000


def _fixed_within(keep: dict[int, np.ndarray], restricted, choice: Mapping[int, int],
                  window: float, duals) -> dict[int, np.ndarray]:
    """`keep` narrowed by fixing on `restricted` (the graph restricted to `keep`, whose
    nodes with one strategy left are folded away) with `duals`."""
    position = {v: int(np.searchsorted(keep[v], choice[v])) for v in restricted.node_columns}
    within = _fixed_by_duals(restricted, duals, position, window,
                             {v: np.arange(len(keep[v])) for v in restricted.node_columns})
    return {v: keep[v][within[v]] if v in within else keep[v] for v in keep}


def _fixed_by_duals(model, duals, choice: Mapping[int, int], window: float,
                    everything: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """`plans_within(model, duals, cost of choice + window)`, or `everything` when the
    duals are missing or their rounding would exclude `choice`."""
    if duals is None:
        return everything
    keep = plans_within(model, duals, model.objective_of(choice) + window)
    if keep is None or any(choice[v] not in kept for v, kept in keep.items()):
        return everything
    return keep


def _alpa_variable_count(problem: ShardingProblem) -> int:
    """Variables of the plain formulation: node strategies plus edge strategy pairs."""
    sizes = problem.num_strategies
    return sum(sizes) + sum(sizes[u] * sizes[v] for u, v in problem.edges)


def least_memory(
    problem: ShardingProblem, *, time_limit: float = 60.0, solver: SolverName = "auto"
) -> float:
    """The least, over choices that honour followers, of the largest memory group total.

    Costs are ignored: this is the smallest `memory_budget` for which `solve` can succeed.

    **Arguments:**
    - `problem`: the problem (its own `memory_budget` is ignored).
    - `time_limit`, `solver`: as for `solve`.

    **Returns:** bytes per device; 0.0 when the problem has no memory groups.
    """
    _check_options(time_limit, "marginal")
    root, strategy_of = resolve_followers(problem)
    groups = merged_memory_groups(problem, root, strategy_of)
    if not any(group.terms for group in groups):
        return max((group.constant for group in groups), default=0.0)
    model, _ = least_memory_model(groups)
    solver_name = resolve_solver(solver)
    # The MIP itself, not its relaxation first (as `run_model` would): the choice whose
    # peak is reported stays the one the MIP finds.
    values, status = build_solver_model(model, solver_name).run(time_limit, False, None,
                                                                MIP_RELATIVE_GAP)
    if values is None:
        raise RuntimeError(
            f"the solver found no strategy choice within time_limit={time_limit} s while "
            "computing the least memory; pass a larger time_limit."
        )
    choice = node_choices(model, values)
    choices = [int(strategy_of[v][choice.get(int(root[v]), 0)]) for v in range(problem.num_nodes)]
    return peak_memory(problem, choices)
