"""The sharding ILP as a mixed-integer program, and running it with pulp (HiGHS or CBC).

In: a reduced `CostGraph` and its binding `MemoryGroup`s (from `_ilp_reduce.py`).
Out: a `_Model` of plain arrays (column costs, binary flags, rows, the one-hot columns of
each node) built by `sharding_model` (least cost under the memory budget) or
`least_memory_model` (least peak memory); `to_pulp` and `run_pulp` solve it with the solver
`resolve_solver` picks, and `node_choices` reads back one strategy per node.

Before the model is built each edge matrix is shifted by its row and column minima (so it
is >= 0 with a zero in every row and column), and all costs are scaled so the largest
coefficient is 1 (`_normalised_costs`). Edges are linearised with Alpa's marginal
constraints (`_add_marginal_edge`, Zheng et al. 2022, REFERENCES.md) or product bounds
(`_add_product_edge`). Solver gaps, seed and threads are fixed so plans are exact and
repeatable.
"""

from __future__ import annotations

import warnings
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
# Solution values above this count as "strategy chosen" (HiGHS's integrality tolerance is
# 1e-6, so a chosen binary reads at least 1 - 1e-6).
CHOSEN_THRESHOLD = 0.5


# --------------------------------------------------------------------------------------
# The ILP, as plain arrays
# --------------------------------------------------------------------------------------

_LE, _EQ, _GE = pulp.LpConstraintLE, pulp.LpConstraintEQ, pulp.LpConstraintGE


@dataclass
class _Model:
    """A mixed-integer program: minimise cost . x over x >= 0 subject to `rows`.

    Binary columns are in [0, 1]; continuous columns are unbounded above. Each row is
    (columns, coefficients, sense, right-hand side). `node_columns[v]` are the one-hot
    strategy columns of node v.
    """

    cost: list[float] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    rows: list[tuple[np.ndarray, np.ndarray, int, float]] = field(default_factory=list)
    node_columns: dict[int, np.ndarray] = field(default_factory=dict)

    def add_columns(self, costs: np.ndarray, binary: bool) -> np.ndarray:
        start = len(self.cost)
        self.cost.extend(float(c) for c in costs)
        self.binary.extend([binary] * len(costs))
        return np.arange(start, len(self.cost))

    def add_row(self, columns, coefficients, sense: int, rhs: float) -> None:
        self.rows.append((np.asarray(columns), np.asarray(coefficients, float), sense, rhs))

    def add_one_hot_node(self, v: int, costs: np.ndarray) -> np.ndarray:
        columns = self.add_columns(costs, binary=True)
        self.add_row(columns, np.ones(len(columns)), _EQ, 1.0)
        self.node_columns[v] = columns
        return columns


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


def _add_marginal_edge(model: _Model, v: int, w: int, matrix: np.ndarray) -> None:
    """Alpa's linearisation: e[i, j] >= 0 for every pair, sum_j e[i, j] = s_v[i] and
    sum_i e[i, j] = s_w[j] (the last column's equation is implied and left out). With
    one-hot s the only such e is the outer product s_v s_w^T, so continuous e is exact."""
    s_v, s_w = model.node_columns[v], model.node_columns[w]
    e = model.add_columns(matrix.ravel(), binary=False).reshape(matrix.shape)
    for i in range(matrix.shape[0]):
        model.add_row(np.append(e[i, :], s_v[i]), [1.0] * matrix.shape[1] + [-1.0], _EQ, 0.0)
    for j in range(matrix.shape[1] - 1):
        model.add_row(np.append(e[:, j], s_w[j]), [1.0] * matrix.shape[0] + [-1.0], _EQ, 0.0)


def _add_product_edge(model: _Model, v: int, w: int, matrix: np.ndarray) -> None:
    """Product bound: e[i, j] >= s_v[i] + s_w[j] - 1, e >= 0, only where matrix > 0. The
    matrix is >= 0 so the minimum puts e at max(0, s_v[i] + s_w[j] - 1) = s_v[i] s_w[j]
    for one-hot s; exact, smaller than the marginal form, but a weaker LP relaxation."""
    s_v, s_w = model.node_columns[v], model.node_columns[w]
    pairs = np.argwhere(matrix > 0)
    e = model.add_columns(matrix[pairs[:, 0], pairs[:, 1]], binary=False)
    for column, (i, j) in zip(e, pairs):
        model.add_row([column, s_v[i], s_w[j]], [1.0, -1.0, -1.0], _GE, -1.0)


def sharding_model(
    graph: CostGraph, groups: list[MemoryGroup], budget: float | None, form: Formulation
) -> _Model:
    """The ILP of the reduced problem: costs scaled to <= 1, memory scaled by the budget."""
    node_cost, edges, scale = _normalised_costs(graph)
    model = _Model()
    for v in sorted(node_cost):
        model.add_one_hot_node(v, node_cost[v] / scale)
    add_edge = _add_marginal_edge if form == "marginal" else _add_product_edge
    for v, w, matrix in edges:
        add_edge(model, v, w, matrix / scale)
    for group in groups:
        columns = np.concatenate([model.node_columns[v] for v, _ in group.terms])
        bytes_ = np.concatenate([t for _, t in group.terms])
        model.add_row(columns, bytes_ / budget, _LE, (budget - group.constant) / budget)
    return model


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


def _pulp_solver(name: Literal["highs", "cbc"], time_limit: float, msg: bool):
    common = dict(msg=msg, timeLimit=time_limit, gapRel=MIP_RELATIVE_GAP,
                  gapAbs=MIP_ABSOLUTE_GAP, threads=SOLVER_THREADS)
    if name == "highs":
        return pulp.HiGHS(random_seed=SOLVER_RANDOM_SEED, **common)
    options = [f"randomCbcSeed {SOLVER_RANDOM_SEED + 1}"]  # CBC reads 0 as "seed from clock"
    if pulp.COIN_CMD(msg=False).available():  # a CBC binary on PATH
        return pulp.COIN_CMD(options=options, **common)
    with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC, still shipped
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(options=options, **common)


def to_pulp(model: _Model) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    """The model as a pulp problem; zero-padded names keep pulp's name-sorted column order
    equal to ours."""
    problem = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
    width = len(str(len(model.cost)))
    variables = [
        problem.add_variable(f"x{i:0{width}d}", 0, 1 if b else None,
                             pulp.LpBinary if b else pulp.LpContinuous)
        for i, b in enumerate(model.binary)
    ]
    problem.setObjective(pulp.LpAffineExpression(
        [(variables[i], c) for i, c in enumerate(model.cost) if c != 0]))
    width = len(str(len(model.rows)))
    for r, (columns, coefficients, sense, rhs) in enumerate(model.rows):
        terms = pulp.LpAffineExpression([(variables[c], a) for c, a in zip(columns, coefficients)])
        problem.addConstraint(pulp.LpConstraint(terms, sense, f"c{r:0{width}d}", rhs))
    return problem, variables


def run_pulp(built, solver: Literal["highs", "cbc"], time_limit: float, msg: bool):
    """Solve a model built by `to_pulp` (None: a model without columns).

    **Returns:** (column values or None, status), status one of "optimal", "time_limit",
    "infeasible", "no_solution".
    """
    if built is None:
        return np.zeros(0), "optimal"
    problem, variables = built
    problem.solve(_pulp_solver(solver, time_limit, msg))
    if problem.status == pulp.LpStatusInfeasible:
        return None, "infeasible"
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, "no_solution"
    values = np.array([v.varValue if v.varValue is not None else 0.0 for v in variables])
    return values, "optimal" if problem.sol_status == pulp.LpSolutionOptimal else "time_limit"


def node_choices(model: _Model, values: np.ndarray) -> dict[int, int]:
    choice = {}
    for v, columns in model.node_columns.items():
        k = int(np.argmax(values[columns]))
        assert values[columns[k]] > CHOSEN_THRESHOLD, f"no strategy chosen for merged node {v}"
        choice[v] = k
    return choice

