"""The Megatron grid's `uneven_stages`: a pp that does not divide the layers (Megatron-LM's
--decoder-first/last-pipeline-num-layers, as DeepSeek-V3's 61 layers need) is tried, its
stages split as evenly as the layer marks allow; without it Megatron's rule pp | layers
prunes it, naming the option."""

from __future__ import annotations

import dataclasses

import optax

import autopar
from autopar.manual import megatron_candidates, megatron_grid_search
from examples import gpt


def test_uneven_stages_lifts_the_divisibility_rule_only():
    def reasons(**kw):
        found = megatron_candidates(16, 8, 64, num_layers=5, pp_values=(2, 8),
                                    tp_values=(1,), microbatch_sizes=(2,), **kw)
        return {c.name: r for c, r in found}

    even = reasons()
    assert "pp=2 does not divide the 5 layers" in even["megatron(dp=8,tp=1,pp=2)"]
    assert "uneven_stages=True" in even["megatron(dp=8,tp=1,pp=2)"]
    uneven = reasons(uneven_stages=True)
    assert uneven["megatron(dp=8,tp=1,pp=2,mb=4)"] == ""
    # more stages than layers stays pruned
    assert "pp=8 stages for 5 layers" in uneven["megatron(dp=2,tp=1,pp=8)"]


def test_uneven_grid_row_is_megatron_plan_of_the_uneven_split():
    cfg = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=32, num_layers=3, seq_len=16,
                              layer_markers=True)
    optimizer = optax.adamw(1e-2)
    step = gpt.make_train_step(cfg, optimizer)
    args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 8))
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1, devices_per_host=4)
    best, results = megatron_grid_search(
        step, *args, cluster=cluster, pp_values=(2,), tp_values=(1,),
        sequence_parallel=(False,), distributed_optimizer=(False,), recompute=("none",),
        virtual_stages=(1,), microbatch_sizes=(2,), uneven_stages=True)
    times = {c.name: o for c, o in results if isinstance(o, float)}
    assert set(times) == {"megatron(dp=2,tp=1,pp=2,mb=2)"}
    # 3 marked layers over 2 stages: 2 + 1 (the head riding with the last)
    assert [s.layers for s in best.stages] == [(0, 2), (2, 4)]
    plan = autopar.megatron_plan(step, *args, cluster=cluster, dp=2, tp=1, pp=2,
                                 num_microbatches=2)
    assert times["megatron(dp=2,tp=1,pp=2,mb=2)"] == plan.predicted_step_time
