"""Planning-phase progress: log lines, timings, quiet unless shown."""

import io
import logging

import pytest

from autopar._progress import phase, show_progress


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "autopar"]


def test_phase_logs_start_and_end_and_stores_the_duration(caplog):
    caplog.set_level(logging.INFO, logger="autopar")
    timings = {}
    with phase("intra-op ILP", timings) as p:
        p.update("mesh (2, 4) 3/5")
    messages = _messages(caplog)
    assert messages[0] == "intra-op ILP ..."
    assert messages[1].startswith("intra-op ILP: mesh (2, 4) 3/5 (")
    assert messages[2].startswith("intra-op ILP done in ") and messages[2].endswith(" s")
    assert set(timings) == {"intra-op ILP"}
    assert 0 <= timings["intra-op ILP"] < 5
    assert float(messages[2].split()[-2]) == pytest.approx(timings["intra-op ILP"], abs=0.01)


def test_a_repeated_phase_adds_up_its_durations(monkeypatch):
    clock = iter([10.0, 11.5, 20.0, 20.25])
    monkeypatch.setattr("autopar._progress.time.perf_counter", lambda: next(clock))
    timings = {}
    for _ in range(2):
        with phase("stage DP", timings):
            pass
    assert timings == {"stage DP": pytest.approx(1.75)}


def test_a_failing_phase_logs_the_failure_and_stores_nothing(caplog):
    caplog.set_level(logging.INFO, logger="autopar")
    timings = {}
    with pytest.raises(RuntimeError, match="solver crashed"), phase("ILP", timings):
        raise RuntimeError("solver crashed")
    assert timings == {}
    assert _messages(caplog)[-1].startswith("ILP failed after ")


def test_quiet_by_default_and_shown_by_show_progress(capsys):
    logger = logging.getLogger("autopar")
    assert logger.getEffectiveLevel() > logging.INFO, "the library must not print INFO"
    with phase("tracing", {}):
        pass
    assert capsys.readouterr().err == ""

    stream = io.StringIO()
    with show_progress(stream):
        with phase("tracing", {}):
            pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "autopar: tracing ..."
    assert lines[1].startswith("autopar: tracing done in ")

    # After the block the logger is quiet again and the handler is gone.
    assert logger.getEffectiveLevel() > logging.INFO
    with phase("tracing", {}):
        pass
    assert len(stream.getvalue().splitlines()) == 2
