"""Alpa's stage DP: slice L layers into pipeline stages and give each stage a submesh.

In: the number of layers, the cluster shape, the submesh shapes, the number of microbatches
B and a callback ``stage_cost(start, end, submesh_index) -> StageCost`` giving the
per-microbatch latency (forward + backward) of layers ``[start, end)`` on a submesh, with
the best logical mesh (the callback picks it). Out: a `StagePlan`. Numbers only, no JAX.

With B microbatches the pipeline latency is ``sum_i t_i + (B - 1) * max_j t_j`` (Alpa,
REFERENCES.md). For a bound t_max on every stage, F(k, d) is the least sum of stage
latencies slicing layers k..L onto exactly d devices with every stage <= t_max; the answer
is the min over the candidate t_max (the distinct feasible stage latencies) of
``F(0, N) + (B - 1) * t_max``.

Search order. Alpa visits the candidates in increasing order and stops once
``B * t_max >= best``. We visit them in decreasing order instead, which gives the same
answer with far fewer DP runs: the DP at t_max returns a plan whose actual largest stage t'
may be below t_max; every candidate in [t', t_max] has the same F, so only t' matters, and
the next candidate worth solving is the largest one below ``min(t', best / B)`` (the second
term is Alpa's pruning rule). We stop when no candidate is left, when the DP finds no plan,
or when ``F + (B - 1) * t_low >= best``, t_low being a lower bound on any plan's largest
stage (F only grows as t_max falls). The DP runs once per point of the (largest stage,
sum of stages) Pareto front that can still win.

Stage count and position. Alpa's F also indexes the number of stages because a stage's
memory depends on its position: under 1F1B stage i of S keeps min(B, S - i) microbatches
of activations (`autopar.cost.in_flight_microbatches`). With `num_positions` P the callback
takes a fourth argument, the stage's position counted from the last stage (1 = the last),
capped at P (its answer may not change beyond P: for 1F1B, P = B), and F(b, k, d) indexes
the stages from layer k to the end, b, exactly up to P - 1, with b = P meaning "P or
more". Without positions the count is only tracked when `num_stages` or `max_stages`
constrain it (then exactly, up to the most stages allowed).

Positions asked. A callback with ``monotone_in_position = True`` promises that a stage's
answer never improves as its position grows (1F1B: more microbatches in flight, so a
leaner or recomputing fit, then none). It is asked at the first and the last position
of each (layer range, submesh) and bisected where they differ; the positions between
two equal answers share them (`_evaluate`). The chosen stages are asked again at their
own positions, which also checks the promise: if an answer differs, every position is
asked and the DP runs again.

Packing. When the host-local submesh sizes are powers of two dividing `devices_per_host`
(always so for Alpa's shapes with a power-of-two `devices_per_host`), every plan that uses
all devices packs onto the cluster (`assign_devices`), and the answer is exact. Otherwise
(e.g. 1x4 submeshes on hosts of 6) a plan that does not pack is skipped and the search goes
on with smaller t_max, and a second, exact search runs on the submeshes that always pack;
the better of the two is returned, which may miss a packable optimum that mixes in the
other sizes (brute_force_stages finds it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.cost import pipeline_latency
from autopar.inter._stage_dp_bounded import _bounded_dp
from autopar.inter._stage_dp_messages import format_bytes, no_plan_error
from autopar.inter._submesh import SubmeshShape, _check_fits, assign_devices, submesh_shapes

log = logging.getLogger("autopar")


@dataclass(frozen=True)
class StageCost:
    """What the cost callback says about layers ``[start, end)`` on one submesh.

    **Arguments:**
    - `latency`: seconds per microbatch, forward plus backward, with the best logical mesh.
    - `feasible`: False if the stage does not fit (memory) or cannot be sharded.
    - `memory`: bytes per device the stage needs; used to explain infeasible plans.
    - `detail`: anything the caller wants back for the chosen stages (e.g. the mesh).
    - `memory_parts`: `memory` by part (`autopar.cost.StageMemory`), when the caller has it.
    """

    latency: float
    feasible: bool
    memory: float = 0.0
    detail: Any = None
    memory_parts: Any = None


@dataclass(frozen=True)
class Pruned:
    """The `StageCost.detail` of a stage the callback cut off by a bound instead of costing
    it (`StageOptions.prune_by_bound`): no plan holding it is as fast as `bound`, the DP
    objective (seconds per step) of a plan known to exist, and it takes at least
    `latency` seconds per microbatch. Infeasible, with infinite memory (never measured)."""

    bound: float
    latency: float = 0.0


@dataclass(frozen=True)
class NoPlanOfCount:
    """`best_per_stage_count`'s answer for a stage count its table holds no plan of:
    why (`reason`) and, where the bound pruned every plan of the count, the least DP
    objective (seconds per step) any of them can have (`lower_bound`; None otherwise)."""

    reason: str
    lower_bound: float | None = None


@dataclass(frozen=True)
class StagePlan:
    """The chosen pipeline stages.

    **Arguments:**
    - `stages`: ``(start, end, submesh_index)`` per stage, in pipeline order, covering
      layers ``[0, num_layers)``; `submesh_index` indexes the submesh list the DP was given.
    - `latency`: ``sum_stage_latency + (B - 1) * max_stage_latency``.
    - `max_stage_latency`, `sum_stage_latency`: over the chosen stages.
    - `num_evaluations`: calls made to the cost callback.
    - `solve_time`: seconds spent in the search, not counting the callback.
    - `stage_costs`: the callback's answer for each chosen stage (carries its `detail`).
    - `device_ids`: each stage's device ids from `assign_devices`.
    - `num_dp_runs`: DP passes, one per candidate t_max actually solved.
    """

    stages: tuple[tuple[int, int, int], ...]
    latency: float
    max_stage_latency: float
    sum_stage_latency: float
    num_evaluations: int
    solve_time: float
    stage_costs: tuple[StageCost, ...] = ()
    device_ids: tuple[tuple[int, ...], ...] = ()
    num_dp_runs: int = 0


StageCostFn = Callable[..., StageCost]  # (start, end, index[, stages_from_here])

# When the submeshes do not always pack (see "Packing" above), give up the search over all
# of them after this many plans that do not pack, each of which costs a DP pass; the exact
# search over the submeshes that always pack still runs.
MAX_UNPACKABLE_PLANS = 32
StageKey = tuple[int, int, int, int]  # (start, end, submesh_index, position)


@dataclass(frozen=True)
class _Problem:
    """Validated inputs shared by the DP and the brute-force reference."""

    num_layers: int
    num_hosts: int
    devices_per_host: int
    num_microbatches: int
    submeshes: tuple[SubmeshShape, ...]
    allowed: tuple[int, ...]
    num_stages: int | None
    max_stages: int | None
    num_positions: int = 1  # positions the callback tells apart (1: it takes 3 arguments)
    positional: bool = False

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def stage_count_range(self) -> tuple[int, int]:
        """Fewest and most stages a plan may have."""
        if self.num_stages is not None:
            return self.num_stages, self.num_stages
        most = min(self.num_layers, self.num_devices)
        return 1, (most if self.max_stages is None else min(most, self.max_stages))

    def position(self, stages_from_here: int) -> int:
        """The position the callback is asked about: capped at `num_positions`."""
        return min(stages_from_here, self.num_positions)

    def keys(self, stages: Sequence[tuple[int, int, int]]) -> list[StageKey]:
        """`(start, end, index, position)` of a plan's stages, in pipeline order."""
        count = len(stages)
        return [(s, e, j, self.position(count - i)) for i, (s, e, j) in enumerate(stages)]


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _prepare(num_layers, num_hosts, devices_per_host, stage_cost, num_microbatches, **options):
    """Check the arguments of `plan_stages` / `brute_force_stages`; returns a `_Problem`."""
    num_layers = _positive_int("num_layers", num_layers)
    num_hosts = _positive_int("num_hosts", num_hosts)
    devices_per_host = _positive_int("devices_per_host", devices_per_host)
    if not callable(stage_cost):
        raise TypeError(
            "stage_cost must be callable as stage_cost(start, end, submesh_index), got "
            f"{type(stage_cost).__name__}"
        )
    submeshes = options["submeshes"]
    submeshes = tuple(
        submesh_shapes(num_hosts, devices_per_host) if submeshes is None else submeshes
    )
    for sub in submeshes:
        if not isinstance(sub, SubmeshShape):
            raise TypeError(f"submeshes must be SubmeshShape, got {type(sub).__name__}")
        _check_fits(sub, num_hosts, devices_per_host)
    allowed = options["allowed_submeshes"]
    allowed = range(len(submeshes)) if allowed is None else allowed
    allowed = tuple(sorted({_submesh_index(i, len(submeshes)) for i in allowed}))
    if not allowed:
        raise ValueError("allowed_submeshes is empty; allow at least one submesh index")
    num_stages, max_stages = _check_stage_counts(
        num_layers, num_hosts * devices_per_host, options["num_stages"], options["max_stages"]
    )
    positions = options.get("num_positions")
    if positions is not None:
        positions = _positive_int("num_positions", positions)
        most = min(num_layers, num_hosts * devices_per_host)
        if max_stages is not None or num_stages is not None:
            most = min(most, num_stages or max_stages)
        positions = min(positions, most)  # no stage has more stages from it than that
    return _Problem(
        num_layers=num_layers,
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        num_microbatches=_positive_int("num_microbatches", num_microbatches),
        submeshes=submeshes,
        allowed=allowed,
        num_stages=num_stages,
        max_stages=max_stages,
        num_positions=positions or 1,
        positional=positions is not None,
    )


def _check_stage_counts(num_layers, num_devices, num_stages, max_stages):
    if num_stages is not None:
        num_stages = _positive_int("num_stages", num_stages)
        if num_stages > num_layers:
            raise ValueError(
                f"cannot slice {num_layers} layers into {num_stages} stages: every stage "
                f"needs at least one layer; ask for num_stages <= {num_layers} or cluster "
                "the model into more layers"
            )
        if num_stages > num_devices:
            raise ValueError(
                f"cannot run {num_stages} stages on {num_devices} devices: every stage "
                f"needs at least one device; ask for num_stages <= {num_devices}"
            )
    if max_stages is not None:
        max_stages = _positive_int("max_stages", max_stages)
        if num_stages is not None and num_stages > max_stages:
            raise ValueError(
                f"num_stages={num_stages} exceeds max_stages={max_stages}; drop one of them"
            )
    return num_stages, max_stages


def _submesh_index(index: Any, num_submeshes: int) -> int:
    if not isinstance(index, (int, np.integer)) or not 0 <= index < num_submeshes:
        raise ValueError(
            f"allowed_submeshes holds {index!r}, which is not an index into the "
            f"{num_submeshes} submeshes; pass indices 0..{num_submeshes - 1}"
        )
    return int(index)


def _call_cost(problem: _Problem, stage_cost: StageCostFn, key: StageKey) -> StageCost:
    key = key if problem.positional else key[:3]
    cost = stage_cost(*key)
    if not isinstance(cost, StageCost):
        raise TypeError(f"stage_cost{key} returned {type(cost).__name__}, expected StageCost")
    if cost.feasible and not (math.isfinite(cost.latency) and cost.latency >= 0):
        raise ValueError(
            f"stage_cost{key} says the stage is feasible but its latency is {cost.latency!r}; "
            "a feasible stage needs a finite latency >= 0 (return feasible=False instead)"
        )
    return cost


class _Costs:
    """The callback's answers, as runs of positions sharing one answer per (start, end,
    submesh index): ``runs[(start, end, index)] = [(first, last, StageCost), ...]``.

    A callback monotone in the position (`monotone_in_position`) is asked at a few
    positions only (`_evaluate`); the positions between two equal answers take the
    lower one's `StageCost`, whose latency is theirs but whose memory parts are not (the
    chosen stages are asked again, `plan_stages`)."""

    def __init__(self, bisected: bool):
        self.runs: dict[tuple[int, int, int], list[tuple[int, int, StageCost]]] = {}
        self.num_positions = 0  # keys covered
        self.num_calls = 0  # callback calls made
        self.bisected = bisected  # whether some positions are inferred, not asked
        # allowed submeshes -> `_search`'s tables of these answers (`_grouped`): the same
        # for every stage count `best_per_stage_count` searches
        self.grouped: dict[tuple[int, ...], tuple] = {}

    def add(self, start: int, end: int, index: int, first: int, last: int,
            cost: StageCost) -> None:
        self.grouped.clear()
        self.runs.setdefault((start, end, index), []).append((first, last, cost))
        self.num_positions += last - first + 1

    def __getitem__(self, key: StageKey) -> StageCost:
        start, end, index, position = key
        for first, last, cost in self.runs.get((start, end, index), ()):
            if first <= position <= last:
                return cost
        raise KeyError(key)

    def __len__(self) -> int:
        return self.num_positions

    def items(self):
        for (start, end, index), runs in self.runs.items():
            for first, last, cost in runs:
                for position in range(first, last + 1):
                    yield (start, end, index, position), cost

    def values(self):
        return (cost for _, cost in self.items())


def _last_position(problem: _Problem, fewest: int, start: int, end: int,
                   num_devices: int) -> int:
    """The farthest position from the last stage at which layers [start, end) on
    `num_devices` devices can sit in a plan (0: none). The other stages need a layer and
    a device each: at least `fewest` stages in all, and `position - 1` after this one."""
    room = min(problem.num_layers - (end - start), problem.num_devices - num_devices)
    if fewest - 1 > room:
        return 0
    return min(problem.num_positions, problem.num_layers - end + 1, room + 1)


def _same_answer(a: StageCost, b: StageCost) -> bool:
    return (not a.feasible and not b.feasible) or (
        a.feasible and b.feasible and a.latency == b.latency
    )


def _evaluate(problem: _Problem, stage_cost: StageCostFn, bisect: bool = True) -> _Costs:
    """Ask the callback about every (layer range, submesh, position) a plan could use.

    A callback whose latency never falls as the position grows (`monotone_in_position`:
    under 1F1B a stage further from the last keeps more microbatches in flight, so it is
    no faster, and once it does not fit it never does) is asked at the first and the
    last position and, where their answers differ, bisected: the positions between two
    equal answers share them. A few calls per (range, submesh) instead of one per
    position."""
    fewest, _ = problem.stage_count_range()
    monotone = bisect and problem.positional and getattr(
        stage_cost, "monotone_in_position", False
    )
    costs = _Costs(monotone)

    def ask(start: int, end: int, index: int, position: int) -> StageCost:
        costs.num_calls += 1
        return _call_cost(problem, stage_cost, (start, end, index, position))

    def split(start, end, index, lo, at_lo, hi, at_hi) -> None:
        """Runs covering positions [lo, hi), knowing the answers at lo and hi."""
        if _same_answer(at_lo, at_hi):
            costs.add(start, end, index, lo, hi - 1, at_lo)
        elif hi - lo == 1:
            costs.add(start, end, index, lo, lo, at_lo)
        else:
            mid = (lo + hi) // 2
            at_mid = ask(start, end, index, mid)
            split(start, end, index, lo, at_lo, mid, at_mid)
            split(start, end, index, mid, at_mid, hi, at_hi)

    for index in problem.allowed:
        num_devices = problem.submeshes[index].num_devices
        for start in range(problem.num_layers):
            for end in range(start + 1, problem.num_layers + 1):
                last = _last_position(problem, fewest, start, end, num_devices)
                if last < 1:
                    continue
                if not monotone:
                    for position in range(1, last + 1):
                        costs.add(start, end, index, position, position,
                                  ask(start, end, index, position))
                    continue
                at_first = ask(start, end, index, 1)
                if last > 1:
                    at_last = ask(start, end, index, last)
                    split(start, end, index, 1, at_first, last, at_last)
                    costs.add(start, end, index, last, last, at_last)
                else:
                    costs.add(start, end, index, 1, 1, at_first)
    return costs


def _group_latency(problem: _Problem, costs: _Costs):
    """Best latency per (start, end, device count, position); inf where no feasible stage.

    **Returns:**
    ``(latency[start, end, group, position - 1], submesh[...], device_counts[group])``:
    submeshes with the same number of devices form one group, which keeps the cheapest.
    Only groups with a feasible stage are kept, and only the positions up to the last at
    which some stage's answer changes (those after it repeat it): a dense array of every
    group and position is ``layers^2 x groups x B`` -- 1.3 GB for GPT-3 175B on 1,024 GPUs
    (98 layers, 131 device counts, 64 microbatches).
    """
    num_layers = problem.num_layers
    allowed = set(problem.allowed)
    runs_of = {}  # (start, end, index) -> its feasible runs, where it has some
    # A stage's answer changes only where a feasible run starts, or after one that ends
    # before the last position: the positions from the latest such change on are alike.
    num_positions = 1
    for key, runs in costs.runs.items():
        feasible = [run for run in runs if run[2].feasible]
        if key[2] not in allowed or not feasible:
            continue
        runs_of[key] = feasible
        for first, last, _ in feasible:
            num_positions = max(num_positions, first)
            if last < problem.num_positions:
                num_positions = max(num_positions, last + 1)
    device_counts = sorted({problem.submeshes[index].num_devices for _, _, index in runs_of})
    group_of = {count: g for g, count in enumerate(device_counts)}
    shape = (num_layers, num_layers + 1, len(device_counts), num_positions)
    latency = np.full(shape, np.inf)
    submesh = np.full(latency.shape, -1, dtype=np.int32)
    for (start, end, index), runs in runs_of.items():
        g = group_of[problem.submeshes[index].num_devices]
        for first, last, cost in runs:
            last = min(last, num_positions)
            if first == last:  # one position: scalars (most keys, without positions)
                at = (start, end, g, first - 1)
                if cost.latency < latency[at]:
                    latency[at], submesh[at] = cost.latency, index
                continue
            at = (start, end, g, slice(first - 1, last))
            better = cost.latency < latency[at]
            latency[at] = np.where(better, cost.latency, latency[at])
            submesh[at] = np.where(better, index, submesh[at])
    return latency, submesh, np.asarray(device_counts, dtype=np.int64)


@dataclass(frozen=True)
class _Buckets:
    """What the DP's first index counts: the stages from a layer to the end, exactly in
    0..`top` (`saturating` False), or exactly below `top` and `top` meaning "`top` or more"
    (`saturating` True; `top` 0: not counted at all)."""

    top: int
    saturating: bool

    @staticmethod
    def of(problem: _Problem, num_positions: int) -> _Buckets:
        if problem.num_stages is not None or problem.max_stages is not None:
            fewest, most = problem.stage_count_range()
            return _Buckets(most, False, fewest)
        return _Buckets(num_positions if num_positions > 1 else 0, True)

    fewest: int = 1

    @property
    def final_range(self) -> range:
        """The buckets a whole plan may end in."""
        if not self.saturating:
            return range(self.fewest, self.top + 1)
        return range(min(1, self.top), self.top + 1)


def _largest_stage_lower_bound(latency) -> float:
    """max over layers of the cheapest feasible stage containing it: every plan's largest
    stage is at least this."""
    cheapest = latency.min(axis=(2, 3))
    num_layers = latency.shape[0]
    return max(float(cheapest[: i + 1, i + 1 :].min()) for i in range(num_layers))


def _is_packable(problem: _Problem, stages: Sequence[StageKey]) -> bool:
    try:
        assign_devices(
            [problem.submeshes[key[2]] for key in stages],
            problem.num_hosts,
            problem.devices_per_host,
        )
    except ValueError:
        return False
    return True


def _chain_submeshes(problem: _Problem) -> tuple[int, ...]:
    """The allowed submeshes that always pack: whole hosts, and host-local ones whose sizes
    are powers of two dividing `devices_per_host` (each divides the next, so filling hosts
    largest first leaves no gap)."""
    devices_per_host = problem.devices_per_host
    return tuple(
        i
        for i in problem.allowed
        if problem.submeshes[i].devices_per_host == devices_per_host
        or (
            devices_per_host % problem.submeshes[i].num_devices == 0
            and problem.submeshes[i].num_devices.bit_count() == 1
        )
    )


def _best_packable(problem: _Problem, costs: _Costs):
    """`_search`, made exact for submesh sets that always pack; for other sets also the
    search restricted to the subset that does (see "Packing" in the module docstring).

    **Returns:**
    ``(stages, num_dp_runs)`` as `_search`.
    """
    stages, num_runs = _search(problem, costs)
    chain = _chain_submeshes(problem)
    if chain == problem.allowed or not chain:
        return stages, num_runs
    restricted, more_runs = _search(dataclasses.replace(problem, allowed=chain), costs)
    if stages is None or (
        restricted is not None
        and _plan_latency(problem, restricted, costs) < _plan_latency(problem, stages, costs)
    ):
        stages = restricted
    return stages, num_runs + more_runs


def _plan_latency(problem: _Problem, stages: Sequence[StageKey], costs) -> float:
    return pipeline_latency([costs[key].latency for key in stages], problem.num_microbatches)


def _distinct_positions(latency, submesh) -> int:
    """The fewest positions P' such that every position from P' on has the same stage
    options as P' (latency and submesh): the DP then counts stages only up to P', which
    costs it a factor P' (often 1: when every stage fits wherever it sits)."""
    num_positions = latency.shape[3]
    while num_positions > 1 and np.array_equal(
        latency[..., num_positions - 2], latency[..., num_positions - 1]
    ) and np.array_equal(submesh[..., num_positions - 2], submesh[..., num_positions - 1]):
        num_positions -= 1
    return num_positions


def _grouped(problem: _Problem, costs: _Costs) -> tuple:
    """`_search`'s tables, computed once per allowed submeshes of `costs`: `latency`
    and `submesh` (`_group_latency`, up to `_distinct_positions`), `device_counts`, the
    candidate t_max (the distinct finite latencies), the live groups and the lower bound
    on any plan's largest stage. Neither depends on the stage counts asked."""
    if problem.allowed not in costs.grouped:
        latency, submesh, device_counts = _group_latency(problem, costs)
        num_positions = _distinct_positions(latency, submesh)
        latency, submesh = latency[..., :num_positions], submesh[..., :num_positions]
        candidates = np.unique(latency[np.isfinite(latency)])
        live = [g for g in range(len(device_counts)) if np.isfinite(latency[:, :, g]).any()]
        t_low = _largest_stage_lower_bound(latency) if candidates.size else math.inf
        costs.grouped[problem.allowed] = (latency, submesh, device_counts, candidates, live,
                                          t_low)
    return costs.grouped[problem.allowed]


def _search(problem: _Problem, costs: _Costs):
    """Visit candidate t_max from the largest down (see the module docstring).

    **Returns:**
    ``(stages, num_dp_runs)``: the best plan as ``(start, end, submesh_index, position)``
    (None if there is none) and the number of DP passes.
    """
    latency, submesh, device_counts, candidates, live, t_low = _grouped(problem, costs)
    num_positions = latency.shape[3]
    buckets = _Buckets.of(problem, num_positions)
    extra = problem.num_microbatches - 1
    best, best_latency, num_runs, num_unpackable = None, math.inf, 0, 0
    index = candidates.size - 1
    while index >= 0:
        t_max = candidates[index]
        groups = _bounded_dp(latency, device_counts, problem.num_devices, t_max, buckets,
                             live)
        num_runs += 1
        if groups is None:
            break
        stages = problem.keys(groups)  # (start, end, group, position)
        at = [(s, e, g, min(p, num_positions) - 1) for s, e, g, p in stages]
        stage_latencies = [float(latency[key]) for key in at]
        stages = [(s, e, int(submesh[key]), p) for key, (s, e, _, p) in zip(at, stages)]
        total, largest = sum(stage_latencies), max(stage_latencies)
        if _is_packable(problem, stages):
            if total + extra * largest < best_latency:
                best, best_latency = stages, total + extra * largest
            limit = min(largest, best_latency / problem.num_microbatches)
        elif num_unpackable < MAX_UNPACKABLE_PLANS:
            num_unpackable, limit = num_unpackable + 1, t_max
        else:
            break
        if total + (extra * t_low if extra else 0.0) >= best_latency:
            break
        index = int(np.searchsorted(candidates, limit, side="left")) - 1
    return best, num_runs


def _make_plan(problem, stages, costs, num_evaluations, solve_time, num_runs) -> StagePlan:
    stage_costs = tuple(costs[key] for key in stages)
    latencies = [c.latency for c in stage_costs]
    total, largest = float(sum(latencies)), float(max(latencies))
    device_ids = assign_devices(
        [problem.submeshes[key[2]] for key in stages], problem.num_hosts,
        problem.devices_per_host,
    )
    return StagePlan(
        stages=tuple(key[:3] for key in stages),
        latency=pipeline_latency(latencies, problem.num_microbatches),
        max_stage_latency=largest,
        sum_stage_latency=total,
        num_evaluations=num_evaluations,
        solve_time=solve_time,
        stage_costs=stage_costs,
        device_ids=tuple(device_ids),
        num_dp_runs=num_runs,
    )


def plan_stages(
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
    memory_budget: float | None = None,
    num_positions: int | None = None,
    stage_counts: dict | None = None,
) -> StagePlan:
    """Slice layers into pipeline stages on submeshes, minimising the pipeline latency.

    **Arguments:**
    - `num_layers`: L; stages are ranges ``[start, end)`` of ``range(L)``.
    - `num_hosts`, `devices_per_host`: the cluster; the plan uses every device.
    - `stage_cost`: ``stage_cost(start, end, submesh_index) -> StageCost``; called at most
      once per argument triple (add your own cache for identical layers).
    - `num_microbatches`: B.
    - `submeshes`: the shapes `submesh_index` refers to; default `submesh_shapes(...)`.
    - `num_stages`: fix the number of stages; `max_stages`: bound it.
    - `allowed_submeshes`: indices into `submeshes` a stage may use; default all.
    - `memory_budget`: bytes per device, only to explain infeasibility in errors.
    - `num_positions`: P; when given, `stage_cost` takes a fourth argument, the stage's
      position from the last stage (1 = the last; S - i for stage i of S), capped at P:
      ``stage_cost(start, end, submesh_index, min(S - i, P))``. Give it when a stage's
      cost depends on where it sits (its memory under 1F1B: P = B, see the module
      docstring); called at most once per argument quadruple, and once more for each
      chosen stage when it is `monotone_in_position` (module docstring).
    - `stage_counts`: when given, filled with ``{count: StagePlan}``, the best plan of
      each stage count the table holds (`best_per_stage_count`), and ``{count:
      NoPlanOfCount}`` for each count it holds none of (pruned by a bound, or none fits).

    **Returns:**
    The `StagePlan` minimising ``sum_i t_i + (B - 1) * max_j t_j``.

    Raises `ValueError` when the request cannot be met or no feasible plan exists.
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
    bisect = True
    while True:
        costs = _evaluate(problem, stage_cost, bisect)
        started = time.perf_counter()
        stages, num_runs = _best_packable(problem, costs)
        if stages is None:
            raise no_plan_error(problem, costs, memory_budget)
        solve_time = time.perf_counter() - started
        # A position between two asked ones shares their latency but not their memory
        # parts: the chosen stages are asked at their own positions.
        if stage_counts is not None:  # the explored space's rows (`autopar.space`)
            missing: dict = {}
            stage_counts.update(best_per_stage_count(problem, costs, stage_cost, missing))
            stage_counts.update(missing)
        if not costs.bisected:
            return _make_plan(problem, stages, costs, costs.num_calls, solve_time, num_runs)
        exact = {key: _call_cost(problem, stage_cost, key) for key in stages}
        if all(_same_answer(exact[key], costs[key]) for key in stages):
            return _make_plan(problem, stages, exact, costs.num_calls, solve_time, num_runs)
        log.warning(
            "stage DP: the stage costs are not monotone in the position as they claim "
            "(stages %s); asking every position instead", stages,
        )
        bisect = False


def best_per_stage_count(problem: _Problem, costs: _Costs, stage_cost: StageCostFn,
                         missing: dict | None = None) -> dict[int, StagePlan]:
    """``{count: StagePlan}``: for each stage count the problem allows, the best plan the
    DP finds on the cost table `costs` already holds (`_best_packable` with the count
    fixed). No stage is costed anew, except that a chosen stage whose position the table
    inferred (`_Costs`) is asked at its own position, as `plan_stages` asks its answer's
    (a count whose answer changes there is left out). A stage the callback pruned by a
    known plan's bound (`StageOptions.prune_by_bound`) is infeasible in the table, so a
    count's plan is the best the table holds, which a search of that count alone may beat.
    `missing`, when given, is filled with a `NoPlanOfCount` for each count left out: the
    bound pruned it (with the least objective its plans can have), or none fits.
    """
    found = {}
    fewest, most = problem.stage_count_range()
    begun = time.perf_counter()
    relaxed = None
    for count in range(fewest, most + 1):
        started = time.perf_counter()
        fixed = dataclasses.replace(problem, num_stages=count)
        stages, num_runs = _best_packable(fixed, costs)
        if stages is None:
            if missing is not None:
                if relaxed is None:
                    relaxed = _with_pruned_as_floors(costs)
                missing[count] = _why_no_plan(fixed, costs, relaxed, count)
            continue
        answers = costs
        if costs.bisected:
            answers = {key: _call_cost(problem, stage_cost, key) for key in stages}
            if not all(_same_answer(answers[key], costs[key]) for key in stages):
                if missing is not None:
                    missing[count] = NoPlanOfCount(
                        f"left out: the best plan of {count} stage(s) in the table changes "
                        "when its stages are asked at their own positions")
                continue
        found[count] = _make_plan(problem, stages, answers, costs.num_calls,
                                  time.perf_counter() - started, num_runs)
    log.info("stage DP: the best plan of %d of stage counts %d..%d, %.2f s", len(found),
             fewest, most, time.perf_counter() - begun)
    return found


def _with_pruned_as_floors(costs: _Costs) -> _Costs:
    """`costs` with every stage the callback pruned (`Pruned`) feasible at the latency it
    takes at least: a plan the DP finds on it is a lower bound on its stage count."""
    relaxed = _Costs(costs.bisected)
    for (start, end, index), runs in costs.runs.items():
        for first, last, cost in runs:
            if isinstance(cost.detail, Pruned):
                cost = StageCost(max(cost.detail.latency, 0.0), True, 0.0, cost.detail)
            relaxed.add(start, end, index, first, last, cost)
    return relaxed


def _why_no_plan(problem: _Problem, costs: _Costs, relaxed: _Costs, count: int
                 ) -> NoPlanOfCount:
    """Why the table holds no plan of `count` stages (`problem` has it fixed): the bound
    pruned a stage of each (then the least objective they can have: the bound, or the
    plan of the pruned stages at their least latency where that is more), or none fits."""
    stages, _ = _best_packable(problem, relaxed)
    pruned = [] if stages is None else [relaxed[key].detail for key in stages
                                        if isinstance(relaxed[key].detail, Pruned)]
    if pruned:
        bound = max(p.bound for p in pruned)
        floor = max(bound, _plan_latency(problem, stages, relaxed))
        return NoPlanOfCount(
            f"pruned by bound: every plan of {count} stage(s) holds a stage that cannot be "
            f"part of a plan as fast as one already found ({bound:.6g} s per step by the "
            f"stage DP); costing every stage (prune_by_bound=False) prices them",
            floor)
    short = [c.memory for c in costs.values() if not c.feasible and 0 < c.memory < math.inf]
    least = f" (the leanest stage that does not fit needs {format_bytes(min(short))})" \
        if short else ""
    return NoPlanOfCount(f"no plan of {count} stage(s): every way to slice the layers into "
                         f"{count} stages on the cluster holds a stage that does not fit "
                         f"the memory budget or cannot be sharded{least}")
