"""benchmarks/bench_long_moe.py on a tiny Llama: one grid gives the best configuration with
context parallelism and the best without (its cp = 1 configurations), and the table says
both."""

from __future__ import annotations

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
