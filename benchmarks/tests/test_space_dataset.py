"""The plan-space data set's summary and its example queries (no exploration here:
`tests/test_space.py` covers `autopar.space`)."""

import json

import pytest
import space_dataset as sd

GIB = 2.0**30


def _entry():
    frontier = [  # by memory, time falling, as Space.frontier() gives it
        {"memory": 10 * GIB, "step_time": 0.30, "label": "megatron(dp=1,tp=8,pp=2)",
         "source": "megatron"},
        {"memory": 30 * GIB, "step_time": 0.20, "label": "auto: a", "source": "auto"},
        {"memory": 50 * GIB, "step_time": 0.10, "label": "auto: b", "source": "auto"},
    ]
    best = {"label": "megatron(dp=8,tp=1,pp=1)", "source": "megatron", "step_time": 0.25,
            "memory_peak": 35 * GIB, "num_stages": 1, "meshes": [[8, 1]],
            "num_microbatches": 1, "schedule": "1f1b", "remat": "none",
            "measured_step_time": None}
    return {"row": "gpt-x@p:1", "frontier": frontier, "best_megatron": best, "measured": []}


def test_best_under_is_the_frontier_point_of_the_largest_memory_below():
    entry = _entry()
    assert sd.best_under(entry, 40 * GIB)["label"] == "auto: a"
    assert sd.best_under(entry, 50 * GIB)["label"] == "auto: b"
    assert sd.best_under(entry, 5 * GIB) is None


def test_megatron_gap_is_its_time_over_the_frontier_at_its_memory():
    # 35 GiB: the frontier's best is "auto: a" at 0.20 s; Megatron takes 0.25 s.
    assert sd.megatron_gap(_entry()) == pytest.approx(0.25 / 0.20)


def test_queries_and_rows(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"rows": [_entry()]}))
    text = sd.queries(path)
    assert "auto: a: 200.00 ms, 30.00 GiB" in text and "1.250" in text
    assert sd.parse_row("gpt-1.3B@dgx-a100-80g:2") == ("gpt-1.3B", "dgx-a100-80g", 2)
    with pytest.raises(SystemExit, match="MODEL@PROFILE:HOSTS"):
        sd.parse_row("gpt-1.3B")
    # 9 (model, GPUs) pairs on 2 profiles, then the long-context and MoE rows
    assert len(sd.SUITE) == 18 + len(sd.LONG_MOE) and sd.SUITE[18:] == list(sd.LONG_MOE)
