"""`explore`: the whole priced plan space of a step on a cluster, and its frontier.

In: a train step, abstract arguments, a cluster, autopar's planning options and the
Megatron grid's. Out: a `Space`: one row per plan priced (`autopar.space._rows`): every
configuration of the Megatron grid (`megatron_grid_search`, feasible or not, with the
reason), every candidate autopar's pipeline search kept (one per microbatch count and
schedule, told by a recorder the search calls, `autopar.search.search(recorder=...)`),
and autopar's plan under a few other memory budgets around its own peak; the chosen plan
with the memory/time frontier of those rows attached (`Plan.frontier()`); a header saying
what made it. `Space.write` writes JSON Lines, `autopar.space.load` reads them back.

Nothing is priced here: every figure is the plan's, from the shared cost model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar._memo import search_scope
from autopar._version import __version__
from autopar.manual import megatron_grid_search
from autopar.plan import FrontierPoint, Plan
from autopar.report import pareto_frontier, plot_space
from autopar.search import PlanOptions, resolve_cluster
from autopar.search._api import search
from autopar.search._options import options_from
from autopar.space._rows import COLUMNS, auto_label, plan_row, point_of, unpriced_row

log = logging.getLogger("autopar")

SCHEMA_VERSION = 3  # 2: the `kind` column; the stage DP's best per stage count
# 3: a stage count without a plan is a row (why; `lower_bound` where the bound pruned it)
READABLE_VERSIONS = (2, 3)  # `load` reads a version-2 file with `lower_bound` null
# Other memory budgets autopar is searched under, as fractions of its plan's peak memory
# per device: what a smaller budget costs, what a larger one buys. A budget between the
# plan's peak and the budget it was searched under is skipped: the plan already fits it.
DEFAULT_BUDGET_FRACTIONS = (0.5, 0.75, 1.5)
# By default those searches run only for a memory-bound plan: one that recomputes, or
# whose peak is at least this share of its budget. Elsewhere a larger budget buys nothing
# the search did not already weigh, and the grid's leaner plans show what less costs.
MEMORY_BOUND_SHARE = 0.85


class _Recorder:
    """What `autopar.search.search` tells about its candidates, kept as rows."""

    def __init__(self, budget: float):
        self.budget = budget
        self.rows: list[dict] = []
        self.chosen_row: dict | None = None

    def candidates(self, plans: Sequence[Plan], chosen: int | None,
                   errors: dict[int, str]) -> None:
        for i, plan in enumerate(plans):
            row = plan_row(plan, "auto", auto_label(plan), budget=self.budget,
                           chosen=i == chosen)
            self.rows.append(row)
            if i == chosen:
                self.chosen_row = row
        for count, reason in sorted(errors.items()):
            self.rows.append(unpriced_row("auto", f"auto: {count} mb", reason,
                                          budget=self.budget, num_microbatches=count))

    def stage_counts(self, plans: Sequence[Plan]) -> None:
        """The stage DP's best plan for each stage count at each microbatch count (kind
        "stage_count"); one the search kept is already a row and is dropped later
        (`_deduplicated`)."""
        for plan in plans:
            self.rows.append(plan_row(plan, "auto", auto_label(plan), budget=self.budget,
                                      kind="stage_count"))

    def stage_count_gaps(self, gaps) -> None:
        """A row (kind "stage_count", not feasible) for each stage count at a microbatch
        count that the stage DP's table holds no plan of: ``(microbatches, stages,
        NoPlanOfCount)``, why and, where the bound pruned it, its `lower_bound`."""
        for num_micro, count, why in gaps:
            row = unpriced_row("auto", f"auto: {count} stage(s), {num_micro} mb", why.reason,
                               budget=self.budget, num_microbatches=num_micro,
                               kind="stage_count")
            row.update(num_stages=count, lower_bound=why.lower_bound)
            self.rows.append(row)


@dataclass
class Space:
    """An explored plan space: `header` (what made it) and `rows` (one per plan priced or
    configuration left out). `plan`: autopar's plan with its frontier attached (None for a
    space loaded from a file)."""

    header: dict
    rows: list[dict]
    plan: Plan | None = field(default=None, repr=False)

    def feasible(self, source: str | None = None) -> list[dict]:
        """The rows priced as plans that fit (of one `source`, "auto" or "megatron")."""
        return [r for r in self.rows if r["feasible"]
                and (source is None or r["source"] == source)]

    def points(self) -> list[FrontierPoint]:
        return [point_of(r) for r in self.feasible()]

    def frontier(self) -> list[FrontierPoint]:
        """The memory/time Pareto frontier of every feasible row, by memory."""
        return pareto_frontier(self.points())

    def best_under(self, memory: float, source: str | None = None) -> dict | None:
        """The fastest feasible row whose peak memory per device is at most `memory`."""
        rows = [r for r in self.feasible(source) if r["memory_peak"] <= memory]
        return min(rows, key=lambda r: r["step_time"], default=None)

    def write(self, path: str | Path) -> Path:
        """JSON Lines: the header, then one row per line. **Returns:** the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps(self.header, sort_keys=True) + "\n")
            for row in self.rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        return path

    def picture(self, path: str | Path) -> Path:
        """Time against memory for every feasible row, the frontier and autopar's plan
        (`autopar.report.plot_space`; a ``.svg`` is written without matplotlib)."""
        return plot_space(self.points(), path, budget=self.header.get("memory_budget"),
                          title=f"{self.header.get('model') or 'step'} on "
                                f"{self.header['cluster']['name']} "
                                f"({self.header['cluster']['num_devices']} devices)")

    def summary(self) -> str:
        """A few lines: counts per source and outcome, the fastest of each, the frontier."""
        lines = []
        for source in ("megatron", "auto"):
            rows = [r for r in self.rows if r["source"] == source]
            ok = [r for r in rows if r["feasible"]]
            if not rows:
                continue
            best = min(ok, key=lambda r: r["step_time"], default=None)
            lines.append(f"{source}: {len(rows)} row(s), {len(ok)} feasible" + (
                f"; fastest {best['label']} {best['step_time'] * 1e3:.4g} ms at "
                f"{best['memory_peak'] / 2**30:.2f} GiB" if best else ""))
        lines.append(f"frontier: {len(self.frontier())} point(s)")
        return "\n".join(lines)


def profile_hash(cluster_json: dict) -> str:
    """sha256 of the cluster's JSON (sorted keys): which cost figures priced the rows."""
    text = json.dumps(cluster_json, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def explore(
    step_fn: Callable,
    *abstract_args: Any,
    cluster: Any = None,
    options: PlanOptions | dict | None = None,
    grid: dict | None = None,
    budget_fractions: Sequence[float] | None = None,
    megatron: bool = True,
    model: str | None = None,
    command: str | None = None,
) -> Space:
    """Price the whole plan space of `step_fn(*abstract_args)` on `cluster`.

    **Arguments:**
    - `step_fn`, `abstract_args`, `cluster`: as for `autopar.plan`.
    - `options`: autopar's `PlanOptions` (or a dict of them); its `memory_budget` (None:
      the device memory) is the budget the chosen plan and the grid are held to.
    - `grid`: keyword arguments for `megatron_grid_search` (``num_heads``,
      ``microbatch_sizes``, ``pp_values``, ...); `megatron=False` leaves the grid out.
    - `budget_fractions`: other budgets autopar is searched under, as fractions of its
      plan's peak memory (``()``: none; None: `DEFAULT_BUDGET_FRACTIONS` when the plan is
      memory-bound, `memory_bound`, else none); a fraction whose budget lies between that
      peak and the budget is skipped (the plan fits it).
    - `model`, `command`: named in the header (`command` default: this process's argv).

    **Returns:** the `Space`; ``space.plan.explain()`` shows the frontier around the plan.

    **Example:**

    ```python
    space = autopar.space.explore(step, state, batch, cluster="dgx-a100-80g",
                                  grid={"num_heads": 16})
    space.write("space.jsonl"); space.picture("space.png")
    print(space.plan.explain())
    ```
    """
    if isinstance(options, PlanOptions):
        options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    resolved = options_from("explore", dict(options or {}))
    for f in budget_fractions or ():
        if not isinstance(f, (int, float)) or f <= 0:
            raise ValueError(f"budget_fractions must be positive numbers, got {f!r}")
    cluster = resolve_cluster(cluster)
    budget = resolved.memory_budget_for(cluster)
    with search_scope():  # one scope: the grid's memos (per graph, per mesh) serve the search
        return _explore(step_fn, abstract_args, cluster, resolved, budget, grid or {},
                        budget_fractions, megatron, model, command)


def _explore(step_fn, abstract_args, cluster, resolved: PlanOptions, budget: float,
             grid: dict, budget_fractions, megatron: bool, model, command) -> Space:
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    rows: list[dict] = []
    traces: dict = {}  # the step traced by the grid, by microbatch count: the search's too
    if megatron:
        rows += _grid_rows(step_fn, abstract_args, cluster, resolved, budget, grid, traces)
        seconds["megatron grid"] = time.perf_counter() - start
    t = time.perf_counter()
    recorder = _Recorder(budget)
    chosen, _ = search(step_fn, abstract_args, cluster, resolved, cache=False,
                       recorder=recorder, traces=traces)
    if recorder.chosen_row is None:  # one mesh, or a scanned stack regrouped: the plan
        recorder.rows.append(plan_row(chosen, "auto", auto_label(chosen), budget=budget,
                                      chosen=True))
    rows += recorder.rows
    seconds["autopar"] = time.perf_counter() - t
    t = time.perf_counter()
    if budget_fractions is None:
        budget_fractions = DEFAULT_BUDGET_FRACTIONS if memory_bound(chosen, budget) else ()
    rows += _other_budgets(step_fn, abstract_args, cluster, resolved, budget, chosen,
                           budget_fractions, traces)
    seconds["autopar, other budgets"] = time.perf_counter() - t
    rows = _deduplicated(rows)
    header = _header(cluster, budget, model, command, seconds)
    space = Space(header, rows)
    frontier = _around(space.frontier(), chosen, recorder)
    space.plan = dataclasses.replace(chosen, frontier_points=tuple(frontier))
    header["seconds"]["all"] = time.perf_counter() - start
    return space


def memory_bound(plan: Plan, budget: float) -> bool:
    """Whether memory shaped the plan: it recomputes, or its peak per device is at least
    `MEMORY_BOUND_SHARE` of the budget."""
    peak = max(s.memory_per_device for s in plan.stages)
    recomputes = any(r != "none" for remats in plan.stage_remat for r in remats)
    return recomputes or peak >= MEMORY_BOUND_SHARE * budget


def _grid_rows(step_fn, args, cluster, options: PlanOptions, budget: float,
               grid: dict, traces: dict) -> list[dict]:
    """Every configuration of the grid: priced (its plan's row) or why not."""
    plans: dict = {}
    grid = {"donate_argnums": options.donate_argnums,
            "batch_argnums": options.batch_argnums, **grid}
    try:
        _, results = megatron_grid_search(step_fn, *args, cluster=cluster,
                                          memory_budget=options.memory_budget, plans=plans,
                                          traces=traces, **grid)
    except ValueError as err:  # no configuration works: every one says why in the text
        log.info("megatron grid: %s", str(err).split("\n")[0])
        return [unpriced_row("megatron", "megatron grid", str(err), budget=budget)]
    rows = []
    for config, outcome in results:
        plan = plans.get(config)
        if isinstance(outcome, float) and plan is not None:
            rows.append(plan_row(plan, "megatron", config.name, budget=budget,
                                 config=config))
        else:
            rows.append(unpriced_row("megatron", config.name, str(outcome), budget=budget,
                                     config=config))
    return rows


def _other_budgets(step_fn, args, cluster, options: PlanOptions, budget: float,
                   chosen: Plan, fractions, traces: dict) -> list[dict]:
    """autopar's candidates under budgets around its plan's peak (`budget_fractions`)."""
    peak = max(s.memory_per_device for s in chosen.stages)
    rows = []
    for f in sorted(set(fractions)):
        other = peak * f
        if peak <= other <= budget:
            continue  # the plan fits: the search would find it again
        recorder = _Recorder(other)
        try:
            plan, _ = search(step_fn, args, cluster,
                             dataclasses.replace(options, memory_budget=other), cache=False,
                             recorder=recorder, traces=traces)
        except ValueError as err:
            rows.append(unpriced_row("auto", f"auto under {other / 2**30:.3g} GiB",
                                     str(err).split("\n")[0], budget=other))
            continue
        if recorder.chosen_row is None:
            recorder.rows.append(plan_row(plan, "auto", auto_label(plan), budget=other))
        for row in recorder.rows:
            row["chosen"] = False  # autopar's plan is the one under `budget`
        rows += recorder.rows
    return rows


def _deduplicated(rows: list[dict]) -> list[dict]:
    """autopar's rows once per plan (the same candidate found under several budgets keeps
    its first row, or the chosen one's); the grid's rows as they are."""
    seen: dict[tuple, int] = {}
    out: list[dict] = []
    for row in rows:
        if row["source"] != "auto" or not row["feasible"]:
            out.append(row)
            continue
        key = (row["label"], row["step_time"], row["memory_peak"])
        if key in seen:
            if row["chosen"]:
                out[seen[key]] = row
            continue
        seen[key] = len(out)
        out.append(row)
    return out


def _around(frontier: list[FrontierPoint], chosen: Plan, recorder) -> list[FrontierPoint]:
    """The frontier with autopar's plan marked; the plan added (marked) where another
    point dominates it, so `explain` always shows where it stands."""
    row = recorder.chosen_row
    label = row["label"] if row else auto_label(chosen)
    me = FrontierPoint(max(s.memory_per_device for s in chosen.stages),
                       chosen.predicted_step_time, label, "auto", True)
    points = [p for p in frontier
              if not (p.source == me.source and p.label == me.label
                      and p.step_time == me.step_time and p.memory == me.memory)]
    return sorted([*points, me], key=lambda p: (p.memory, p.step_time))


def _header(cluster, budget: float, model, command, seconds) -> dict:
    cluster_json = cluster.to_json()
    return {
        "record": "header",
        "schema_version": SCHEMA_VERSION,
        "autopar_version": __version__,
        "profile": {"name": cluster.name, "sha256": profile_hash(cluster_json)},
        "cluster": {"name": cluster.name, "num_hosts": cluster.num_hosts,
                    "devices_per_host": cluster.devices_per_host,
                    "num_devices": cluster.num_devices,
                    "device_memory": float(cluster.device_memory)},
        "model": model,
        "memory_budget": budget,
        "command": command if command is not None else " ".join(sys.argv),
        "columns": sorted(COLUMNS),
        "seconds": dict(seconds),
    }
