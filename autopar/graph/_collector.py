"""`collector_paused`: Python's garbage collector held off while a front-end phase runs.

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
