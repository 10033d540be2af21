"""Progress inside one microbatch count's stage DP: how many layer ILPs are solved, how
long they took, and how many of the fastest plans (level 0) are at most left, logged at
INFO (the command line prints it, `autopar._progress.show_progress`) at most every
`EVERY` seconds, after a solve. The counts' own progress (which count, how many left, an
estimate) is `autopar._progress.Countdown`'s, in `autopar.search._pipeline`."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("autopar")

EVERY = 20.0  # seconds between two progress lines of one table


def level0_left(table) -> tuple[int, int]:
    """(level-0 layer plans not known yet, all of them): one per layer structure and
    candidate shape (`LayerCostTable.candidate_shapes`); the bounds skip many, so the
    first is the most that are left."""
    keys = {(f, tuple(s)) for f in set(table.fingerprints) for s in table.candidate_shapes}
    left = sum((f, s, 0) not in table._cache for f, s in keys)
    return left, len(keys)


def report(table, now: float | None = None, batch: tuple[int, int] | None = None,
           seconds: float = 0.0) -> bool:
    """Log `table`'s progress line when `EVERY` seconds have passed since its last one;
    whether it did. `batch`: (done, all) of the layer plans being solved side by side now
    (`LayerCostTable.prefetch`), `seconds` into it (not yet in `ilp_seconds`)."""
    now = time.perf_counter() if now is None else now
    if now - table.progress_at < EVERY:
        return False
    table.progress_at = now
    left, total = level0_left(table)
    priced = f", {table.num_priced} priced from another count's layouts" \
        if table.num_priced else ""
    now_solving = "" if batch is None or batch[1] < 2 else \
        f" ({batch[0]} of the {batch[1]} plans solved side by side now are done)"
    log.info("%d microbatch(es): %d layer ILPs so far, %.0f s%s%s; fastest layer plans: %d of "
             "%d not known yet, at most (leaner levels as the stages need)",
             table.num_microbatches, table.num_ilps, table.ilp_seconds + seconds, priced,
             now_solving, left, total)
    return True
