"""The stage DP over a scanned stack (its ranges restricted to even shares of the stack)
bounded by an even plan with the embeddings and the head on the end stages
(`autopar.inter._share_bound`): where the plain even cuts give no plan the restricted DP
may choose, this one does, and the plan is the same as without it."""

from __future__ import annotations

import dataclasses
import logging
import re

import optax

import autopar
from autopar.inter import _share_bound
from autopar.inter._share_bound import share_cuts
from autopar.search._stack import even_shares
from examples import gpt

SCANNED = dataclasses.replace(gpt.CONFIGS["tiny"], num_layers=8, scan_layers=True)
# 4 stages of 2 devices over a stack of 8 (10 layers): the even cuts 0, 2, 5, 8, 10 give
# stages 1, 3, 3, 1 iterations, which the DP may not take; 0, 3, 5, 7, 10 give 2 each.
PIPELINE = dict(num_stages=4, num_microbatches=2, submeshes=[(1, 2)], logical_shapes=[(2,)])


def test_share_cuts_put_the_end_layers_on_the_end_stages():
    assert share_cuts(10, 4) == [0, 3, 5, 7, 10]
    assert share_cuts(10, 1) == [0, 10]
    assert share_cuts(10, 3) is None  # 8 iterations do not split in 3
    allowed = even_shares(8, 4)
    cuts = share_cuts(10, 4)
    assert all(allowed(a, b) for a, b in zip(cuts, cuts[1:]))
    plain = [round(i * 10 / 4) for i in range(5)]
    assert not all(allowed(a, b) for a, b in zip(plain, plain[1:]))


def _plan(caplog):
    optimizer = optax.adamw(1e-2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        caplog.clear()
        plan = autopar.plan(
            gpt.make_train_step(SCANNED, optimizer), gpt.abstract_state(SCANNED, optimizer),
            gpt.abstract_batch(SCANNED, 8), cluster=autopar.Cluster.from_profile("cpu-local"),
            cache=False, **PIPELINE)
    bounds = [float(m.group(1)) for r in caplog.records
              if (m := re.search(r"an even plan bounds the search at (\S+) s", r.getMessage()))]
    return plan, bounds


def test_the_share_plan_bounds_the_restricted_dp_and_keeps_its_plan(caplog, monkeypatch):
    on, on_bounds = _plan(caplog)
    monkeypatch.setattr(_share_bound, "SHARE_PLANS", False)
    off, off_bounds = _plan(caplog)
    assert off_bounds == [float("inf")]  # no plain even plan fits the shares
    assert len(on_bounds) == 1 and on_bounds[0] < float("inf")
    assert on.scan_ranges == off.scan_ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert [s.layers for s in on.stages] == [s.layers for s in off.stages]
    assert on.predicted_step_time == off.predicted_step_time
    # The bound is a plan the DP may choose: its answer is no slower.
    assert on.timings["layer ILPs solved"] <= off.timings["layer ILPs solved"]
