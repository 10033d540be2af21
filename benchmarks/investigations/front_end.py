"""What the planner's front end costs: a row's traces and layer clustering, count by count.

For a `planning_time` row, does what the pipeline search does before any ILP, for each
microbatch count it tries (`PlanOptions.microbatch_counts`, in `_reference_first`'s order):
traces the step at that microbatch size (`_trace_microbatch`: with the layer scan run one
iteration per sub-scan, or with automatic layer marks), assigns its layers and makes its
layer cost table (`assign_layers`, `layer_cost_table`: each layer cut out, weighted and
fingerprinted), keeping each count's graph and table as the search does, under the same
`gc.freeze` of what existed before. Prints per count the CPU seconds of the trace and of
the clustering and the garbage collections that ran in them (how many, wall seconds inside
them), then the totals, and a digest of every graph (variables, nodes, parameters, costs)
and of each table's layer fingerprints: two commits that must trace and cluster the same
graphs print the same digests.

Usage (llama-8B@64: three counts, about 10 s a round on 2 cores)::

    python -m benchmarks.investigations.front_end --row llama-8B@64 --rounds 2

CPU seconds on a shared machine vary by 20 % from round to round: compare commits in one
run of each, interleaved, and look at the medians.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

from autopar import _memo  # noqa: E402
from autopar.graph import tied_state, trace  # noqa: E402
from autopar.inter import assign_layers, layer_cost_table, layer_scan  # noqa: E402
from autopar.inter.passes import per_iteration  # noqa: E402
from autopar.search import _pipeline  # noqa: E402
from autopar.search._microbatch import batch_size  # noqa: E402
from autopar.search._options import options_from  # noqa: E402
from benchmarks.planning_time import _row_args  # noqa: E402


def graph_digest(graph) -> str:
    """Every variable and node of `graph` (shapes, roles, parameters as text, costs)."""
    h = hashlib.sha256()
    for v in graph.vars:
        h.update(repr((v.id, v.shape, v.dtype, v.role, v.producer, v.path)).encode())
    for n in graph.nodes:
        h.update(repr((n.id, n.primitive, n.inputs, n.outputs, n.flops, n.bytes_read,
                       n.bytes_written, n.remat, n.source,
                       sorted(map(str, n.params.items())))).encode())
    h.update(repr((graph.invars, graph.outvars, graph.name, graph.arg_names)).encode())
    return h.hexdigest()[:16]


class _Collections:
    """Counts the garbage collections and the wall seconds inside them."""

    def __init__(self):
        self.count, self.seconds, self._start = 0, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


def one_round(step, args, cluster, options, counts, scan_length, collections):
    """{count: (trace CPU, clustering CPU, collections, their wall s, digests)}."""
    _memo.clear_all()
    search = _pipeline._PipelineSearch(step, args, cluster, options, {})
    kept, found = [], {}
    for m in counts:
        before = (collections.count, collections.seconds)
        start = time.process_time()
        graph = _pipeline._trace_microbatch(
            step, args, options, m, None if scan_length else options.num_layers,
            per_iteration(scan_length) if scan_length else None)
        traced = time.process_time()
        layers = assign_layers(graph)
        table = layer_cost_table(graph, layers, search.dp_cluster, m, search.stage_options,
                                 tied_state(graph, options.donate_argnums))
        clustered = time.process_time()
        kept.append((graph, table))  # the search keeps each count's graph and table
        digest = (graph_digest(graph),
                  hashlib.sha256(repr(table.fingerprints).encode()).hexdigest()[:16])
        found[m] = (traced - start, clustered - traced, collections.count - before[0],
                    collections.seconds - before[1], digest)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama-8B@64", help="a planning_time row")
    parser.add_argument("--rounds", type=int, default=2)
    parsed = parser.parse_args(argv)
    step, args, cluster, micro = _row_args(parsed.row)
    options = options_from("plan", {"num_microbatches": micro})
    full = trace(step, *args, batch_argnums=options.batch_argnums)
    stack = layer_scan(full)
    scan_length = None if stack is None else stack.params["length"]
    rows = batch_size(full)
    counts = options.microbatch_counts(rows)
    if len(counts) > 1:
        counts = _pipeline._reference_first(counts, rows, cluster)
    del full
    print(f"{parsed.row}: counts {counts}, "
          f"{'a layer scan of ' + str(scan_length) if scan_length else 'automatic layers'}")
    collections = _Collections()
    gc.freeze()  # as `autopar.search._api._heap_frozen` does for a search
    rounds = []
    for r in range(parsed.rounds):
        found = one_round(step, args, cluster, options, counts, scan_length, collections)
        rounds.append(found)
        for m, (t, c, n, s, digest) in found.items():
            print(f"round {r}: {m:>3} microbatch(es): trace {t:.2f} CPU s, clustering "
                  f"{c:.2f} CPU s; {n} collections ({s:.2f} s wall); digests {digest}")
        print(f"round {r}: total trace {sum(f[0] for f in found.values()):.2f} CPU s, "
              f"clustering {sum(f[1] for f in found.values()):.2f} CPU s", flush=True)
    gc.unfreeze()
    trace_cpu = [sum(f[0] for f in found.values()) for found in rounds]
    cluster_cpu = [sum(f[1] for f in found.values()) for found in rounds]
    print(f"median over {len(rounds)} round(s): trace {statistics.median(trace_cpu):.2f} CPU s, "
          f"clustering {statistics.median(cluster_cpu):.2f} CPU s")


if __name__ == "__main__":
    main()
