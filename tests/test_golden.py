"""Golden plans: the examples re-planned on fixed meshes must match tests/golden/*.json."""

import json

import pytest

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
