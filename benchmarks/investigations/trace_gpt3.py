"""Trace the GPT-3 175B train step (optax adamw) with abstract arguments.

Prints the wall time of each phase, the peak resident memory, the node count and the number
of parameters the tracer found (GPT-3 has about 175B; Brown et al. 2020, Table 2.1).

Usage: ``python benchmarks/investigations/trace_gpt3.py [--config 175B] [--batch-size 8]``
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Run as a script from anywhere: the examples package lives at the repository root.
sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import jax  # noqa: E402
import optax  # noqa: E402

from autopar.graph import trace  # noqa: E402
from examples import gpt  # noqa: E402

# The parameter count the GPT-3 paper reports for its largest model.
GPT3_175B_PARAMS = 175e9
# How far the traced count may be from it: the paper rounds, and vocabulary padding moves it.
PARAM_TOLERANCE = 0.03


def peak_rss_gib() -> float:
    """Peak resident set size of this process in GiB (ru_maxrss is KiB on Linux)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="175B", choices=sorted(gpt.CONFIGS))
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    cfg = gpt.CONFIGS[args.config]
    optimizer = optax.adamw(1e-4)
    start = time.perf_counter()
    state = gpt.abstract_state(cfg, optimizer)
    batch = gpt.abstract_batch(cfg, args.batch_size)
    abstract_s = time.perf_counter() - start

    start = time.perf_counter()
    graph = trace(gpt.make_train_step(cfg, optimizer), state, batch)
    trace_s = time.perf_counter() - start

    print(graph.summary())
    print(f"config             GPT {args.config}, batch {args.batch_size}, seq {cfg.seq_len}")
    print(f"abstract state     {abstract_s:.1f} s")
    print(f"trace              {trace_s:.1f} s")
    print(f"peak RSS           {peak_rss_gib():.2f} GiB")
    print(f"nodes              {len(graph.nodes):,}")
    print(f"parameters found   {graph.num_params:,} (config says {cfg.num_params:,})")
    print(f"train-step FLOPs   {graph.total_flops:.4g}")
    print(f"jax                {jax.__version__}")
    if args.config == "175B":
        error = abs(graph.num_params - GPT3_175B_PARAMS) / GPT3_175B_PARAMS
        verdict = "ok" if error <= PARAM_TOLERANCE else "OUT OF TOLERANCE"
        print(f"vs 175B            {100 * error:.2f}% off ({verdict})")


if __name__ == "__main__":
    main()
