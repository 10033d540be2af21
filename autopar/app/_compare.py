"""`autopar.compare`: the best hand (Megatron-style) plan and autopar's, and why they differ.

In: a train step, abstract arguments and a cluster. Out: a `Comparison`: the best plan of
the full Megatron grid (`autopar.manual.megatron_grid_search`), autopar's plan
(`autopar.plan`), both planners' times, the grid's outcomes, and a report (the
side-by-side table of `autopar.report.compare` and the explanation of
`autopar.report.explain_differences`); `write_pictures` draws both Gantt charts and both
layouts. Called with plans instead of a step, `compare` is the table of
`autopar.report.compare`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.app._score import SCORED_METHOD
from autopar.graph import OpGraph, trace
from autopar.manual import GridResult, megatron_grid_search
from autopar.plan import Plan
from autopar.report import compare as compare_table
from autopar.report import explain_differences
from autopar.search import microbatch_args, resolve_cluster
from autopar.search import plan as auto_plan


@dataclass(frozen=True)
class Comparison:
    """The two planners on one step: plans, graphs, grid outcomes and planning times."""

    hand: Plan
    auto: Plan
    grid: list[GridResult]
    hand_graph: OpGraph = field(repr=False)
    auto_graph: OpGraph = field(repr=False)
    total_flops: float
    seconds: dict[str, float]  # planner -> wall-clock seconds
    devices_per_host: int

    def report(self, top: int = 3) -> str:
        """The table, the grid's summary and the explanation, as `autopar compare` prints."""
        costed = [o for _, o in self.grid if isinstance(o, float)]
        pruned = sum(1 for _, o in self.grid if isinstance(o, str) and o.startswith("pruned"))
        lines = [
            compare_table([self.hand, self.auto], flops=self.total_flops),
            "",
            f"Megatron grid: {len(self.grid)} configurations, {len(costed)} costed, "
            f"{pruned} pruned by Megatron's rules, "
            f"{len(self.grid) - len(costed) - pruned} infeasible or not needed; best "
            f"{self.hand.method}",
            explain_differences(
                self.hand, self.auto, first_graph=self.hand_graph,
                second_graph=self.auto_graph, devices_per_host=self.devices_per_host,
                top=top,
            ),
            "planning time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()),
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def write_pictures(self, out_dir: str | Path) -> list[Path]:
        """Both plans' Gantt charts and layouts under `out_dir` (created): megatron_gantt.png,
        autopar_gantt.png, megatron_layout.png, autopar_layout.png. Needs matplotlib."""
        from autopar.report import gantt, plan_schedule, plot_layout

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, p in (("megatron", self.hand), ("autopar", self.auto)):
            written.append(gantt(plan_schedule(p), out / f"{name}_gantt.png",
                                 title=f"{name}: {p.method}"))
            written.append(plot_layout(p, out / f"{name}_layout.png"))
        return written


def compare(*args: Any, **kwargs: Any):
    """Compare plans: `compare(step_fn, *abstract_args, cluster=...)` runs both planners
    and returns a `Comparison` (print it); `compare(plans, measured=None, flops=None)`
    returns the side-by-side table of given plans (`autopar.report.compare`), followed,
    when the first plan is the user's own (`autopar.score`), by the ranked differences of
    each other plan from it (`autopar.report.explain_differences`)."""
    if args and callable(args[0]) and not isinstance(args[0], Plan):
        return compare_planners(*args, **kwargs)
    table = compare_table(*args, **kwargs)
    plans = list(args[0] if args else kwargs.get("plans", ()))
    if plans and plans[0].method == SCORED_METHOD:
        # The user's own sharding (`autopar.score`) first: why each other plan differs.
        return "\n\n".join([table, *(explain_differences(plans[0], p) for p in plans[1:])])
    return table


def compare_planners(
    step_fn: Callable,
    *abstract_args: Any,
    cluster: Any,
    num_heads: int | None = None,
    batch_argnums: Sequence[int] = (1,),
    auto_options: dict | None = None,
    **grid_options: Any,
) -> Comparison:
    """The best Megatron plan of the full grid and autopar's plan of `step_fn`.

    **Arguments:**
    - `step_fn`, `abstract_args`, `cluster`: as for `autopar.plan`.
    - `num_heads`: attention heads, for the grid's rule tp | heads.
    - `batch_argnums`: as for `autopar.plan`.
    - `auto_options`: keyword arguments for `autopar.plan` (e.g. ``num_microbatches``).
    - `grid_options`: keyword arguments for `megatron_grid_search` (``pp_values``,
      ``microbatch_sizes``, ...).

    **Returns:** the `Comparison`.

    **Example:**

    ```python
    result = autopar.compare(step, state, batch, cluster=Cluster.from_profile(
        "dgx-a100-80g", num_hosts=2), num_heads=32)
    print(result)
    result.write_pictures("compare/")
    ```
    """
    cluster = resolve_cluster(cluster)
    batch_argnums = tuple(batch_argnums)
    seconds = {}
    start = time.perf_counter()
    graphs: dict[int, OpGraph] = {}  # the grid's traces, by number of microbatches
    hand, grid = megatron_grid_search(
        step_fn, *abstract_args, cluster=cluster, num_heads=num_heads,
        batch_argnums=batch_argnums, traces=graphs, **grid_options,
    )
    seconds["Megatron grid"] = time.perf_counter() - start
    start = time.perf_counter()
    auto = auto_plan(step_fn, *abstract_args, cluster=cluster, batch_argnums=batch_argnums,
                     **(auto_options or {}))
    seconds["autopar"] = time.perf_counter() - start
    m = auto.num_microbatches
    if m not in graphs:  # autopar's plan runs the step traced at its microbatch size
        args = microbatch_args(abstract_args, batch_argnums, m)
        graphs[m] = trace(step_fn, *args, batch_argnums=batch_argnums)
    return Comparison(
        hand=hand, auto=auto, grid=grid, hand_graph=graphs[hand.num_microbatches],
        auto_graph=graphs[m], total_flops=graphs[1].total_flops,
        seconds=seconds, devices_per_host=cluster.devices_per_host,
    )
