"""What a per-count trace's conversion to an `OpGraph` costs, apart from JAX's tracing.

For a `planning_time` row, traces the step at one microbatch count as the pipeline search
does (`_pipeline._trace_microbatch`: the layer scan run one iteration per sub-scan, or
automatic layer marks), keeps the jaxpr JAX made, then rebuilds the `OpGraph` from it
(`autopar.graph._trace._GraphBuilder`: nodes, variables, FLOPs, bytes, sources) `--repeats`
times and prints the CPU seconds of each build, and a digest of the nodes' costs (two
commits that must build the same graph print the same digest). The whole trace of a count
costs several times more (JAX's tracing, linearization and transposition); this isolates
the part the tracer's own code adds.

Usage (llama-8B@64, count 32: about 30 s on 2 cores)::

    python -m benchmarks.investigations.trace_conversion --row llama-8B@64 --count 32
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.abspath(os.path.join(__file__, "..", "..", "..")))

from autopar.graph import Role, trace  # noqa: E402
from autopar.graph import _trace as tracer  # noqa: E402
from autopar.inter import layer_scan  # noqa: E402
from autopar.inter.passes import per_iteration  # noqa: E402
from autopar.search import _pipeline  # noqa: E402
from autopar.search._options import options_from  # noqa: E402
from benchmarks.planning_time import _row_args  # noqa: E402


def count_jaxpr(row: str, count: int):
    """The closed jaxpr of `row`'s step traced at `count` microbatches as the search
    traces it (the last one JAX made: the step's, after any nested trace)."""
    step, args, _, micro = _row_args(row)
    options = options_from("plan", {"num_microbatches": micro})
    stack = layer_scan(trace(step, *args, batch_argnums=options.batch_argnums))
    made = []
    make = tracer._make_jaxpr

    def keep(fn, abstract):
        made.append(make(fn, abstract))
        return made[-1]

    tracer._make_jaxpr = keep
    try:
        _pipeline._trace_microbatch(
            step, args, options, count, None if stack else options.num_layers,
            per_iteration(stack.params["length"]) if stack else None)
    finally:
        tracer._make_jaxpr = make
    return made[-1][0]


def build(closed):
    """The tracer's nodes for `closed` (as `trace` builds them, roles aside)."""
    builder = tracer._GraphBuilder()
    invars = [builder.new_var(v.aval, Role.OTHER) for v in closed.jaxpr.invars]
    builder.inline(closed.jaxpr, closed.consts, invars, remat=False)
    return builder.nodes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama-8B@64", help="a planning_time row")
    parser.add_argument("--count", type=int, default=32, help="microbatches")
    parser.add_argument("--repeats", type=int, default=3)
    parsed = parser.parse_args(argv)
    closed = count_jaxpr(parsed.row, parsed.count)
    for r in range(parsed.repeats):
        start = time.process_time()
        nodes = build(closed)
        seconds = time.process_time() - start
        digest = hashlib.sha256(repr([(n.primitive, n.inputs, n.outputs, n.flops,
                                       n.bytes_read, n.bytes_written, n.source)
                                      for n in nodes]).encode()).hexdigest()[:16]
        print(f"build {r}: {len(nodes)} nodes in {seconds:.3f} CPU s; digest {digest}",
              flush=True)


if __name__ == "__main__":
    main()
