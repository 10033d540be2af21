"""The plans a user would try instead, costed by the same model as the chosen one.

In: the step, its (abstract) arguments, the cluster and the chosen plan. Out: a list of
`Alternative`s, each a plan a person would write by hand with its predicted step time
and memory per device, or the reason it does not exist (it does not fit, the batch does
not split):

- data parallel: every device holds the whole state and a slice of the batch;
- data parallel with ZeRO-1 (Megatron-LM's distributed optimizer): the same, with the
  optimizer state split over the devices;
- the fastest Megatron-LM configuration (dp x tp, and pp when the chosen plan pipelines)
  of a small grid (no sequence parallelism, recompute or interleaving; one microbatch and
  the chosen plan's count), as `autopar compare` costs the full grid.

All three are Megatron-LM layouts scored by `autopar.manual` (a fixed layout per layer,
cheap to cost: no search), on abstract arguments; nothing runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("autopar")


@dataclass(frozen=True)
class Alternative:
    """A hand-written plan beside the chosen one: `plan` None when it could not be made,
    `reason` saying why."""

    name: str
    plan: Any = None
    reason: str = ""

    @property
    def step_time(self) -> float | None:
        return None if self.plan is None else self.plan.predicted_step_time

    @property
    def memory_per_device(self) -> float | None:
        if self.plan is None:
            return None
        return max(s.memory_per_device for s in self.plan.stages)


def alternatives(step_fn: Callable, args: Sequence[Any], cluster, chosen=None, *,
                 megatron: bool = True, memory_budget: float | None = None,
                 donate_argnums: Sequence[int] = (), batch_argnums: Sequence[int] = (1,),
                 ) -> list[Alternative]:
    """Plan the alternatives of the module docstring for `step_fn(*args)` on `cluster`.

    **Arguments:**
    - `chosen`: the chosen `Plan`; the Megatron grid tries its microbatch count, and
      pipeline stages only when it has several.
    - `megatron`: also cost the small Megatron grid (tensor parallel degrees).
    - `memory_budget`, `donate_argnums`, `batch_argnums`: as the chosen plan was made.

    **Returns:** the alternatives, in the order above.
    """
    from autopar.cluster import Cluster
    from autopar.manual import MegatronConfig, megatron_grid_search, megatron_plan_for_graph

    cluster = cluster if isinstance(cluster, Cluster) else Cluster.from_json(cluster)
    donate = tuple(donate_argnums) or (0,)  # a training loop's memory: state updated in place
    traces: dict = {}
    common = dict(memory_budget=memory_budget, donate_argnums=donate)
    n = cluster.num_devices
    found = []
    try:
        grid_best, grid = megatron_grid_search(
            step_fn, *args, cluster=cluster, traces=traces, batch_argnums=batch_argnums,
            microbatch_counts=sorted({1, chosen.num_microbatches if chosen else 1}),
            pp_values=None if chosen is not None and chosen.num_stages > 1 else (1,),
            sequence_parallel=(False,), distributed_optimizer=(False,),
            recompute=("none",), virtual_stages=(1,), **common,
        ) if megatron else (None, [])
    except (ValueError, NotImplementedError) as err:
        grid_best, grid = None, [("", _first_sentence(err))]
    for name, zero in (("data parallel", False),
                       ("data parallel + ZeRO-1 (optimizer state split)", True)):
        config = MegatronConfig(dp=n, tp=1, distributed_optimizer=zero)
        try:
            graph = traces.get(1)
            if graph is None:
                from autopar.graph import trace

                graph = traces[1] = trace(step_fn, *args, batch_argnums=batch_argnums)
            found.append(Alternative(name, megatron_plan_for_graph(graph, cluster, config,
                                                                   **common)))
        except (ValueError, NotImplementedError) as err:
            found.append(Alternative(name, reason=_first_sentence(err)))
    if grid_best is not None:
        costed = sum(isinstance(outcome, float) for _, outcome in grid)
        config = grid_best.method.removeprefix("megatron(").removesuffix(")")
        found.append(Alternative(f"Megatron-LM {config} (best of {costed})", grid_best))
    elif megatron:
        found.append(Alternative("Megatron-LM dp x tp", reason=grid[0][1] if grid else ""))
    return found


def _first_sentence(err: Exception) -> str:
    text = str(err).split("\n")[0]
    return text.split(". ")[0].rstrip(".")
