"""Planning progress (issue 45): the search says which microbatch count it is on, what is
left and about how long; a count without a plan does not serve as the reference whose
layer layouts the other counts are priced on. No ILP is solved here."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

import autopar
from autopar._progress import Countdown


def test_countdown_says_what_is_left_and_estimates_it(caplog):
    """Each start names the item, its place, the items left after it; from the second
    on, an estimate of the seconds left at the pace so far. An item searched again is
    counted again."""
    left = Countdown("microbatch counts", [1, 64, 32])
    with caplog.at_level(logging.INFO, logger="autopar"):
        left.start(1, "microbatch(es)")
        assert left.estimate() is None  # nothing finished: no pace yet
        left.done(1)
        left.start(64, "microbatch(es)")
        left.done(64)
        left.start(32, "microbatch(es)")
        left.done(32)
        left.again(64, "microbatch(es), again")
        left.done(64)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("microbatch counts: 1 microbatch(es) (1 of 3; left after it: "
                               "64, 32); ")
    assert "left at the pace so far" not in lines[0]
    assert lines[1].startswith("microbatch counts: 64 microbatch(es) (2 of 3; left after it: "
                               "32); ")
    assert lines[1].endswith("s left at the pace so far")
    assert "(3 of 3; left after it: none)" in lines[2]
    assert "64 microbatch(es), again (4 of 4; left after it: none)" in lines[3]
    assert left.finished == [1, 64, 32, 64] and not left.todo


def test_estimate_is_the_pace_times_what_is_left():
    """Two of four items took 10 s and 20 s: about 30 s for the two left (the running one
    counted whole less what it has run)."""
    left = Countdown("counts", ["a", "b", "c", "d"])
    left.finished, left.seconds, left.todo = ["a", "b"], [10.0, 20.0], ["c", "d"]
    assert left.estimate() == pytest.approx(30.0)


class _Search:
    """`_PipelineSearch.stage_choices` over made-up counts: `search_count` records the
    reference and layout-keeping it was asked with and finds a plan for the counts in
    `feasible` only (latency: the count, so the smallest feasible count wins)."""

    stage_choices = autopar.search._pipeline._PipelineSearch.stage_choices
    _searched_in_full = autopar.search._pipeline._PipelineSearch._searched_in_full

    def __init__(self, feasible, devices_per_host=8):
        self.options = autopar.PlanOptions(num_microbatches="auto")
        self.cluster = SimpleNamespace(devices_per_host=devices_per_host)
        self.scan_length, self.traced, self.errors = None, {}, {}
        self.feasible, self.calls = set(feasible), []

    def search_count(self, num_micro, reference, keep_layouts):
        from autopar.search._pipeline import _Candidate

        self.calls.append((num_micro, reference, keep_layouts))
        table = f"table {num_micro}"
        if num_micro not in self.feasible:
            self.errors[num_micro] = ValueError(f"{num_micro}: no plan")
            return [], table
        priced = {"layer costs priced": 3} if reference is not None else {}
        choice = SimpleNamespace(timings=priced, stage_layers=[(0, 1), (1, 2)])
        return [_Candidate(choice, None, num_micro, "1f1b", float(num_micro))], table


def test_a_count_without_a_plan_is_not_the_reference():
    """A batch of 64 rows on 8 devices a host: the reference is 1 microbatch
    (`_reference_first`). Where it has no plan, the next reference is chosen by the same
    rule among the counts left: neither 32 nor 64 divides over a host, so the largest
    microbatch, 32, is searched in full, keeping its layouts, and 64 is priced on them;
    32 wins, searched on its own layouts already. Before, 64 was searched in full and 32
    priced on it, then searched again on its own layouts."""
    search = _Search(feasible={32, 64})
    candidates = search.stage_choices(64)
    assert search.calls == [
        (1, None, True),  # the reference count: no plan
        (32, None, True),  # searched in full, its layouts kept: the reference now
        (64, "table 32", False),  # priced on 32's layouts
    ]
    assert sorted(c.num_microbatches for c in candidates) == [32, 64]


def test_the_next_reference_divides_over_a_host_where_one_does():
    """128 rows on 4 devices a host, counts 1, 32, 64: the reference is 32 (4 rows a
    microbatch, `_reference_first`). Without a plan there, the next by the same rule is
    1, whose 128 rows divide over a host, not the largest count left (64), which is
    priced on 1's layouts."""
    search = _Search(feasible={1, 64}, devices_per_host=4)
    search.stage_choices(128)
    assert search.calls == [(32, None, True), (1, None, True), (64, "table 1", False)]


def test_a_reference_with_a_plan_serves_every_count():
    search = _Search(feasible={1, 32, 64})
    search.stage_choices(64)
    assert search.calls == [(1, None, True), (64, "table 1", False), (32, "table 1", False)]


def test_no_count_with_a_plan_raises_the_largest_counts_error():
    search = _Search(feasible=())
    with pytest.raises(ValueError, match="64: no plan"):
        search.stage_choices(64)
    assert [c[0] for c in search.calls] == [1, 32, 64]


def test_layer_ilp_progress_says_what_is_solved_and_what_is_left(caplog):
    """Inside a count's stage DP, at most every `EVERY` seconds after a solve: the layer
    ILPs solved and their seconds, and how many fastest layer plans (one per layer
    structure and candidate shape) are at most left."""
    from autopar.inter import _progress

    table = SimpleNamespace(
        fingerprints=["embed", "block", "block", "head"], candidate_shapes=((8,), (2, 4)),
        _cache={("embed", (8,), 0): None, ("block", (8,), 0): None, ("block", (8,), 1): None},
        num_microbatches=32, num_ilps=3, ilp_seconds=41.6, num_priced=5, progress_at=100.0)
    assert _progress.level0_left(table) == (4, 6)
    with caplog.at_level(logging.INFO, logger="autopar"):
        assert not _progress.report(table, now=100.0 + _progress.EVERY - 1)
        assert _progress.report(table, now=100.0 + _progress.EVERY)
        assert not _progress.report(table, now=101.0 + _progress.EVERY)
        assert _progress.report(table, now=100.0 + 2 * _progress.EVERY, batch=(2, 6),
                                seconds=8.0)
    assert [r.getMessage() for r in caplog.records] == [
        "32 microbatch(es): 3 layer ILPs so far, 42 s, 5 priced from another count's "
        "layouts; fastest layer plans: 4 of 6 not known yet, at most (leaner levels as "
        "the stages need)",
        "32 microbatch(es): 3 layer ILPs so far, 50 s, 5 priced from another count's "
        "layouts (2 of the 6 plans solved side by side now are done); fastest layer plans: "
        "4 of 6 not known yet, at most (leaner levels as the stages need)"]


def test_a_refused_count_does_not_set_the_pace():
    """A count settled without its ILPs (refused by its memory floor) is finished but
    gives no pace: the estimate waits for a count searched in full."""
    left = Countdown("microbatch counts", [1, 64, 32])
    left.start(1)
    left.done(1, paced=False)
    assert left.finished == [1] and left.estimate() is None
