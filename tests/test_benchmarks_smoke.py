"""The benchmarks as a user meets them: one entry point listing the product benchmarks, the
investigations apart, and the scripts' own tests (`benchmarks/tests`, their parts on the
tiny GPT) passing. Each runs in a subprocess: this process imports no benchmark script."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_the_entry_point_lists_the_product_benchmarks():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT, env=_env()).stdout
    for name in ("bench_large", "bench_local", "validate_public", "planning_time",
                 "runtime_overhead", "parity_sweep", "gpu_ground_truth", "space_dataset"):
        assert f"  {name} " in out
    assert not list(BENCHMARKS.glob("*probe*.py"))  # investigations live in investigations/


def test_the_benchmark_scripts_own_tests_pass():
    """benchmarks/tests checks the scripts' parts: the Spearman rank correlation against
    hand-computed values, the remat label, row selection, a tiny GPT row planned by both
    planners and rendered, local plans run and timed, memory-bound rows doubling their
    microbatches, the scanned Llama rows, where results are stored, and a results-page
    section replacing only itself, the plan-space summary's queries and the long-context
    and MoE table."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "benchmarks/tests"],
        capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) == 15, done.stdout[-2000:]
