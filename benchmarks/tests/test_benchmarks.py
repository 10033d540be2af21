"""Smoke test of the benchmark scripts' parts on the tiny GPT (run by
`tests/test_benchmarks_smoke.py` in a subprocess; `conftest.py` puts benchmarks/ on the
path)."""

import json

import bench_large
import bench_local
import numpy as np
import pytest
import run_benchmarks
from bench_markdown import render


def test_spearman_matches_hand_computed_values():
    assert bench_local.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench_local.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ranks (1, 2, 3) against (1, 3, 2): 1 - 6·(0 + 1 + 1) / (3·(9 - 1)) = 0.5.
    assert bench_local.spearman([1, 2, 3], [5, 9, 7]) == pytest.approx(0.5)
    # A tie shares the mean rank: (1.5, 1.5, 3) against (1, 2, 3).
    rx = np.array([1.5, 1.5, 3]) - 2
    expected = (rx * np.array([-1, 0, 1])).sum() / np.sqrt((rx**2).sum() * 2)
    assert bench_local.spearman([7, 7, 9], [1, 2, 3]) == pytest.approx(expected)
    with pytest.raises(ValueError, match="same length"):
        bench_local.spearman([1, 2], [1, 2, 3])


def test_remat_label_names_runs_of_layers():
    from types import SimpleNamespace

    def plan(*stages):
        return SimpleNamespace(stage_remat=stages)

    assert bench_large.remat_label(plan(("none", "none"), ("none",))) == "none"
    label = bench_large.remat_label(
        plan(("none", "selective", "selective"), ("selective", "full"), ("none",))
    )
    assert label == "layers 0 none, 1-3 selective, 4 full, 5 none"


def test_select_rows_rejects_unknown_names():
    assert [r.key for r in run_benchmarks.select_rows(None, quick=True)] == list(
        run_benchmarks.QUICK_ROWS
    )
    assert len(run_benchmarks.select_rows(None, quick=False)) == 25
    with pytest.raises(ValueError, match="unknown row"):
        run_benchmarks.select_rows(["gpt-7B@8"], quick=False)


def test_row_on_tiny_gpt_and_markdown(tmp_path):
    row = bench_large.Row("gpt", "tiny", 1, global_batch=8)
    result = bench_large.run_row(row, microbatches=(2,), pp_values=(2,))
    assert result.auto is not None and result.megatron is not None, result.notes
    assert result.total_flops > 0 and result.num_gpus == 8
    for planner in (result.auto, result.megatron):
        assert planner.step_time > 0
        assert planner.tflops_per_gpu == pytest.approx(
            result.total_flops / (planner.step_time * 8) / 1e12
        )
    assert result.ratio == pytest.approx(result.megatron.step_time / result.auto.step_time)
    # The Megatron grid is `megatron_grid_search`'s, with the row's microbatch counts.
    assert result.megatron.plan_line.startswith("megatron(")
    assert "pp=2" in result.megatron.plan_line and "2 mb" in result.megatron.plan_line
    assert any(n.endswith("Megatron configurations costed") for n in result.notes)

    results = {"rows": {row.key: run_benchmarks.row_record(result, (2,), 1.0)}, "local": None}
    path, out = tmp_path / "results.json", tmp_path / "benchmarks.md"
    run_benchmarks.save(results, path, out)
    stored = json.loads(path.read_text())["rows"][row.key]
    assert stored["commit"] == run_benchmarks.code_version() != ""  # a hash, or "unknown"
    text = render(results, [row.key, "gpt-39B@64"])
    assert f"planned at commit {stored['commit']}" in text
    assert f"| {row.key} | 8 |" in text
    # The schedule columns come from the plans (Megatron: pp = 2 runs 1F1B).
    assert result.megatron.schedule == "1f1b" and stored["megatron"]["schedule"] == "1f1b"
    line = next(x for x in text.splitlines() if x.startswith(f"| {row.key} |"))
    assert f"| {result.auto.schedule} |" in line and "| 1f1b |" in line
    # What autopar recomputes is a column of its own (issue 15).
    assert stored["auto"]["remat"] == result.auto.remat != "-"
    assert f"| {result.auto.remat} |" in line
    assert "Rows not run yet: gpt-39B@64" in text
    assert "--rows gpt-39B@64" in text


def test_local_plans_run_and_are_timed():
    results, per_round = bench_local.run_local("tiny", batch_size=8, num_steps=1, only=2,
                                               rounds=2)
    assert [r.name for r in results] == ["shard (8,)", "shard (2, 4)"]
    assert all(r.predicted > 0 and r.measured > 0 for r in results)
    assert len(per_round) == 2 and all(len(times) == 2 for times in per_round)
    with pytest.raises(ValueError, match="rounds and num_steps must be at least 1"):
        bench_local.run_local("tiny", rounds=0)


def test_memory_bound_rows_double_the_microbatches(monkeypatch):
    row = bench_large.Row("gpt", "tiny", 1, global_batch=64)
    state_and_grads = bench_large.least_memory_per_device(row, 64)  # 1 sequence each
    assert bench_large.least_memory_per_device(row, 8) > state_and_grads > 0
    # A row that needs 4x the microbatches to fit at all, then one more doubling before
    # both planners find a plan.
    device = bench_large.Cluster.from_profile(bench_large.PROFILE).device_memory
    monkeypatch.setattr(run_benchmarks, "least_memory_per_device",
                        lambda r, m: device * 7.9 / m)
    ran = []

    def fake_run_row(r, counts, schedule="auto", megatron_grid=True):
        ran.append(counts)
        auto = object() if counts[0] >= 16 else None
        return bench_large.RowResult(r, 8, 1.0, auto, object(), ("grid note",))

    monkeypatch.setattr(run_benchmarks, "run_row", fake_run_row)
    counts, result = run_benchmarks.plan_row(row, (2,))
    assert counts == (16,) and ran == [(8,), (16,)]
    need = [f"{device * 7.9 / m / 2**30:.0f}" for m in (2, 4)]
    assert result.notes == (
        f"2 microbatches: even a plan splitting everything over every GPU needs {need[0]} "
        "GiB per GPU",
        f"4 microbatches: even a plan splitting everything over every GPU needs {need[1]} "
        "GiB per GPU",
        "8 microbatches: no autopar plan fits",
        "grid note",
    )


def test_llama_rows_scan_their_layers_on_h100_and_render_apart(tmp_path):
    row = bench_large.Row("llama", "tiny", 1, global_batch=8, profile="dgx-h100")
    assert row.key == "llama-tiny@8" and row.num_layers == 4
    assert row.cluster().device_kind == "NVIDIA H100 80GB HBM3"
    _, args = bench_large.model_step(row)
    _, loop_args = bench_large.model_step(row, loop=True)  # the Megatron baseline's form
    assert args[0].params["layers"]["attn"]["wq"].shape[0] == 4  # stacked for the scan
    assert len(loop_args[0].params["layers"]) == 4  # a list of layers
    record = {"num_gpus": 8, "auto": None, "megatron": None, "ratio": None,
              "microbatches": [2], "notes": ["note"], "commit": "abc"}
    text = render({"rows": {row.key: record}}, ["gpt-1.3B@8", row.key])
    gpt_table, llama_table = text.split("## Llama (scanned layers)")
    assert row.key not in gpt_table and f"| {row.key} | 8 |" in llama_table
    assert "Rows not run yet: gpt-1.3B@8." in gpt_table


def test_a_run_written_elsewhere_keeps_its_results_beside_it(tmp_path):
    """`--out O.md` stores the run's rows in O.json, not in the page's results.json."""
    args = run_benchmarks.parse_args(["--local-only", "--out", str(tmp_path / "o.md")])
    assert args.results == tmp_path / "o.json"
    assert run_benchmarks.parse_args([]).results == run_benchmarks.RESULTS
    given = run_benchmarks.parse_args(["--out", str(tmp_path / "o.md"),
                                       "--results", str(tmp_path / "r.json")])
    assert given.results == tmp_path / "r.json"


def test_a_benchmark_replaces_only_its_own_section(tmp_path):
    from _results import read_section, write_section

    page = tmp_path / "benchmarks.md"
    write_section("one", "## One\n\nfirst", "python -m benchmarks one", path=page)
    write_section("two", "## Two\n\nsecond", "python -m benchmarks two", path=page)
    write_section("one", "## One\n\nagain", "python -m benchmarks one --x", path=page)
    text = page.read_text()
    assert text.startswith("# Benchmarks\n") and text.index("## One") < text.index("## Two")
    one, two = read_section("one", page), read_section("two", page)
    assert "again" in one and "first" not in one and "`python -m benchmarks one --x`" in one
    assert "second" in two and "`python -m benchmarks two`" in two
    assert one.split("\n")[2].startswith("*Produced at commit ")
