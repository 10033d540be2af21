"""The values of one microbatch, each held only until its last reader has run.

In: at build time, which stages' tasks read which values (`readers_by_stage`); at run time,
the values the tasks produce and read. Out: each value in the layout of the stage that
reads it, dropped as soon as no task left reads it there.

A value lives as up to one copy per stage: the copy as produced (on the producing stage)
and a moved copy on each stage that reads it in another layout. A stage's copy goes once
that stage's last task reading the value has run; a copy no stage reads any more stays
only while some stage that still reads the value has no copy of its own to read from. So
an activation kept for a backward goes when that backward has run, and a value handed to
the next stage leaves this stage once the next stage has received it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

ReaderCounts = Mapping[int, Mapping[int, int]]  # var -> stage -> tasks on it reading var


def readers_by_stage(segments: Iterable, per_microbatch: set[int]) -> dict[int, dict[int, int]]:
    """var -> stage -> number of the stage's tasks that read it, over `segments` (the
    forward and backward segments run once per microbatch), for the per-microbatch values
    only (step-wide inputs such as parameters live for the whole step)."""
    counts: dict[int, dict[int, int]] = {}
    for seg in segments:
        if not seg.nodes:
            continue  # an empty segment is skipped at run time: it reads nothing
        for v in seg.inputs:
            if v in per_microbatch:
                per_stage = counts.setdefault(v, {})
                per_stage[seg.stage] = per_stage.get(seg.stage, 0) + 1
    return counts


class MicrobatchValues:
    """One microbatch's values (see the module docstring); safe to use from the stage
    threads at once.

    **Arguments:**
    - `readers`: `readers_by_stage(...)`, computed once per executable.
    - `sources`: var -> a function making the value on first read (a microbatch's slice of
      a batch input: sliced when a stage first reads it, not all up front).
    - `lock`: shared by the step's microbatches.
    """

    def __init__(
        self, readers: ReaderCounts, sources: Mapping[int, Callable[[], Any]], lock: threading.Lock
    ):
        self.left = {v: dict(per_stage) for v, per_stage in readers.items()}
        self.copies: dict[int, dict[int | None, Any]] = {}  # var -> stage (None: source) -> array
        self.sources = dict(sources)
        self.lock = lock

    def put(self, v: int, x: Any, stage: int) -> None:
        """Hold `x`, just produced on `stage`, if any task of the microbatch reads it."""
        with self.lock:
            if self.left.get(v):
                self.copies[v] = {stage: x}

    def read(self, v: int, stage: int, place: Callable[[Any], Any]) -> Any:
        """The value as `stage` reads it: its own copy, else one made with `place` from a
        copy held elsewhere (or from the value's source). `place(x)` returns `x` moved to
        the stage's layout, or `x` itself when it already has it."""
        with self.lock:
            copies = self.copies.get(v)
            if copies is None:
                make = self.sources.pop(v, None)
                assert make is not None, (
                    f"variable {v} is read on stage {stage} but was never produced or "
                    "was dropped before its last reader (a bug in the reader counts)"
                )
                copies = self.copies[v] = {None: make()}
            x = copies.get(stage)
            if x is None:
                x = next(iter(copies.values()))
            placed = place(x)
            copies[stage] = placed
            self._prune(v)
            return placed

    def done(self, stage: int, inputs: Iterable[int]) -> None:
        """A task of `stage` that read `inputs` has run: drop what nobody reads any more."""
        with self.lock:
            for v in inputs:
                per_stage = self.left.get(v)
                if per_stage is None or stage not in per_stage:
                    continue  # a step-wide value
                per_stage[stage] -= 1
                if per_stage[stage] == 0:
                    del per_stage[stage]
                self._prune(v)

    def _prune(self, v: int) -> None:
        copies, left = self.copies.get(v), self.left.get(v, {})
        if copies is None:
            return
        if not left:
            del self.copies[v]
            return
        spare = [t for t in copies if t not in left]
        # Keep one spare copy only while a stage that still reads `v` has no copy yet.
        if spare and not any(r in copies for r in left):
            spare = spare[1:]
        for t in spare:
            del copies[t]

    def held(self) -> dict[int, tuple]:
        """var -> the stages holding a copy (for tests and debugging)."""
        with self.lock:
            return {v: tuple(c) for v, c in self.copies.items()}
