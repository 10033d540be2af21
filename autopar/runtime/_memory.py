"""Live bytes per device, sampled between a pipelined step's tasks (off by default).

In: `jax.live_arrays()`. Out: `MemorySample`s, bytes per device id of the arrays alive
when each task of the step ended. Arrays alive before the step that are not its arguments
(e.g. other models, earlier results the caller keeps) are left out, so a sample counts what
the step holds: its arguments, the values it keeps and the results made so far.
Buffers XLA uses inside one program (its temporaries) are not arrays and do not show.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class MemorySample:
    """Live bytes per device id after one task (`kind`: "start", "forward", "backward",
    "apply")."""

    stage: int
    kind: str
    microbatch: int
    live_bytes: dict[int, int]


def live_bytes_per_device(skip: Iterable = ()) -> dict[int, int]:
    """Bytes of the live arrays on each addressable device, leaving out the arrays in
    `skip` (compared by identity)."""
    skipped = {id(x) for x in skip}
    totals: dict[int, int] = {}
    for x in jax.live_arrays():
        if id(x) in skipped or x.is_deleted():
            continue
        shard_bytes = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for device in x.sharding.addressable_devices:
            totals[device.id] = totals.get(device.id, 0) + shard_bytes
    return totals


class MemoryRecorder:
    """Samples live bytes per device; made at the start of a step, given its arguments."""

    def __init__(self, step_args: Sequence):
        args = {id(x) for x in step_args}
        # Held for the step so that their ids stay theirs (a freed id can be reused).
        self._before = [x for x in jax.live_arrays() if id(x) not in args]
        self.samples: list[MemorySample] = []

    def sample(self, stage: int, kind: str, microbatch: int) -> None:
        live = live_bytes_per_device(self._before)
        self.samples.append(MemorySample(stage, kind, microbatch, live))

    def finish(self) -> list[MemorySample]:
        self._before = []
        return self.samples


def peak_live_bytes(samples: Sequence[MemorySample], device_ids: Iterable[int]) -> int:
    """The largest live bytes on any of `device_ids` over `samples`."""
    ids = list(device_ids)
    return max((s.live_bytes.get(d, 0) for s in samples for d in ids), default=0)
