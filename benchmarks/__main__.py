"""One entry point for autopar's product benchmarks.

    python -m benchmarks --help              # the benchmarks, one line each
    python -m benchmarks NAME [ARGS ...]     # run one (NAME --help: its own options)

Each NAME runs its script as ``python benchmarks/SCRIPT.py [ARGS ...]`` would, with any
fixed arguments of the entry first. The investigation scripts are in
`benchmarks/investigations/` (``python -m benchmarks.investigations.NAME``).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: (script, fixed arguments, one line)
BENCHMARKS = {
    "bench_large": ("run_benchmarks.py", ["--no-local"],
                    "large models on virtual GPU clusters: autopar against the best Megatron "
                    "grid plan"),
    "bench_local": ("run_benchmarks.py", ["--local-only"],
                    "local plans on 8 virtual CPU devices: predicted against measured"),
    "run_benchmarks": ("run_benchmarks.py", [], "bench_large's rows, then bench_local"),
    "validate_public": ("validate_public.py", [],
                        "the cost model against published training runs (BLOOM, MT-NLG, ...)"),
    "bench_long_moe": ("bench_long_moe.py", [],
                       "long context and MoE: the Megatron grid with CP / EP against without"),
    "planning_time": ("planning_time.py", [],
                      "method='auto' planning time by phase, demo to GPT-3 175B"),
    "runtime_overhead": ("runtime_overhead.py", [],
                         "runtime overhead against jax.jit; pipeline bubbles measured"),
    "parity_sweep": ("parity_sweep.py", [],
                     "random autopar configurations trained against one device"),
    "space_dataset": ("space_dataset.py", [],
                      "the plan-space data set: whole priced spaces of a fixed suite, "
                      "frontiers, measured local plans"),
    "gpu_ground_truth": ("gpu_ground_truth.py", [],
                         "one GPU: measured profile and GPT steps against predictions"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [
        "usage: python -m benchmarks NAME [ARGS ...]",
        "       python -m benchmarks NAME --help    (the benchmark's own options)",
        "",
        "Product benchmarks (results: docs/benchmarks.md, one section each; a run that",
        "writes the page replaces only its own section):",
        "",
        *(f"  {name:<{width}}  {line}" for name, (_, _, line) in BENCHMARKS.items()),
        "",
        "Investigation scripts: benchmarks/investigations/README.md",
        "(python -m benchmarks.investigations.NAME).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    script, fixed, _ = BENCHMARKS[name]
    path = HERE / script
    # As `python benchmarks/SCRIPT.py` runs it: benchmarks/ and the repository importable.
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    sys.argv = [f"python -m benchmarks {name}", *fixed, *args]
    runpy.run_path(str(path), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
