"""A Megatron layer plan over the budget by the layer ILP's linear memory bound (every
value held at once) is planned again with the bound lifted: the pipeline stage's check,
the liveness of the layout with the activations in flight, decides whether it fits
(`autopar.manual._megatron._pinned_solver`). A context-parallel refusal is no memory
verdict and is raised as it was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autopar.intra import ContextParallelError, MemoryBudgetError
from autopar.intra._options import ShardOptions
from autopar.manual import _megatron


def _solver(monkeypatch, first_error):
    budgets = []

    def plan_keeping_state(sub, cluster, mesh, options, ties, fixed, weights, *, pinned):
        budgets.append(options.memory_budget)
        if len(budgets) == 1:
            raise first_error
        return "plan"

    monkeypatch.setattr(_megatron, "plan_keeping_state", plan_keeping_state)
    solve = _megatron._pinned_solver(None, None, {}, ShardOptions(memory_budget=80 * 2**30),
                                     {}, None)
    return solve, budgets


def test_over_the_layer_bound_is_left_to_the_stage_check(monkeypatch):
    solve, budgets = _solver(monkeypatch, MemoryBudgetError(80 * 2**30, 90 * 2**30))
    sub = SimpleNamespace(invars=[], nodes=[], outvars=[])
    assert solve(sub, None, (), None) == "plan"
    assert budgets == [80 * 2**30, _megatron._LIFTED_BUDGET]


def test_a_context_parallel_refusal_is_raised(monkeypatch):
    solve, budgets = _solver(monkeypatch, ContextParallelError("cannot split"))
    with pytest.raises(ContextParallelError, match="cannot split"):
        solve(SimpleNamespace(invars=[], nodes=[], outvars=[]), None, (), None)
    assert budgets == [80 * 2**30]
