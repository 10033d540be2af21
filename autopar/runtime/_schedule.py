"""Pipeline schedules: the order in which each stage runs its microbatch tasks."""

from __future__ import annotations

from autopar.choices import Schedule

Task = tuple[str, int, int]  # (phase "forward"|"backward", stage, microbatch)


def stage_order(schedule: Schedule, stage: int, num_stages: int, num_microbatches: int):
    """The tasks of one stage, in the order it runs them.

    GPipe: every forward, then every backward. 1F1B (PipeDream-flush): `num_stages - stage
    - 1` warm-up forwards, then one forward and one backward in turn, then the remaining
    backwards; a stage keeps at most `num_stages - stage` microbatches in flight.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [("forward", stage, i) for i in range(m)] + [
            ("backward", stage, i) for i in range(m)
        ]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")
    warmup = min(num_stages - stage - 1, m)
    order = [("forward", stage, i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order.append(("forward", stage, f))
        f += 1
        order.append(("backward", stage, b))
        b += 1
    order += [("backward", stage, i) for i in range(b, m)]
    return order


def dispatch_order(schedule: Schedule, num_stages: int, num_microbatches: int) -> list[Task]:
    """All tasks in an order that respects every dependency and each stage's own order.

    A forward of microbatch i on stage s needs the forward of i on stage s - 1; a backward
    needs the backward on stage s + 1 and its own forward.
    """
    queues = [stage_order(schedule, s, num_stages, num_microbatches) for s in range(num_stages)]
    done: set[Task] = set()
    order: list[Task] = []
    total = sum(len(q) for q in queues)
    heads = [0] * num_stages
    while len(order) < total:
        progressed = False
        for s in range(num_stages):
            while heads[s] < len(queues[s]):
                task = queues[s][heads[s]]
                phase, _, i = task
                deps = []
                if phase == "forward" and s > 0:
                    deps.append(("forward", s - 1, i))
                if phase == "backward":
                    deps.append(("forward", s, i))
                    if s + 1 < num_stages:
                        deps.append(("backward", s + 1, i))
                if not all(d in done for d in deps):
                    break
                order.append(task)
                done.add(task)
                heads[s] += 1
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks (a bug): {heads}"
    return order
