"""Are a one-host mesh (a, b) and its transpose (b, a) the same layer ILPs relabelled?

Issue 45 asked for the pair to be solved once. This plans one `planning_time` row with
one solver job (``AUTOPAR_JOBS=1``: every ILP solved in this process, its CPU seconds
counted here) and prints:

- per logical mesh shape, the layer ILPs built and solved (a ring re-solve,
  `exact_ring_problem`, counts on its mesh) and their build and solve CPU seconds;
- per layer cost table (one per microbatch count), how many (layer structure, level)
  costs on (a, b) equal those on (b, a) bit for bit, and each pair that differs (pairs
  of whole hosts apart: axis 0 crosses hosts there, so they are no twins);
- the predicted step time and each stage's mesh.

With ``--drop`` it plans without the one-host shapes (a, b) with a > b > 1 instead
(what solving one of each pair would give were the other dropped): the predicted step
time and layer ILP count to compare with the row's.

Usage (the demo: under a minute; the CLI row ``llama-8B@8-cli``: some 5 CPU minutes)::

    python -m benchmarks.investigations.twin_meshes demo
    python -m benchmarks.investigations.twin_meshes demo --drop

Findings at 14901d8 (tests/test_twin_meshes.py says why): the demo's layers 0 and 1 are
cheaper on (4, 2) than on (2, 4), its stage is on (4, 2), and dropping (4, 2) moves its
prediction from 0.026407624841747968 to 0.028053746063622972 s; on the CLI row 15 of 24
pairs differ (its level-0 pairs by some 1e-7 of the cost, leaner levels by up to 4 %),
its stage is on (2, 4), and dropping (4, 2) leaves its prediction (12.71191422585544 s)
with 84 layer ILPs instead of 102; on llama-8B@64 1 of its 6 one-host pairs differs.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["AUTOPAR_JOBS"] = "1"
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

import autopar  # noqa: E402
from autopar.inter import _ilp_driver, _layer_table, _submesh  # noqa: E402


def _record(tables: list, shapes: dict, counts: dict) -> None:
    """Patch the layer table so that each table made lands in `tables`, each ILP built
    maps id(problem) -> mesh shape in `shapes`, and `counts[(shape, what)]` sums
    [ILPs, CPU seconds] of builds and solves."""
    init = _layer_table.LayerCostTable.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        tables.append(self)

    def timed(build, what):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            prepared = build(*args, **kwargs)
            if prepared is not None:
                shapes[id(prepared.problem)] = prepared.mesh.shape
                entry = counts[(prepared.mesh.shape, what)]
                entry[0] += 1
                entry[1] += time.process_time() - start
            return prepared
        return wrapper

    solve = _ilp_driver.solve

    def solved(problem, **solve_args):
        start = time.process_time()
        try:
            return solve(problem, **solve_args)
        finally:
            entry = counts[(shapes.get(id(problem)), "solve")]
            entry[0] += 1
            entry[1] += time.process_time() - start

    _layer_table.LayerCostTable.__init__ = recorded
    _layer_table.prepare_on_mesh = timed(_layer_table.prepare_on_mesh, "build")
    _layer_table.exact_ring_problem = timed(_layer_table.exact_ring_problem, "ring build")
    _ilp_driver.solve = solved


def _drop_transposes() -> None:
    """Plan without the one-host (a, b) with a > b > 1 (every module that reads the
    shapes imported `logical_mesh_shapes` by name)."""
    from autopar.inter import _choose, _floor_reach, _stage_costs, _submesh_cut

    shapes = _submesh.logical_mesh_shapes

    def kept(sub, every=False):
        found = shapes(sub, every)
        if sub.num_hosts == 1:
            found = [s for s in found if not (len(s) == 2 and s[0] > s[1] > 1)]
        return found

    for module in (_submesh, _choose, _floor_reach, _stage_costs, _submesh_cut):
        module.logical_mesh_shapes = kept


def _compare(table) -> None:
    """The table's (a, b) costs against its (b, a) ones, per structure and level; pairs
    of more devices than a host has (a submesh of whole hosts: axis 0 crosses hosts, the
    pair are no twins) apart."""
    found = {True: [0, []], False: [0, []]}  # one host? -> [equal, differing]
    for (fingerprint, shape, level), cost in table._cache.items():
        if len(shape) != 2 or shape[0] >= shape[1]:
            continue
        twin = table._cache.get((fingerprint, shape[::-1], level), "unknown")
        if twin == "unknown":
            continue
        tally = found[shape[0] * shape[1] <= table.cluster.devices_per_host]
        if twin == cost:
            tally[0] += 1
        else:
            tally[1].append((shape, level, fingerprint[:12], cost, twin))
    print(f"table of {table.num_microbatches} microbatch(es): {table.num_ilps} layer ILPs")
    for one_host, (same, differ) in found.items():
        print(f"  {'one host' if one_host else 'across hosts'}: (a, b) / (b, a) pairs "
              f"equal {same}, differ {len(differ)}")
        for shape, level, fingerprint, cost, twin in differ:
            print(f"    {shape} level {level} structure {fingerprint}: latency "
                  f"{getattr(cost, 'latency', cost)!r} against "
                  f"{getattr(twin, 'latency', twin)!r}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("row")
    parser.add_argument("--drop", action="store_true",
                        help="plan without the one-host (a, b), a > b > 1")
    ns = parser.parse_args(argv)
    from benchmarks.planning_time import _row_args

    tables, shapes, counts = [], {}, collections.defaultdict(lambda: [0, 0.0])
    _record(tables, shapes, counts)
    if ns.drop:
        _drop_transposes()
    step, args, cluster, micro = _row_args(ns.row)
    cpu, wall = time.process_time(), time.perf_counter()
    plan = autopar.plan(step, *args, cluster=cluster, num_microbatches=micro, cache=False)
    print(f"{ns.row}{' --drop' if ns.drop else ''}: {time.perf_counter() - wall:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} CPU s; predicted {plan.predicted_step_time!r} s; "
          f"{sum(t.num_ilps for t in tables)} layer ILPs")
    for (shape, what), (count, seconds) in sorted(counts.items(), key=str):
        print(f"  {shape} {what}: {count}, {seconds:.2f} CPU s")
    for table in tables:
        _compare(table)
    meshes = [str(s.mesh.shape) for s in getattr(plan, "stages", ()) if hasattr(s, "mesh")]
    print(f"stage meshes: {', '.join(meshes) or plan}")


if __name__ == "__main__":
    main()
