"""Pipeline schedules: GPipe, 1F1B, interleaved 1F1B and zero bubble (ZB-H1).

The orders (each task once, dependencies kept, microbatches in flight as the cost model
says), the simulated step time against `pipeline_latency`, and numerical parity with one
device (3 AdamW steps, loss rtol 1e-5) on a cheap 8-layer MLP with 8 microbatches.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import NO_MICROBATCH_CHECK, run_steps

import autopar
from autopar.cost import (
    bubble_fraction,
    in_flight_microbatches,
    pipeline_latency,
    pipelined_step_time,
)
from autopar.report import simulate_schedule
from autopar.report._gantt import makespan
from autopar.runtime import dependencies, device_orders, dispatch_order
from examples import mlp

MLP = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=8, layer_markers=True)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]


# ---- orders and formulas (no devices) ----------------------------------------------------


@pytest.mark.parametrize("schedule, v", SCHEDULES)
@pytest.mark.parametrize("groups, m", [(2, 8), (4, 8), (4, 4), (3, 6)])
def test_orders_run_every_task_once_after_its_inputs(schedule, v, groups, m):
    stages = groups * v
    orders = device_orders(schedule, stages, m, v)
    assert len(orders) == groups
    tasks = [t for order in orders for t in order]
    phases = ("forward", "backward") + (("weight",) if schedule == "zero_bubble" else ())
    expected = {(p, s, i) for p in phases for s in range(stages) for i in range(m)}
    assert len(tasks) == len(expected) and set(tasks) == expected
    for g, order in enumerate(orders):
        assert all(s % groups == g for _, s, _ in order), "a task off its device group"
    done = set()
    for task in dispatch_order(schedule, stages, m, v):
        assert all(d in done for d in dependencies(task, stages)), task
        done.add(task)


@pytest.mark.parametrize("schedule, v", SCHEDULES)
@pytest.mark.parametrize("groups, m", [(2, 8), (4, 8), (4, 16)])
def test_simulated_step_is_the_cost_model_latency(schedule, v, groups, m):
    """Equal stages, forward 1 and backward 2 per microbatch (per group: split over its
    v chunks): the simulated makespan is `pipeline_latency`, and the idle share
    `bubble_fraction`."""
    stages = groups * v
    tasks = simulate_schedule([1.0 / v] * stages, [2.0 / v] * stages, m, schedule,
                              virtual_stages=v)
    predicted = pipeline_latency([3.0] * groups, m, schedule, v)
    assert makespan(tasks) == pytest.approx(predicted)
    busy = sum(t.duration for t in tasks)
    assert 1 - busy / (groups * makespan(tasks)) == pytest.approx(
        bubble_fraction(groups, m, schedule, v)
    )


def test_bubble_formulas_by_hand():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, "interleaved_1f1b", 2) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 8, "zero_bubble") == pytest.approx(1 / 9)  # (3/3) / (8 + 1)
    assert pipeline_latency([1.0, 2.0], 4) == 9.0
    assert pipeline_latency([1.0, 2.0], 4, "interleaved_1f1b", 2) == 8.5
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        bubble_fraction(4, 8, "1f1b", 2)


def test_zero_bubble_by_hand_timeline():
    """ZB-H1 on 2 stages, 2 microbatches, F = 2, B = 2, W = 1 per stage, timed by hand:
    stage 0 runs F0 [0, 2], F1 [2, 4], B0 [6, 8] (after stage 1's B0), W0 [8, 9],
    B1 [10, 12], W1 [12, 13]; stage 1 runs F0 [2, 4], B0 [4, 6], F1 [6, 8], B1 [8, 10],
    W0 [10, 11], W1 [11, 12]. The step ends at 13: 10 of work plus a bubble of
    (p - 1)(T_F + T_B - T_W) = 3 (Qi et al. 2024, section 3), where 1F1B's is
    (p - 1)(T_F + T_B + T_W) = 5. The cost model's formulas read the same simulation."""
    from autopar.cost import bubble_scale

    tasks = simulate_schedule([2.0, 2.0], [3.0, 3.0], 2, "zero_bubble",
                              weight_times=[1.0, 1.0])
    timeline = {(t.stage, t.kind, t.microbatch): (t.start, t.end) for t in tasks}
    assert timeline == {
        (0, "forward", 0): (0, 2), (0, "forward", 1): (2, 4), (0, "backward", 0): (6, 8),
        (0, "weight", 0): (8, 9), (0, "backward", 1): (10, 12), (0, "weight", 1): (12, 13),
        (1, "forward", 0): (2, 4), (1, "backward", 0): (4, 6), (1, "forward", 1): (6, 8),
        (1, "backward", 1): (8, 10), (1, "weight", 0): (10, 11), (1, "weight", 1): (11, 12),
    }
    shares = (2.0, 2.0, 1.0)
    assert bubble_scale("zero_bubble", num_groups=2, num_microbatches=2,
                        phase_shares=shares) == pytest.approx(3 / 5)
    assert pipeline_latency([5.0, 5.0], 2, "zero_bubble", phase_shares=shares) == (
        pytest.approx(13.0)
    )
    assert pipeline_latency([5.0, 5.0], 2, "1f1b") == 15.0
    assert bubble_fraction(2, 2, "zero_bubble", phase_shares=shares) == pytest.approx(
        1 - 20 / (2 * 13)
    )


@pytest.mark.parametrize("groups, m", [(2, 8), (4, 8), (4, 32)])
@pytest.mark.parametrize("shares", [(1, 1, 1), (0.4, 0.4, 0.2), (0.3, 0.5, 0.2)])
def test_zero_bubble_fills_what_its_weight_passes_can(groups, m, shares):
    """With at least p microbatches, ZB-H1's bubble is (p - 1)(T_F + T_B - T_W) against
    1F1B's (p - 1)(T_F + T_B + T_W) (Qi et al. 2024, section 3): the simulated share of
    1F1B's bubble whatever the split, not a fixed third."""
    from autopar.cost import bubble_scale

    f, b, w = (x / sum(shares) for x in shares)
    assert bubble_scale("zero_bubble", num_groups=groups, num_microbatches=m,
                        phase_shares=shares) == pytest.approx((f + b - w) / (f + b + w))


def test_zero_bubble_gains_less_with_few_microbatches():
    """With fewer microbatches than stages there are fewer W passes to fill the drain:
    the simulated share of 1F1B's bubble grows (4 stages, 2 microbatches: 5/9, not 1/3)."""
    from autopar.cost import bubble_scale

    assert bubble_scale("zero_bubble", num_groups=4, num_microbatches=2) == pytest.approx(5 / 9)
    assert bubble_scale("zero_bubble", num_groups=4, num_microbatches=4) == pytest.approx(1 / 3)


@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_microbatches_in_flight_match_the_orders(schedule, v):
    """The most microbatches (in whole-stage units) a device group holds between their
    forward and their backward, as `in_flight_microbatches` says."""
    groups, m = 4, 8
    stages = groups * v
    for g, order in enumerate(device_orders(schedule, stages, m, v)):
        held, most = set(), 0
        for phase, s, i in order:
            if phase == "forward":
                held.add((s, i))
            elif phase == "backward":
                held.discard((s, i))
            most = max(most, len(held))
        expected = in_flight_microbatches(schedule, m, groups - g, v, groups)
        assert most / v == pytest.approx(expected), (g, most)


def test_interleaving_needs_microbatches_in_rounds_of_the_groups():
    with pytest.raises(ValueError, match="not a multiple of 4: use num_microbatches=8"):
        device_orders("interleaved_1f1b", 8, 6, 2)


def test_interleaved_microbatches_not_in_rounds_fail_before_running():
    optimizer = optax.sgd(0.1)
    step = mlp.make_train_step(MLP, optimizer)
    state = mlp.init_state(MLP, optimizer, jax.random.key(0))
    batch = mlp.make_batch(MLP, 24, jax.random.key(1))
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), num_stages=2,
        num_microbatches=3, schedule="interleaved_1f1b", virtual_stages=2,
    )
    with pytest.raises(ValueError, match="3 microbatches is not a multiple of 2"):
        par(state, batch)
    jax.tree.map(np.asarray, state)  # the caller's state is intact


def test_options_reject_virtual_stages_without_interleaving():
    step = mlp.make_train_step(MLP, optax.sgd(0.1))
    with pytest.raises(ValueError, match="needs schedule='interleaved_1f1b'"):
        autopar.autoparallel(step, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        autopar.autoparallel(step, schedule="zigzag")


# ---- parity with one device ----------------------------------------------------------


def _parity(num_groups: int, schedule: str, v: int, **options):
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = mlp.make_train_step(MLP, optimizer)
    state = mlp.init_state(MLP, optimizer, jax.random.key(0))
    batch = mlp.make_batch(MLP, 32, jax.random.key(1))
    ref, _ = run_steps(jax.jit(step), state, batch)
    devices = 8 // num_groups
    extra = {"virtual_stages": v} if v > 1 else {}
    par = autopar.autoparallel(
        step, cluster=autopar.Cluster.from_profile("cpu-local"), donate_argnums=(),
        num_stages=num_groups, num_microbatches=8, schedule=schedule,
        submeshes=[(1, devices)], logical_shapes=[(devices,)], **extra, **options,
        **NO_MICROBATCH_CHECK,
    )
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    return par


@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_two_stage_parity(schedule, v):
    par = _parity(2, schedule, v)
    plan = par.plan
    assert plan.schedule == schedule and plan.num_stages == 2 * v
    assert plan.num_device_groups == 2 and plan.virtual_stages == v
    if schedule == "interleaved_1f1b":  # stage s on the devices of stage s mod 2
        ids = [s.sharding.mesh.device_ids for s in plan.stages]
        assert ids[2:] == ids[:2] and ids[0] != ids[1]
    if schedule == "zero_bubble":  # B and W both ran, and show on the measured chart
        mlp_state = mlp.init_state(MLP, optax.adamw(1e-2, eps=1e-6), jax.random.key(0))
        batch = mlp.make_batch(MLP, 32, jax.random.key(1))
        _, timeline = par.record_timeline(mlp_state, batch)
        assert {t.kind for t in timeline} == {"forward", "backward", "weight", "apply"}


@pytest.mark.extended
@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_four_stage_parity(schedule, v):
    par = _parity(4, schedule, v)
    assert par.plan.num_stages == 4 * v and par.plan.schedule == schedule


def test_auto_schedule_picks_the_fastest_predicted():
    """A dry run (zero bubble's parity is test_two_stage_parity's). `schedule="auto"` gives
    the plan of whichever schedule, planned on its own, predicts the shortest step; and the
    launch cost decides between 1F1B and zero bubble on the same stages, each priced as its
    plan prices it (`pipelined_step_time`: 3 tasks per microbatch under zero bubble, 2 under
    1F1B). With cpu-local's launch cost zero bubble's 8 extra launches per stage outweigh
    its smaller bubble on this tiny model; with launches free its smaller bubble wins."""
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = mlp.make_train_step(MLP, optimizer)
    args = (mlp.abstract_state(MLP, optimizer), mlp.abstract_batch(MLP, 32))
    local = autopar.Cluster.from_profile("cpu-local")
    assert local.dispatch_overhead > 0
    free = dataclasses.replace(local, dispatch_overhead=0.0)
    common = dict(num_stages=2, num_microbatches=8, submeshes=[(1, 4)],
                  logical_shapes=[(4,)], cache=False, **NO_MICROBATCH_CHECK)
    for cluster, faster in ((local, "1f1b"), (free, "zero_bubble")):
        auto = autopar.plan(step, *args, cluster=cluster, schedule="auto", **common)
        alone = {
            s: autopar.plan(step, *args, cluster=cluster, schedule=s, **common, **extra)
            for s, extra in (("1f1b", {}), ("zero_bubble", {}),
                             ("interleaved_1f1b", {"virtual_stages": 2}))
        }
        fastest = min(alone, key=lambda s: alone[s].predicted_step_time)
        assert auto.schedule == fastest
        assert auto.predicted_step_time == pytest.approx(
            alone[fastest].predicted_step_time, rel=1e-12)
        # 1F1B against zero bubble on the same stages, priced by the plan's own function
        stages = alone["1f1b"]
        predicted = {
            s: pipelined_step_time([st.time_per_microbatch for st in stages.stages],
                                   stages.cluster, 8, s, phase_shares=stages.phase_shares)
            for s in ("1f1b", "zero_bubble")
        }
        assert min(predicted, key=predicted.get) == faster
        assert stages.predicted_step_time == pytest.approx(predicted["1f1b"], rel=1e-12)


def test_auto_schedule_weighs_interleaving_by_predicted_time():
    """A dry run where compute dwarfs the stage-boundary transfers (8 dense layers of
    16384 x 16384 on a dgx-a100-80g host, 2 device groups, 2 microbatches: a bubble of 1/3
    under 1F1B): "auto" weighs 1F1B, zero bubble and interleaved 1F1B with v = 2 and 4
    (the last two planned by the stage DP as 4 and 8 stages, every boundary's transfer in
    their stage costs) and takes the least predicted step time, here interleaving with
    v = 4. Each candidate's time is `pipeline_latency` of its stage costs, with its stages'
    split into forward, input-gradient and weight-gradient time (`phase_shares`)."""
    from autopar.graph import trace
    from autopar.search._microbatch import batch_size
    from autopar.search._options import PlanOptions
    from autopar.search._pipeline import _stage_choices
    from autopar.search._schedules import phase_shares
    from autopar.search._schedules import pick as _pick
    from autopar.search._schedules import stage_times as _stage_times

    big = mlp.MLPConfig(in_dim=16384, hidden=16384, out_dim=16384, num_layers=8,
                        layer_markers=True)
    optimizer = optax.adamw(1e-3)
    step = mlp.make_train_step(big, optimizer)
    args = (mlp.abstract_state(big, optimizer), mlp.abstract_batch(big, 4096))
    cluster = autopar.Cluster.from_profile("dgx-a100-80g")
    options = PlanOptions(num_stages=2, num_microbatches=2, schedule="auto")
    rows = batch_size(trace(step, *args, batch_argnums=options.batch_argnums))
    candidates = _stage_choices(step, args, cluster, options, rows, None, {})
    by_stages = {len(c.choice.stage_layers): c for c in candidates}
    assert sorted(by_stages) == [2, 4, 8]
    assert by_stages[2].schedule == "zero_bubble"  # beats 1F1B: a third of its bubble
    # The plan's own stage times: the stitched stage plans, recompute and the transfer
    # into each stage (what Plan.predicted_step_time adds up).
    times = _stage_times(by_stages[2].choice)
    shares = phase_shares(by_stages[2].choice, cluster)
    assert by_stages[2].latency == pytest.approx(
        pipelined_step_time(times, cluster, 2, "zero_bubble", phase_shares=shares)
    )
    assert by_stages[2].latency < pipelined_step_time(times, cluster, 2, "1f1b",
                                                      phase_shares=shares)
    for stages, v in ((4, 2), (8, 4)):
        c = by_stages[stages]
        assert c.schedule == "interleaved_1f1b"
        chunks = _stage_times(c.choice)
        assert c.latency == pytest.approx(pipelined_step_time(
            chunks, cluster, 2, "interleaved_1f1b", 2, phase_shares(c.choice, cluster)
        ))
        per_group = [sum(chunks[g::2]) for g in range(2)]
        assert c.latency > pipeline_latency(per_group, 2, "interleaved_1f1b", v,
                                            phase_shares(c.choice, cluster))
    best = _pick(candidates)
    assert best is min(candidates, key=lambda c: c.latency) is by_stages[8]


@pytest.mark.extended  # 34 s on 2 busy cores; test_two_stage_parity covers the runtime
def test_megatron_interleaved_plan_matches_one_device():
    optimizer = optax.adamw(1e-2, eps=1e-6)
    step = mlp.make_train_step(MLP, optimizer)
    state = mlp.init_state(MLP, optimizer, jax.random.key(0))
    batch = mlp.make_batch(MLP, 32, jax.random.key(1))
    ref, _ = run_steps(jax.jit(step), state, batch)
    plan = autopar.megatron_plan(
        step, state, batch, cluster=autopar.Cluster.from_profile("cpu-local"), dp=2, tp=2,
        pp=2, num_microbatches=8, schedule="interleaved_1f1b", virtual_stages=2,
    )
    assert plan.num_stages == 4 and plan.virtual_stages == 2
    assert "v=2" in plan.method
    losses, _ = run_steps(autopar.autoparallel(step, plan=plan, donate_argnums=()), state, batch)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_every_declared_schedule_is_tested():
    from autopar.choices import SCHEDULES as DECLARED

    assert sorted(s for s, _ in SCHEDULES) == sorted(DECLARED)


def test_megatron_uneven_chunks():
    """6 marked layers do not split over pp=2 x v=2 chunks: Megatron's rule refuses, and
    `even_chunks=False` splits them as evenly as the marks allow (Llama 3's uneven
    stages), the chunks a layer apart at most."""
    cfg = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=6, layer_markers=True)
    optimizer = optax.sgd(0.1)
    step = mlp.make_train_step(cfg, optimizer)
    state = jax.eval_shape(lambda: mlp.init_state(cfg, optimizer, jax.random.key(0)))
    batch = jax.eval_shape(lambda: mlp.make_batch(cfg, 32, jax.random.key(1)))
    options = dict(cluster=autopar.Cluster.from_profile("cpu-local"), dp=2, tp=2, pp=2,
                   num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="pass even_chunks=False"):
        autopar.megatron_plan(step, state, batch, **options)
    plan = autopar.megatron_plan(step, state, batch, even_chunks=False, **options)
    assert plan.num_stages == 4 and plan.virtual_stages == 2 and ",uneven" in plan.method
    sizes = [b - a for a, b in (s.layers for s in plan.stages)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == plan.stages[-1].layers[1]


def test_phase_times_split_each_backward_as_the_runtime_does():
    """`phase_times` (the F/B/W split zero bubble's prediction takes): on 2 stages of the
    dense MLP, the last stage's backward splits into B (the gradient handed back) and W
    (its weight gradients), each with as many matmul FLOPs as its forward (dX = dY W^T and
    dW = X^T dY); the first stage hands nothing back, so its backward is all W; and the
    three times are each pass's nodes timed by `compute_time`."""
    from autopar.cost import MATMUL_PRIMITIVES, compute_time
    from autopar.graph import trace
    from autopar.inter.passes import assign_layers, partition, phase_times, split_backward

    optimizer = optax.sgd(0.1)
    step = mlp.make_train_step(MLP, optimizer)
    graph = trace(step, mlp.abstract_state(MLP, optimizer), mlp.abstract_batch(MLP, 32))
    layers = assign_layers(graph)
    half = layers.num_layers // 2
    part = partition(graph, layers, [(0, half), (half, layers.num_layers)])
    grads = set(part.grad_vars)
    cluster = autopar.Cluster.from_profile("cpu-local")
    splits = [split_backward(seg, part.stage_graphs[seg.stage], grads) for seg in part.backward]
    assert not splits[0][0].nodes and splits[0][1].nodes  # stage 0: all W

    def dot_flops(stage, nodes):
        g = part.stage_graphs[stage]
        return sum(g.nodes[n].flops for n in nodes if g.nodes[n].primitive == "dot_general")

    b, w = splits[1]
    forward = dot_flops(1, part.forward[1].nodes)
    assert dot_flops(1, b.nodes) == forward == dot_flops(1, w.nodes)

    def seconds(stage, nodes):
        g = part.stage_graphs[stage]
        return sum(
            compute_time(g.nodes[n].flops, g.nodes[n].bytes_read + g.nodes[n].bytes_written,
                         cluster, g.vars[g.nodes[n].outputs[0]].dtype,
                         matmul=g.nodes[n].primitive in MATMUL_PRIMITIVES)
            for n in nodes
        )

    expected = (
        sum(seconds(seg.stage, seg.nodes) for seg in part.forward),
        sum(seconds(s, bw[0].nodes) for s, bw in enumerate(splits)),
        sum(seconds(s, bw[1].nodes) for s, bw in enumerate(splits)),
    )
    assert phase_times(part, cluster) == pytest.approx(expected)
