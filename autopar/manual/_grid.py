"""`megatron_grid_search`: the best Megatron-style plan over (dp, tp, pp) and microbatches.

In: a train step, abstract arguments, a cluster and the values to try. Out: the plan with
the least predicted step time, and every configuration tried with its predicted time or
the reason it was skipped (does not fit in memory, a weight that cannot be split, fewer
layers than stages, a sequence tp does not divide). Sequence parallelism is tried with
and without by default (with tp > 1): it trades the per-layer all-reduces for
reduce-scatters and all-gathers of the same volume and keeps a tp-th of the layer-norm
regions' activations, so it decides which configurations fit. The step is traced once
per microbatch count; each configuration costs one ILP (or, for layer-marked models, one
per distinct layer).

Which configurations are valid follows Narayanan et al. 2021 (REFERENCES.md, "Guidance"):
dp·tp·pp is the number of devices and TP stays inside a host (tp <= devices per host);
with pipelining, the batch is cut into microbatches of each given size per data-parallel
rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from autopar.graph import OpGraph, Role, trace
from autopar.manual._layout import MegatronConfig
from autopar.manual._megatron import megatron_plan_for_graph
from autopar.plan import Plan
from autopar.search import microbatch_args, resolve_cluster

log = logging.getLogger("autopar")

GridResult = tuple[MegatronConfig, float | str]  # predicted seconds, or why it was skipped


def megatron_grid_search(
    step_fn: Callable,
    *abstract_args: Any,
    cluster: Any,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    sequence_parallel: Sequence[bool] = (False, True),
    pp_values: Sequence[int] = (1,),
    distributed_optimizer: Sequence[bool] = (False, True),
    recompute: Sequence[str] = ("none", "selective"),
    donate_argnums: Sequence[int] = (0,),
    batch_argnums: Sequence[int] = (1,),
    memory_budget: float | None = None,
) -> tuple[Plan, list[GridResult]]:
    """Try every valid Megatron configuration; return the fastest predicted plan.

    **Arguments:**
    - `step_fn`, `abstract_args`, `cluster`: as for `megatron_plan`.
    - `microbatch_sizes`: examples per microbatch per data-parallel rank, tried when
      pp > 1 (with pp = 1 the whole batch is one microbatch).
    - `sequence_parallel`, `pp_values`, `distributed_optimizer`, `recompute`: the values
      to try (sequence parallelism only where tp > 1; recompute needs layer marks).
    - `donate_argnums`, `batch_argnums`, `memory_budget`: as for `megatron_plan`.

    **Returns:** ``(best plan, results)``; `results` lists every configuration tried, in
    order, with its predicted step time in seconds or a string saying why it was skipped.
    Raises ValueError naming every reason if no configuration works.

    **Example:**

    ```python
    best, results = megatron_grid_search(step, state, batch, cluster="dgx-a100-80g")
    for config, outcome in results:
        print(config.name, outcome)
    ```
    """
    cluster = resolve_cluster(cluster)
    graph = trace(step_fn, *abstract_args, batch_argnums=tuple(batch_argnums))
    configs = megatron_configs(
        cluster.num_devices,
        cluster.devices_per_host,
        _batch_size(graph),
        microbatch_sizes=microbatch_sizes,
        sequence_parallel=sequence_parallel,
        pp_values=pp_values,
        distributed_optimizer=distributed_optimizer,
        recompute=recompute,
    )
    results: list[GridResult] = []
    best: Plan | None = None
    graphs = {1: graph}  # traced once per microbatch count: a pipelined plan runs one
    for config in configs:
        start = time.perf_counter()
        try:
            m = config.num_microbatches
            if m not in graphs:
                args = microbatch_args(abstract_args, tuple(batch_argnums), m)
                graphs[m] = trace(step_fn, *args, batch_argnums=tuple(batch_argnums))
            plan = megatron_plan_for_graph(
                graphs[m], cluster, config, donate_argnums=donate_argnums,
                memory_budget=memory_budget,
            )
        except ValueError as err:  # MemoryBudgetError is a ValueError
            results.append((config, f"{type(err).__name__}: {err}"))
            log.info("%s: skipped (%s)", config.name, type(err).__name__)
            continue
        results.append((config, plan.predicted_step_time))
        log.info("%s: predicted %.4g s (planned in %.1f s)", config.name,
                 plan.predicted_step_time, time.perf_counter() - start)
        if best is None or plan.predicted_step_time < best.predicted_step_time:
            best = plan
    if best is None:
        reasons = "\n".join(f"  {c.name}: {outcome}" for c, outcome in results)
        raise ValueError(
            f"no Megatron configuration of this step works on {cluster.num_devices} devices "
            f"of {cluster.name!r}:\n{reasons or '  (no valid configuration)'}\n"
            "Use more devices or memory, or other pp_values / microbatch_sizes."
        )
    return best, results


def megatron_configs(
    num_devices: int,
    devices_per_host: int,
    batch_size: int | None,
    *,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    sequence_parallel: Sequence[bool] = (False,),
    pp_values: Sequence[int] = (1,),
    distributed_optimizer: Sequence[bool] = (False,),
    recompute: Sequence[str] = ("none",),
) -> list[MegatronConfig]:
    """Every valid configuration: dp·tp·pp = `num_devices`, tp <= `devices_per_host`.

    Sequence parallelism is only tried with tp > 1; with pp > 1 the number of microbatches
    is ``batch_size / (dp · size)`` for each microbatch size that divides the batch.
    """
    configs: list[MegatronConfig] = []
    for pp in dict.fromkeys(pp_values):
        if pp < 1 or num_devices % pp:
            continue
        for tp in _divisors(num_devices // pp):
            if tp > devices_per_host:
                continue
            dp = num_devices // (pp * tp)
            for sp in dict.fromkeys(sequence_parallel):
                if sp and tp == 1:
                    continue
                for zero1 in dict.fromkeys(distributed_optimizer):
                    for m in _microbatch_counts(pp, dp, batch_size, microbatch_sizes):
                        configs.extend(MegatronConfig(
                            dp=dp, tp=tp, pp=pp, sequence_parallel=sp,
                            distributed_optimizer=zero1, num_microbatches=m, recompute=rc,
                        ) for rc in dict.fromkeys(recompute))
    return configs


def _microbatch_counts(pp, dp, batch_size, microbatch_sizes) -> list[int]:
    if pp == 1 or batch_size is None:
        return [1]
    counts = [
        batch_size // (dp * size)
        for size in microbatch_sizes
        if size >= 1 and batch_size % (dp * size) == 0
    ]
    return list(dict.fromkeys(counts))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_size(graph: OpGraph) -> int | None:
    sizes = [graph.vars[v].shape[0] for v in graph.invars
             if graph.vars[v].role is Role.BATCH and graph.vars[v].shape]
    return max(sizes) if sizes else None
