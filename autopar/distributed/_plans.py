"""Every process must run the same plan: compare what each derived, adopt process 0's."""

from __future__ import annotations

import hashlib
import json
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger("autopar")

# Plan fields, at any depth, that legitimately differ between processes: wall-clock
# planning times (the plan's `timings`, the ILP's `build_time` and `solve_time`).
UNSHARED_FIELDS = frozenset({"timings", "build_time", "solve_time"})


def shared_json(data):
    """A plan's JSON without the fields in `UNSHARED_FIELDS`, at any depth."""
    if isinstance(data, dict):
        return {k: shared_json(v) for k, v in data.items() if k not in UNSHARED_FIELDS}
    if isinstance(data, list):
        return [shared_json(v) for v in data]
    return data


def plan_digest(plan) -> bytes:
    """SHA-256 of the plan's JSON without its wall-clock times."""
    return hashlib.sha256(json.dumps(shared_json(plan.to_json()), sort_keys=True).encode()).digest()


def differing_processes(plan) -> list[int]:
    """The processes whose plan differs from process 0's; every process calls it.

    **Returns:** the same list on every process (empty when all plans agree).
    """
    if jax.process_count() == 1:
        return []
    mine = np.frombuffer(plan_digest(plan), dtype=np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    return [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]


def agree_on_plan(plan):
    """Process 0's plan on every process; every process calls it.

    Planning is meant to be deterministic, so every process normally derives the same
    plan and this only checks it. If they differ (e.g. the planner visited a set of
    strings, whose order depends on each process's hash seed), process 0's plan is sent to
    all and a warning names the processes that disagreed.

    **Returns:** `plan` itself when all agree, else process 0's plan (a new `Plan`).
    """
    from autopar.plan import Plan

    differing = differing_processes(plan)
    if not differing:
        return plan
    log.warning(
        "processes %s derived a different plan from process 0's; all use process 0's. "
        "Set PYTHONHASHSEED to the same value on every process to make planning agree.",
        differing,
    )
    text = json.dumps(plan.to_json(), sort_keys=True).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.array(len(text), np.int64)))
    buffer = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(text, np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer)).astype(np.uint8)
    return Plan.from_json(json.loads(received.tobytes().decode()))
