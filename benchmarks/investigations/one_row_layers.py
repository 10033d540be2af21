"""How do a row's layers at one-row microbatches differ from the reference count's?

Traces one `planning_time.py` row at two microbatch counts as the search does (automatic
layers or the layer scan one iteration per sub-scan) and cuts each into layers. Per
layer it prints both node counts, the primitives one has more of than the other, whether
the two have the same operations in the same order (then every layout of the reference
applies as it is), and else whether `autopar.inter._one_row.row_map` pairs them (then the
reference's layouts are carried onto the one-row layer and priced; "no" where it does not,
e.g. a scanned layer: the layer solves its own ILPs). No ILP is solved.

Usage (the CLI line's counts 32 and 64: about 22 CPU s)::

    python -m benchmarks.investigations.one_row_layers --row llama-8B@8-cli --counts 32 64

On llama-8B@8-cli every layer but the last two (the loss, 2 and 4 nodes, the same) has
14 to 18 more `broadcast_in_dim` nodes at 64 microbatches (of 1,561 to 2,216 nodes), each
pairs: `autopar/inter/_one_row.py`.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

from autopar.graph import trace  # noqa: E402
from autopar.inter import assign_layers, layer_scan  # noqa: E402
from autopar.inter._one_row import row_map  # noqa: E402
from autopar.inter.passes import per_iteration  # noqa: E402
from autopar.inter.passes._partition import partition  # noqa: E402
from autopar.search import _pipeline  # noqa: E402
from autopar.search._options import options_from  # noqa: E402
from benchmarks.planning_time import _row_args  # noqa: E402


def layer_graphs(step, args, options, count: int, scan_length):
    """The step at one of `count` microbatches, cut into its layers' graphs as the layer
    cost table cuts them."""
    graph = _pipeline._trace_microbatch(
        step, args, options, count, None if scan_length else options.num_layers,
        per_iteration(scan_length) if scan_length else None)
    layers = assign_layers(graph)
    return partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)]).stage_graphs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama-8B@8-cli", help="a planning_time row")
    parser.add_argument("--counts", type=int, nargs=2, default=(32, 64),
                        metavar=("REFERENCE", "ONE_ROW"))
    parsed = parser.parse_args(argv)
    step, args, _, micro = _row_args(parsed.row)
    options = options_from("plan", {"num_microbatches": micro})
    stack = layer_scan(trace(step, *args, batch_argnums=options.batch_argnums))
    scan_length = None if stack is None else stack.params["length"]
    theirs, mine = (layer_graphs(step, args, options, m, scan_length) for m in parsed.counts)
    print(f"{parsed.row}: {parsed.counts[1]} microbatch(es) against {parsed.counts[0]}, "
          f"{'a layer scan of ' + str(scan_length) if scan_length else 'automatic layers'}")
    for k, (a, b) in enumerate(zip(theirs, mine)):
        pa = collections.Counter(n.primitive for n in a.nodes)
        pb = collections.Counter(n.primitive for n in b.nodes)
        same = [n.primitive for n in a.nodes] == [n.primitive for n in b.nodes]
        paired = "-" if same else ("yes" if row_map(b, a) is not None else "no")
        print(f"layer {k}: {len(a.nodes)} / {len(b.nodes)} nodes; more at "
              f"{parsed.counts[1]}: {dict(pb - pa)}; fewer: {dict(pa - pb)}; same operations: "
              f"{same}; paired: {paired}")


if __name__ == "__main__":
    main()
