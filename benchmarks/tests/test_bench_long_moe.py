"""benchmarks/bench_long_moe.py on a tiny Llama: one grid gives the best configuration with
context parallelism and the best without (its cp = 1 configurations), and the table says
both."""

from __future__ import annotations

import time

import bench_long_moe
import pytest

from examples import llama


@pytest.mark.extended  # a dozen grid configurations: about 20 s on an idle 2-core machine
def test_tiny_row_with_and_without_context_parallelism():
    row = bench_long_moe.Row("llama-tiny", llama.CONFIGS["tiny"], 64, 8, 1, (1,),
                             cp_values=(1, 2))
    result = bench_long_moe.evaluate(row, auto=False)
    best, plain = result["with"], result["without"]
    assert best["seconds"] <= plain["seconds"]
    assert "cp=" not in plain["config"]
    assert best["costed"] >= 2
    text = bench_long_moe.table([result])
    assert f"| {row.key} |" in text and plain["config"] in text


def test_table_shows_autopar_beside_the_grid():
    """autopar's cell names its plan and peak memory; the last column is the grid's best
    step time over autopar's (no planning: results as `evaluate` saves them)."""
    result = {"row": "r", "with": {"config": "megatron(cp=4)", "seconds": 3.0, "tflops": 1.0},
              "without": {"error": "none fits"},
              "auto": {"config": "1 stage(s): mesh (8,), ring CP x8, remat none; 4 mb",
                       "seconds": 4.0, "tflops": 0.75, "peak_gib": 70.25}}
    # (the row's line; the row notes follow the table)
    line = next(x for x in bench_long_moe.table([result]).splitlines() if x.startswith("| r |"))
    assert "ring CP x8" in line and "(70.2 GiB)" in line and line.endswith("| 0.75 |")


def test_a_row_nothing_fits_reports_its_closest_miss():
    """The grid's no-plan error in one cell names the configuration needing least memory,
    preferring a figure counted with the experts over one the dense proxy failed."""
    message = "\n".join([
        "no Megatron configuration of this step works on 256 devices of 'dgx-h100':",
        "  megatron(dp=64,tp=1,pp=4,zero1,ep=1): pruned: 1 microbatch(es) for 4 pipeline "
        "stages (at least one per stage)",
        "  megatron(dp=16,tp=1,pp=16,zero1,mb=32,ep=1): ValueError: the Megatron layout "
        "megatron(dp=16,tp=1,pp=16,zero1,mb=32,ep=1) does not fit stage 0 (layers 0..3) in "
        "80.00 GiB per device: it needs 84.00 GiB with the activations of 16 microbatch(es) "
        "in flight (1f1b); use a larger tp or pp",
        "  megatron(dp=64,tp=1,pp=4,zero1,mb=8,recompute=full,ep=64): ValueError: the "
        "Megatron layout megatron(dp=64,tp=1,pp=4,zero1,mb=8,recompute=full,ep=64) does "
        "not fit stage 0 in 80.00 GiB per device: it needs 103.69 GiB with context-parallel "
        "K/V buffers and expert weights; use a larger tp, cp, ep or pp, or recompute",
        "  megatron(dp=64,tp=1,pp=4,zero1,mb=8,recompute=full,ep=8): ValueError: the "
        "Megatron layout megatron(dp=64,tp=1,pp=4,zero1,mb=8,recompute=full,ep=8) does "
        "not fit stage 0 in 80.00 GiB per device: it needs 232.89 GiB with context-parallel "
        "K/V buffers and expert weights; use a larger tp, cp, ep or pp, or recompute",
        "Use more devices or memory, or other pp_values / microbatch_sizes.",
    ])
    cell = bench_long_moe.no_plan(message)
    assert cell.startswith("no Megatron configuration of this step works on 256 devices")
    assert "none of 4 configurations (1 pruned by Megatron's rules)" in cell
    assert cell.endswith("closest: megatron(dp=64,tp=1,pp=4,zero1,mb=8,recompute=full,"
                         "ep=64): does not fit stage 0 in 80.00 GiB per device: it needs "
                         "103.69 GiB with context-parallel K/V buffers and expert weights")
    plain = bench_long_moe.no_plan(message, plain=True)
    assert "none of 2 configurations (1 pruned by Megatron's rules)" in plain
    assert plain.endswith("ep=1): does not fit stage 0 (layers 0..3) in 80.00 GiB per "
                          "device: it needs 84.00 GiB with the activations of 16 "
                          "microbatch(es) in flight (1f1b)")


def test_planning_limit_stops_and_says_so():
    """--auto-limit: planning that runs past the limit is stopped with a message."""
    with pytest.raises(bench_long_moe.PlanningStopped, match="planning stopped at 1 s"):
        with bench_long_moe._planning_limit(1):
            time.sleep(3)
    with bench_long_moe._planning_limit(None):
        pass  # no limit: nothing happens
