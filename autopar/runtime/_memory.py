"""Bytes per device held during a pipelined step, sampled task by task (off by default).

In: `jax.live_arrays()`, the step's own arrays by what they are (`parts`), and each task's
compiled program (`task_working_bytes`). Out: `MemorySample`s.

Two kinds of sample:
- between tasks (after each task has run): the bytes of the live arrays per device id,
  split into the step's parts ("state": parameters and optimizer state with the copies
  moved to a stage in another layout; "gradients": the running sums; "activations": the
  microbatches' values held between tasks; "batch": the caller's batch arguments;
  "other": whatever else the step made, e.g. the update's results);
- while a task runs (`running`, taken when its arguments are in place and it is about to
  be dispatched): the same, plus the task's own working memory, which no array shows: what
  XLA's `memory_analysis()` of the task's executable says it allocates beyond its
  arguments (its temporaries, and its outputs not written into donated arguments).

Arrays alive before the step that are not its arguments (other models, earlier results the
caller keeps) are left out, so a sample counts what the step holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import jax

PARTS = ("state", "gradients", "activations", "batch", "other")


@dataclass(frozen=True)
class MemorySample:
    """Bytes per device id at one moment of a step (`kind`: "start", "forward",
    "backward", "weight", "apply"; `running`: taken while that task runs, else after it).

    `live_bytes`: the step's live arrays; `parts`: the same by part (`PARTS`), part ->
    device id -> bytes; `working_bytes`: the running task's working memory per device
    (`task_working_bytes`; empty between tasks)."""

    stage: int
    kind: str
    microbatch: int
    live_bytes: dict[int, int]
    parts: dict[str, dict[int, int]] = field(default_factory=dict)
    working_bytes: dict[int, int] = field(default_factory=dict)
    running: bool = False

    def total(self, device_id: int) -> int:
        """Live and working bytes on `device_id`."""
        return self.live_bytes.get(device_id, 0) + self.working_bytes.get(device_id, 0)

    def part(self, name: str, device_id: int) -> int:
        """Bytes of part `name` ("working": the running task's working memory)."""
        if name == "working":
            return self.working_bytes.get(device_id, 0)
        return self.parts.get(name, {}).get(device_id, 0)


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def live_bytes_per_device(skip: Iterable = ()) -> dict[int, int]:
    """Bytes of the live arrays on each addressable device, leaving out the arrays in
    `skip` (compared by identity)."""
    return _tally(skip, {})[0]


def _tally(skip: Iterable, part_of: Mapping[int, str]):
    """(bytes per device, part -> bytes per device) of the live arrays not in `skip`; an
    array's part is `part_of[id(array)]`, "other" when unnamed."""
    skipped = {id(x) for x in skip}
    totals: dict[int, int] = {}
    parts: dict[str, dict[int, int]] = {}
    for x in jax.live_arrays():
        if id(x) in skipped or x.is_deleted():
            continue
        nbytes = _shard_bytes(x)
        by_device = parts.setdefault(part_of.get(id(x), "other"), {})
        for device in x.sharding.addressable_devices:
            totals[device.id] = totals.get(device.id, 0) + nbytes
            by_device[device.id] = by_device.get(device.id, 0) + nbytes
    return totals, parts


def task_working_bytes(fn, args: Sequence) -> int:
    """Bytes per device a task's program allocates beyond its arguments while it runs:
    XLA's `memory_analysis()` of `fn`'s executable for `args` (`executable_working_bytes`).
    `fn` is a `jax.jit`; this compiles it ahead of time for `args` (a separate compile from
    the one its first call makes: a caller that runs the program too should dispatch the
    compiled executable instead, as the pipeline runtime does)."""
    return executable_working_bytes(fn.lower(*args).compile())


def executable_working_bytes(executable) -> int:
    """Bytes per device a compiled program allocates beyond its arguments while it runs:
    XLA's `memory_analysis()` (temp + output - alias: its temporaries and its results,
    less the results written into donated arguments); 0 on a backend without it."""
    stats = executable.memory_analysis()
    if stats is None:  # a backend without the analysis
        return 0
    return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes


class MemoryRecorder:
    """Samples bytes per device; made at the start of a step, given its arguments."""

    def __init__(self, step_args: Sequence):
        args = {id(x) for x in step_args}
        # Held for the step so that their ids stay theirs (a freed id can be reused).
        self._before = [x for x in jax.live_arrays() if id(x) not in args]
        self.samples: list[MemorySample] = []

    def sample(self, stage: int, kind: str, microbatch: int,
               parts: Mapping[str, Iterable] | None = None,
               working: Mapping[int, int] | None = None) -> None:
        """Record the live bytes now, `parts` naming the step's arrays by part (part ->
        arrays; the rest count as "other"); `working`: device id -> the working bytes of
        the task about to run (a `running` sample)."""
        part_of = {id(x): name for name, arrays in (parts or {}).items() for x in arrays}
        live, by_part = _tally(self._before, part_of)
        self.samples.append(MemorySample(
            stage, kind, microbatch, live, by_part, dict(working or {}), working is not None,
        ))

    def finish(self) -> list[MemorySample]:
        self._before = []
        return self.samples


def peak_live_bytes(samples: Sequence[MemorySample], device_ids: Iterable[int]) -> int:
    """The largest live bytes (arrays only) on any of `device_ids` over `samples`."""
    ids = list(device_ids)
    return max((s.live_bytes.get(d, 0) for s in samples for d in ids), default=0)


def peak_sample(samples: Sequence[MemorySample], device_ids: Iterable[int]
                ) -> tuple[MemorySample | None, int]:
    """(the sample, device id) with the most live and working bytes on any of
    `device_ids`: the measured peak, working memory included (`MemorySample.total`)."""
    ids = list(device_ids)
    best, best_device, most = None, -1, -1
    for s in samples:
        for d in ids:
            if s.total(d) > most:
                best, best_device, most = s, d, s.total(d)
    return best, best_device
