"""`compare`: the side-by-side table of plans, the bubble formula, and `autopar compare`."""

from __future__ import annotations

import pytest

from autopar.app import cli
from autopar.cluster import LogicalMesh
from autopar.intra import PredictedCost, ShardingPlan
from autopar.plan import Plan, Stage
from autopar.report import compare, pipeline_bubble, plan_figures

GIB = 2**30


def _stage(layers, device_ids, shape, compute, communication, memory, collectives):
    mesh = LogicalMesh.create(shape, device_ids, ("data", "model"))
    cost = PredictedCost(compute, communication, 0.0, memory, collectives)
    sharding = ShardingPlan(mesh, (), (), (), cost, "fingerprint")
    return Stage(layers, sharding)


def _plans():
    """A one-stage 2x4 plan and a two-stage pipeline of 2x2 stages with 4 microbatches."""
    spmd = Plan(
        method="megatron(dp=2,tp=4,pp=1)",
        cluster={},
        stages=(_stage((0, 1), range(8), (2, 4), 2e-3, 1e-3, 3 * GIB,
                       {"all_reduce": (8, 4096.0)}),),
        inputs=(),
        graph_fingerprint="fingerprint",
    )
    pipeline = Plan(
        method="megatron(dp=2,tp=2,pp=2,mb=4)",
        cluster={},
        stages=(
            _stage((0, 2), range(4), (2, 2), 4e-3, 0.0, 1 * GIB,
                   {"all_reduce": (2, 1024.0), "all_gather": (1, 512.0)}),
            _stage((2, 4), range(4, 8), (2, 2), 6e-3, 0.0, 2 * GIB,
                   {"all_reduce": (3, 2048.0)}),
        ),
        inputs=(),
        graph_fingerprint="fingerprint",
        num_microbatches=4,
        runtime="pipeline",  # stage costs are per microbatch
    )
    return spmd, pipeline


def test_pipeline_bubble_matches_hand_computation():
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble(2, 4) == pytest.approx(1 / 5)
    assert pipeline_bubble(1, 16) == 0.0
    with pytest.raises(ValueError, match="at least one stage and one microbatch"):
        pipeline_bubble(2, 0)


def test_plan_figures_by_hand():
    spmd, pipeline = _plans()
    flops = 8e12
    figures = plan_figures(pipeline, flops=flops, measured=0.01)
    # Alpa's pipeline latency over per-microbatch stage times 4 ms and 6 ms:
    # 4 + 6 + (4 - 1) * 6 = 28 ms.
    assert figures.step_time == pytest.approx(28e-3)
    assert figures.num_devices == 8
    assert figures.memory_per_device == 2 * GIB  # the larger stage
    # per step: both stages' per-microbatch collectives, 4 microbatches
    assert figures.collectives == {"all_gather": (4, 2048.0), "all_reduce": (20, 12288.0)}
    assert figures.bubble == pytest.approx(1 / 5)
    assert figures.tflops_per_device == pytest.approx(flops / (28e-3 * 8) / 1e12)
    assert figures.mesh == "data=2 x model=2"
    assert plan_figures(spmd).tflops_per_device is None


def test_compare_table_shows_each_plan():
    spmd, pipeline = _plans()
    table = compare([spmd, pipeline], measured=[3.5e-3, None], flops=8e12)
    lines = table.splitlines()
    row = {line.split("  ")[0].strip(): line for line in lines}
    assert "megatron(dp=2,tp=4,pp=1)" in lines[0] and "megatron(dp=2,tp=2,pp=2,mb=4)" in lines[0]
    assert "3.000 ms" in row["predicted step time"]  # 2 ms compute + 1 ms communication
    assert "28.000 ms" in row["predicted step time"]
    assert "3.0 GiB" in row["memory per device"] and "2.0 GiB" in row["memory per device"]
    assert "1.00x" in row["vs fastest"] and "9.33x" in row["vs fastest"]
    assert "0.0%" in row["pipeline bubble"] and "20.0%" in row["pipeline bubble"]
    assert "8 x, 4.0 KiB" in row["all_reduce (count, bytes)"]
    assert "20 x, 12.0 KiB" in row["all_reduce (count, bytes)"]
    # the one-stage plan has no all-gather
    assert row["all_gather (count, bytes)"].split()[-5:] == ["-", "4", "x,", "2.0", "KiB"]
    assert f"{8e12 / (3e-3 * 8) / 1e12:.4g}" in row["TFLOP/s per device"]
    assert "3.500 ms" in row["measured step time"]
    assert "1.17" in row["measured / predicted"]


def test_compare_rejects_mismatched_measurements():
    spmd, pipeline = _plans()
    with pytest.raises(ValueError, match="measured has 1 entries for 2 plans"):
        compare([spmd, pipeline], measured=[1.0])
    with pytest.raises(ValueError, match="at least one plan"):
        compare([])
    with pytest.raises(TypeError, match=r"not a mapping; pass list\(plans.values\(\)\)"):
        compare({"auto": spmd, "manual": pipeline})
    with pytest.raises(TypeError, match=r"plans\[1\] is a str, not an autopar.Plan"):
        compare([spmd, "megatron"])


def test_cli_compare_prints_table(capsys):
    status = cli.main([
        "compare", "--model", "gpt-tiny", "--profile", "dgx-a100-80g", "--hosts", "1",
        "--configs", "dp8tp1,dp2tp4,dp2tp2pp2mb4", "--no-auto",
    ])
    out = capsys.readouterr().out
    assert status == 0
    assert "skipped megatron(dp=2,tp=2,pp=2,mb=4)" in out and "pipeline" in out
    header = out.splitlines()[1]
    assert "megatron(dp=8,tp=1,pp=1)" in header and "megatron(dp=2,tp=4,pp=1)" in header
    assert "predicted step time" in out and "TFLOP/s per device" in out


def test_cli_compare_rejects_bad_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--model", "gpt-tiny", "--configs", "dp2x4"])
    assert "is not a Megatron configuration" in capsys.readouterr().err
