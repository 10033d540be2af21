"""Pictures and pipeline schedules: who holds which shard, simulated schedules, drawings."""

import sys

import numpy as np
import pytest

from autopar.cluster import Cluster
from autopar.cluster._mesh import LogicalMesh
from autopar.intra._sharding_plan import PredictedCost, ShardingPlan
from autopar.plan import InputInfo, Plan, Stage
from autopar.report import (
    TaskRecord,
    gantt,
    gantt_compare,
    plan_schedule,
    plot_layout,
    simulate_schedule,
)
from autopar.report._gantt import idle_fraction, makespan
from autopar.report._pictures import device_label, layer_rows, owner_grid, shard_holders

MESH_2X2 = LogicalMesh.create((2, 2))  # devices 0 1 / 2 3, axes x (rows) and y (columns)
MESH_2X4 = LogicalMesh.create((2, 4))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sharding(mesh, total_time=1e-3):
    cost = PredictedCost(total_time, 0.0, 0.0, 1024.0)
    return ShardingPlan(mesh, (), (), (), cost, "fingerprint")


def _plan(inputs, stages=None, num_microbatches=1):
    return Plan(
        method="shard",
        cluster=Cluster.from_profile("cpu-local").to_json(),
        stages=stages or (Stage((0, 1), _sharding(MESH_2X4)),),
        inputs=tuple(inputs),
        graph_fingerprint="fingerprint",
        num_microbatches=num_microbatches,
    )


def _param(path, shape, spec):
    return InputInfo(path, shape, "float32", "param", spec)


GPT_LIKE = [
    *(
        _param(f"params/layers/{i}/mlp/{name}", shape, spec)
        for i in range(3)
        for name, shape, spec in [
            ("w1", (16, 64), ((), ("y",))),
            ("b1", (64,), (("y",),)),
            ("w2", (64, 16), (("y",), ())),
        ]
    ),
    _param("params/wte", (128, 16), (("x", "y"), ())),
    InputInfo("batch/tokens", (8, 16), "int32", "batch", (("x",), ())),
]


# ---- who holds what ----------------------------------------------------------------------


def test_shard_holders_follow_the_mesh_axes():
    assert shard_holders(((), ("y",)), MESH_2X2) == {(0, 0): (0, 2), (0, 1): (1, 3)}
    assert shard_holders((("x",), ()), MESH_2X2) == {(0, 0): (0, 1), (1, 0): (2, 3)}
    assert shard_holders((("x",), ("y",)), MESH_2X2) == {
        (0, 0): (0,), (0, 1): (1,), (1, 0): (2,), (1, 1): (3,)
    }
    # Two axes on one dim: major to minor, so ('y', 'x') puts x innermost.
    by_y_then_x = {(0,): (0,), (1,): (2,), (2,): (1,), (3,): (3,)}
    assert shard_holders((("y", "x"),), MESH_2X2) == by_y_then_x
    assert shard_holders(((), ()), MESH_2X2) == {(0, 0): (0, 1, 2, 3)}
    with pytest.raises(ValueError, match=r"mesh axes \['z'\]"):
        shard_holders((("z",),), MESH_2X2)


def test_owner_grid_of_a_column_split_matrix():
    grid, holders = owner_grid((4, 8), ((), ("y",)), MESH_2X2)
    assert holders == [(0, 2), (1, 3)]
    assert grid.shape == (4, 8)
    assert (grid[:, :4] == 0).all() and (grid[:, 4:] == 1).all()


def test_owner_grid_of_a_3d_tensor_flattens_the_leading_dims():
    # [experts=2, rows=2, cols=4] split on experts (x) and columns (y).
    grid, holders = owner_grid((2, 2, 4), (("x",), (), ("y",)), MESH_2X2)
    assert holders == [(0,), (1,), (2,), (3,)]
    np.testing.assert_array_equal(
        grid, [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    )


def test_owner_grid_samples_big_tensors_and_keeps_every_shard():
    grid, holders = owner_grid((51200, 64), (("x", "y"), ()), MESH_2X4, max_cells=32)
    assert grid.shape == (32, 32)
    assert sorted(set(grid[:, 0].tolist())) == list(range(8))
    assert (np.diff(grid[:, 0]) >= 0).all(), "row blocks in device order"


def test_device_labels():
    assert device_label((0, 1, 2, 3)) == "0-3"
    assert device_label((0, 2, 4, 6)) == "0,2,4,6"
    assert device_label((5,)) == "5"
    assert device_label((0, 8, 16, 24, 32)) == "0,8,…(5)"


def test_layer_rows_merge_identical_layers():
    rows = layer_rows(_plan(GPT_LIKE))
    assert [title for title, _ in rows] == ["layers 0-2", "outside layers"]
    assert [i.path for i in rows[0][1]] == ["params/layers/0/mlp/w1", "params/layers/0/mlp/w2"]
    changed = list(GPT_LIKE)
    changed[3] = _param("params/layers/1/mlp/w1", (16, 64), (("x",), ()))
    titles = [title for title, _ in layer_rows(_plan(changed))]
    assert titles == ["layer 0", "layer 1", "layer 2", "outside layers"]


# ---- drawing -----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_layout_writes_an_image(tmp_path, suffix):
    path = plot_layout(_plan(GPT_LIKE), tmp_path / f"layout{suffix}")
    data = path.read_bytes()
    assert len(data) > 10_000
    if suffix == ".png":
        assert data.startswith(PNG_MAGIC)
    else:
        assert b"<svg" in data[:1000] and b"mlp/w1" in data


def test_plot_layout_needs_a_weight_matrix(tmp_path):
    plan = _plan([_param("params/b", (8,), ((),))])
    with pytest.raises(ValueError, match="no parameters with two or more dims"):
        plot_layout(plan, tmp_path / "x.png")


def test_pictures_without_matplotlib_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install autopar\[plot\]"):
        plot_layout(_plan(GPT_LIKE), tmp_path / "x.png")
    with pytest.raises(ImportError, match=r"pip install autopar\[plot\]"):
        gantt(simulate_schedule([1.0], [1.0], 2), tmp_path / "x.png")


# ---- pipeline schedules ------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    ("num_stages", "num_microbatches"), [(1, 1), (1, 4), (2, 4), (4, 8), (4, 2)]
)
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule, num_stages, num_microbatches):
    t_f, t_b = 1.0, 2.5
    tasks = simulate_schedule([t_f] * num_stages, [t_b] * num_stages, num_microbatches, schedule)
    assert len(tasks) == 2 * num_stages * num_microbatches
    expected = (num_microbatches + num_stages - 1) * (t_f + t_b)
    assert makespan(tasks) == pytest.approx(expected)
    # The bubble: (p - 1) / (m + p - 1) of the time (REFERENCES.md, Megatron-LM).
    bubble = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert idle_fraction(tasks) == pytest.approx(bubble)


def _order(tasks, stage):
    mine = sorted((t for t in tasks if t.stage == stage), key=lambda t: t.start)
    return [f"{t.kind[0].upper()}{t.microbatch}" for t in mine]


def test_tasks_run_in_schedule_order():
    one_f = simulate_schedule([1.0] * 4, [2.0] * 4, 6, "1f1b")
    assert _order(one_f, 0) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3",
                                "B4", "B5"]
    assert _order(one_f, 3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4",
                                "F5", "B5"]
    gpipe = simulate_schedule([1.0] * 4, [2.0] * 4, 2, "gpipe")
    assert _order(gpipe, 1) == ["F0", "F1", "B0", "B1"]


def _by_key(tasks):
    return {(t.kind, t.stage, t.microbatch): t for t in tasks}


def test_unequal_stages_by_hand():
    # Stage 0: F 1 s, B 1 s; stage 1: F 2 s, B 1 s; two microbatches.
    # GPipe: s0 F0 0-1 F1 1-2; s1 F0 1-3 F1 3-5 B0 5-6 B1 6-7; s0 B0 6-7 B1 7-8.
    gpipe = _by_key(simulate_schedule([1, 2], [1, 1], 2, "gpipe"))
    assert (gpipe["backward", 0, 0].start, gpipe["backward", 0, 1].end) == (6, 8)
    # 1F1B: s1 F0 1-3 B0 3-4 F1 4-6 B1 6-7; s0 F0 0-1 F1 1-2 B0 4-5 B1 7-8.
    one_f = _by_key(simulate_schedule([1, 2], [1, 1], 2, "1f1b", apply_times=[0.5, 0.25]))
    assert (one_f["forward", 1, 1].start, one_f["backward", 0, 0].start) == (4, 4)
    assert one_f["apply", 0, -1].start == 8 and one_f["apply", 0, -1].end == 8.5
    assert one_f["apply", 1, -1].end == 7.25
    assert makespan(list(one_f.values())) == 8.5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_random_times_respect_every_dependency(schedule):
    rng = np.random.default_rng(0)
    forward, backward = rng.uniform(0.5, 2, 3), rng.uniform(0.5, 2, 3)
    tasks = _by_key(simulate_schedule(forward, backward, 5, schedule))
    for (kind, stage, m), task in tasks.items():
        assert task.duration == pytest.approx((forward if kind == "forward" else backward)[stage])
        if kind == "forward" and stage > 0:
            assert task.start >= tasks["forward", stage - 1, m].end
        if kind == "backward":
            assert task.start >= tasks["forward", stage, m].end
            if stage < 2:
                assert task.start >= tasks["backward", stage + 1, m].end
    for stage in range(3):
        mine = sorted((t for t in tasks.values() if t.stage == stage), key=lambda t: t.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:])), "no overlap"


def test_simulate_schedule_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        simulate_schedule([1.0], [1.0], 2, "zigzag")
    with pytest.raises(ValueError, match="one of each per pipeline stage"):
        simulate_schedule([1.0, 1.0], [1.0], 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        simulate_schedule([1.0], [1.0], 0)


def test_plan_schedule_agrees_with_the_plans_predicted_step_time():
    stages = tuple(
        Stage((i, i + 1), _sharding(LogicalMesh.create((4,), range(4 * i, 4 * i + 4)), 0.003))
        for i in range(2)
    )
    plan = _plan(GPT_LIKE[:1], stages=stages, num_microbatches=4)
    tasks = plan_schedule(plan)
    assert len(tasks) == 2 * 2 * 4
    assert makespan(tasks) == pytest.approx(plan.predicted_step_time)


def test_gantt_and_compare_write_images(tmp_path):
    predicted = simulate_schedule([1e-3, 1e-3], [2e-3, 2e-3], 4, "1f1b", apply_times=[5e-4] * 2)
    measured = [TaskRecord(t.stage, t.kind, t.microbatch, t.start * 1.2, t.end * 1.25)
                for t in predicted]
    one = gantt(predicted, tmp_path / "schedule.png", title="GPT, 2 stages")
    both = gantt_compare(predicted, measured, tmp_path / "compare.png")
    for path in (one, both):
        assert path.read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ValueError, match="measured is empty"):
        gantt_compare(predicted, [], tmp_path / "x.png")
