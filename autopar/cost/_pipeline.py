"""Pipeline formulas: step latency, bubble, microbatches in flight, stage memory.

In: per-stage (or per-layer) predicted seconds and bytes, the schedule, the number of
stages and microbatches, and how a stage's time splits into forward, input-gradient and
weight-gradient passes. Every schedule's bubble is simulated from its task order
(`autopar.cost._schedule`, the orders the runtime runs). Out: seconds, fractions, counts
and bytes. The stage DP, `Plan`, the Megatron scorer, `compare`, the reports and the
benchmarks all call these, so every prediction of a pipeline uses the same formula.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from autopar._memo import memo
from autopar.choices import SCHEDULES, Schedule, check_choice
from autopar.cost._collective import link_for, transfer_time
from autopar.cost._schedule import simulate, tasks_per_step
from autopar.cost.backends import backend_for
from autopar.cost.backends._base import cluster_field

# A stage's time per microbatch split into its forward F, input-gradient backward B and
# weight-gradient backward W, when the plan gives no split of its own (`Plan.phase_shares`,
# from `autopar.inter.passes.phase_times`): Qi et al. 2024 ("Zero Bubble Pipeline
# Parallelism", section 3; REFERENCES.md "Pipeline schedules") take T_F = T_B = T_W (a
# backward twice a forward, split evenly), a third each.
DEFAULT_PHASE_SHARES = (1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0)


def bubble_scale(schedule: Schedule = "1f1b", virtual_stages: int = 1, num_groups: int = 2,
                 num_microbatches: int = 1,
                 phase_shares: Sequence[float] = DEFAULT_PHASE_SHARES) -> float:
    """The fill and drain of `schedule` as a share of 1F1B's, on `num_groups` equal device
    groups running `num_microbatches`: both simulated (`autopar.cost._schedule.simulate`,
    the orders the runtime runs, with each stage's F, B and W in `phase_shares`), so every
    schedule's bubble comes from the same code. 1 for GPipe and 1F1B; 1/v for interleaved
    1F1B with v virtual stages whenever the microbatches fill the rounds (Narayanan et al.
    2021, section 2.2); for zero bubble (ZB-H1) what W can fill: (T_F + T_B - T_W) /
    (T_F + T_B + T_W) of it once there are enough microbatches (Qi et al. 2024, section
    3), a third with the paper's equal times, more when W is small. One group has no
    bubble: 1.

    **Example:** ``bubble_scale("zero_bubble", num_groups=4, num_microbatches=8) == 1 / 3``;
    with ``phase_shares=(0.4, 0.4, 0.2)`` it is 0.6.
    """
    check_choice("schedule", schedule, SCHEDULES)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {virtual_stages}")
    if virtual_stages != 1 and schedule != "interleaved_1f1b":
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved_1f1b', "
            f"not {schedule!r}"
        )
    if schedule in ("1f1b", "gpipe") or num_groups < 2:
        return 1.0
    shares = _check_shares(phase_shares)
    ones = _simulated_fill(num_groups, num_microbatches, "1f1b", 1, shares)
    return _simulated_fill(num_groups, num_microbatches, schedule, virtual_stages, shares) / ones


def _check_shares(phase_shares: Sequence[float]) -> tuple[float, float, float]:
    shares = tuple(float(x) for x in phase_shares)
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise ValueError(
            f"phase_shares are a stage's forward, input-gradient and weight-gradient shares "
            f"of its time, three numbers >= 0 (not all 0); got {tuple(phase_shares)}"
        )
    total = sum(shares)
    return shares[0] / total, shares[1] / total, shares[2] / total


@memo("cost.simulated_fill", "(groups, microbatches, schedule, ...)", maxsize=4096)
def _simulated_fill(num_groups: int, num_microbatches: int, schedule: str,
                    virtual_stages: int, shares: tuple[float, float, float]) -> float:
    """Fill and drain, in units of one group's time per microbatch: the simulated step of
    equal groups (each chunk 1/v of its group's work) less the m microbatches of work."""
    forward, input_grad, weight = shares
    v = virtual_stages
    stages = num_groups * v
    _, ends = simulate(
        [forward / v] * stages, [(input_grad + weight) / v] * stages, num_microbatches,
        schedule, v, weight=[weight / v] * stages,
    )
    return max(ends) - num_microbatches


def stage_dispatch_time(cluster, num_stages: int, num_microbatches: int,
                        schedule: Schedule = "1f1b") -> float:
    """Seconds per microbatch a stage pays for launching its programs: its
    `tasks_per_step` times the profile's `dispatch_overhead`, spread over the step's
    microbatches (as `pipeline_latency` takes stage times per microbatch). The stage DP,
    `Plan.predicted_step_time` (so the Megatron scorer and `compare`) and the schedule
    choice all charge it through this function.

    **Example:** 2 stages, 4 microbatches, 1F1B, 1 ms per launch: 9 tasks per step,
    ``9 * 1e-3 / 4`` s per microbatch.
    """
    overhead = _dispatch_overhead(cluster)
    if not overhead:
        return 0.0
    return overhead * tasks_per_step(num_stages, num_microbatches, schedule) / num_microbatches


def _dispatch_overhead(cluster) -> float:
    """A `Cluster`'s `dispatch_overhead`, or the same key of its JSON (what a `Plan` keeps)."""
    return float(cluster_field(cluster, "dispatch_overhead") or 0.0)


def pipeline_latency(stage_times: Sequence[float], num_microbatches: int,
                     schedule: Schedule = "1f1b", virtual_stages: int = 1,
                     phase_shares: Sequence[float] = DEFAULT_PHASE_SHARES) -> float:
    """Seconds per step of a pipeline whose stages take `stage_times` per microbatch.

    Alpa's latency (Zheng et al. 2022, REFERENCES.md "Stage DP"): the first microbatch
    passes every stage, each later one adds the slowest stage,
    ``sum_i t_i + (B - 1) * max_j t_j``, i.e. ``B * max t`` of work on the slowest stage
    plus the fill and drain ``sum_i t_i - max t`` (the stage DP's objective). Other
    schedules scale that fill and drain by `bubble_scale`, their simulated bubble over
    1F1B's with the stages' F/B/W `phase_shares` (for `interleaved_1f1b`, `stage_times`
    are per device group, all v chunks of a group together). One stage accumulating B
    microbatches takes ``B * t``; one stage and one microbatch, ``t``.

    **Example:** ``pipeline_latency([1.0, 2.0], 4) == 9.0``;
    ``pipeline_latency([1.0, 2.0], 4, "interleaved_1f1b", 2) == 8.5``.
    """
    if not stage_times:
        raise ValueError("a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    slowest = max(stage_times)
    scale = bubble_scale(schedule, virtual_stages, len(stage_times), num_microbatches,
                         phase_shares)
    return num_microbatches * slowest + (sum(stage_times) - slowest) * scale


def pipelined_step_time(stage_times: Sequence[float], cluster, num_microbatches: int,
                        schedule: Schedule = "1f1b", num_device_groups: int | None = None,
                        phase_shares: Sequence[float] = DEFAULT_PHASE_SHARES,
                        group_devices: Sequence[int] | None = None,
                        returned_bytes: Sequence[float] | None = None) -> float:
    """Seconds per step of a plan whose stages, in order, take `stage_times` per microbatch
    before launching their programs: each stage also pays `stage_dispatch_time` for
    `schedule` (zero bubble launches 3 tasks per microbatch, the others 2), stage s runs
    on device group s mod `num_device_groups` (default: one group per stage; interleaved
    1F1B has p groups of v stages each), and `pipeline_latency` takes the groups' times.
    `Plan.predicted_step_time` and the planner's schedule choice both call this, so a
    schedule is chosen by the time its plan then predicts.

    The cluster's backend (`autopar.cost.backends.backend_for`) adds what its runtime
    does, given the pipeline's `group_devices` (devices per stage) and `returned_bytes`
    (per stage, the weight gradients' bytes per device its backward returns):

    - each backward task of a pipeline of several stages pays
      `Backend.returned_gradient_seconds` (XLA:CPU with `transpose_bandwidth`: a copy to
      row-major);
    - where the devices share the host's cores, `Backend.shared_cores_step_time` is the
      step (XLA:CPU with `host_cores` fewer than its devices: a processor-sharing
      simulation of GPipe and 1F1B, the host's launches on the same cores); other
      schedules and backends keep the formula above.

    **Example:** two stages of 1 s, 4 microbatches, 1F1B, no dispatch cost: ``5.0``.
    """
    groups = num_device_groups or len(stage_times)
    if not stage_times or len(stage_times) % groups:
        raise ValueError(
            f"{len(stage_times)} stage(s) do not fill {groups} device group(s) evenly; "
            "give a stage time per stage, the stages a multiple of the groups"
        )
    shares = _check_shares(phase_shares)
    forward = [t * shares[0] for t in stage_times]
    backend = backend_for(cluster)
    if returned_bytes is not None and len(stage_times) > 1:
        stage_times = [t + backend.returned_gradient_seconds(cluster, b)
                       for t, b in zip(stage_times, returned_bytes)]
        shares = _with_forward(shares, sum(forward), sum(stage_times))
    shared = backend.shared_cores_step_time(
        cluster, forward, [t - f for t, f in zip(stage_times, forward)], num_microbatches,
        group_devices, schedule, groups)
    if shared is not None:
        return shared
    dispatch = stage_dispatch_time(cluster, len(stage_times), num_microbatches, schedule)
    per_group = [0.0] * groups  # interleaved: a device group runs all its chunks
    for s, t in enumerate(stage_times):
        per_group[s % groups] += t + dispatch
    return pipeline_latency(per_group, num_microbatches, schedule,
                            len(stage_times) // groups, shares)


def _with_forward(shares: tuple[float, float, float], forward: float,
                  total: float) -> tuple[float, float, float]:
    """`shares` once the stages' time has grown to `total` with the forward's seconds
    unchanged (the backward returns the gradients): the rest split as before."""
    if total <= 0:
        return shares
    f = forward / total
    rest = shares[1] + shares[2]
    if rest <= 0:
        return f, 1.0 - f, 0.0
    return f, (1.0 - f) * shares[1] / rest, (1.0 - f) * shares[2] / rest


def bubble_fraction(num_stages: int, num_microbatches: int, schedule: Schedule = "1f1b",
                    virtual_stages: int = 1,
                    phase_shares: Sequence[float] = DEFAULT_PHASE_SHARES) -> float:
    """Idle fraction of a pipeline of equal stages, simulated: f / (m + f), f the fill and
    drain in stage times, ``(p - 1) * bubble_scale``: (p - 1) / (m + p - 1) for GPipe and
    1F1B (Narayanan et al. 2021; REFERENCES.md "Megatron-LM plans"), (p - 1) / (v m + p - 1)
    interleaved; zero bubble by how much of the fill its W passes take (`phase_shares`).
    `num_stages` p counts device groups (for interleaved 1F1B, stages / v). One stage has
    no bubble.

    **Example:** ``bubble_fraction(4, 8) == 3 / 11``;
    ``bubble_fraction(4, 8, "interleaved_1f1b", 2) == 3 / 19``.
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a pipeline needs at least one stage and one microbatch, got "
            f"{num_stages} stage(s) and {num_microbatches} microbatch(es)"
        )
    bubble = (num_stages - 1) * bubble_scale(schedule, virtual_stages, num_stages,
                                             num_microbatches, phase_shares)
    return bubble / (num_microbatches + bubble)


def in_flight_microbatches(schedule: Schedule, num_microbatches: int, stages_from_here: int,
                           virtual_stages: int = 1, num_groups: int | None = None) -> float:
    """Microbatches whose activations a stage holds at once, in whole-stage units.

    GPipe: all of them. 1F1B: one per stage from this one to the last, min(m, p - i) on
    stage i of p (Narayanan et al. 2021; REFERENCES.md "Pipeline schedules").
    Zero bubble (ZB-H1): as 1F1B (Qi et al. 2024 bound its peak by 1F1B's first stage;
    the runtime's stage i also keeps what i pending weight-gradient passes read, which
    this leaves out).
    Interleaved 1F1B on device group i of p (`num_groups`; `stages_from_here` = p - i)
    with v chunks: Megatron's warm-up keeps 2 (p - i - 1) + (v - 1) p + 1
    chunk-microbatches, each 1/v of the group's layers, so that count / v in stage units,
    at most m (Narayanan et al. 2021, section 2.2).
    """
    check_choice("schedule", schedule, SCHEDULES)
    m = num_microbatches
    if schedule == "gpipe":
        return m
    if schedule != "interleaved_1f1b" or virtual_stages == 1:
        return min(m, stages_from_here)
    p, v = (num_groups or stages_from_here), virtual_stages
    chunks = 2 * (stages_from_here - 1) + (v - 1) * p + 1
    return min(m * v, chunks) / v


def crossing_bytes(reads: Iterable[tuple[int, int, int]], nbytes: Mapping[int, float],
                   num_layers: int) -> list[float]:
    """Per layer k (0..`num_layers`), bytes of the forward values made in layers before k
    and read in layer k or later: what a stage starting at layer k receives per microbatch
    (its gradients go back the same size). `reads`: (value, layer that makes it, layer
    that reads it), one per forward read; `nbytes`: each value's whole size.

    **Example:** a value made in layer 0 and read in layer 2 crosses into layers 1 and 2.
    """
    crossing: list[set[int]] = [set() for _ in range(num_layers + 1)]
    for v, made, read in reads:
        for b in range(made + 1, read + 1):
            crossing[b].add(v)
    return [float(sum(nbytes[v] for v in vs)) for vs in crossing]


def boundary_transfer_time(num_bytes: float, cluster, num_devices: int) -> float:
    """Seconds per microbatch a stage boundary costs the stage after it: the activations
    crossing it (`num_bytes`, the whole values) forward and their gradients back, each a
    cross-mesh `transfer_time` into the stage's `num_devices` devices, as the runtime moves
    them (`autopar.distributed.copy_to_devices`: per-device shares in parallel; Alpa's
    cross-mesh resharding, Zheng et al. 2022 section 5). The previous stage is taken to be
    on the devices just before this one's (the stage DP packs stages in order), so the
    link is the inter-host one when the two stages together span hosts.

    **Example:** on one host, 1 MB into 4 devices: 2 * (alpha + 1e6 / (4 * bandwidth)).
    """
    if num_devices < 1:
        raise ValueError(f"a stage needs at least one device, got {num_devices}")
    if num_bytes <= 0:
        return 0.0
    total = cluster.num_devices
    if 2 * num_devices > total:  # no room for two such stages (a virtual cluster's search)
        link = link_for(cluster, range(total))
        return 2 * (link.latency + num_bytes / (num_devices * link.bandwidth))
    before = range(total - 2 * num_devices, total - num_devices)
    after = range(total - num_devices, total)
    return 2 * transfer_time(num_bytes, cluster, before, after)


def memory_budget(cluster, requested: float | None = None) -> float:
    """Bytes per device a plan may use: `requested`, or else the cluster's device memory."""
    if requested is not None:
        return float(requested)
    return float(cluster.device_memory)
