"""Progress and timing of the planning phases, on the ``autopar`` logger.

The library stays quiet: messages go to ``logging.getLogger("autopar")`` at INFO, which
Python does not show unless someone asks. The ``autopar`` command line asks
(`show_progress`), so ``autopar demo`` prints each phase as it starts and ends; a script
can do the same with ``with show_progress(): ...``.

**Example:**

```python
timings: dict[str, float] = {}
with phase("intra-op ILP", timings) as p:
    for i, shape in enumerate(shapes):
        p.update(f"mesh {shape} {i + 1}/{len(shapes)}")
        ...
timings["intra-op ILP"]  # seconds
```
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, MutableMapping
from typing import TextIO

log = logging.getLogger("autopar")

# How the command line prints autopar's messages: "autopar: intra-op ILP done in 1.23 s".
PROGRESS_FORMAT = "autopar: %(message)s"


class Phase:
    """A running phase, as `phase` yields it: report sub-steps with `update`."""

    def __init__(self, name: str, logger: logging.Logger = log):
        self.name = name
        self.start = time.perf_counter()
        self._log = logger

    @property
    def elapsed(self) -> float:
        """Seconds since the phase started."""
        return time.perf_counter() - self.start

    def update(self, message: str) -> None:
        """Log how far the phase got, e.g. ``p.update("mesh (2, 4) 3/5")``."""
        self._log.info("%s: %s (%.2f s)", self.name, message, self.elapsed)


@contextlib.contextmanager
def phase(
    name: str,
    timings: MutableMapping[str, float] | None = None,
    logger: logging.Logger = log,
) -> Iterator[Phase]:
    """Time one planning phase and log its start and end at INFO.

    **Arguments:**
    - `name`: what the phase does, e.g. ``"intra-op ILP"``.
    - `timings`: where to store the duration in seconds, under `name`. A phase that runs
      several times (once per submesh, say) adds up its durations.
    - `logger`: the logger; default ``autopar``.

    **Returns:** a context manager yielding a `Phase`. If the body raises, the failure is
    logged with the time spent, nothing is stored, and the exception propagates.
    """
    current = Phase(name, logger)
    logger.info("%s ...", name)
    try:
        yield current
    except BaseException:
        logger.info("%s failed after %.2f s", name, current.elapsed)
        raise
    seconds = current.elapsed
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + seconds
    logger.info("%s done in %.2f s", name, seconds)


@contextlib.contextmanager
def show_progress(stream: TextIO | None = None, level: int = logging.INFO) -> Iterator[None]:
    """Print autopar's log messages at `level` and above to `stream` while the block runs.

    For programs that want to watch the planner (the command line wraps every command in
    it); the library never calls it. On exit the ``autopar`` logger is as before.

    **Arguments:**
    - `stream`: where to print; default ``sys.stderr`` (looked up on entry).
    - `level`: the least level printed.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(PROGRESS_FORMAT))
    handler.setLevel(level)
    previous_level = log.level
    log.addHandler(handler)
    if log.getEffectiveLevel() > level:
        log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous_level)


class Countdown:
    """Progress over a known list of items searched one after another (the microbatch
    counts of a pipeline search): which one starts, how many are done and left, and an
    estimate of the seconds left at the pace of those done so far.

    **Example:**

    ```python
    left = Countdown("microbatch counts", [1, 32, 64])
    for count in (1, 32, 64):
        left.start(count)  # "microbatch counts: 32 (2 of 3; left after it: 64); ..."
        ...
        left.done(count)
    left.again(32, "its own layer layouts")  # an item searched once more, added
    ```

    **Arguments:**
    - `name`: what the items are, e.g. ``"microbatch counts"``.
    - `items`: the items in the order they will be searched.
    - `logger`: the logger; default ``autopar``.
    """

    def __init__(self, name: str, items, logger: logging.Logger = log):
        self.name = name
        self.todo = list(items)
        self.finished: list = []
        self.seconds: list[float] = []
        self.start_time = time.perf_counter()
        self._began: float | None = None
        self._log = logger

    def estimate(self) -> float | None:
        """Seconds left for the items not finished (the one running counted whole) at the
        mean pace of those finished; None before one has finished."""
        if not self.seconds:
            return None
        pace = sum(self.seconds) / len(self.seconds)
        running = 0.0 if self._began is None else time.perf_counter() - self._began
        return max(0.0, pace * len(self.todo) - running)

    def start(self, item, note: str = "") -> None:
        """Log that `item` starts: its place, the items left after it, time so far and
        the estimate of what is left."""
        if item in self.todo:
            self.todo.remove(item)
        self.todo.insert(0, item)
        self._began = time.perf_counter()
        total = len(self.finished) + len(self.todo)
        after = ", ".join(map(str, self.todo[1:])) or "none"
        estimate = self.estimate()
        left = "" if estimate is None else f", about {estimate:.0f} s left at the pace so far"
        self._log.info("%s: %s%s (%d of %d; left after it: %s); %.0f s so far%s",
                       self.name, item, f" {note}" if note else "", len(self.finished) + 1,
                       total, after, time.perf_counter() - self.start_time, left)

    def done(self, item, paced: bool = True) -> None:
        """`item` finished: its seconds count in the pace unless not `paced` (an item
        settled without the work the others take, e.g. refused by a bound)."""
        if self._began is not None and paced:
            self.seconds.append(time.perf_counter() - self._began)
        self._began = None
        if item in self.todo:
            self.todo.remove(item)
        self.finished.append(item)

    def again(self, item, note: str = "") -> None:
        """`item` is searched once more (added to what is left) and starts now."""
        self.start(item, note)
