"""The slow reference for the stage DP (`autopar.inter._stage_dp.plan_stages`): every
slicing and every submesh choice tried, for tests on small instances."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Collection, Sequence

from autopar.cost import pipeline_latency
from autopar.inter._stage_dp import (
    StageCost,
    StageCostFn,
    StageKey,
    StagePlan,
    _call_cost,
    _is_packable,
    _make_plan,
    _prepare,
)
from autopar.inter._stage_dp_messages import no_plan_error
from autopar.inter._submesh import SubmeshShape


def brute_force_stages(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    stage_cost: StageCostFn,
    num_microbatches: int,
    *,
    submeshes: Sequence[SubmeshShape] | None = None,
    num_stages: int | None = None,
    max_stages: int | None = None,
    allowed_submeshes: Collection[int] | None = None,
    num_positions: int | None = None,
) -> StagePlan:
    """The slow reference for `plan_stages`: try every slicing and every submesh choice.

    Same arguments and result; exponential in `num_layers`, for tests on small instances.
    Only plans that use every device and pack (`assign_devices`) count.
    """
    problem = _prepare(
        num_layers,
        num_hosts,
        devices_per_host,
        stage_cost,
        num_microbatches,
        submeshes=submeshes,
        num_stages=num_stages,
        max_stages=max_stages,
        allowed_submeshes=allowed_submeshes,
        num_positions=num_positions,
    )
    started = time.perf_counter()
    costs: dict[StageKey, StageCost] = {}
    fewest, most = problem.stage_count_range()
    best, best_latency = None, math.inf
    for count in range(fewest, most + 1):
        for cuts in itertools.combinations(range(1, problem.num_layers), count - 1):
            bounds = (0, *cuts, problem.num_layers)
            for choice in itertools.product(problem.allowed, repeat=count):
                if sum(problem.submeshes[j].num_devices for j in choice) != problem.num_devices:
                    continue
                stages = problem.keys(
                    [(bounds[i], bounds[i + 1], j) for i, j in enumerate(choice)]
                )
                for key in stages:
                    if key not in costs:
                        costs[key] = _call_cost(problem, stage_cost, key)
                if not all(costs[key].feasible for key in stages):
                    continue
                latency = pipeline_latency(
                    [costs[key].latency for key in stages], problem.num_microbatches
                )
                if latency < best_latency and _is_packable(problem, stages):
                    best, best_latency = stages, latency
    if best is None:
        raise no_plan_error(problem, costs, None)
    return _make_plan(problem, best, costs, len(costs), time.perf_counter() - started, 0)
