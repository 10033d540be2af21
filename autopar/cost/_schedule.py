"""Pipeline schedules: the order in which each device group runs its microbatch tasks.

A task is `(phase, stage, microbatch)`. Phases: "forward"; "backward" (the whole backward,
or with zero-bubble schedules only its input-gradient part B); "weight" (zero-bubble only:
the weight-gradient part W of the backward, which nothing downstream waits for).

Stages run on device groups. Usually each stage has its own devices (`virtual_stages` = 1).
With `interleaved_1f1b` and `virtual_stages` v, `num_stages` = p·v stages run on p device
groups, stage s on group s mod p (Megatron-LM's interleaved schedule: each device holds v
non-adjacent chunks of layers).

`simulate` runs these orders with a predicted time per task: the one simulator behind every
schedule's predicted bubble (`autopar.cost.pipeline_latency`, `bubble_fraction`) and the
predicted Gantt charts (`autopar.report.simulate_schedule`). The runtime runs the same
orders (`autopar.runtime`).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.choices import SCHEDULES, Schedule, check_choice

Task = tuple[str, int, int]  # (phase, stage, microbatch)


def stage_order(schedule: Schedule, stage: int, num_stages: int, num_microbatches: int):
    """The tasks of one stage (its own device group, `virtual_stages` = 1), in order.

    GPipe: every forward, then every backward. 1F1B (PipeDream-flush): `num_stages - stage
    - 1` warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards; a stage keeps at most `num_stages - stage` microbatches in flight.
    Zero bubble (ZB-H1, Qi et al. 2024): 1F1B's order of forwards and input-gradient
    backwards B; in the steady phase a weight-gradient pass W follows each B once `stage`
    W's are pending, in the cool-down one W follows each B (filling the wait for the next
    B, which the stages after it no longer delay with their W's), the rest come last.
    Stage i keeps 1F1B's p - i forwards in flight plus i pending W's: the memory of 1F1B's
    first stage on every stage (ZB-H1). With T_F = T_B = T_W the step takes
    m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W), a third of 1F1B's bubble.
    """
    check_choice("schedule", schedule, SCHEDULES)
    m = num_microbatches
    if schedule == "gpipe":
        return [("forward", stage, i) for i in range(m)] + [
            ("backward", stage, i) for i in range(m)
        ]
    if schedule not in ("1f1b", "zero_bubble"):
        raise ValueError(
            f"stage_order is for one stage per device group; {schedule!r} needs "
            "device_orders (and 'auto' is resolved by the planner before anything runs)"
        )
    warmup = min(num_stages - stage - 1, m)
    order = [("forward", stage, i) for i in range(warmup)]
    weights: list[int] = []  # microbatches whose W is pending
    lag = stage

    def backward(i: int, cooldown: bool) -> None:
        order.append(("backward", stage, i))
        if schedule != "zero_bubble":
            return
        weights.append(i)
        if cooldown or len(weights) > lag:
            order.append(("weight", stage, weights.pop(0)))

    f, b = warmup, 0
    while f < m:
        order.append(("forward", stage, f))
        f += 1
        backward(b, cooldown=False)
        b += 1
    for i in range(b, m):
        backward(i, cooldown=True)
    order += [("weight", stage, i) for i in weights]
    return order


def interleaved_order(group: int, num_groups: int, virtual_stages: int,
                      num_microbatches: int) -> list[Task]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2) on device group
    `group` of p = `num_groups`, holding stages `group`, `group + p`, ...: microbatches go
    through the chunks in rounds of p; `2 (p - group - 1) + (v - 1) p` warm-up forwards,
    then one forward and one backward in turn, then the remaining backwards."""
    p, v, m = num_groups, virtual_stages, num_microbatches
    if m % p:
        raise ValueError(
            f"interleaved_1f1b runs microbatches in rounds of the {p} pipeline device "
            f"groups; {m} microbatches is not a multiple of {p}: use num_microbatches="
            f"{(m // p + 1) * p}"
        )
    total = m * v

    def task(phase: str, k: int) -> Task:
        chunk = (k // p) % v
        if phase == "backward":
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return (phase, chunk * p + group, microbatch)

    warmup = min((p - group - 1) * 2 + (v - 1) * p, total)
    order = [task("forward", k) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        order.append(task("forward", f))
        f += 1
        order.append(task("backward", b))
        b += 1
    order += [task("backward", k) for k in range(b, total)]
    return order


def device_orders(schedule: Schedule, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> list[list[Task]]:
    """Per device group, its tasks in the order it runs them (see the module docstring)."""
    if schedule == "interleaved_1f1b":
        if virtual_stages < 1 or num_stages % virtual_stages:
            raise ValueError(
                f"{num_stages} stages cannot be {virtual_stages} virtual stages per device "
                "group; the number of stages must be a multiple of virtual_stages"
            )
        groups = num_stages // virtual_stages
        return [
            interleaved_order(g, groups, virtual_stages, num_microbatches)
            for g in range(groups)
        ]
    if virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved_1f1b', not "
            f"{schedule!r}"
        )
    return [stage_order(schedule, s, num_stages, num_microbatches) for s in range(num_stages)]


def dependencies(task: Task, num_stages: int) -> list[Task]:
    """The tasks whose results `task` reads: a forward reads the previous stage's forward;
    a backward (B) its own forward and the next stage's B; a weight pass W its own B."""
    phase, stage, i = task
    if phase == "forward":
        return [("forward", stage - 1, i)] if stage > 0 else []
    if phase == "weight":
        return [("backward", stage, i)]
    deps = [("forward", stage, i)]
    if stage + 1 < num_stages:
        deps.append(("backward", stage + 1, i))
    return deps


def dispatch_order(schedule: Schedule, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> list[Task]:
    """All tasks in one order that respects every dependency and each device group's own
    order (round robin over the groups, each running ahead while its next task's inputs
    have been dispatched)."""
    queues = device_orders(schedule, num_stages, num_microbatches, virtual_stages)
    done: set[Task] = set()
    order: list[Task] = []
    total = sum(len(q) for q in queues)
    heads = [0] * len(queues)
    while len(order) < total:
        progressed = False
        for g, queue in enumerate(queues):
            while heads[g] < len(queue):
                task = queue[heads[g]]
                if not all(d in done for d in dependencies(task, num_stages)):
                    break
                order.append(task)
                done.add(task)
                heads[g] += 1
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks (a bug): {heads}"
    return order


TimedTask = tuple[Task, float, float]  # (task, start, end) in seconds


def simulate(forward: Sequence[float], backward: Sequence[float], num_microbatches: int,
             schedule: Schedule = "1f1b", virtual_stages: int = 1,
             weight: Sequence[float] | None = None) -> tuple[list[TimedTask], list[float]]:
    """Start and end of every task of one step when each device group runs its tasks in
    its order (`device_orders`), each as soon as the tasks it reads from (`dependencies`)
    have ended and its devices are free. Transfers take no time (a stage's time includes
    the transfer into it).

    **Arguments:**
    - `forward`, `backward`: seconds per microbatch of each of the `num_stages` stages'
      forward and whole backward (for interleaved 1F1B, of each of the p·v chunks).
    - `weight`: zero bubble only: seconds of each stage's weight-gradient part W of its
      backward; the input-gradient part B is the rest (Qi et al. 2024 time F, B and W
      apart, REFERENCES.md "Pipeline schedules"). None: a half of the backward each.

    **Returns:** the tasks in the order simulated, and each device group's time its last
    task ends.

    **Example:** two stages, F = 1, B + W = 2, two microbatches, 1F1B: stage 1's first
    backward starts at 2 (after both forwards of microbatch 0) and the step ends at 8.
    """
    num_stages = len(forward)
    orders = device_orders(schedule, num_stages, num_microbatches, virtual_stages)
    if schedule == "zero_bubble":
        weight = [b / 2 for b in backward] if weight is None else list(weight)
        if any(w > b * (1 + 1e-12) or w < 0 for w, b in zip(weight, backward)):
            raise ValueError(
                f"a stage's weight-gradient time must lie between 0 and its backward's; got "
                f"weight {list(weight)} for backward {list(backward)}"
            )
    else:
        weight = [0.0] * num_stages
    seconds = {
        "forward": list(forward),
        "backward": [b - w for b, w in zip(backward, weight)],
        "weight": list(weight),
    }
    end: dict[Task, float] = {}
    timed: list[TimedTask] = []
    group_free = [0.0] * len(orders)
    heads = [0] * len(orders)
    while any(h < len(order) for h, order in zip(heads, orders)):
        progressed = False
        for g, order in enumerate(orders):
            while heads[g] < len(order):
                task = order[heads[g]]
                deps = dependencies(task, num_stages)
                if any(d not in end for d in deps):
                    break
                start = max([group_free[g]] + [end[d] for d in deps])
                group_free[g] = end[task] = start + seconds[task[0]][task[1]]
                timed.append((task, start, group_free[g]))
                heads[g] += 1
                progressed = True
        assert progressed, f"{schedule} schedule deadlocked at tasks {heads}"
    return timed, group_free


def simulate_shared(forward: Sequence[float], backward: Sequence[float],
                    num_microbatches: int, group_devices: Sequence[int], cores: int,
                    total_devices: int, schedule: Schedule = "1f1b",
                    virtual_stages: int = 1, host_work: float = 0.0) -> float:
    """Seconds per step of `simulate`'s schedule when every device group's devices share
    `cores` CPU cores with all `total_devices` devices of their host (XLA:CPU's virtual
    devices: one thread each, all on the process's cores), and the task times were
    measured with every device busy (each at ``cores / total_devices`` of a core).

    Processor sharing: while b devices are busy, each runs at ``cores / max(b, cores)`` of
    a core (at most one core per device thread), so a task progresses
    ``total_devices / max(b, cores)`` times as fast as its time says. A pipeline's bubble
    then costs little: the devices of the stages that run use the cores the idle ones
    leave. `host_work`: seconds of one core the host thread spends launching the step's
    tasks (`tasks_per_step` times the profile's `dispatch_overhead`, per stage), work on
    the same cores: it adds ``host_work / cores``. GPipe and 1F1B orders (`stage_order`);
    `forward` and `backward` are seconds per microbatch of each stage, `group_devices`
    the devices of each stage's group.

    **Example:** two stages of 4 devices on 8 devices sharing 2 cores, F = 1, B = 2, one
    microbatch: each task runs alone, at twice its speed, 3 s in all against `simulate`'s
    6 s; with 4 microbatches the bubble vanishes: 12 s, the work of the 8 devices over
    the 2 cores (`simulate`: 15 s).
    """
    num_stages = len(forward)
    if len(group_devices) != num_stages or min(group_devices, default=0) < 1:
        raise ValueError(
            f"simulate_shared needs a device count >= 1 per stage, got {list(group_devices)} "
            f"for {num_stages} stage(s)"
        )
    if cores < 1 or total_devices < max(group_devices):
        raise ValueError(
            f"simulate_shared needs cores >= 1 and total_devices >= every group's devices, "
            f"got {cores} core(s), {total_devices} device(s), groups {list(group_devices)}"
        )
    orders = device_orders(schedule, num_stages, num_microbatches, virtual_stages)
    if len(orders) != num_stages:
        raise ValueError(f"simulate_shared runs one stage per device group, not {schedule!r}")
    seconds = {"forward": list(forward), "backward": list(backward)}
    heads = [0] * num_stages
    done: set[Task] = set()
    left: dict[Task, float] = {}
    now = 0.0
    while True:
        running = []
        for g, order in enumerate(orders):
            if heads[g] < len(order):
                task = order[heads[g]]
                if all(d in done for d in dependencies(task, num_stages)):
                    running.append((g, task))
        if not running:
            break
        busy = sum(group_devices[g] for g, _ in running)
        speed = total_devices / max(busy, cores)
        for _, task in running:
            left.setdefault(task, seconds[task[0]][task[1]])
        step = min(left[task] for _, task in running) / speed
        now += step
        for g, task in running:
            left[task] -= step * speed
            if left[task] <= 1e-12 * max(1.0, seconds[task[0]][task[1]]):
                done.add(task)
                heads[g] += 1
    assert all(h == len(o) for h, o in zip(heads, orders)), f"{schedule} deadlocked at {heads}"
    return now + host_work / cores


def tasks_per_step(num_stages: int, num_microbatches: int,
                   schedule: Schedule = "1f1b") -> int:
    """Programs one stage's devices launch per step.

    One stage: one program for the whole step (the SPMD runtime's jit, or the pipeline
    runtime's fused step with its microbatches in a `lax.scan`). Several: per microbatch a
    forward and a backward task (zero bubble: the backward split in two, B and W), and
    once per step the stage's update (`autopar.runtime.PipelineExecutable`).

    **Example:** ``tasks_per_step(1, 8) == 1``; ``tasks_per_step(2, 4) == 9``;
    ``tasks_per_step(2, 4, "zero_bubble") == 13``.
    """
    check_choice("schedule", schedule, SCHEDULES)
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a plan needs at least one stage and one microbatch, got {num_stages} stage(s) "
            f"and {num_microbatches} microbatch(es)"
        )
    if num_stages == 1:
        return 1
    per_microbatch = 3 if schedule == "zero_bubble" else 2
    return num_microbatches * per_microbatch + 1
