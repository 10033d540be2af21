"""The schedule picture tells the truth: predicted and measured charts on their own axes,
the measured one from its own start, and a line comparing the two step times that names
the cost profile (and says how to measure one when it is built in)."""

from __future__ import annotations

import pytest

from autopar.report import gantt_compare, gantt_compare_figure, simulate_schedule
from autopar.report._gantt import TaskRecord, is_builtin_profile, makespan

pytest.importorskip("matplotlib")


def _schedules():
    predicted = simulate_schedule([1e-3, 1e-3], [2e-3, 2e-3], 4)  # 15 ms
    # Measured 600x slower, recorded 100 s into the run (a clock that does not start at 0).
    measured = [TaskRecord(t.stage, t.kind, t.microbatch, 100 + 600 * t.start,
                           100 + 600 * t.end) for t in predicted]
    return predicted, measured


def test_predicted_and_measured_have_their_own_axes_and_units():
    predicted, measured = _schedules()
    fig = gantt_compare_figure(predicted, measured, "gpt", profile="local (cpu-local)")
    charts = [ax for ax in fig.axes if ax.patches]
    assert len(charts) == 2
    top, bottom = charts
    assert not top.get_shared_x_axes().joined(top, bottom), "the two charts share an axis"
    assert top.get_xlabel() == "time (ms)" and bottom.get_xlabel() == "time (s)"
    # Each axis spans its own chart: the prediction fills its axis, not 1/600 of it.
    assert top.get_xlim()[1] == pytest.approx(makespan(predicted) * 1e3 * 1.02)
    assert bottom.get_xlim()[1] == pytest.approx(makespan(measured) * 1.02)
    assert min(p.get_x() for p in bottom.patches) == pytest.approx(0.0)  # from its start
    line = " ".join(fig._suptitle.get_text().split())
    assert "predicted 15 ms per step, measured 9 s (600x the prediction)" in line
    assert "'local (cpu-local)'" in line and "run `autopar profile`" in line


def test_a_measured_profile_is_named_without_the_hint(tmp_path):
    predicted, measured = _schedules()
    fig = gantt_compare_figure(predicted, measured, profile="local (local-measured)")
    line = " ".join(fig._suptitle.get_text().split())
    assert "'local (local-measured)'" in line and "autopar profile" not in line
    assert is_builtin_profile("dgx-a100-80g") and not is_builtin_profile("local-measured")
    path = gantt_compare(predicted, measured, tmp_path / "schedule.png")
    assert path.read_bytes().startswith(b"\x89PNG")
