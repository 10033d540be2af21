"""The explored plan space (`autopar.space`): its rows, its frontier, its file.

One exploration of a 2-layer GPT on 2 CPU devices under a budget its fastest plans do not
fit (so the plan is memory-bound and a larger budget is searched too) serves every test.
It costs every stage in full (`prune_by_bound=False`), so that the stage DP's table holds
a plan of two stages (the bound prunes them: they are slower) and each stage count has
its row.
"""

import dataclasses
import json

import helpers
import pytest

import autopar
from autopar.app import cli
from autopar.manual._grid import megatron_candidates
from autopar.plan import FrontierPoint, Plan
from autopar.report import on_frontier, pareto_frontier
from autopar.space import COLUMNS, SCHEMA_VERSION, explore, load

CFG = dataclasses.replace(helpers.GPT, num_layers=2, hidden=16, num_heads=2, vocab_size=64,
                          seq_len=8)
GRID = dict(microbatch_sizes=(1,), sequence_parallel=(False,),
            distributed_optimizer=(False, True), recompute=("none", "full"),
            virtual_stages=(1,), num_heads=2)
# Between the 4-microbatch plan's peak (about 183 KiB) and the 2-microbatch one's (196 KiB):
# the fastest plans do not fit, so the plan is memory-bound.
BUDGET = 190 * 1024


@pytest.fixture(scope="module")
def explored():
    step, args = helpers.tiny_gpt_step(CFG, batch_size=4)
    cluster = helpers.cluster("cpu-local", 1, 2)
    space = explore(step, *args, cluster=cluster,
                    options={"memory_budget": BUDGET, "prune_by_bound": False},
                    grid=GRID, budget_fractions=(1.5,), model="gpt 2 layers",
                    command="test_space")
    return space, step, args, cluster


def test_rows_have_the_schema_and_a_header(explored, tmp_path):
    space, *_ = explored
    header = space.header
    assert header["schema_version"] == SCHEMA_VERSION
    assert header["autopar_version"] == autopar.__version__
    assert header["profile"]["name"] == "cpu-local" and len(header["profile"]["sha256"]) == 16
    assert header["command"] == "test_space" and header["memory_budget"] == BUDGET
    for row in space.rows:
        assert set(row) == set(COLUMNS)
        assert row["source"] in ("auto", "megatron")
        assert row["kind"] == ("grid" if row["source"] == "megatron" else row["kind"])
        assert row["kind"] in ("grid", "search", "stage_count")
        if row["feasible"]:
            assert row["step_time"] > 0 and row["memory_peak"] > 0
            parts = sum(row[k] for k in ("compute", "communication", "recompute", "transfer",
                                         "bubble", "other"))
            assert parts == pytest.approx(row["step_time"], rel=1e-9)
            assert row["compute"] > 0 and row["memory_peak"] == max(row["memory_per_stage"])
            assert sum(row["communication_by_kind"].values()) == pytest.approx(
                row["communication"], rel=1e-9, abs=1e-15)
        else:
            assert row["reason"] and row["step_time"] is None
    assert sum(r["chosen"] for r in space.rows) == 1


def test_every_grid_configuration_appears_once(explored):
    space, step, args, cluster = explored
    names = [r["label"] for r in space.rows if r["source"] == "megatron"]
    assert len(names) == len(set(names))
    enumerated = megatron_candidates(
        cluster.num_devices, cluster.devices_per_host, 4, num_layers=CFG.num_layers,
        num_heads=2, microbatch_sizes=(1,), distributed_optimizer=(False, True))
    assert {c.name for c, _ in enumerated} <= set(names)
    rows = {r["label"]: r for r in space.rows if r["source"] == "megatron"}
    # Infeasible ones say why: a rule, "not needed", or the memory error.
    assert any(r["reason"].startswith("pruned") for r in rows.values())
    assert any("does not fit" in r["reason"] for r in rows.values() if r["reason"])
    # A priced row is the plan megatron_plan makes of that configuration.
    row = next(r for r in rows.values() if r["feasible"])
    hand = autopar.megatron_plan(step, *args, cluster=cluster, dp=row["dp"], tp=row["tp"],
                                 pp=row["pp"], num_microbatches=row["num_microbatches"],
                                 distributed_optimizer=row["distributed_optimizer"],
                                 recompute=row["remat"], memory_budget=BUDGET)
    assert row["step_time"] == pytest.approx(hand.predicted_step_time, rel=1e-12)


def test_the_chosen_plan_is_on_the_frontier(explored):
    space, *_ = explored
    chosen = next(r for r in space.rows if r["chosen"])
    assert chosen["step_time"] == pytest.approx(space.plan.predicted_step_time, rel=1e-12)
    assert chosen["memory_peak"] <= BUDGET
    autos = [p for p in space.points() if p.source == "auto"]
    me = next(p for p in autos if p.chosen)
    assert on_frontier(me, pareto_frontier(autos))
    # Nothing explored under the budget is faster.
    assert all(r["step_time"] >= chosen["step_time"] for r in space.feasible()
               if r["memory_peak"] <= BUDGET)
    # A larger budget was searched, and buys a faster plan.
    assert any(r["budget"] > BUDGET for r in space.feasible("auto"))
    assert space.best_under(2 * BUDGET)["step_time"] < chosen["step_time"]


def test_each_stage_count_has_its_best_plan(explored):
    space, step, args, cluster = explored
    chosen = next(r for r in space.rows if r["chosen"])
    autos = [r for r in space.feasible("auto") if r["budget"] == BUDGET]
    # One row per (microbatches, schedule, stage count, meshes): the stage DP's best plan
    # of each stage count the search did not keep is a row of its own.
    keys = [(r["num_microbatches"], r["schedule"], r["num_stages"], str(r["meshes"]))
            for r in autos]
    assert len(keys) == len(set(keys))
    two = [r for r in autos if r["kind"] == "stage_count"]
    assert {r["num_stages"] for r in two} == {2} and {r["num_stages"] for r in autos} == {1, 2}
    assert {r["num_microbatches"] for r in two} == {r["num_microbatches"] for r in autos
                                                   if r["kind"] == "search"}
    for row in two:  # a device each: leaner and slower than the chosen plan
        assert row["meshes"] == [[1], [1]] and len(row["memory_per_stage"]) == 2
        assert row["memory_peak"] < chosen["memory_peak"]
        assert row["step_time"] > chosen["step_time"]
    # The row of the chosen count (searched on its own layouts) is the plan the search
    # makes with that stage count fixed.
    row = next(r for r in two if r["num_microbatches"] == chosen["num_microbatches"])
    fixed = autopar.plan(step, *args, cluster=cluster, memory_budget=BUDGET, num_stages=2,
                         num_microbatches=row["num_microbatches"], cache=False)
    assert fixed.predicted_step_time == pytest.approx(row["step_time"], rel=1e-9)
    assert max(s.memory_per_device for s in fixed.stages) == row["memory_peak"]
    # The leaner two-stage plans are on the frontier below the chosen plan's memory.
    assert min(p.memory for p in space.frontier()) == min(r["memory_peak"] for r in two)


def test_best_per_stage_count_matches_brute_force():
    """Each stage count's plan from the DP's table is that count's optimum (numbers only)."""
    from autopar.inter._stage_brute import brute_force_stages
    from autopar.inter._stage_dp import StageCost, StagePlan, plan_stages

    weights = (3.0, 1.0, 2.0, 4.0, 1.5)

    def stage_cost(start, end, index):
        devices = (1, 2, 4)[index]
        work = sum(weights[start:end])
        memory = work / devices
        return StageCost(work / devices + 0.1 * (devices - 1), memory <= 3.0, memory)

    from autopar.inter._submesh import SubmeshShape

    subs = [SubmeshShape(1, 1), SubmeshShape(1, 2), SubmeshShape(1, 4)]
    found: dict = {}
    best = plan_stages(5, 1, 4, stage_cost, 4, submeshes=subs, stage_counts=found)
    plans = {count: p for count, p in found.items() if isinstance(p, StagePlan)}
    assert best.latency == min(p.latency for p in plans.values())
    for count in range(1, 5):
        try:
            brute = brute_force_stages(5, 1, 4, stage_cost, 4, submeshes=subs,
                                       num_stages=count)
        except ValueError:
            assert found[count].reason.startswith(f"no plan of {count} stage(s)")
            continue
        assert len(found[count].stages) == count
        assert found[count].latency == pytest.approx(brute.latency, rel=1e-12)
    assert len(plans) >= 2


def test_a_stage_count_without_a_plan_says_why():
    """A stage count whose every plan holds a stage cut off by the bound (`Pruned`) is
    "pruned by bound" with a lower bound no plan of that count beats (brute force on the
    stages' true costs); one that no slicing fits says so (numbers only)."""
    from autopar.inter._stage_brute import brute_force_stages
    from autopar.inter._stage_dp import NoPlanOfCount, Pruned, StageCost, StagePlan, plan_stages
    from autopar.inter._submesh import SubmeshShape

    weights = (3.0, 1.0, 2.0, 4.0, 1.5)

    def true_cost(start, end, index):  # the whole model on one stage never fits
        devices = (1, 2, 4)[index]
        work = sum(weights[start:end])
        return StageCost(work / devices + 0.1 * (devices - 1),
                         work / devices <= 3.0 and end - start < 5, work / devices)

    def pruned_cost(start, end, index):  # slow stages cut off, at 0.9 of their latency
        cost = true_cost(start, end, index)
        if cost.feasible and cost.latency > 3.05:
            return StageCost(float("inf"), False, float("inf"), Pruned(0.0, 0.9 * cost.latency))
        return cost

    subs = [SubmeshShape(1, 1), SubmeshShape(1, 2), SubmeshShape(1, 4)]
    found: dict = {}
    plan_stages(5, 1, 4, pruned_cost, 4, submeshes=subs, stage_counts=found)
    assert set(found) == {1, 2, 3, 4}
    brute = brute_force_stages(5, 1, 4, true_cost, 4, submeshes=subs, num_stages=2)
    assert isinstance(found[2], NoPlanOfCount) and found[2].reason.startswith("pruned by bound")
    assert 0 < found[2].lower_bound <= brute.latency
    assert isinstance(found[3], StagePlan)
    for count in (1, 4):  # no slicing fits: no bound to give
        assert found[count].reason.startswith(f"no plan of {count} stage(s)")
        assert found[count].lower_bound is None
        with pytest.raises(ValueError):
            brute_force_stages(5, 1, 4, true_cost, 4, submeshes=subs, num_stages=count)


def test_explain_of_a_memory_bound_plan_shows_the_frontier(explored):
    space, *_ = explored
    points = space.plan.frontier()
    assert len(points) >= 3 and sum(p.chosen for p in points) == 1
    assert [p.memory for p in points] == sorted(p.memory for p in points)
    text = space.plan.explain()
    section = text.split("memory/time frontier")[1].split("\n")[1:]
    shown = [line for line in section if line.startswith("  budget ")]
    assert len(shown) >= 3
    assert sum("<- this plan" in line for line in shown) == 1
    assert any("x this plan's time" in line for line in shown)
    # The frontier survives the plan's JSON.
    assert Plan.from_json(json.loads(json.dumps(space.plan.to_json()))).frontier() == points


def test_the_loader_round_trips(explored, tmp_path):
    space, *_ = explored
    path = space.write(tmp_path / "space.jsonl")
    again = load(tmp_path)
    assert again.header == json.loads(json.dumps(space.header))
    assert again.rows == json.loads(json.dumps(space.rows))
    assert again.frontier() == space.frontier()
    lines = path.read_text().splitlines()
    lines[0] = lines[0].replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99')
    (tmp_path / "old.jsonl").write_text("\n".join(lines))
    with pytest.raises(ValueError, match="schema version 99"):
        load(tmp_path / "old.jsonl")
    with pytest.raises(ValueError, match="no space file"):
        load(tmp_path / "missing.jsonl")
    # A version-2 file (no `lower_bound` column) reads with the column null.
    header, *rows = (json.loads(line) for line in path.read_text().splitlines())
    header["schema_version"] = 2
    (tmp_path / "v2.jsonl").write_text("\n".join(
        json.dumps(r) for r in [header] + [{k: v for k, v in r.items() if k != "lower_bound"}
                                           for r in rows]))
    assert load(tmp_path / "v2.jsonl").rows == json.loads(json.dumps(
        [dict(r, lower_bound=None) for r in space.rows]))


def test_the_picture_with_and_without_matplotlib(explored, tmp_path):
    space, *_ = explored
    assert space.picture(tmp_path / "space.png").read_bytes().startswith(b"\x89PNG")
    from autopar.report._frontier import write_svg

    svg = write_svg(space.points(), tmp_path / "space.svg", budget=BUDGET).read_text()
    assert svg.startswith("<svg") and svg.count("<circle") == len(space.feasible("auto"))


def test_pareto_frontier_by_hand():
    points = [FrontierPoint(4, 1.0, "a", "auto"), FrontierPoint(2, 2.0, "b", "megatron"),
              FrontierPoint(3, 2.5, "c", "auto"), FrontierPoint(1, 4.0, "d", "auto"),
              FrontierPoint(2, 2.0, "e", "auto", chosen=True)]
    frontier = pareto_frontier(points)
    assert [p.label for p in frontier] == ["d", "e", "a"]  # c is beaten by b and e
    assert not on_frontier(points[2], frontier)
    with pytest.raises(ValueError, match="autopar.space.explore"):
        Plan.frontier(dataclasses.replace(_any_plan(), frontier_points=()))
    with pytest.raises(ValueError, match="budget_fractions must be positive"):
        explore(lambda: None, cluster="cpu-local", budget_fractions=(0,))


def test_space_command_help_and_budgets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["space", "--help"])
    assert exit_info.value.code == 0
    assert "space.jsonl" in capsys.readouterr().out
    assert cli._fractions("0.5,1.5") == (0.5, 1.5) and cli._fractions("none") == ()
    with pytest.raises(Exception, match="budget fractions"):
        cli._fractions("0.5,-1")


def _any_plan() -> Plan:
    from autopar.cluster._mesh import LogicalMesh
    from autopar.intra._sharding_plan import PredictedCost, ShardingPlan
    from autopar.plan import Stage

    sharding = ShardingPlan(LogicalMesh.create((1,), (0,)), (), (), (),
                            PredictedCost(1.0, 0.0, 0.0, 1.0), "")
    return Plan("shard", helpers.cluster("cpu-local", 1, 1).to_json(),
                (Stage((0, 1), sharding),), (), "")
