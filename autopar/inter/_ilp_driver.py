"""Layer ILPs solved side by side: generators that yield ILPs, driven to their ends.

In: generators (`LayerCostTable._level_steps`) that yield each `PreparedILP` they need
solved and are sent its solution (or the exception its solve raised). Out: what each
generator returns, in order. With a solver pool (`autopar.intra._pool`) every generator's
next ILP is in flight at once; without one, each is solved here.
"""

from __future__ import annotations

import logging
from concurrent import futures

from autopar.graph._collector import fewer_collections
from autopar.intra import MemoryBudgetError, solve
from autopar.intra._planner import PreparedILP
from autopar.intra._pool import WorkerDied

log = logging.getLogger("autopar")


def drive(all_steps: list, pool, finished=None) -> list:
    """Run the generators `all_steps` to their ends, solving the ILPs they yield (in
    `pool` when given: every generator's next ILP is in flight at once); their results in
    order. `finished(done, total)`, when given, is called as each generator ends."""
    results: list = [None] * len(all_steps)
    ended = [0]

    def end(i: int, value) -> None:
        results[i] = value
        ended[0] += 1
        if finished is not None:
            finished(ended[0], len(all_steps))

    # Each ILP goes to the pool as soon as it is built, so that building the next
    # overlaps solving this one; a generator whose solve has come back is sent it between
    # two builds (its next ILP, if any, is then built and in flight before the batch's
    # last), and after the last build as each solve comes back. The order changes when
    # an ILP is solved, never its answer.
    handles = {}
    with fewer_collections():  # see `autopar.graph._collector`
        for i, steps in enumerate(all_steps):
            _advance(i, steps, None, handles, end, pool)
            _advance_ready(all_steps, handles, end, pool, wait=False)
        while handles:
            _advance_ready(all_steps, handles, end, pool, wait=True)
    return results


def _advance_ready(all_steps: list, handles: dict, end, pool, wait: bool) -> None:
    """Send each generator whose solve has come back (or is solved here: no future) its
    outcome, in generator order; with `wait`, first wait for one to come back when none
    has."""
    ready = [i for i, (_, future) in handles.items() if future is None or future.done()]
    if not ready and wait:
        futures.wait([future for _, future in handles.values()],
                     return_when=futures.FIRST_COMPLETED)
        ready = [i for i, (_, future) in handles.items() if future.done()]
    for i in sorted(ready):
        _advance(i, all_steps[i], _outcome(handles.pop(i)), handles, end, pool)


def _advance(i: int, steps, outcome, handles: dict, end, pool) -> None:
    """Send `outcome` (a solution or the exception its solve raised) into generator
    `i`: its next ILP is started (`handles[i]`), or its result goes to `end(i, result)`."""
    try:
        if isinstance(outcome, BaseException) and not isinstance(outcome, MemoryBudgetError):
            prepared = steps.throw(outcome)
        else:
            prepared = steps.send(outcome)
    except StopIteration as stop:
        end(i, stop.value)
        return
    handles[i] = _start_solve(prepared, pool)


def _start_solve(prepared: PreparedILP, pool) -> tuple:
    """(prepared, its solve's future in `pool`, or None: solved by `_outcome`)."""
    if pool is None or pool.broken:
        return prepared, None
    try:
        return prepared, pool.submit(prepared.problem, **prepared.solve_args)
    except OSError as err:  # no worker could start (then the pool is broken)
        log.warning("the sharding ILP pool failed (%s): solving here instead", err)
        return prepared, None


def _outcome(handle: tuple):
    """The solution of a `_start_solve` handle, or the exception its solve raised."""
    prepared, future = handle
    try:
        if future is not None:
            try:
                return future.result()
            except WorkerDied as err:
                log.warning("%s: solving its ILP here instead", err)
        return solve(prepared.problem, **prepared.solve_args)
    except Exception as err:
        return err
