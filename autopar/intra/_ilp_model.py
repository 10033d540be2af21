"""The sharding ILP as a mixed-integer program, and running it (HiGHS or CBC).

In: a reduced `CostGraph` and its binding `MemoryGroup`s (from `_ilp_reduce.py`).
Out: a `_Model` of plain arrays (column costs, binary flags, rows, the one-hot columns of
each node) built by `sharding_model` (least cost under the memory budget) or
`least_memory_model` (least peak memory); `build_solver_model` and `run_model` solve it with
the solver `resolve_solver` picks (HiGHS through highspy's arrays, CBC through pulp), and
`node_choices` reads back one strategy per node.

Before the model is built each edge matrix is shifted by its row and column minima (so it
is >= 0 with a zero in every row and column), and all costs are scaled so the largest
coefficient is 1 (`_normalised_costs`). Edges are linearised with Alpa's marginal
constraints (`_add_marginal_edges`, Zheng et al. 2022, REFERENCES.md) or product bounds
(`_add_product_edge`). Solver gaps, seed and threads are fixed so plans are exact and
repeatable.

Equal-cost optima are told apart by a second solve: the same model with its cost bounded
by the optimum found (`with_cost_bound`), minimising a weighted sum of strategy indices
whose minimiser is unique (`tie_break_weights`, `tie_break_costs`), so the plan does not
depend on the solver; strategies the LP relaxation's duals (`lp_row_duals`) prove too dear
are left out of it first (`plans_within`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pulp

from autopar.intra._ilp_reduce import CostGraph, MemoryGroup

Formulation = Literal["marginal", "product"]
SolverName = Literal["auto", "highs", "cbc"]

# HiGHS stops once (upper - lower) / upper <= mip_rel_gap; its default of 1e-4 would accept a
# plan 0.01 % worse than the best. The plan must be exact (the tests compare it with brute
# force to 1e-9), so both gaps are closed down to floating-point noise. The absolute gap is
# in scaled-objective units, where the largest single cost coefficient is 1.
MIP_RELATIVE_GAP = 1e-9
MIP_ABSOLUTE_GAP = 1e-10
# Fixed seed and one thread: the same problem always gives the same search and choices.
SOLVER_RANDOM_SEED = 0
SOLVER_THREADS = 1
# The tie-break solve keeps every plan whose scaled cost is within this of the optimum
# found: relative, like the MIP gap (the solvers cannot tell plans this close apart, and
# float noise in equal costs is some 1e-15 of them), plus an absolute term for an optimum
# of 0. The solvers' feasibility tolerance (1e-7 absolute) widens the window a little more.
TIE_RELATIVE_TOLERANCE = 1e-9
TIE_ABSOLUTE_TOLERANCE = 1e-12
# HiGHS's `time_limit` is wall-clock seconds, which grow with whatever else runs on the
# cores. On main a loaded machine (load 8-12 on 2 cores) made a tiny GPT's leaner-memory
# MIP take 30 wall s of its 60 (11 CPU s): its tie-break stopped "incomplete", another plan
# of the same cost was kept, and plans could depend on the load (issue 18). So the limit
# `solve` is given counts CPU seconds of this process between its solves (the tie-break
# gets what the first solve left), and HiGHS itself is given this many times the limit in
# wall-clock seconds: a solve is cut short only when the machine is loaded more than this
# many times over. (A HiGHS interrupt callback that checks CPU seconds, as session 8 tried,
# is a Python call per event, some 2 per branch-and-bound node: a 24,415-node MIP took
# 13.5 CPU s with it against 11.2 without; this costs nothing.)
WALL_CLOCK_BACKSTOP = 10.0
# Reduced-cost fixing (`plans_within`) keeps a strategy unless it provably costs more than
# the tie window plus this (the solvers' primal feasibility tolerance, in scaled units).
_FIXING_MARGIN = 1e-7
# Solution values above this count as "strategy chosen" (HiGHS's integrality tolerance is
# 1e-6, so a chosen binary reads at least 1 - 1e-6).
CHOSEN_THRESHOLD = 0.5
# An LP relaxation whose binaries are all within this of 0 or 1 is taken as the MIP's
# solution (HiGHS's own MIP integrality tolerance, `mip_feasibility_tolerance`).
INTEGRALITY_TOLERANCE = 1e-6


# --------------------------------------------------------------------------------------
# The ILP, as plain arrays
# --------------------------------------------------------------------------------------

_LE, _EQ, _GE = pulp.LpConstraintLE, pulp.LpConstraintEQ, pulp.LpConstraintGE


@dataclass
class _Model:
    """A mixed-integer program: minimise cost . x over x >= 0 subject to its rows.

    Binary columns are in [0, 1]; continuous columns are unbounded above. The rows are
    kept as blocks of whole arrays (`add_rows`): per row its length, sense and right-hand
    side, and the columns and coefficients of all its rows end to end; `row_arrays` joins
    them, `rows` gives them one by one as (columns, coefficients, sense, right-hand side).
    `node_columns[v]` are the one-hot strategy columns of node v.
    """

    cost: list[float] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    # (lengths, columns, coefficients, senses, right-hand sides) of each block of rows
    row_blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = (
        field(default_factory=list))
    node_columns: dict[int, np.ndarray] = field(default_factory=dict)
    # (v, w, grid): grid[a, b] is the column of edge {v, w} at strategy classes (a, b), -1
    # if none; edge_classes[k] = (class of each strategy of v, of w) for edge_columns[k]
    edge_columns: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    edge_classes: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # cost units per unit of `cost` (`sharding_model` scales the largest coefficient to 1)
    scale: float = 1.0
    num_rows: int = 0

    def add_columns(self, costs: np.ndarray, binary: bool) -> np.ndarray:
        start = len(self.cost)
        self.cost.extend(np.asarray(costs, float).tolist())
        self.binary.extend([binary] * len(costs))
        return np.arange(start, len(self.cost))

    def add_row(self, columns, coefficients, sense: int, rhs: float) -> None:
        columns = np.asarray(columns)
        self.add_rows(np.array([len(columns)], dtype=np.int64), columns, coefficients,
                      np.array([sense], dtype=np.int64), np.array([rhs], dtype=float))

    def add_rows(self, lengths: np.ndarray, columns: np.ndarray, coefficients,
                 senses: np.ndarray, rhs: np.ndarray) -> None:
        """Rows whose columns and coefficients lie end to end (`lengths` of each)."""
        self.row_blocks.append((lengths, np.asarray(columns),
                                np.asarray(coefficients, float), senses, rhs))
        self.num_rows += len(lengths)

    def row_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row end to end, in order: (lengths, columns, coefficients, senses,
        right-hand sides)."""
        if not self.row_blocks:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0), empty, np.zeros(0)
        return tuple(np.concatenate([block[k] for block in self.row_blocks])
                     for k in range(5))

    @property
    def rows(self) -> list[tuple[np.ndarray, np.ndarray, int, float]]:
        """Each row as (columns, coefficients, sense, right-hand side)."""
        lengths, columns, coefficients, senses, rhs = self.row_arrays()
        ends = np.cumsum(lengths).tolist()
        return [(columns[end - n:end], coefficients[end - n:end], int(sense), float(b))
                for n, end, sense, b in zip(lengths.tolist(), ends, senses, rhs)]

    def add_one_hot_node(self, v: int, costs: np.ndarray) -> np.ndarray:
        columns = self.add_columns(costs, binary=True)
        self.add_row(columns, np.ones(len(columns)), _EQ, 1.0)
        self.node_columns[v] = columns
        return columns

    def add_edge_columns(self, v: int, w: int, shape, pairs: np.ndarray, costs) -> np.ndarray:
        """Continuous columns for the class pairs `pairs` of edge {v, w}."""
        columns = self.add_columns(costs, binary=False)
        grid = np.full(shape, -1)
        grid[pairs[:, 0], pairs[:, 1]] = columns
        self.edge_columns.append((v, w, grid))
        return columns

    def values_of(self, choice: Mapping[int, int]) -> np.ndarray:
        """The exact column values of a choice: one-hot nodes, edge products s_v s_w."""
        values = np.zeros(len(self.cost))
        for v, columns in self.node_columns.items():
            values[columns[choice[v]]] = 1.0
        for (v, w, grid), (row_class, col_class) in zip(self.edge_columns, self.edge_classes):
            column = grid[row_class[choice[v]], col_class[choice[w]]]
            if column >= 0:
                values[column] = 1.0
        return values

    def objective_of(self, choice: Mapping[int, int]) -> float:
        """cost . x of a choice, summed exactly."""
        values = self.values_of(choice)
        return math.fsum(np.asarray(self.cost)[values != 0].tolist())


def _normalised_costs(graph: CostGraph):
    """Shift every edge by its row then column minima into the node costs, and every node
    cost by its minimum; drop all-zero edges. Exact: the shifts only add constants to the
    objective for every choice. **Returns:** (node_cost, [(v, w, matrix >= 0)], scale)."""
    node_cost = dict(graph.node_cost)
    edges = []
    for v, w, matrix in graph.edges():
        row_min = matrix.min(axis=1)
        matrix = matrix - row_min[:, None]
        col_min = matrix.min(axis=0)
        matrix = matrix - col_min[None, :]
        node_cost[v], node_cost[w] = node_cost[v] + row_min, node_cost[w] + col_min
        if matrix.any():
            edges.append((v, w, matrix))
    node_cost = {v: c - c.min() for v, c in node_cost.items()}
    largest = [float(c.max()) for c in node_cost.values()] + [float(m.max()) for *_, m in edges]
    scale = max(largest, default=0.0) or 1.0
    return node_cost, edges, scale


def _classes(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of `matrix`, in order of first appearance: (index of each class's
    first row, class of every row). Rows are told apart by their bytes (after `+ 0.0`, so
    that -0.0 and 0.0 are one value): a dict of them is ten times faster than
    `np.unique(axis=0)` on these small matrices (issue 18)."""
    rows = np.ascontiguousarray(matrix + 0.0)
    class_of: dict[bytes, int] = {}
    first, classes = [], []
    for i, row in enumerate(rows):
        key = row.tobytes()
        k = class_of.get(key)
        if k is None:
            k = class_of[key] = len(first)
            first.append(i)
        classes.append(k)
    return np.array(first, dtype=np.int64), np.array(classes, dtype=np.int64)


def _compressed_edge(matrix: np.ndarray):
    """An edge's cost matrix over classes of identical rows and identical columns.

    Strategies of a node that give the edge's tensor the same layout have identical rows
    (columns) of resharding costs; the ILP needs one edge column per pair of such classes,
    not per pair of strategies. **Returns:** (row class of each row, column class of each
    column, the class matrix)."""
    row_first, row_class = _classes(matrix)
    col_first, col_class = _classes(matrix.T)
    return row_class, col_class, matrix[np.ix_(row_first, col_first)]


def _class_sums(columns: np.ndarray, classes: np.ndarray, count: int) -> list[np.ndarray]:
    """The strategy columns of each class (their sum is the class's indicator), each in
    column order (a stable sort by class, cut at the class sizes)."""
    grouped = columns[np.argsort(classes, kind="stable")]
    ends = np.cumsum(np.bincount(classes, minlength=count)).tolist()
    return [grouped[start:end] for start, end in zip([0, *ends], ends)]


def _all_classes(matrices: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`_classes` of every matrix of `matrices`, found together: their rows side by side
    (zero-padded to one width, each behind its matrix's index), distinct rows by their
    bytes (`np.unique` of a void view, after `+ 0.0`, as `_classes` tells them apart), and
    the classes numbered by first appearance. Issue 45: one sort for the few thousand rows
    of a layer ILP's edges, not a dict per matrix; with the rows made in one block
    (`_add_marginal_rows`) the models of every other of llama-8B@64's 94 layer ILPs and
    their HiGHS arrays took 0.75 CPU s against 1.93 s, the same arrays (a comparison
    with main's `sharding_model` on the problems of `benchmarks.investigations.ilp_replay
    dump llama-8B@64`).

    **Returns:** per matrix, (index of each class's first row, class of every row)."""
    heights = np.array([len(m) for m in matrices], dtype=np.int64)
    offsets = np.cumsum(heights) - heights
    padded = np.zeros((int(heights.sum()), 1 + max(m.shape[1] for m in matrices)))
    padded[:, 0] = np.repeat(np.arange(len(matrices)), heights)
    for m, offset in zip(matrices, offsets.tolist()):
        padded[offset:offset + len(m), 1:1 + m.shape[1]] = m + 0.0
    rows = padded.view(np.dtype((np.void, padded.itemsize * padded.shape[1]))).ravel()
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    number, first = rank[inverse.ravel()], first[order]  # classes by first appearance
    starts = number[offsets]  # a matrix's first row starts its first class
    ends = np.append(starts[1:], len(first))
    return [(first[a:b] - offset, number[offset:offset + height] - a) for a, b, offset, height
            in zip(starts.tolist(), ends.tolist(), offsets.tolist(), heights.tolist())]


def _add_marginal_edges(model: _Model, edges: list[tuple[int, int, np.ndarray]]) -> None:
    """Alpa's linearisation over strategy classes (`_compressed_edge`) of every edge (v, w,
    matrix): e[a, b] >= 0 for every pair of classes, sum_b e[a, b] = S_v[a] and
    sum_a e[a, b] = S_w[b], with S the sum of a class's strategy columns (the last column
    class's equation is implied and left out). With one-hot s the classes' indicators are
    one-hot, and the only such e is their outer product, so continuous e is exact; with
    one strategy per class this is Alpa's formulation itself, and merging classes leaves
    the LP relaxation's bound as it was (a fractional e disaggregates in proportion to s).

    Each edge's columns (class pairs, row-major) follow the last one's; its rows, v's
    classes then w's, follow too, made for all edges at once (`_add_marginal_rows`)."""
    if not edges:
        return
    classes = _all_classes([m for _, _, m in edges] + [m.T for _, _, m in edges])
    sides = []  # (edge columns by row, node columns, class of each strategy)
    for k, (v, w, matrix) in enumerate(edges):
        (row_first, row_class), (col_first, col_class) = classes[k], classes[len(edges) + k]
        pair_cost = matrix[np.ix_(row_first, col_first)]
        e = model.add_columns(pair_cost.ravel(), binary=False).reshape(pair_cost.shape)
        model.edge_columns.append((v, w, e))
        model.edge_classes.append((row_class, col_class))
        sides += [(e, model.node_columns[v], row_class),
                  (e.T[:e.shape[1] - 1], model.node_columns[w], col_class)]
    _add_marginal_rows(model, sides)


def _add_marginal_rows(model: _Model, sides) -> None:
    """The rows sum_b e[a, b] - S[a] = 0 of `_add_marginal_edges`, one per row a of each
    side's `e` (S[a]: the side's strategy columns of class a; classes from len(e) on get
    no row), as one block: each row's edge columns, then its strategy columns in column
    order (`_class_sums`), coefficients 1 and -1, as a loop over the rows would append
    them. Issue 45: whole-array operations, not a pair of concatenations per row."""
    counts = np.array([len(e) for e, _, _ in sides], dtype=np.int64)
    first_row = np.cumsum(counts) - counts
    widths = np.repeat([e.shape[1] for e, _, _ in sides], counts)
    classes = np.concatenate([c for _, _, c in sides])
    side = np.repeat(np.arange(len(sides)), [len(c) for _, _, c in sides])
    named = classes < counts[side]  # strategies of a class with a row
    row = (first_row[side] + classes)[named]
    order = np.argsort(row, kind="stable")  # column order within each row
    strategies = np.concatenate([c for _, c, _ in sides])[named][order]
    lengths = widths + np.bincount(row, minlength=len(widths))
    starts = np.cumsum(lengths) - lengths
    edge_starts = np.cumsum(widths) - widths
    on_edge = (np.repeat(starts - edge_starts, widths) + np.arange(int(widths.sum())))
    index = np.empty(int(lengths.sum()), dtype=np.int64)
    value = np.full(len(index), -1.0)
    index[on_edge] = np.concatenate([e.ravel() for e, _, _ in sides])
    value[on_edge] = 1.0
    index[value < 0] = strategies
    model.add_rows(lengths.astype(np.int64), index, value,
                   np.full(len(lengths), _EQ, dtype=np.int64), np.zeros(len(lengths)))


def _add_product_edge(model: _Model, v: int, w: int, matrix: np.ndarray) -> None:
    """Product bound over strategy classes: e[a, b] >= S_v[a] + S_w[b] - 1, e >= 0, only
    where the class matrix is > 0. It is >= 0, so the minimum puts e at
    max(0, S_v[a] + S_w[b] - 1) = S_v[a] S_w[b] for one-hot s; exact, smaller than the
    marginal form, but a weaker LP relaxation."""
    row_class, col_class, classes = _compressed_edge(matrix)
    s_v = _class_sums(model.node_columns[v], row_class, classes.shape[0])
    s_w = _class_sums(model.node_columns[w], col_class, classes.shape[1])
    pairs = np.argwhere(classes > 0)
    e = model.add_edge_columns(v, w, classes.shape, pairs, classes[pairs[:, 0], pairs[:, 1]])
    model.edge_classes.append((row_class, col_class))
    for column, (a, b) in zip(e, pairs):
        model.add_row(np.concatenate([[column], s_v[a], s_w[b]]),
                      [1.0] + [-1.0] * (len(s_v[a]) + len(s_w[b])), _GE, -1.0)


def sharding_model(
    graph: CostGraph, groups: list[MemoryGroup], budget: float | None, form: Formulation
) -> _Model:
    """The ILP of the reduced problem: costs scaled to <= 1, memory scaled by the budget."""
    node_cost, edges, scale = _normalised_costs(graph)
    model = _Model(scale=scale)
    for v in sorted(node_cost):
        model.add_one_hot_node(v, node_cost[v] / scale)
    if form == "marginal":
        _add_marginal_edges(model, [(v, w, matrix / scale) for v, w, matrix in edges])
    for v, w, matrix in edges if form == "product" else ():
        _add_product_edge(model, v, w, matrix / scale)
    for group in groups:
        columns = np.concatenate([model.node_columns[v] for v, _ in group.terms])
        bytes_ = np.concatenate([t for _, t in group.terms])
        model.add_row(columns, bytes_ / budget, _LE, (budget - group.constant) / budget)
    return model


def tie_break_weights(nodes) -> dict[int, float]:
    """The weight w_v of each node in the tie-break objective sum_v w_v * (v's original
    strategy index), which is least at the canonical plan among equal-cost optima.

    With r the rank of v among the n `nodes` in sorted order and p_r the (r+1)-th prime,
    w_v = 1 + (n - r + frac(sqrt(p_r))) / (n + 1), in (1, 2) and decreasing in r. So:
    - a plan lower at one node and no higher elsewhere is always preferred (lower indices);
    - swapping which of two nodes takes the lower index favours the earlier node, as a
      lexicographic order would;
    - the minimiser is unique: two plans s != s' differ by sum_v w_v (s_v - s'_v), a
      rational number plus sum_v (s_v - s'_v) sqrt(p_v) / (n + 1), and 1 and the square
      roots of distinct primes are linearly independent over the rationals (Besicovitch
      1940), so the difference is never 0. (In floating point the ties of real models,
      which trade a few nodes, are separated by far more than the solver's gap.)
    Plain rational weights such as 1 + (n - r) / n would tie (ranks a + b = c + d).
    """
    nodes = sorted(nodes)
    n = len(nodes)
    return {
        v: 1.0 + (n - rank + math.sqrt(prime) % 1.0) / (n + 1)
        for rank, (v, prime) in enumerate(zip(nodes, _first_primes(n)))
    }


def tie_break_costs(model: _Model, weights: Mapping[int, float],
                    strategy_index: Mapping[int, np.ndarray]) -> np.ndarray:
    """The tie-break objective per column: weights[v] * strategy_index[v][k] on the column
    of strategy k of node v (`strategy_index`: original indices), 0 on edge columns."""
    costs = np.zeros(len(model.cost))
    for v, columns in model.node_columns.items():
        costs[columns] = weights[v] * np.asarray(strategy_index[v], float)
    return costs


def plans_within(model: _Model, duals: np.ndarray, bound: float) -> dict[int, np.ndarray] | None:
    """The strategies of each node that some plan of cost <= `bound` may use, by
    reduced-cost fixing with the LP relaxation's row duals `duals` (exact for any duals).

    With y the duals (clipped to the sign their row's sense allows) and d = c - A^T y, every
    feasible x has cost c.x = y.b + d.x + sum_i y_i (a_i.x - b_i) >= y.b + d.x, and at a plan
    every column is in [0, 1] (edge columns are products of two class indicators). So
    c.x >= D + sum_(d_j > 0) d_j x_j + sum_(d_j < 0) |d_j| (1 - x_j), D = y.b + sum min(0, d),
    and a plan within `bound` has x_j = 0 where d_j > slack = bound - D, and x_j = 1 where
    d_j < -slack. `_FIXING_MARGIN` widens the slack by the solvers' feasibility tolerance.

    **Returns:** the kept strategy indices (into the model's) of every node, or None when
    the duals prove nothing (slack not finite).
    """
    cost = np.asarray(model.cost)
    y = np.asarray(duals, float)
    lengths, columns, coefficients, senses, rhs = model.row_arrays()
    y = np.where(senses == _LE, np.minimum(y, 0.0), np.where(senses == _GE, np.maximum(y, 0.0), y))
    weights = coefficients * np.repeat(y, lengths)
    reduced = cost - np.bincount(columns, weights, minlength=len(cost))
    lower = math.fsum((y * rhs).tolist()) + math.fsum(np.minimum(reduced, 0.0).tolist())
    slack = bound - lower + _FIXING_MARGIN
    if not math.isfinite(slack):
        return None
    keep = {}
    for v, node_columns in model.node_columns.items():
        d = reduced[node_columns]
        allowed = d <= slack
        forced = d < -slack
        if forced.any():
            allowed &= forced
        keep[v] = np.flatnonzero(allowed)
    return keep


def _first_primes(count: int) -> list[int]:
    """The first `count` primes (sieve of Eratosthenes)."""
    limit = max(16, int(count * (math.log(count + 2) + math.log(math.log(count + 2)) + 2)))
    sieve = np.ones(limit, dtype=bool)
    sieve[:2] = False
    for k in range(2, math.isqrt(limit) + 1):
        if sieve[k]:
            sieve[k * k :: k] = False
    primes = np.flatnonzero(sieve)
    assert len(primes) >= count
    return [int(p) for p in primes[:count]]


def least_memory_model(groups: list[MemoryGroup]) -> tuple[_Model, int]:
    """Minimise z subject to z >= every group's bytes (scaled by the largest upper bound).
    **Returns:** the model and the column of z."""
    scale = max(g.upper() for g in groups) or 1.0
    model = _Model()
    for v, t in sorted({v: t for g in groups for v, t in g.terms}.items()):
        model.add_one_hot_node(v, np.zeros(len(t)))
    (peak,) = model.add_columns([1.0], binary=False)
    for group in groups:
        columns = np.concatenate([model.node_columns[v] for v, _ in group.terms] + [[peak]])
        coefficients = np.concatenate([t / scale for _, t in group.terms] + [[-1.0]])
        model.add_row(columns, coefficients, _LE, -group.constant / scale)
    return model, int(peak)


# --------------------------------------------------------------------------------------
# Running pulp
# --------------------------------------------------------------------------------------


def resolve_solver(solver: SolverName) -> Literal["highs", "cbc"]:
    if solver not in ("auto", "highs", "cbc"):
        raise ValueError(f'solver must be "auto", "highs" or "cbc", got {solver!r}.')
    highs_available = pulp.HiGHS(msg=False).available()
    if solver == "highs" and not highs_available:
        raise ValueError('solver="highs" needs the highspy package: pip install highspy, '
                         'or pass solver="cbc".')
    if solver == "auto":
        return "highs" if highs_available else "cbc"
    return solver


def _pulp_solver(time_limit: float, msg: bool, warm_start: bool, gap_rel: float,
                 mip: bool = True):
    """pulp's CBC (a CBC binary on PATH, else pulp's bundled one)."""
    common = dict(mip=mip, msg=msg, timeLimit=time_limit, gapRel=gap_rel,
                  gapAbs=MIP_ABSOLUTE_GAP, threads=SOLVER_THREADS)
    options = [f"randomCbcSeed {SOLVER_RANDOM_SEED + 1}"]  # CBC reads 0 as "seed from clock"
    if pulp.COIN_CMD(msg=False).available():  # a CBC binary on PATH
        return pulp.COIN_CMD(options=options, warmStart=warm_start, **common)
    with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC, still shipped
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(options=options, warmStart=warm_start, **common)


def _expression(variables: list[pulp.LpVariable], costs) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression([(variables[i], c) for i, c in enumerate(costs) if c != 0])


class _PulpBuilt:
    """A model built for CBC through pulp."""

    def __init__(self, model: _Model):
        self.model = model
        self.problem = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
        width = len(str(len(model.cost)))  # zero-padded: pulp's name order is ours
        self.variables = [
            self.problem.add_variable(f"x{i:0{width}d}", 0, 1 if b else None,
                                      pulp.LpBinary if b else pulp.LpContinuous)
            for i, b in enumerate(model.binary)
        ]
        self.problem.setObjective(_expression(self.variables, model.cost))
        width = len(str(model.num_rows))
        self.rows = []
        for r, (columns, coefficients, sense, rhs) in enumerate(model.rows):
            terms = pulp.LpAffineExpression(
                [(self.variables[c], a) for c, a in zip(columns, coefficients)])
            self.rows.append(pulp.LpConstraint(terms, sense, f"c{r:0{width}d}", rhs))
            self.problem.addConstraint(self.rows[-1])

    def add_cost_bound(self, bound: float, secondary: np.ndarray) -> None:
        self.problem.addConstraint(pulp.LpConstraint(
            _expression(self.variables, self.model.cost), _LE, "cost_bound", bound))
        self.problem.setObjective(_expression(self.variables, secondary))

    def run(self, time_limit, msg, start, gap_rel):
        if start is not None:
            for variable, value in zip(self.variables, start):
                variable.setInitialValue(float(value))
        self.problem.solve(_pulp_solver(time_limit, msg, start is not None, gap_rel))
        if self.problem.status == pulp.LpStatusInfeasible:
            return None, "infeasible"
        if self.problem.sol_status not in (pulp.LpSolutionOptimal,
                                           pulp.LpSolutionIntegerFeasible):
            return None, "no_solution"
        values = np.array([v.varValue if v.varValue is not None else 0.0
                           for v in self.variables])
        optimal = self.problem.sol_status == pulp.LpSolutionOptimal
        return values, "optimal" if optimal else "time_limit"

    def row_duals(self, time_limit, msg):
        self.problem.solve(_pulp_solver(time_limit, msg, False, MIP_RELATIVE_GAP, mip=False))
        if self.problem.sol_status != pulp.LpSolutionOptimal:
            return None
        duals = [row.pi for row in self.rows]
        return None if None in duals else np.array(duals, float)


def _quiet_highs():
    """A `highspy.Highs` with its log off. Its constructor prints a banner to the C-level
    standard output, once per instance (pulp makes one per solve): it is sent to /dev/null."""
    import os
    import sys

    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    highs.setOptionValue("output_flag", False)
    return highs


class _HighsBuilt:
    """A model passed to highspy directly, as whole arrays: the same columns and rows, in
    the same order, as pulp would pass one by one (pulp's per-variable calls cost more than
    the solve on small models), hence the same search."""

    def __init__(self, model: _Model):
        import highspy

        self.model = model
        n = len(model.cost)
        self.cost = np.asarray(model.cost, float)
        self.integer = np.asarray(model.binary, bool)
        self.upper = np.where(self.integer, 1.0, highspy.kHighsInf)
        # the rows as one row-wise matrix (zeros dropped), built with whole-array operations
        lengths, index, value, sense, rhs = model.row_arrays()
        keep = value != 0
        row_of = np.repeat(np.arange(len(lengths)), lengths)
        kept = np.bincount(row_of[keep], minlength=len(lengths))
        self.starts = np.concatenate([[0], np.cumsum(kept)]).astype(np.int32)
        self.index = index[keep].astype(np.int32)
        self.value = value[keep].astype(float)
        self.lower = np.where((sense == _EQ) | (sense == _GE), rhs, -highspy.kHighsInf)
        self.row_upper = np.where((sense == _EQ) | (sense == _LE), rhs, highspy.kHighsInf)
        self.objective = self.cost
        self.num_col = n
        self.tie_break = False  # `add_cost_bound` makes it the tie-break problem
        self.presolve = True  # `without_presolve` turns the MIP's presolve off
        # the LP relaxation's optimum and row duals (a simplex vertex's: valid for
        # reduced-cost fixing, if weaker than interior ones) once `integral_relaxation`
        # has solved it, integral or not
        self.relaxation_values: np.ndarray | None = None
        self.relaxation_duals: np.ndarray | None = None

    def add_cost_bound(self, bound: float, secondary: np.ndarray) -> None:
        import highspy

        keep = self.cost != 0
        columns = np.flatnonzero(keep).astype(np.int32)
        self.index = np.concatenate([self.index, columns])
        self.value = np.concatenate([self.value, self.cost[keep]])
        self.starts = np.append(self.starts, self.starts[-1] + len(columns)).astype(np.int32)
        self.lower = np.append(self.lower, -highspy.kHighsInf)
        self.row_upper = np.append(self.row_upper, bound)
        self.objective = np.asarray(secondary, float)
        self.tie_break = True

    def _highs(self, mip: bool, options: Mapping[str, object]):
        import highspy

        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.num_col, len(self.lower)
        lp.col_cost_, lp.col_lower_ = self.objective, np.zeros(self.num_col)
        lp.col_upper_ = self.upper
        lp.row_lower_, lp.row_upper_ = self.lower, self.row_upper
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = self.num_col, len(self.lower)
        lp.a_matrix_.start_, lp.a_matrix_.index_ = self.starts, self.index
        lp.a_matrix_.value_ = self.value
        if mip:
            lp.integrality_ = [highspy.HighsVarType.kInteger if b
                               else highspy.HighsVarType.kContinuous for b in self.integer]
        highs = _quiet_highs()
        for key, value in options.items():
            highs.setOptionValue(key, value)
        highs.passModel(lp)
        return highs

    @staticmethod
    def _options(time_limit, msg, gap_rel) -> dict:
        return dict(output_flag=bool(msg), mip_rel_gap=gap_rel, mip_abs_gap=MIP_ABSOLUTE_GAP,
                    threads=SOLVER_THREADS, time_limit=float(time_limit) * WALL_CLOCK_BACKSTOP,
                    random_seed=SOLVER_RANDOM_SEED)

    def run(self, time_limit, msg, start, gap_rel):
        import highspy

        options = self._options(time_limit, msg, gap_rel)
        if self.tie_break:
            options |= _HIGHS_TIE_BREAK_OPTIONS
        if not self.presolve:
            options["presolve"] = "off"
        highs = self._highs(True, options)
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = np.asarray(start, float)
            highs.setSolution(solution)
        highs.run()
        status = highs.getModelStatus()
        kind = highspy.HighsModelStatus
        if status in (kind.kInfeasible, kind.kUnboundedOrInfeasible):
            return None, "infeasible"
        if status == kind.kOptimal:
            return np.array(highs.getSolution().col_value), "optimal"
        stopped = (kind.kTimeLimit, kind.kIterationLimit, kind.kInterrupt,
                   kind.kObjectiveBound, kind.kObjectiveTarget)
        if status in stopped and highs.getInfo().primal_solution_status == 2:
            return np.array(highs.getSolution().col_value), "time_limit"
        return None, "no_solution"

    def integral_relaxation(self, time_limit, msg) -> np.ndarray | None:
        """The LP relaxation's optimum (dual simplex) when it sets every binary to 0 or 1
        (within `INTEGRALITY_TOLERANCE`, then rounded): an optimum of the MIP too, found
        without HiGHS's MIP set-up; None otherwise. Issue 18: 5 of the demo's 6 largest
        layer ILPs (17-19k columns) have such relaxations, solved in 0.05 CPU s against
        0.23 s for the MIP. Any optimum will do: the canonical tie-break that follows
        picks the same plan from every optimum.

        A model with memory rows (bytes over the budget) is tried too: a fractional
        relaxation is not solved for nothing, since its duals fix strategies for the MIP
        (`autopar.intra._ilp._solve_within_incumbent`) and for the tie-break's first
        round (`vertex_row_duals`). Issue 45: the CLI line's slowest layer ILPs (2-GPU
        meshes, 32 microbatches, ~200k columns, one memory row) have integral
        relaxations, solved by dual simplex in 0.7 CPU s against 5.4 s for the MIP, and
        their tie-break fixes on these duals in 0.4 s against 11.6 s of interior point
        on the whole model."""
        import highspy

        options = self._options(time_limit, msg, MIP_RELATIVE_GAP) | _HIGHS_RELAXATION_OPTIONS
        highs = self._highs(False, options)
        highs.run()
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        values = np.array(highs.getSolution().col_value)
        self.relaxation_values = values.copy()
        self.relaxation_duals = np.array(highs.getSolution().row_dual, float)
        binary = values[self.integer]
        if np.any(np.minimum(binary, 1.0 - binary) > INTEGRALITY_TOLERANCE):
            return None
        values[self.integer] = np.round(binary)
        return values

    def row_duals(self, time_limit, msg):
        import highspy

        options = self._options(time_limit, msg, MIP_RELATIVE_GAP) | _HIGHS_LP_OPTIONS
        highs = self._highs(False, options)
        highs.run()
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return np.array(highs.getSolution().row_dual, float)


# The LP relaxation of the first solve without presolve: on the demo's six largest layer
# ILPs (17-19k columns) dual simplex takes half the CPU time (0.31 -> 0.16 s in all); these
# models have nothing for presolve to remove but its own bookkeeping (issue 18).
_HIGHS_RELAXATION_OPTIONS = dict(presolve="off")


# The tie-break MIP starts from a plan that is already optimal for its cost row and, in
# practice, for its objective too (the first solve's optimum is usually canonical or a few
# swaps from it): what remains is proving it, and HiGHS's primal heuristics (RINS, RENS,
# root reduced-cost sub-MIPs, each a MIP solve of its own) only look for better plans.
# Turned off, the tie-break takes 40 % less CPU time (issue 18: the 11 leaner-level MIPs of
# gpt-1.3B@16 over 1 CPU s, 26.6 -> 15.9 CPU s, the same plans). The first solve keeps
# them: there they find the incumbent that closes the gap (turned off: 22 -> 27 CPU s).
# The options change the search only: the tie-break's answer is its unique minimiser.
_HIGHS_TIE_BREAK_OPTIONS = dict(
    mip_heuristic_effort=0.0,
    mip_heuristic_run_rins=False,
    mip_heuristic_run_rens=False,
    mip_heuristic_run_root_reduced_cost=False,
)


def build_solver_model(model: _Model, solver: Literal["highs", "cbc"]):
    """The model ready for `solver`: HiGHS through highspy directly, CBC through pulp."""
    return _HighsBuilt(model) if solver == "highs" else _PulpBuilt(model)


def without_presolve(built) -> None:
    """Solve `built`'s MIP without HiGHS's presolve (CBC: no change). For the first
    solve's MIP started from an incumbent (`autopar.intra._ilp._solve_within_incumbent`):
    its model is the graph restricted by reduced-cost fixing, little is left for presolve
    to remove, and the root solves it (issue 45: the demo's two fractional layer ILPs, on
    the (2, 4) mesh, 1.17 -> 0.60 and 0.46 -> 0.32 CPU s in all, the same plans; the 98
    ILPs of llama-8B@64 gave the same choices in the same time). It changes the search,
    not the answer: the canonical tie-break that follows picks one plan from any
    optimum."""
    if isinstance(built, _HighsBuilt):
        built.presolve = False


def with_cost_bound(built, bound: float, secondary: np.ndarray) -> None:
    """Turn `built` into the tie-break problem: the row cost . x <= bound is added and
    `secondary` (per column) becomes the objective."""
    built.add_cost_bound(bound, secondary)


def run_model(built, time_limit: float, msg: bool, start: np.ndarray | None = None,
              gap_rel: float = MIP_RELATIVE_GAP, fractional=None):
    """Solve a model built by `build_solver_model` (None: a model without columns).

    `start`: a feasible solution to start from (one value per column); `gap_rel`: the
    relative MIP gap (the absolute one is `MIP_ABSOLUTE_GAP`). Without `start`, HiGHS
    first solves the LP relaxation and returns it when it is integral
    (`_HighsBuilt.integral_relaxation`); when it is fractional and `fractional` is given,
    `fractional(relaxation values, row duals)` solves the MIP instead and its (values,
    status) are returned.

    **Returns:** (column values or None, status), status one of "optimal", "time_limit",
    "infeasible", "no_solution".
    """
    if built is None:
        return np.zeros(0), "optimal"
    if start is None and isinstance(built, _HighsBuilt):
        values = built.integral_relaxation(time_limit, msg)
        if values is not None:
            return values, "optimal"
        if fractional is not None and built.relaxation_duals is not None:
            return fractional(built.relaxation_values, built.relaxation_duals)
    return built.run(time_limit, msg, start, gap_rel)


# HiGHS solves the LP relaxation for `lp_row_duals` by interior point without crossover:
# it ends near the analytic centre of the optimal face, where the duals are strictly
# complementary (every column that is 0 on the whole face has a positive reduced cost), so
# reduced-cost fixing keeps little more than the face; a simplex vertex's duals are
# degenerate and keep far more (gpt_2x4 golden case, 93 nodes: 95 strategies kept, 2 nodes
# left with a choice, against 1,114 strategies and all 93 nodes with dual simplex).
# Presolve off: its postsolve gives the removed columns vertex-like duals (295 kept, 10).
_HIGHS_LP_OPTIONS = dict(solver="ipm", run_crossover="off", presolve="off")


def lp_row_duals(built, time_limit: float, msg: bool):
    """Row duals of the LP relaxation of a model built by `build_solver_model`, in row
    order; None when the LP was not solved to optimality."""
    return built.row_duals(time_limit, msg)


def vertex_row_duals(built, time_limit: float | None = None, msg: bool = False):
    """The row duals of a simplex vertex of the LP relaxation of a model built for HiGHS:
    those the first solve left (`_HighsBuilt.integral_relaxation`, integral or not), else,
    given a `time_limit`, that LP solved now; None for CBC or an LP not solved to
    optimality."""
    if not isinstance(built, _HighsBuilt):
        return None
    if built.relaxation_duals is None and time_limit is not None:
        built.integral_relaxation(time_limit, msg)
    return built.relaxation_duals


def node_choices(model: _Model, values: np.ndarray) -> dict[int, int]:
    choice = {}
    for v, columns in model.node_columns.items():
        k = int(np.argmax(values[columns]))
        assert values[columns[k]] > CHOSEN_THRESHOLD, f"no strategy chosen for merged node {v}"
        choice[v] = k
    return choice

