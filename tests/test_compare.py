"""`compare`: the side-by-side table of plans, the bubble formula, and `autopar compare`."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import NO_MICROBATCH_CHECK

import autopar
from autopar.app import cli
from autopar.app._examples import named_model
from autopar.cluster import LogicalMesh
from autopar.intra import PredictedCost, ShardingPlan
from autopar.plan import Plan, Stage
from autopar.report import (
    compare,
    differences,
    explain_differences,
    pipeline_bubble,
    plan_figures,
    time_split,
)
from autopar.search import microbatch_args

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


@pytest.mark.extended  # the default tier prints the table in the --configs test below
def test_cli_compare_prints_table(capsys):
    status = cli.main([
        "compare", "--model", "gpt-tiny", "--profile", "dgx-a100-80g", "--hosts", "1",
        "--configs", "dp2tp4,sp", "--no-auto",
    ])
    out = capsys.readouterr().out
    assert status == 0
    header = next(line for line in out.splitlines() if line.startswith("plan "))
    assert "megatron(dp=2,tp=4,pp=1,sp)" in header
    assert "predicted step time" in out and "TFLOP/s per device" in out


def test_cli_configs_cost_like_megatron_plan_at_the_microbatch_size(capsys):
    """``--configs dp2tp2pp2mb4`` is planned on the step traced at one microbatch, exactly
    as `megatron_plan` plans it (it used to be the full-batch step: 4x the work)."""
    status = cli.main([
        "compare", "--model", "gpt-tiny", "--hosts", "1", "--batch", "8",
        "--configs", "dp2tp2pp2mb4", "--no-auto",
    ])
    out = capsys.readouterr().out
    assert status == 0
    line = next(x for x in out.splitlines() if x.startswith("megatron(dp=2,tp=2,pp=2,mb=4):"))
    printed = float(line.split("predicted ")[1].split(" s")[0])
    header = next(x for x in out.splitlines() if x.startswith("plan "))
    assert "megatron(dp=2,tp=2,pp=2,mb=4)" in header
    assert "predicted step time" in out and "TFLOP/s per device" in out
    model = named_model("gpt-tiny", 8, layer_markers=True)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    plan = autopar.megatron_plan(model.train_step, model.abstract_state, model.abstract_batch,
                                 cluster=cluster, dp=2, tp=2, pp=2, num_microbatches=4)
    assert printed == plan.predicted_step_time


def test_cli_compare_rejects_bad_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--model", "gpt-tiny", "--configs", "dp2x4"])
    assert "is not a Megatron configuration" in capsys.readouterr().err


def test_cli_configs_options_parse():
    configs = cli._megatron_configs("dp8tp2pp4mb64,sp,zero1,recompute=selective,interleaved=2,"
                                    "dp2tp4")
    first, second = configs
    assert (first.dp, first.tp, first.pp, first.num_microbatches) == (8, 2, 4, 64)
    assert first.sequence_parallel and first.distributed_optimizer
    assert first.recompute == "selective" and first.virtual_stages == 2
    assert second.name == "megatron(dp=2,tp=4,pp=1)"
    with pytest.raises(Exception, match="nor an option"):
        cli._megatron_configs("dp2tp4,zero2")
    with pytest.raises(Exception, match="unknown recompute 'some'"):
        cli._megatron_configs("dp2tp4,recompute=some")


# ---- why two plans differ ----------------------------------------------------------------


def _slow_inter_host_cluster():
    """2 hosts x 4 devices whose inter-host link is 1000x slower than the profile's."""
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2, devices_per_host=4)
    slow = dataclasses.replace(cluster.inter_host,
                               bandwidth=cluster.inter_host.bandwidth / 1000)
    return dataclasses.replace(cluster, inter_host=slow)


def test_time_split_parts_sum_to_the_predicted_step_time():
    _, pipeline = _plans()
    split = time_split(pipeline)
    # slowest stage 6 ms per microbatch, 4 microbatches: 24 ms of work, 4 ms fill/drain
    assert split.bubble == pytest.approx(4e-3)
    assert split.compute == pytest.approx(4 * 6e-3)
    assert sum(split.parts().values()) == pytest.approx(pipeline.predicted_step_time)
    assert split.memory_per_device == 2 * GIB


def test_explanation_names_tensor_parallelism_across_hosts():
    """Built to differ in one way: tp=8 over two hosts' slow links against pp=2 across the
    hosts with tp=4 inside each. The top difference is the all-reduce traffic, and it
    names the weights the first plan splits across hosts."""
    model = named_model("gpt-tiny", 8, layer_markers=True)
    args = (model.abstract_state, model.abstract_batch)
    cluster = _slow_inter_host_cluster()
    across = autopar.megatron_plan(model.train_step, *args, cluster=cluster, dp=1, tp=8,
                                   num_microbatches=4)
    pipelined = autopar.megatron_plan(model.train_step, *args, cluster=cluster, dp=1, tp=4,
                                      pp=2, num_microbatches=4)
    assert pipelined.predicted_step_time < across.predicted_step_time
    graph = autopar.graph.trace(model.train_step, *microbatch_args(args, (1,), 4))
    diffs = differences(across, pipelined, first_graph=graph, second_graph=graph,
                        devices_per_host=4)
    top = diffs[0]
    assert top.part.startswith("communication") and top.saved > 0
    assert "split across hosts" in top.why.split(";")[0]  # the tp=8 plan
    assert "no matmul weight split across hosts" in top.why.split(";")[1]
    text = explain_differences(across, pipelined, first_graph=graph, second_graph=graph,
                               devices_per_host=4)
    ranked = [line for line in text.splitlines() if line.lstrip()[:2] in ("1.", "2.", "3.")]
    assert len(ranked) == 3 and "split across hosts" in ranked[0]
    assert "stage 1: layers" in text and "weight" in text and "activation" in text


def test_python_compare_runs_both_planners_and_explains(tmp_path):
    model = named_model("mlp-tiny", 8)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1, devices_per_host=2)
    result = autopar.compare(
        model.train_step, model.abstract_state, model.abstract_batch, cluster=cluster,
        pp_values=(1,), sequence_parallel=(False,), distributed_optimizer=(False,),
        recompute=("none",), microbatch_sizes=(), auto_options={"num_microbatches": 1},
    )
    assert isinstance(result, autopar.app.Comparison)
    costed = {c.name: o for c, o in result.grid if isinstance(o, float)}
    assert result.hand.method in costed
    assert result.hand.predicted_step_time == min(costed.values())
    text = result.report()
    assert "largest differences" in text and "planning time: Megatron grid" in text
    assert result.hand.method in text and result.auto.method in text
    pytest.importorskip("matplotlib")
    written = result.write_pictures(tmp_path)
    assert sorted(p.name for p in written) == [
        "autopar_gantt.png", "autopar_layout.png", "megatron_gantt.png", "megatron_layout.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_reported_memory_is_the_planners_stage_memory():
    """A stage stitched from layer plans records what the planner checked against the
    budget (`Stage.predicted_memory`); its sharding plan's peak is the sum of its layers'
    peaks. The reports show the former (a plan predicted at 81.5 GiB on 80 GiB devices was
    the latter)."""
    spmd, pipeline = _plans()
    stages = (dataclasses.replace(pipeline.stages[0], predicted_memory=1.5 * GIB),
              pipeline.stages[1])  # stage 1 records nothing: its sharding plan's peak
    pipeline = dataclasses.replace(pipeline, stages=stages)
    assert [s.memory_per_device for s in stages] == [1.5 * GIB, 2 * GIB]
    stages = (dataclasses.replace(stages[0], predicted_memory=2.5 * GIB), stages[1])
    pipeline = dataclasses.replace(pipeline, stages=stages)
    assert plan_figures(pipeline).memory_per_device == 2.5 * GIB
    assert time_split(pipeline).memory_per_device == 2.5 * GIB
    assert "2.5 GiB" in compare([spmd, pipeline])


def test_search_log_gives_the_plans_predicted_step_time(caplog):
    """The pipeline search logs, per microbatch count, the time the plan it makes
    predicts (`Plan.predicted_step_time`: the stitched stage plans), and says by how much
    the stage DP's sum of layer costs differs; each stage's memory fits the budget."""
    import logging

    model = named_model("gpt-tiny", 8, layer_markers=True)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1, devices_per_host=2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        plan = autopar.plan(model.train_step, model.abstract_state, model.abstract_batch,
                            cluster=cluster, num_microbatches=2, **NO_MICROBATCH_CHECK)
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("2 microbatch(es):"))
    logged = float(line.split("predicted ")[1].split(" s")[0])
    assert logged == pytest.approx(plan.predicted_step_time, rel=1e-3)
    if "stage DP's sum of layer costs" in line:
        dp = float(line.split("layer costs ")[1].split(" s")[0])
        extra = float(line.split("boundaries ")[1].split(" s")[0])
        assert dp + extra == pytest.approx(logged, rel=1e-3)
    assert all(0 < s.memory_per_device <= cluster.device_memory for s in plan.stages)
    assert plan_figures(plan).memory_per_device == max(s.predicted_memory for s in plan.stages)


def test_interleaved_plan_figures_count_each_device_once():
    """Interleaved 1F1B: 4 stages (model chunks) on 2 device groups of 4, v = 2, 4
    microbatches. The plan uses 8 devices, not 16, and idles (p - 1) / (v·m + p - 1) =
    1/9 of the step (Narayanan et al. 2021, §2.2.2), not the 3/7 of 4 plain stages."""
    _, pipeline = _plans()
    first, second = pipeline.stages
    chunks = (first, second, dataclasses.replace(first, layers=(4, 6)),
              dataclasses.replace(second, layers=(6, 8)))
    interleaved = dataclasses.replace(pipeline, stages=chunks, schedule="interleaved_1f1b")
    figures = plan_figures(interleaved, flops=8e12)
    assert figures.num_devices == 8
    assert figures.bubble == pytest.approx(1 / 9)
    assert figures.tflops_per_device == pytest.approx(
        8e12 / (interleaved.predicted_step_time * 8) / 1e12)
