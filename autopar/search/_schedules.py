"""Schedules in the pipeline search: the schedule a stage DP choice runs and its predicted
step time, and interleaved 1F1B searched as p·v stages then folded onto p device groups.

In: a `PipelineChoice` (the stage DP's), the microbatch count, the schedule asked for and
the cluster. Out: a schedule name and seconds per step (`autopar.cost.pipelined_step_time`,
what `Plan.predicted_step_time` computes).
"""

from __future__ import annotations

import dataclasses
import logging

from autopar.choices import Schedule
from autopar.cost import DEFAULT_PHASE_SHARES, pipelined_step_time
from autopar.inter import PipelineChoice, SubmeshShape
from autopar.inter.passes import phase_times

log = logging.getLogger("autopar")


def dp_schedule(schedule: str) -> str:
    """The schedule whose activations in flight the stage DP's memory model counts:
    1F1B's for the schedules that keep as many (zero bubble; "auto" chooses among those)
    and for the chunks of an interleaved pipeline searched as p·v stages."""
    return "1f1b" if schedule in ("auto", "zero_bubble", "interleaved_1f1b") else schedule


def stage_times(choice: PipelineChoice) -> list[float]:
    """Seconds per microbatch of each chosen stage as its plan predicts it
    (`Stage.time_per_microbatch`): the stitched sharding plan's cost, recompute and the
    transfer into the stage. The stage DP adds up its layers' costs instead; the stitched
    plan adds what joining them costs (a value resharded where one layer hands it to the
    next in another layout). Launching the stage's programs is left out: it depends on the
    schedule, and `schedule_for` adds it per schedule (`pipelined_step_time`, as
    `Plan.predicted_step_time` does)."""
    transfer = choice.stage_transfer or (0.0,) * len(choice.stage_plans)
    return [sp.cost.total + r + t for sp, r, t in
            zip(choice.stage_plans, choice.stage_recompute, transfer)]


def _stage_dp_times(choice: PipelineChoice) -> list[float]:
    """Seconds per microbatch of each stage as the stage DP added them up (its layers'
    costs), launching its programs left out as in `stage_times`."""
    dispatch = choice.stage_dispatch or (0.0,) * len(choice.stage_plans)
    return [c.latency - d for c, d in zip(choice.dp.stage_costs, dispatch)]


def stitch_note(choice: PipelineChoice, num_micro: int, schedule: str, virtual_stages: int,
                cluster, latency: float) -> str:
    """Where the plan's predicted time differs from the stage DP's: says by how much."""
    _, dp_latency = schedule_for(choice, num_micro, schedule, virtual_stages, cluster,
                                 _stage_dp_times(choice))
    if abs(latency - dp_latency) <= 1e-9 * max(latency, 1e-30):
        return ""
    return (f" (the stage DP's sum of layer costs {dp_latency:.4g} s; joining the layers' "
            f"plans and the stage boundaries {latency - dp_latency:+.4g} s)")


def schedule_for(choice: PipelineChoice, num_micro: int, schedule: str, virtual_stages: int,
                 cluster, times: list[float] | None = None) -> tuple[Schedule, float]:
    """The schedule the plan runs and its predicted step time (`pipelined_step_time` of
    the stages' `times`, by default `stage_times`, with each schedule's cost of launching
    the stages' programs and the stages' split into forward, input-gradient and
    weight-gradient passes, `phase_shares`: what `Plan.predicted_step_time` computes):
    `schedule` as asked, or with "auto" the fastest of 1F1B and zero bubble (the same activations
    in flight, so both fit wherever the stage DP's 1F1B plan fits; ties go to 1F1B);
    "auto" weighs interleaving too, as candidates of their own (`_interleaved_candidates`)."""
    times = stage_times(choice) if times is None else times
    shares = phase_shares(choice, cluster)
    shape = {"group_devices": [len(sp.mesh.device_ids) for sp in choice.stage_plans],
             "returned_bytes": [c.memory_parts.gradients if c.memory_parts else 0.0
                                for c in choice.dp.stage_costs]}
    if schedule == "interleaved_1f1b":
        groups = len(times) // virtual_stages
        return "interleaved_1f1b", pipelined_step_time(
            times, cluster, num_micro, "interleaved_1f1b", groups, shares, **shape
        )
    names = ("1f1b", "zero_bubble") if schedule == "auto" else (schedule,)
    predicted = [(pipelined_step_time(times, cluster, num_micro, n, phase_shares=shares,
                                      **shape), n)
                 for n in reversed(names)]
    if len(predicted) > 1 and len(times) > 1:
        log.info("%d microbatch(es), %d stage(s): %s predicted (F/B/W shares %s)", num_micro,
                 len(times), ", ".join(f"{n} {t:.4g} s" for t, n in predicted), shares)
    latency, name = min(predicted)
    return name, latency


def phase_shares(choice: PipelineChoice, cluster) -> tuple[float, float, float]:
    """The chosen stages' forward, input-gradient and weight-gradient shares of their
    time (`phase_times`, the cost model's roofline per node), rounded to 6 digits so that
    plans save the same on every machine; a third each when the graph times nothing."""
    times = phase_times(choice.partition, cluster)
    total = sum(times)
    if total <= 0:
        return DEFAULT_PHASE_SHARES
    return tuple(round(t / total, 6) for t in times)


AUTO_VIRTUAL_STAGES = (2, 4)
"""The virtual stages per device group that `schedule="auto"` weighs for interleaved 1F1B
(Megatron-LM's runs use 2 to 4 chunks per device; each doubling halves the bubble again
and doubles the stage-boundary transfers)."""


def interleaved_search(cluster, single, virtual_stages: int, num_stages: int | None):
    """The stage DP's problem for interleaved 1F1B: p·v stages of equal submeshes on a
    cluster v times as large, each stage with a 1/v share of the memory budget (a device
    holds v of them); `fold` then puts stage s on the devices of stage s mod p."""
    v, p = virtual_stages, num_stages
    if p is None:
        raise ValueError(
            "schedule='interleaved_1f1b' with virtual_stages needs num_stages=p, the "
            "pipeline's device groups (the plan has p * virtual_stages stages)"
        )
    per_group, rest = divmod(cluster.num_devices, p)
    per_host = cluster.devices_per_host
    if rest or (per_group > per_host and per_group % per_host):
        raise ValueError(
            f"num_stages={p} device groups cannot split the {cluster.num_devices} devices "
            f"evenly into whole hosts or parts of one; use a num_stages dividing "
            f"{cluster.num_devices}"
        )
    shape = (1, per_group) if per_group <= per_host else (per_group // per_host, per_host)
    virtual = dataclasses.replace(cluster, num_hosts=cluster.num_hosts * v)
    single = dataclasses.replace(single, memory_budget=single.memory_budget / v)
    return virtual, single, p * v, [SubmeshShape(*shape)]


def fold(choice: PipelineChoice, num_groups: int, num_devices: int) -> PipelineChoice:
    """Stage s of the p·v stages the DP placed on a v times larger cluster, moved to the
    devices of stage s mod p."""
    groups = choice.device_ids[:num_groups]
    assert sorted(d for ids in groups for d in ids) == list(range(num_devices)), (
        f"the first {num_groups} stages must cover the devices once, got {groups}"
    )
    plans = tuple(
        dataclasses.replace(
            sp, mesh=dataclasses.replace(sp.mesh, device_ids=groups[s % num_groups])
        )
        for s, sp in enumerate(choice.stage_plans)
    )
    device_ids = tuple(groups[s % num_groups] for s in range(len(plans)))
    return dataclasses.replace(choice, stage_plans=plans, device_ids=device_ids)


def pick(candidates: list):
    """The fastest candidate; when it is one stage and one microbatch also gives one stage,
    that one (no pipeline, so no microbatches either: the whole batch at once). A number of
    microbatches the user fixed is the only candidate, so one stage keeps them (gradient
    accumulation, as asked)."""
    best = min(candidates, key=lambda c: c.latency)  # first of equals: fewer microbatches
    single = next((c for c in candidates if c.num_microbatches == 1), None)
    if (len(best.choice.stage_layers) == 1 and best.num_microbatches > 1
            and single is not None and len(single.choice.stage_layers) == 1):
        return single
    return best


