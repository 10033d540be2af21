"""The next reference count when the first has no plan (`_reference_first` among the counts
left), on a real model: the tiny GPT, batch 128 on one 8-device host, a memory budget
that refuses 1 microbatch by its memory floor. 32 (the largest microbatch left) is
searched in full and 64 priced on its layouts; the plan is the one every count searched
in full gives. The order alone, without ILPs: tests/test_planning_progress.py."""

from __future__ import annotations

import dataclasses
import logging

import optax
import pytest
from helpers import NO_MICROBATCH_CHECK

import autopar
from examples import gpt

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)  # 4 blocks + head
# Below layer 0's memory floor at 1 microbatch of 128 rows on 8 devices (1.19 MB), well
# above what 32 or 64 microbatches need.
BUDGET = 1_000_000


@pytest.mark.extended  # two searches of three counts, about 60 s; the order: test_planning_progress
def test_a_refused_reference_passes_to_the_largest_microbatch_left(caplog):
    optimizer = optax.adamw(1e-2)
    args = (gpt.abstract_state(GPT, optimizer), gpt.abstract_batch(GPT, 128))
    plans = {}
    for share in (True, False):
        with caplog.at_level(logging.INFO, logger="autopar"):
            caplog.clear()
            plans[share] = autopar.plan(
                gpt.make_train_step(GPT, optimizer), *args,
                cluster=autopar.Cluster.from_profile("dgx-a100-80g"),
                num_microbatches="auto", submeshes=[(1, 8)], logical_shapes=[(8,)],
                memory_budget=BUDGET, share_layouts=share, cache=False,
                **NO_MICROBATCH_CHECK)
        if share:
            started = [r.getMessage().split(" microbatch(es)")[0].split(": ")[1]
                       for r in caplog.records
                       if r.getMessage().startswith("microbatch counts: ")]
            assert started[:3] == ["1", "32", "64"]
            assert any("refused before any ILP" in r.getMessage() for r in caplog.records)
            assert any("layer costs from the layouts of the 32-microbatch search" in
                       r.getMessage() for r in caplog.records)
    shared, full = plans[True], plans[False]
    assert shared.num_microbatches == full.num_microbatches
    assert [s.layers for s in shared.stages] == [s.layers for s in full.stages]
    assert shared.predicted_step_time == full.predicted_step_time
