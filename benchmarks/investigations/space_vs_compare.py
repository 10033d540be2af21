"""`autopar space` against `autopar compare` on the same row: CPU seconds and wall time.

Both price the full Megatron grid and run one autopar search of the row; `space` also
keeps every plan as a row and writes the file and the picture, `compare` explains the
difference between the two best plans. The two commands run as child processes in
turn (compare, space, compare, space, ... for `--rounds`), with the plan cache off
(``AUTOPAR_PLAN_CACHE=0``), so that a slow spell of the shared machine falls on both;
each run's CPU seconds (user + system, its ILP worker processes included) come from
`resource.getrusage(RUSAGE_CHILDREN)`, which counts the work whatever else the machine
runs. Medians are printed.

Usage (about 15 minutes a round on a loaded 2-core machine):
``python benchmarks/investigations/space_vs_compare.py [--model gpt-1.3B] [--hosts 2]
[--rounds 1] [--out DIR]``
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = "import sys; from autopar.app.cli import main; sys.exit(main(sys.argv[1:]))"


def run(command: list[str]) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, the output's last lines) of one child command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "AUTOPAR_PLAN_CACHE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CLI, *command], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tail = [line for line in done.stdout.splitlines() if line.startswith(
        ("planning time", "explored", "compared"))]
    return cpu, wall, "; ".join(tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-1.3B")
    parser.add_argument("--hosts", default="2")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="keep the last space there (default: a temporary folder)")
    args = parser.parse_args(argv)
    row = ["--model", args.model, "--hosts", args.hosts]
    times: dict[str, list[tuple[float, float]]] = {"compare": [], "space": []}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        for i in range(args.rounds):
            for name, command in (("compare", ["compare", *row]),
                                  ("space", ["space", *row, "--out", out])):
                cpu, wall, tail = run(command)
                times[name].append((cpu, wall))
                print(f"round {i + 1} {name}: {cpu:.1f} CPU s, {wall:.1f} s wall ({tail})",
                      flush=True)
    print("\n| command | CPU s (median) | wall s (median) | runs |\n|---|---|---|---|")
    for name, runs in times.items():
        print(f"| `autopar {name} {' '.join(row)}` | "
              f"{statistics.median(c for c, _ in runs):.1f} | "
              f"{statistics.median(w for _, w in runs):.1f} | {len(runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
