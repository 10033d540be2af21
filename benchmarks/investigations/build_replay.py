"""What building the sharding problems costs: a row's `build_problem` calls, replayed.

Plans a `planning_time` row once (workers off), recording every `build_problem` call the
search makes, then builds them all again from empty memos (`autopar._memo.clear_all`)
`--rounds` times and prints each round's CPU seconds and a digest of every problem built
(node and edge costs, memory, footprints, edges, memory groups, followers, and each
strategy's specs, collectives and costs, to the last bit). Two commits that must build the
same problems print the same digest; the CPU seconds compare their builds alone, without
the ILPs and the search around them (issue 45).

Usage (llama-8B@64: about a minute to plan, 12-25 s a round on 2 cores)::

    python -m benchmarks.investigations.build_replay --row llama-8B@64 --rounds 2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["AUTOPAR_JOBS"] = "1"  # every build in this process
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

import numpy as np  # noqa: E402

import autopar  # noqa: E402
import autopar.intra._planner as _planner  # noqa: E402
from autopar import _memo  # noqa: E402
from autopar.intra._problem import build_problem  # noqa: E402
from benchmarks.planning_time import _row_args  # noqa: E402


def _digest(built: list) -> str:
    h = hashlib.sha256()
    for b in built:
        p = b.problem
        for arr in (*p.node_costs, *p.edge_costs, *p.node_memory, *(p.footprint or ())):
            h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
        followers = sorted((v, u, tuple(m)) for v, (u, m) in p.followers.items())
        h.update(repr((p.edges, p.memory_groups, followers, p.names)).encode())
        h.update(repr([(n.name, [(s.name, s.in_specs, s.out_specs, s.collectives,
                                  s.compute_cost, s.comm_cost, s.out_bytes)
                                 for s in n.strategies]) for n in b.ilp_nodes]).encode())
    return h.hexdigest()[:16]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama-8B@64", help="a planning_time row")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    calls = []

    def recorded(*a, **k):
        calls.append((a, k))
        return build_problem(*a, **k)

    _planner.build_problem = recorded
    step, step_args, cluster, micro = _row_args(args.row)
    plan = autopar.plan(step, *step_args, cluster=cluster, num_microbatches=micro,
                        cache=False)
    _planner.build_problem = build_problem
    print(f"{args.row}: plan {plan.predicted_step_time!r} s, {len(calls)} builds", flush=True)
    for r in range(args.rounds):
        _memo.clear_all()
        start = time.process_time()
        built = [build_problem(*a, **k) for a, k in calls]
        cpu = time.process_time() - start
        print(f"round {r}: {cpu:.2f} CPU s, digest {_digest(built)}", flush=True)
        del built


if __name__ == "__main__":
    main()
