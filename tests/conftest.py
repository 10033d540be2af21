"""Test set-up: 8 virtual CPU devices, float32, strict checks."""

import atexit
import os
import shutil
import tempfile

# XLA:CPU's LLVM optimisation level 0: the suite compiles about a thousand small programs,
# and LLVM's optimisation passes are most of each compile (a pipeline test measured 51 s of
# CPU at the default level, 34 s at 0). What the tests check does not depend on it: the HLO
# (collectives, fusions) and XLA's buffer assignment (memory_analysis) come before LLVM,
# results agree to rounding (rtol 1e-5); the whole suite passes at either level (checked
# both ways). Users' programs keep XLA's default level.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests plan from scratch; the on-disk plan cache is tested on its own, in temp folders.
os.environ.setdefault("AUTOPAR_PLAN_CACHE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One compilation cache for the run, on disk, shared by xdist's workers (the controller
# makes the folder before it starts them; they inherit the variable): the suite compiles
# the same small programs many times over (the tiny GPT's one-device step in most files,
# the same stage programs in several), and a program XLA compiled once is loaded, not
# compiled again. The key is the program without its source locations, so a hit can
# carry another caller's line numbers in its HLO metadata; what the tests read of a
# compiled program (its instructions, collectives, `memory_analysis`) is the program's.
if "AUTOPAR_TEST_XLA_CACHE" not in os.environ:
    os.environ["AUTOPAR_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="autopar-test-xla-")
    atexit.register(shutil.rmtree, os.environ["AUTOPAR_TEST_XLA_CACHE"], True)
jax.config.update("jax_compilation_cache_dir", os.environ["AUTOPAR_TEST_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 virtual CPU devices, got {len(devs)}"
    return devs


# The longest test files first (seconds of one file's tests in a `--durations` run of the
# whole suite, descending), so that the two workers of `-n 2 --dist loadfile` do not end
# with one of them running a long file alone (pyproject's `--no-loadscope-reorder` keeps
# this order; xdist would otherwise order files by their number of tests). Files not
# named keep their collection order after these.
# test_profile times collectives against a profile it measures: it is kept apart from
# test_multihost's start, whose two worker processes would share the cores while it times.
LONGEST_FILES = (
    "test_multihost.py", "test_remat.py", "test_planning_speed.py", "test_pipeline.py",
    "test_deferred.py", "test_profile.py", "test_strategy_validity.py",
    "test_benchmarks_smoke.py", "test_intra_correctness.py", "test_pipeline_memory.py",
    "test_pipeline_schedules.py", "test_scan_pipeline.py", "test_transformers_models.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
