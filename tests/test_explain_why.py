"""explain()'s why: the batch layout (what first reads each input, a warning for rows that
do not split over the mesh), the choices in words, planning time whose parts add up."""

from __future__ import annotations

import dataclasses

import optax

import autopar
from autopar.graph import trace
from autopar.report import Alternative, explain
from autopar.report._why import batch_lines, batch_warnings, planning_lines
from examples import mlp

CFG = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
OPT = optax.sgd(0.1)


def _planned(batch_size):
    step = mlp.make_train_step(CFG, OPT)
    args = (mlp.abstract_state(CFG, OPT), mlp.abstract_batch(CFG, batch_size))
    plan = autopar.plan(step, *args, cluster="cpu-local", method="shard", mesh_shape=(8,),
                        cache=False)
    return plan, trace(step, *args)


def test_batch_layout_names_what_reads_each_input_when_they_differ():
    plan, graph = _planned(16)
    batch = [i for i in plan.inputs if i.role == "batch"]
    # Lay the two inputs out differently by hand, as a plan may: the report says why.
    changed = dataclasses.replace(plan, inputs=tuple(
        dataclasses.replace(i, spec=((),) * len(i.shape)) if i is batch[1] else i
        for i in plan.inputs))
    text = "\n".join(batch_lines(changed, graph))
    assert f"{batch[1].path} {batch[1].shape}: whole on each of the 8 devices" in text
    assert "laid out differently because the planner places each where the first " in text
    assert f"{batch[0].path} is first read by dot_general" in text
    assert not batch_warnings(plan)


def test_rows_that_do_not_split_over_the_mesh_are_warned_about():
    plan, _ = _planned(12)
    (warning,) = batch_warnings(plan)
    assert warning.startswith("the batch (batch/x, batch/y): 12 rows are split")
    assert "not divisible by 8" in warning and "(e.g. 8 or 16)" in warning


def test_choices_and_alternatives_in_words():
    plan, graph = _planned(16)
    slower = dataclasses.replace(plan, stages=plan.stages)  # a stand-in costed plan
    text = explain(plan, alternatives=[Alternative("data parallel", slower),
                                       Alternative("Megatron-LM dp x tp", reason="no")],
                   graph=graph)
    assert "compared with plans written by hand" in text
    assert "  data parallel" in text and "(1.00x)" in text
    assert "Megatron-LM dp x tp  not possible: no" in text
    assert "why this plan:" in text and "- Weights:" in text


def test_planning_time_shows_parts_once_and_a_total():
    lines = planning_lines({"trace": 1.0, "search": 4.0, "stage_dp_and_ilps": 3.5,
                            "layer ILPs": 3.0, "stage DP": 0.5, "layer ILPs solved": 7})
    assert lines[0] == ("planning time: 5.00 s in all (tracing the step 1.00 s, sharding "
                        "each layer (integer programs) 3.00 s, choosing pipeline stages "
                        "0.50 s)")
    assert lines[1] == "planning work: 7 layer sharding problems solved"
