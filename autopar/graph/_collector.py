"""Python's garbage collector during a plan: held off while a front-end phase runs
(`collector_paused`), run less often while a search allocates (`fewer_collections`), and
kept off the heap that existed before the search (`heap_frozen`).

Tracing a step (`autopar.graph.trace`: JAX's tracer, then one `Node` and `Var` per
equation), cutting a stacked layer scan into pieces (`split_stacked`) and cutting a traced
step into its layers (`partition`, `structural_fingerprint`, `assign_layers`) allocate
hundreds of thousands of small objects and free almost none of them before they end. Each
700 allocations the collector runs, and every tenth of those runs walks the older objects
too, which grow with what the search has made so far (the graphs of the counts traced
before, their layer tables, the ILP problems). llama-8B@64's three counts ran some 330
collections each while traced and cut into layers, 19 with these phases held off, and
took 2.53 CPU s to trace and 1.29 to cut into layers against 2.20 and 1.12 (medians of two
interleaved rounds on a loaded machine, both with the structure memo of
`autopar.graph._jaxpr_text`; `python -m benchmarks.investigations.front_end --row
llama-8B@64`); gpt-175B@1024's one count 2,815 collections against 106. What runs is the
same, so the graphs are the same; the garbage such a phase leaves is collected when the
collector next runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within this block (or a function decorated with it) the garbage collector does not
    run; it is switched back on after. Nested blocks, and a caller who switched it off
    (`gc.disable`), are left as they are."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# The collector's first threshold while a plan is searched (`fewer_collections`): a layer
# ILP's build allocates some hundred thousand small objects, most of which live on in its
# problem and memos. At Python's default (700) the collector ran 469 times in the demo's
# layer ILPs, 0.19 of the main process's ~2 CPU s there, and 644 times (0.39 s) in its
# whole plan; at 10,000, 26 times (0.09 s) there and 194 times (0.14 s) in all (counted
# with a `gc.callbacks` spy around `autopar.plan` of `benchmarks/planning_time.py`'s demo
# row).
PLANNING_GC_THRESHOLD = 10_000


@contextlib.contextmanager
def fewer_collections(threshold: int = PLANNING_GC_THRESHOLD) -> Iterator[None]:
    """Within this block the collector's first threshold is at least `threshold` (never
    lowered), restored after; nothing where the collector is off. Garbage is collected as
    before, less often: no cost or plan depends on when."""
    if not gc.isenabled():
        yield
        return
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], threshold), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """Leave the objects that exist before a search (JAX's, the caller's, the traced graph)
    out of the garbage collector's scans while it runs (`gc.freeze`), and hand them back
    after (`gc.unfreeze`). The search allocates millions of small objects, so the
    collector runs full collections during it, and each would walk that whole heap again:
    the demo's search took 2.4-2.7 s frozen against 2.7-3.2 s. Objects the search makes
    are collected as usual. Where the caller has frozen objects of its own (before a
    fork, say), or turned the collector off, nothing is changed."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
