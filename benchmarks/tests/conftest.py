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

# Run from the library's suite (tests/test_benchmarks_smoke.py): its on-disk compilation
# cache (tests/conftest.py), so the tiny GPT's programs compiled there are loaded here.
if os.environ.get("AUTOPAR_TEST_XLA_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["AUTOPAR_TEST_XLA_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
