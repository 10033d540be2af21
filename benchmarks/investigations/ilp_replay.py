"""What a row's layer ILPs cost to solve, and where the planning process waits for them.

Three commands over a `planning_time` row (issue 45):

- ``dump ROW FILE``: plans the row once with the workers off (``AUTOPAR_JOBS=1``),
  recording every sharding ILP the search solves (its problem, `solve`'s arguments and
  the choices found), and pickles them to FILE.
- ``replay FILE [--rounds N]``: solves them all again here and prints each round's CPU
  seconds, the problems over 0.1 CPU s, and how many choices differ from the recorded
  ones. Run in two checkouts on one FILE (``PYTHONPATH`` and the working directory of
  each), interleaved, it compares their solvers on the same problems: 0 differing means
  the same choices to the last index.
- ``timeline ROW``: plans the row with the solver pool and prints, in seconds from the
  start of `autopar.plan`, when each layer ILP's build began and ended in this process
  (mesh shape, layer graph) and when its solve came back from a worker; then the
  garbage collector's runs and CPU seconds, in the whole plan and in the layer ILPs.
  The critical path is the builds here while the workers keep up; timings on a shared
  machine are noisy (compare CPU seconds, and note the load).

Usage (the demo: a few seconds each; llama-8B@64's dump about a minute, 180 MB)::

    python -m benchmarks.investigations.ilp_replay dump demo /tmp/demo_ilps.pkl
    python -m benchmarks.investigations.ilp_replay replay /tmp/demo_ilps.pkl --rounds 3
    python -m benchmarks.investigations.ilp_replay timeline demo
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.getcwd())


def _plan(row: str):
    import autopar
    from benchmarks.planning_time import _row_args

    step, args, cluster, micro = _row_args(row)
    return autopar.plan(step, *args, cluster=cluster, num_microbatches=micro, cache=False)


def dump(row: str, path: str) -> None:
    os.environ["AUTOPAR_JOBS"] = "1"
    from autopar.inter import _ilp_driver

    solved = []
    original = _ilp_driver.solve

    def recorded(problem, **solve_args):
        solution = original(problem, **solve_args)
        solved.append((problem, solve_args, solution.choices))
        return solution

    _ilp_driver.solve = recorded
    plan = _plan(row)
    with open(path, "wb") as out:
        pickle.dump(solved, out, protocol=pickle.HIGHEST_PROTOCOL)
    print(f"{row}: {len(solved)} ILPs solved, predicted {plan.predicted_step_time!r} s; "
          f"written to {path}")


def replay(path: str, rounds: int) -> None:
    from autopar.intra import solve

    with open(path, "rb") as f:
        solved = pickle.load(f)
    for r in range(rounds):
        total, differing, slow = 0.0, 0, []
        for i, (problem, solve_args, choices) in enumerate(solved):
            start = time.process_time()
            found = solve(problem, **solve_args)
            seconds = time.process_time() - start
            total += seconds
            differing += found.choices != choices
            if seconds > 0.1:
                slow.append(f"{i}: {seconds:.3f}")
        print(f"round {r + 1}: {total:.3f} CPU s for {len(solved)} ILPs, {differing} "
              f"differing; over 0.1 s: {', '.join(slow) or 'none'}")


def timeline(row: str) -> None:
    from autopar.inter import _layer_table
    from autopar.intra import _pool

    start = time.perf_counter()
    events = []

    def now() -> float:
        return time.perf_counter() - start

    prepare = _layer_table.prepare_on_mesh

    def timed_prepare(sub, cluster, mesh, *args, **kwargs):
        began = now()
        prepared = prepare(sub, cluster, mesh, *args, **kwargs)
        events.append((began, f"build {mesh.shape} of graph {id(sub) % 10_000}: "
                              f"{began:.3f} - {now():.3f}"))
        return prepared

    submit = _pool.SolverPool.submit

    def timed_submit(self, problem, **solve_args):
        sent = now()
        future = submit(self, problem, **solve_args)
        future.add_done_callback(lambda _: events.append(
            (sent, f"  solve sent {sent:.3f}, back {now():.3f}")))
        return future

    _layer_table.prepare_on_mesh = timed_prepare
    _pool.SolverPool.submit = timed_submit
    collections = {"all": [0, 0.0], "layer ILPs": [0, 0.0]}
    began = [0.0]
    inside = [0]
    drive = _layer_table.LayerCostTable._drive

    def counted_drive(self, *args, **kwargs):
        inside[0] += 1
        try:
            return drive(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    def collected(phase, info):
        if phase == "start":
            began[0] = time.process_time()
            return
        for key in ("all", "layer ILPs") if inside[0] else ("all",):
            collections[key][0] += 1
            collections[key][1] += time.process_time() - began[0]

    _layer_table.LayerCostTable._drive = counted_drive
    gc.callbacks.append(collected)
    cpu = time.process_time()
    plan = _plan(row)
    gc.callbacks.remove(collected)
    print(f"{row}: plan in {now():.3f} s wall, {time.process_time() - cpu:.2f} CPU s here, "
          f"predicted {plan.predicted_step_time!r} s")
    for _, line in sorted(events, key=lambda e: e[0]):
        print(line)
    for key, (count, seconds) in collections.items():
        print(f"garbage collections ({key}): {count}, {seconds:.3f} CPU s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("row")
    d.add_argument("file")
    r = sub.add_parser("replay")
    r.add_argument("file")
    r.add_argument("--rounds", type=int, default=1)
    t = sub.add_parser("timeline")
    t.add_argument("row")
    ns = parser.parse_args(argv)
    if ns.command == "dump":
        dump(ns.row, ns.file)
    elif ns.command == "replay":
        replay(ns.file, ns.rounds)
    else:
        timeline(ns.row)


if __name__ == "__main__":
    main()
