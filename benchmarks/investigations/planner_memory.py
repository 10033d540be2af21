"""Where the planner's memory goes (issue 18's 4 GB): one `planning_time.py` row planned in
this process, with the resident set before and after the stage DP and, after it, the size
of each of the search's caches.

Sizes are a walk of each cache's objects (`sys.getsizeof`, numpy arrays by their bytes),
each object counted once, under the first cache that reaches it, after the layer graphs
(which every cache points into). The walk itself takes memory: the process's peak after it
is not the search's (use `planning_time.py` for that).

Run: ``python benchmarks/investigations/planner_memory.py gpt-39B@64`` (about a minute on 2
cores) or ``gpt-175B@1024`` (about nine minutes).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _resident() -> str:
    """VmRSS and VmHWM of this process (Linux), MB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, kb = line.split()[:2]
            fields[name.rstrip(":")] = int(kb) / 1024
    return ", ".join(f"{k} {v:,.0f} MB" for k, v in fields.items())


def _deep_size(obj, seen: set[int]) -> int:
    """Bytes of `obj` and what it reaches that `seen` does not hold yet."""
    import numpy as np

    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += o.nbytes + sys.getsizeof(np.empty(0))
            continue
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.append(o.__dict__)
        elif hasattr(o, "__slots__"):
            stack.extend(getattr(o, s) for s in o.__slots__ if hasattr(o, s))
    return total


def main(row: str) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, str(ROOT))
    import autopar
    from autopar.inter import _choose, _stage_costs
    from autopar.intra import _planner as intra_planner
    from benchmarks.planning_time import _row_args

    plan_stages = _choose.plan_stages

    def measured(*args, **kwargs):
        print(f"before the stage DP: {_resident()}", flush=True)
        result = plan_stages(*args, **kwargs)
        print(f"after the stage DP: {_resident()}", flush=True)
        cost = args[3]
        inner = cost.stage_cost if isinstance(cost, _stage_costs._Restricted) else cost
        table, seen = inner.table, set()
        mb = 2**20
        print(f"  layer graphs: {_deep_size(table.per_layer, seen) / mb:,.0f} MB")
        for name in ("_plans", "_cache", "_remat_cache", "range_cache"):
            held = getattr(table, name)
            print(f"  LayerCostTable.{name}: {len(held):,} entries, "
                  f"{_deep_size(held, seen) / mb:,.0f} MB")
        for name in ("_orders", "_hopeless", "_prefix"):
            held = getattr(inner, name)
            print(f"  _StageCosts.{name}: {len(held):,} entries, "
                  f"{_deep_size(held, seen) / mb:,.0f} MB")
        built = dict(intra_planner._BUILT.by_graph)
        print(f"  built problems: {len(intra_planner._BUILT.order):,}, "
              f"{intra_planner._BUILT.bytes / mb:,.0f} MB as the cache counts them, "
              f"{_deep_size(built, seen) / mb:,.0f} MB with what they reach", flush=True)
        return result

    _choose.plan_stages = measured
    step, args, cluster, micro = _row_args(row)
    start = time.perf_counter()
    plan = autopar.plan(step, *args, cluster=cluster, num_microbatches=micro, cache=False)
    print(f"planned in {time.perf_counter() - start:.1f} s, predicted step "
          f"{plan.predicted_step_time:.4g} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpt-39B@64")
