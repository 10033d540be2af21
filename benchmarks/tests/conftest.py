"""Tests of the benchmark scripts' parts: 8 virtual CPU devices, as `tests/conftest.py`.

`tests/test_benchmarks_smoke.py` runs this folder in a subprocess (`python -m pytest
benchmarks/tests`), so the library's test process never imports a benchmark script.
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("AUTOPAR_PLAN_CACHE", "0")

# The benchmark scripts import each other as top-level modules (as `python -m benchmarks
# NAME` runs them).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
