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
# gradient amplified by AdamW; the sweep now checks such runs step by step from the
# one-device run's state, within that step's own rounding spread (benchmarks/parity_sweep.py,
# "Comparison").
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
    """One-device runs and their own rounding spread per model, computed once."""
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


def _reference(spread):
    """A 2-parameter-leaf, 1-optimizer-leaf reference whose state never changes."""
    import numpy as np

    state = [np.zeros(4, np.float32), np.ones(3, np.float32), np.full(2, 0.5, np.float32)]
    return sweep.Reference(losses=[1.0, 0.9, 0.8], states=[state] * (sweep.NUM_STEPS + 1),
                           num_param_leaves=2, spread=[[spread, 0.0, 0.0]] * sweep.NUM_STEPS)


def test_compare_chained_at_rtol_atol_else_each_single_step_within_its_own_spread():
    import numpy as np

    reference = _reference(spread=1e-5)
    state = reference.states[0]
    off = [np.asarray([0, 0, 3e-5, 0], np.float32), state[1]]
    assert sweep.compare(reference, (reference.losses, state[:2]))["trajectory"] == "matches"
    with pytest.raises(AssertionError, match="parameter leaf 0 differs"):
        sweep.compare(reference, (reference.losses, off))  # past atol 1e-5, no single steps
    # The chained run diverged, but every single step from the reference's state matches:
    # step 1 is off by 1.5e-5 on leaf 0, within atol 1e-5 + that step's spread 1e-5.
    steps = [(loss, list(state)) for loss in reference.losses]
    steps[0] = (1.0, [np.asarray([0, 1.5e-5, 0, 0], np.float32), *state[1:]])
    matched = sweep.compare(reference, (reference.losses, off), steps)
    assert matched["trajectory"] == "diverged" and matched["max_allowance_used"] > 0
    with pytest.raises(AssertionError, match="step 1 from the one-device run's state.*"
                                             "state leaf 0 differs"):
        sweep.compare(_reference(spread=0.0), (reference.losses, off), steps)
    # No allowance on leaves whose one-device step does not move under reordering (the
    # optimizer state here), nor on losses, chained or single-step.
    steps[2] = (0.8, [*state[:2], np.full(2, 0.50002, np.float32)])
    with pytest.raises(AssertionError, match="step 3 .*state leaf 2 differs"):
        sweep.compare(reference, (reference.losses, off), steps)
    with pytest.raises(AssertionError, match="losses differ"):
        sweep.compare(reference, ([1.0, 0.9001, 0.8], state[:2]), steps)
    steps[2] = (0.8001, list(state))
    with pytest.raises(AssertionError, match="step 3 .*loss differs"):
        sweep.compare(reference, (reference.losses, off), steps)


def test_reorderings_keep_each_moe_routing_group_whole():
    import numpy as np

    assert sweep.row_block("gpt") == 1 and sweep.row_block("moe") == 2
    orders = sweep.reorderings("moe", num=5)
    for rows in orders:
        assert sorted(rows) == list(range(sweep.BATCH_SIZE))
        assert np.all(rows[0::2] % 2 == 0) and np.all(rows[1::2] == rows[0::2] + 1)
    assert any(not np.array_equal(rows, np.arange(sweep.BATCH_SIZE)) for rows in orders)


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
