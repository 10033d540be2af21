"""What does pricing a shared layout cost, built alone against read out of the whole problem?

Plans one `planning_time.py` row (`num_microbatches="auto"`: one count's layer ILPs
solved, their layouts priced on the other counts' layer graphs) in this process with one
solver job, and runs every `price_layout` call of the search both ways: the layout's
strategies built alone (`autopar/intra/_price_layout.py`, what the search uses) and read
out of the layer graph's whole problem (`price_layout(..., whole=True)`). It prints the
CPU seconds of each way over all calls, how many calls gave a plan, and how many gave
plans that differ in any field (stats but build times included; 0 expected), then the
row's predicted step time.

Usage (Llama-8B@64: about 2 CPU minutes on 2 cores)::

    AUTOPAR_JOBS=1 python -m benchmarks.investigations.price_layout_cost --row llama-8B@64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

import autopar  # noqa: E402
from autopar.inter import _repricing  # noqa: E402
from autopar.intra._planner import price_layout  # noqa: E402
from benchmarks.planning_time import _row_args  # noqa: E402


def _differences(new, whole) -> list[str]:
    """The fields in which the two plans differ (build times aside)."""
    if new is None or whole is None:
        return [] if new is None and whole is None else ["one is None"]
    found = [f.name for f in dataclasses.fields(whole)
             if f.name != "stats" and getattr(new, f.name) != getattr(whole, f.name)]
    stats = [({k: v for k, v in p.stats.items() if k != "build_time"}) for p in (new, whole)]
    return found + (["stats"] if stats[0] != stats[1] else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama-8B@64", help="a planning_time.py row")
    args = parser.parse_args()
    tally = {"calls": 0, "plans": 0, "differ": 0, "alone s": 0.0, "whole s": 0.0}

    def both(*call_args, **kwargs):
        start = time.process_time()
        new = price_layout(*call_args, **kwargs)  # first: nothing of the whole memoised
        tally["alone s"] += time.process_time() - start
        start = time.process_time()
        whole = price_layout(*call_args, whole=True, **kwargs)
        tally["whole s"] += time.process_time() - start
        differ = _differences(new, whole)
        if differ:
            print("differs:", differ)
        tally["calls"] += 1
        tally["plans"] += new is not None
        tally["differ"] += bool(differ)
        return new

    _repricing.price_layout = both
    step, step_args, cluster, microbatches = _row_args(args.row)
    plan = autopar.plan(step, *step_args, cluster=cluster, num_microbatches=microbatches,
                        cache=False)
    print(f"{args.row}: {tally['calls']} layouts priced ({tally['plans']} plans), "
          f"{tally['differ']} differ; CPU s built alone {tally['alone s']:.2f}, read out of "
          f"the whole problem {tally['whole s']:.2f}; predicted step "
          f"{plan.predicted_step_time!r} s")


if __name__ == "__main__":
    main()
