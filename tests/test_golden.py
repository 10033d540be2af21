"""Golden plans: the examples re-planned on fixed meshes must match tests/golden/*.json,
whichever MILP solver plans them."""

import json

import pytest

import autopar.intra._ilp as ilp
import autopar.intra._planner as planner
from autopar.intra import ShardOptions
from autopar.intra._ilp import Solution, SolveStats
from autopar.intra._ilp_model import resolve_solver
from scripts.regenerate_golden import (
    GOLDEN_CASES,
    GOLDEN_DIR,
    REGENERATE_COMMAND,
    diff_records,
    dumps,
    golden_plan,
)


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda case: case.name)
def test_plan_matches_golden_file(case):
    assert case.path.is_file(), (
        f"golden file {case.path} is missing; create it with: {REGENERATE_COMMAND} {case.name}"
    )
    expected = json.loads(case.path.read_text())
    found = golden_plan(case)
    differences = diff_records(expected, found)
    assert not differences, (
        f"the plan of {case.name} differs from {case.path.name} in {len(differences)} "
        "place(s):\n  " + "\n  ".join(differences) + "\nIf the change is intended, "
        f"regenerate with: {REGENERATE_COMMAND} {case.name}"
    )


# The cases whose CBC solves take tens of seconds on two cores (CBC's MILP is 4-5 times
# slower than HiGHS's on these); the others plan in a few seconds together.
SLOW_WITH_CBC = {"gpt_2x4", "moe_2x4", "wide_resnet_2x4"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.extended) if c.name in SLOW_WITH_CBC else c
     for c in GOLDEN_CASES],
    ids=lambda case: case.name,
)
def test_other_solver_gives_the_golden_plan(case):
    """Equal-cost plans are common (a matrix split along either of two equal dimensions);
    the ILP picks the canonical one, so HiGHS and CBC give the same plan."""
    if resolve_solver("auto") != "highs":
        pytest.skip("highspy is not installed: the golden files were checked with CBC above")
    other = "cbc"  # solver="auto" (the golden files and the test above) uses HiGHS
    differences = diff_records(json.loads(case.path.read_text()), golden_plan(case, other))
    assert not differences, (
        f"with solver={other!r} the plan of {case.name} differs from {case.path.name} in "
        f"{len(differences)} place(s):\n  " + "\n  ".join(differences)
    )


def test_time_limit_becomes_a_plan_warning(monkeypatch):
    """A solve stopped by its time limit (forced here: a real one is not repeatable) is
    named in the plan's warnings."""
    import optax

    from autopar.app._examples import LEARNING_RATE, load_example
    from autopar.cluster import Cluster
    from autopar.search import plan

    run_model = ilp.run_model

    def stopped(*args, **kwargs):
        values, status = run_model(*args, **kwargs)
        return values, "time_limit" if status == "optimal" else status

    monkeypatch.setattr(ilp, "run_model", stopped)
    case = next(c for c in GOLDEN_CASES if c.name == "mlp_2x4")
    module, config = load_example(case.model.family), case.model.config()
    optimizer = optax.adamw(LEARNING_RATE)
    result = plan(
        module.make_train_step(config, optimizer),
        module.abstract_state(config, optimizer),
        module.abstract_batch(config, 8),
        cluster=Cluster.from_profile("cpu-local"),
        method="shard",
        mesh_shape=(2, 4),
    )
    assert result.stages[0].sharding.stats["status"] == "time_limit"
    assert any(
        "the sharding ILP on mesh (2, 4) stopped at its 60 s time limit; the plan may not be "
        "optimal: raise the ILP time limit" in warning
        for warning in result.warnings
    ), result.warnings

    # Stopped in the tie-break: optimal, but maybe not the plan another solver gives.
    stats = SolveStats(num_nodes=1, num_nodes_after_merge=1, num_ilp_nodes=1,
                       num_variables_before_merge=2, num_variables=2, num_constraints=1,
                       build_time=0.0, solve_time=5.0, solver="cbc", formulation="marginal",
                       tie_break="incomplete")
    (warning,) = planner._solve_warnings(
        Solution((0,), 0.0, "optimal", stats), result.stages[0].mesh, ShardOptions(time_limit=5)
    )
    assert warning.startswith("the sharding ILP on mesh (2, 4) found an optimal plan but its "
                              "tie-break among equal-cost plans stopped at the 5 s time limit")


def test_golden_files_are_written_canonically():
    """Every golden file is exactly what the script writes (sorted, no stray files)."""
    names = {case.path.name for case in GOLDEN_CASES}
    assert {p.name for p in GOLDEN_DIR.glob("*.json")} == names
    for case in GOLDEN_CASES:
        text = case.path.read_text()
        assert dumps(json.loads(text)) == text, f"{case.path.name} was edited by hand"


def test_diff_records_names_every_change():
    old = {"method": "shard", "mesh_shape": [8], "specs": {"a": "P('x')", "b": "P(None)"}}
    new = {"method": "shard", "mesh_shape": [2, 4], "specs": {"a": "P(None)", "c": "P()"}}
    assert diff_records(old, new) == [
        "mesh_shape: golden [8], now [2, 4]",
        "a: golden P('x'), now P(None)",
        "b: golden P(None), now missing (input removed?)",
        "c: not in the golden file, now P()",
    ]
    assert diff_records(old, old) == []
