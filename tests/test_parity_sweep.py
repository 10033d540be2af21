"""A fixed sample of the parity sweep (benchmarks/parity_sweep.py) against one device.

The sweep draws each configuration from its seed; these ten seeds cover every model (GPT,
scanned GPT, MoE, Wide-ResNet, Llama) and every method (auto, shard, data, zero2, zero3),
the four mesh shapes, one and two pipeline stages, 1, 2 and 4 microbatches and both
schedules. They run in this process (8 virtual CPU devices, see conftest.py) rather than in
subprocesses; the sweep itself runs each in its own process. The ten cost about 30 CPU
seconds each (planning and compiling), so they are in the extended tier, and one of them,
the GPT on a (2, 4) mesh, is the default-tier twin.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from autopar.choices import METHODS

SWEEP_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "parity_sweep.py"
# (seed, what it draws) — the description is checked, so a change to the sweep's drawing
# shows up here rather than silently changing what the sample covers.
SAMPLE = {
    2: "gpt, auto, stages 1, 4 microbatches, 1f1b",
    28: "gpt, shard, mesh (2, 4), 1 microbatches, gpipe",
    1: "gpt_scan, zero3, mesh (8,), 2 microbatches, gpipe",
    47: "moe, auto, stages 2, 4 microbatches, 1f1b",
    13: "moe, data, mesh (2, 4), 1 microbatches, gpipe",
    9: "wide_resnet, zero3, mesh (2, 4), 1 microbatches, gpipe",
    63: "wide_resnet, zero2, mesh (4, 2), 2 microbatches, gpipe",
    33: "llama, shard, mesh (4, 2), 2 microbatches, gpipe",
    81: "llama, zero2, mesh (2, 2, 2), 2 microbatches, gpipe",
    6: "llama, auto, stages 2, 1 microbatches, gpipe",
}
# The default-tier twin of the sample.
DEFAULT_TIER = (28,)
# Known misses of the sample; strict, so a fix shows. Seed 13 (MoE, data, (2, 4)) was one:
# one parameter element off by 1.06e-5, a rounding-level gradient difference on a near-zero
# gradient amplified by AdamW; the sweep now allows each leaf the one-device run's own
# rounding sensitivity (benchmarks/parity_sweep.py, "Comparison").
KNOWN_MISSES: dict[int, str] = {}


def _load_sweep():
    name = "autopar_parity_sweep"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SWEEP_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while building
        spec.loader.exec_module(module)
    return sys.modules[name]


sweep = _load_sweep()


def _draw(seed):
    """The sweep's configuration of `seed` without remat (the sample pins what it covers)."""
    return sweep.config_for(seed, remats=())


def test_sample_draws_what_it_says_and_covers_every_model_and_method():
    for seed, described in SAMPLE.items():
        assert _draw(seed).describe() == f"{described}, 1 process(es)", seed
    configs = [_draw(seed) for seed in SAMPLE]
    assert {c.model for c in configs} == set(sweep.MODELS)
    assert {c.method for c in configs} == set(METHODS)


def test_sweep_draws_only_valid_combinations():
    for seed in range(500):
        config = sweep.config_for(seed)
        assert config == sweep.config_for(seed), "a seed must always draw the same config"
        rows = sweep.BATCH_SIZE // config.num_microbatches
        assert rows * config.num_microbatches == sweep.BATCH_SIZE, config
        if config.method in ("data", "zero2", "zero3"):
            assert rows % sweep.NUM_DEVICES == 0, config
        if config.method == "auto":
            assert config.mesh_shape is None, config  # the pipeline search ignores it
        else:
            assert config.num_stages is None and config.mesh_shape is not None, config


@pytest.fixture(scope="module")
def references():
    """One-device losses, parameters and rounding sensitivity per model, computed once."""
    return {}


def _sample_params():
    params = []
    for seed in SAMPLE:
        marks = [] if seed in DEFAULT_TIER else [pytest.mark.extended]
        if seed in KNOWN_MISSES:
            marks.append(pytest.mark.xfail(reason=KNOWN_MISSES[seed], strict=True))
        params.append(pytest.param(seed, marks=marks, id=str(seed)))
    return params


@pytest.mark.parametrize("seed", _sample_params())
def test_sample_matches_one_device(seed, references):
    config = _draw(seed)
    if config.model not in references:
        references[config.model] = sweep.reference_for(config.model, None)
    result = sweep.run_config(config, reference=references[config.model])
    assert len(result["losses"]) == sweep.NUM_STEPS


def test_compare_allows_each_leaf_its_measured_rounding_sensitivity_and_no_more():
    import numpy as np

    reference = ([1.0, 0.9], [np.zeros(4, np.float32), np.ones(3, np.float32)])
    off = [np.asarray([0, 0, 3e-5, 0], np.float32), np.ones(3, np.float32)]
    with pytest.raises(AssertionError, match="parameter leaf 0 differs"):
        sweep.compare(reference, ([1.0, 0.9], off))  # past atol 1e-5, no allowance
    # Leaf 0's one-device run moved by 1.5e-5 under a rounding-level perturbation: allowed
    # 1e-5 + 2 x 1.5e-5; leaf 1 moved by nothing, so it stays at rtol / atol.
    sweep.compare(reference, ([1.0, 0.9], off), sensitivity=[1.5e-5, 0.0])
    with pytest.raises(AssertionError, match="parameter leaf 0 differs"):
        sweep.compare(reference, ([1.0, 0.9], off), sensitivity=[5e-6, 0.0])
    with pytest.raises(AssertionError, match="losses differ"):  # losses get no allowance
        sweep.compare(reference, ([1.0, 0.9001], reference[1]), sensitivity=[1.0, 1.0])


def test_summary_merges_runs_by_seed_and_names_each_code_state():
    config = sweep.dataclasses.asdict(_draw(28))
    results = [
        {"seed": 1, "config": config, "status": "pass", "seconds": 10.0, "cpu_seconds": 5.0,
         "code": "abc1234"},
        {"seed": 2, "config": config, "status": "fail", "seconds": 300.0, "cpu_seconds": 290.0,
         "code": "def5678+dirty", "error": "timeout after 300 s"},
        {"seed": 3, "config": config, "status": "pass", "seconds": 20.0, "cpu_seconds": 9.0,
         "code": "abc1234"},
    ]
    text = sweep.markdown({"results": results, "remat_drawn": True, "host": "2 CPU cores"})
    assert "**2/3 configurations match one device**; not passing: 1 timeout." in text
    assert "| abc1234 | 1, 3 | 2/2 | 30 | 14 |" in text
    assert "| def5678+dirty | 2 | 0/1 | 300 | 290 |" in text
    assert "seed 2 (" in text and "timeout on def5678+dirty" in text
    assert sweep._ranges([5, 1, 2, 3, 7]) == "1-3, 5, 7"
