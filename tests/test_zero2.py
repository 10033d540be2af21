"""ZeRO-2 in the Megatron scorer: gradients sharded over "data", reduce-scattered per
microbatch under the compute (`MegatronConfig(zero2=True)`, `autopar.cost._zero2`)."""

from __future__ import annotations

import dataclasses

import optax
import pytest

import autopar
from autopar.cost import (
    collective_time,
    exposed_time,
    zero2_exposed_reduction,
    zero2_gradient_bytes,
)
from autopar.graph import trace
from autopar.manual import MegatronConfig, megatron_plan_for_graph
from autopar.search import microbatch_args
from examples import gpt

GIB = 2**30
# bf16 compute with fp32 master weights, as the large runs (the gradient sums are fp32).
CFG = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, num_layers=4, layer_markers=True,
                          dtype="bfloat16", master_dtype="float32")


def test_gradient_bytes_by_hand():
    # 1.49 GiB of fp32 gradient sums per device over 64 ranks, largest tensor 0.41 GiB
    kept, in_flight = zero2_gradient_bytes(1.49 * GIB, 0.41 * GIB, 64)
    assert kept == pytest.approx(1.49 * GIB / 64)
    assert in_flight == pytest.approx(0.41 * GIB)
    assert zero2_gradient_bytes(100.0, 40.0, 1) == (100.0, 0.0)  # nothing to shard over
    with pytest.raises(ValueError, match="shards >= 1"):
        zero2_gradient_bytes(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="largest_gradient_bytes >= 0"):
        zero2_gradient_bytes(1.0, -1.0, 2)


def test_exposed_reduction_by_hand():
    # 250 ms under 336 ms of compute at overlap 0.8: 0.2 x 250 = 50 ms exposed
    assert zero2_exposed_reduction(0.250, 0.336, 0.8) == pytest.approx(0.050)
    # under 100 ms of compute only 100 ms hides: 150 ms exposed
    assert zero2_exposed_reduction(0.250, 0.100, 0.8) == pytest.approx(0.150)
    assert zero2_exposed_reduction(0.250, 1.0, 0.0) == pytest.approx(0.250)


def test_config_needs_the_distributed_optimizer():
    with pytest.raises(ValueError, match="pass distributed_optimizer=True with zero2=True"):
        MegatronConfig(dp=2, tp=2, zero2=True)
    config = MegatronConfig(dp=2, tp=2, pp=2, distributed_optimizer=True, zero2=True)
    assert config.name == "megatron(dp=2,tp=2,pp=2,zero2)"


OPT = optax.adamw(1e-4)
BATCH = 32
M = 4


@pytest.fixture(scope="module")
def plans():
    """dp4 tp2 pp2 with 4 microbatches on two virtual DGX A100 (DP across hosts), ZeRO-1
    and ZeRO-2: (cluster, zero1 plan, zero2 plan)."""
    step = gpt.make_train_step(CFG, OPT)
    args = (gpt.abstract_state(CFG, OPT), gpt.abstract_batch(CFG, BATCH))
    graph = trace(step, *microbatch_args(args, (1,), M), batch_argnums=(1,))
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=2)
    base = MegatronConfig(dp=4, tp=2, pp=2, num_microbatches=M, distributed_optimizer=True)
    cache: dict = {}
    zero1 = megatron_plan_for_graph(graph, cluster, base, solve_cache=cache)
    zero2 = megatron_plan_for_graph(graph, cluster, dataclasses.replace(base, zero2=True),
                                    solve_cache=cache)
    return cluster, zero1, zero2


def test_zero2_shards_gradients_and_adds_the_exposed_reduce_scatter(plans):
    """Every stage's gradient sums are 1/4 of ZeRO-1's, its working memory holds one more
    bucket (the largest gradient), and its time per microbatch grows by the reduce-scatter
    of its gradients over "data" that its compute does not hide, by hand."""
    cluster, zero1, zero2 = plans
    assert zero2.method == "megatron(dp=4,tp=2,pp=2,zero2,mb=4)"
    assert any("ZeRO-2 is priced, not run" in w for w in zero2.warnings)
    assert zero2.predicted_step_time > zero1.predicted_step_time
    for one, two in zip(zero1.stages, zero2.stages):
        p1, p2 = one.memory_parts, two.memory_parts
        assert p1.gradients > 0
        assert p2.gradients == pytest.approx(p1.gradients / 4)
        assert p2.state == pytest.approx(p1.state)
        assert p2.activations == pytest.approx(p1.activations)
        bucket = p2.working - p1.working
        assert 0 < bucket < p1.gradients  # one gradient of the stage's several
        assert p2.total < p1.total  # the tiny model's gradients dwarf one bucket
        c1, c2 = one.sharding.cost, two.sharding.cost
        assert c2.compute == c1.compute
        seconds = collective_time("reduce_scatter", p1.gradients, cluster, one.mesh, "data")
        expected = exposed_time(c1.compute + one.recompute_time, seconds, cluster.overlap)
        assert expected > 0
        assert c2.communication - c1.communication == pytest.approx(expected)
        assert two.time_per_microbatch - one.time_per_microbatch == pytest.approx(expected)
        assert c2.collectives["reduce_scatter"][0] == pytest.approx(
            c1.collectives.get("reduce_scatter", (0.0, 0.0))[0] + 1)


def test_grid_takes_zero2_where_only_it_fits(plans):
    """With a memory budget between the two layouts' peaks, the grid asked to try ZeRO-2
    finds ZeRO-1 out of memory and returns the ZeRO-2 plan."""
    from autopar.manual import megatron_grid_search

    cluster, zero1, zero2 = plans
    peak1 = max(s.memory_per_device for s in zero1.stages)
    peak2 = max(s.memory_per_device for s in zero2.stages)
    assert peak2 < peak1
    step = gpt.make_train_step(CFG, OPT)
    args = (gpt.abstract_state(CFG, OPT), gpt.abstract_batch(CFG, BATCH))
    best, results = megatron_grid_search(
        step, *args, cluster=cluster, pp_values=(2,), tp_values=(2,), microbatch_counts=(M,),
        sequence_parallel=(False,), distributed_optimizer=(True,), zero2=(False, True),
        recompute=("none",), virtual_stages=(1,), memory_budget=(peak1 + peak2) / 2)
    assert best.method == zero2.method
    assert best.predicted_step_time == pytest.approx(zero2.predicted_step_time)
    outcomes = {c.name: r for c, r in results}
    assert "does not fit" in outcomes[zero1.method]


def test_zero2_without_layer_marks_is_refused():
    cfg = dataclasses.replace(CFG, layer_markers=False)
    opt = optax.sgd(0.1)
    step = gpt.make_train_step(cfg, opt)
    graph = trace(step, gpt.abstract_state(cfg, opt), gpt.abstract_batch(cfg, 8),
                  batch_argnums=(1,))
    config = MegatronConfig(dp=4, tp=2, distributed_optimizer=True, zero2=True)
    with pytest.raises(ValueError, match="mark the layer edges or use zero2=False"):
        megatron_plan_for_graph(graph, "cpu-local", config)
