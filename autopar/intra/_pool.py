"""Sharding ILPs solved side by side in worker processes (issue 18).

A search solves hundreds to thousands of sharding ILPs, many of them independent (every
layer structure on every logical mesh before the stage DP starts; the layers of a stage at
one memory level). Their problems are plain numbers (`ShardingProblem`), so they can be
solved elsewhere: `SolverPool` keeps `jobs()` worker processes, each reading problems from
its stdin and writing `Solution`s (or the exception the solve raised) to its stdout, and
`submit` hands a problem to the next free one.

The workers are plain subprocesses (`autopar.intra._pool_worker`) rather than
`multiprocessing`'s: those re-import the caller's main module, which a user's training
script need not guard with ``if __name__ == "__main__"``. A solve is deterministic given
its problem (HiGHS in one thread, a CPU-second time limit, canonical ties), so the pool
changes when a plan is found, never which plan.

`AUTOPAR_JOBS` sets the number of workers (default: the CPUs this process may use);
``AUTOPAR_JOBS=1`` solves every ILP in the calling process.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("autopar")

JOBS_ENV = "AUTOPAR_JOBS"
_HEADER = 8  # bytes of a frame's length, little-endian


def jobs() -> int:
    """Worker processes for the ILPs: `AUTOPAR_JOBS`, else the CPUs this process may use.

    Raises `ValueError` when `AUTOPAR_JOBS` is not a whole number >= 1."""
    raw = os.environ.get(JOBS_ENV, "").strip()
    if not raw:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{JOBS_ENV}={raw!r} is not a number of worker processes: set it to a whole "
            f"number >= 1 (1 solves every sharding ILP in this process), or unset it to "
            f"use one worker per CPU."
        )
    return value


class WorkerDied(RuntimeError):
    """A worker process ended before it answered (killed, out of memory)."""


def _write_frame(stream, payload: bytes) -> None:
    stream.write(len(payload).to_bytes(_HEADER, "little"))
    stream.write(payload)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    header = stream.read(_HEADER)
    if len(header) < _HEADER:
        return None
    size = int.from_bytes(header, "little")
    payload = stream.read(size)
    return payload if len(payload) == size else None


# A worker imports only the solver's modules (numpy, pulp, highspy): the `autopar` and
# `autopar.intra` packages are registered as bare packages, without running their
# `__init__`s, which import JAX and the rest of autopar (0.9 s and 300 MB more per
# worker). The solver's modules import nothing else of autopar.
_BOOTSTRAP = """
import sys, types
for name, path in {packages!r}:
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
from autopar.intra._pool_worker import serve
serve()
"""


class _Worker:
    def __init__(self):
        intra = Path(__file__).resolve().parent
        packages = (("autopar", str(intra.parent)), ("autopar.intra", str(intra)))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP.format(packages=packages)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )

    def call(self, payload: bytes) -> bytes:
        try:
            _write_frame(self.process.stdin, payload)
            answer = _read_frame(self.process.stdout)
        except OSError as err:  # a broken pipe: the worker has ended
            raise WorkerDied(f"a sharding ILP worker stopped: {err}") from err
        if answer is None:
            code = self.process.poll()
            raise WorkerDied(f"a sharding ILP worker stopped (exit status {code})")
        return answer

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SolverPool:
    """`size` worker processes solving `autopar.intra.solve` calls; started on the first
    `submit`, stopped by `close` (and at exit)."""

    def __init__(self, size: int):
        self.size = size
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: list[_Worker] = []
        self._threads: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # A problem's worker died twice, or no worker could start: `solver_pool` stops
        # handing the pool out.
        self.broken = False

    @property
    def started(self) -> bool:
        """Whether the workers have been started (and not closed since)."""
        return self._threads is not None

    def _start(self) -> None:
        with self._lock:
            if self._threads is not None:
                return
            log.info("solving sharding ILPs in %d worker processes (%s)", self.size, JOBS_ENV)
            for _ in range(self.size):
                try:
                    worker = _Worker()
                except OSError:
                    self.broken = True  # cannot start a process here: not tried again
                    raise
                self._workers.append(worker)
                self._idle.put(worker)
            self._threads = ThreadPoolExecutor(self.size, thread_name_prefix="autopar-ilp")

    def submit(self, problem, **solve_args) -> Future:
        """A future of `solve(problem, **solve_args)`: its `Solution`, or the exception
        the solve raised (`MemoryBudgetError`, ...) re-raised by `result()`. A worker
        that ends first is replaced and the problem solved by the new one; `WorkerDied`
        when that one ends too."""
        self._start()
        payload = pickle.dumps((problem, solve_args), protocol=pickle.HIGHEST_PROTOCOL)
        return self._threads.submit(self._run, payload)

    def _run(self, payload: bytes):
        worker = self._idle.get()
        try:
            answer = worker.call(payload)
        except WorkerDied:
            # Killed from outside (the OOM killer, a stray signal): a new worker takes the
            # problem once; a second death is the problem's own and is raised.
            worker = self._replace(worker)
            try:
                answer = worker.call(payload)
            except WorkerDied:
                # Twice in a row: the problem, or workers that cannot run here (a Python
                # without the solver's modules). The search goes on without the pool.
                self.broken = True
                self._idle.put(self._replace(worker))
                raise
        self._idle.put(worker)
        kind, value = pickle.loads(answer)
        if kind == "raise":
            raise value
        return value

    def _replace(self, dead: _Worker) -> _Worker:
        dead.close()
        worker = _Worker()
        with self._lock:
            self._workers[self._workers.index(dead)] = worker
        return worker

    def close(self) -> None:
        with self._lock:
            if self._threads is None:
                return
            self._threads.shutdown(wait=True)
            self._threads = None
            for worker in self._workers:
                worker.close()
            self._workers.clear()
            self._idle = queue.Queue()


_POOL: SolverPool | None = None


def solver_pool() -> SolverPool | None:
    """The process's shared pool; None when `jobs()` is 1 or the pool broke."""
    global _POOL
    size = jobs()
    if size <= 1 or (_POOL is not None and _POOL.broken):
        return None
    if _POOL is None or _POOL.size != size:
        if _POOL is not None:
            _POOL.close()
        _POOL = SolverPool(size)
    return _POOL


def warm_up() -> None:
    """Start the shared pool's workers now (nothing when `solver_pool` has none), so that
    their start-up (a Python and the solver's modules: about 0.25 CPU s each) runs beside
    the caller's own work instead of delaying the first ILP: `autopar.plan` calls it
    before tracing the step. A pool whose workers cannot start is left broken (its
    ILPs are solved in this process, as `submit` failing leaves it)."""
    pool = solver_pool()
    if pool is None:
        return
    try:
        pool._start()
    except OSError as err:
        log.warning("the sharding ILP pool failed (%s): solving here instead", err)


@atexit.register
def _close_pool() -> None:
    if _POOL is not None:
        _POOL.close()
