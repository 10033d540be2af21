"""The command line, run in-process: help texts, `autopar plan`, `autopar demo`, the README."""

import re
import sys
from pathlib import Path

import pytest

from autopar.app import cli
from autopar.app._demo import LOSS_TOLERANCE, DemoResult, _write_files, run_demo
from autopar.app._examples import model_names, named_model, parse_model_name
from autopar.cluster import Cluster
from autopar.cluster._mesh import LogicalMesh
from autopar.intra._sharding_plan import PredictedCost, ShardingPlan
from autopar.plan import InputInfo, Plan, Stage

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_GPT = dict(vocab_size=64, seq_len=8, hidden=16, num_layers=1, num_heads=2)


@pytest.mark.parametrize("command", [[], ["demo"], ["plan"], ["profile"]])
def test_help_of_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: autopar {' '.join(command)}".rstrip())
    if not command:
        assert all(name in out for name in ("demo", "plan", "profile"))


def test_plan_writes_a_loadable_plan(tmp_path, capsys):
    out = tmp_path / "mlp.json"
    layout = tmp_path / "mlp.png"
    argv = ["plan", "--model", "mlp-tiny", "--profile", "cpu-local", "--out", str(out),
            "--layout", str(layout)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "autopar plan" in printed.out and f"wrote {out}" in printed.out
    plan = Plan.load(out)
    assert plan.cluster["name"] == "cpu-local"
    assert plan.cluster["num_hosts"] * plan.cluster["devices_per_host"] == 8
    paths = {i.path for i in plan.inputs}
    assert {"params/layers/0/w", "params/layers/2/b", "batch/x", "batch/y"} <= paths
    assert layout.read_bytes().startswith(PNG_MAGIC)


def test_plan_on_a_fixed_mesh_of_a_resized_cluster(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "mlp-tiny", "--profile", "cpu-local", "--hosts", "1",
            "--devices-per-host", "4", "--method", "shard", "--mesh-shape", "2,2",
            "--batch", "4", "--out", str(out)]
    assert cli.main(argv) == 0
    plan = Plan.load(out)
    assert plan.method == "shard" and plan.stages[0].mesh.shape == (2, 2)
    assert {i.path: i.shape for i in plan.inputs}["batch/x"] == (4, 16)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-2T"], r"unknown model 'gpt-2T'.*gpt-tiny.*wide_resnet-250M.*mlp-tiny"),
        (["--model", "bert-base"], r"unknown model 'bert-base': a name is <family>-<size>"),
        (["--model", "mlp-tiny", "--hosts", "0"], r"--hosts must be >= 1, got 0"),
        (["--model", "mlp-tiny", "--batch", "0"], r"batch size must be >= 1"),
        (["--model", "mlp-tiny", "--mesh-shape", "2,x"], r"'2,x' is not a mesh shape"),
        (["--model", "mlp-tiny", "--profile", "no-such-profile"], r"no-such-profile"),
    ],
)
def test_plan_errors_say_what_is_wrong(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--profile", "cpu-local", *argv, "--out", str(tmp_path / "p.json")])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "p.json").exists()


def test_model_names_cover_every_example_size():
    names = model_names()
    assert {"gpt-1.3B", "gpt-tiny", "moe-380M", "wide_resnet-250M", "mlp-wide"} <= set(names)
    assert parse_model_name("wide_resnet-250M") == ("wide_resnet", "250M")
    assert parse_model_name("gpt-small-test") == ("gpt", "small-test")
    model = named_model("gpt-1.3B", batch_size=2)  # abstract: nothing is allocated
    assert model.abstract_batch["tokens"].shape == (2, 1024)
    assert model.abstract_state.params["wte"].shape == (51200, 2048)


def test_demo_trains_beside_one_device_and_writes_its_files(tmp_path):
    lines = []
    result = run_demo(tmp_path, num_steps=2, method="shard", mesh_shape=(8,),
                      model=TINY_GPT, echo=lines.append)
    assert len(result.losses) == len(result.reference_losses) == 2
    assert result.max_difference <= LOSS_TOLERANCE
    assert result.losses[1] < result.losses[0], "the model trains"
    text = "\n".join(lines)
    assert "autopar plan — method shard" in text
    assert re.search(r"step\s+autopar loss\s+1-device loss", text)
    assert "max |difference|" in text and ": ok" in text
    assert re.search(r"predicted [\d.]+ \w+ per step, measured [\d.]+ \w+ \([\d.e+]+x the "
                     r"prediction\); cost profile 'local \(", text)
    assert Plan.load(tmp_path / "plan.json").to_json() == result.plan.to_json()
    assert (tmp_path / "plan_layout.png").read_bytes().startswith(PNG_MAGIC)
    explained = (tmp_path / "plan_explain.txt").read_text()
    assert explained.startswith(result.plan.explain().splitlines()[0]) and explained in text + "\n"
    # explain() of the demo: the plan beside the plans a user would write, with times.
    alternatives = re.findall(r"^  (data parallel.*?|Megatron-LM dp=\S+ \(best of \d+\))\s+"
                              r"[\d.]+ (?:us|ms|s) \([\d.]+x\)\s+per step, [\d.]+ \w?i?B per "
                              r"device$", explained, flags=re.MULTILINE)
    assert len(alternatives) >= 2, explained
    assert "why this plan:" in explained and "batch layout:" in explained
    for internal in ("stage DP", "layer ILPs", "stage_dp_and_ilps"):
        assert internal not in explained
    assert {f.name for f in result.files} == {"plan.json", "plan_explain.txt", "plan_layout.png"}


@pytest.mark.parametrize(("difference", "status"), [(1e-6, 0), (1.0, 1)])
def test_demo_exit_status_follows_the_loss_difference(monkeypatch, capsys, difference, status):
    calls = []

    def fake_run_demo(out_dir, **kwargs):
        calls.append((out_dir, kwargs))
        return DemoResult(None, (2.0, 1.5), (2.0, 1.5 + difference), ())

    monkeypatch.setattr("autopar.app._demo.run_demo", fake_run_demo)
    assert cli.main(["demo", "--steps", "2", "--out-dir", "out", "--mesh-shape", "2,4"]) == status
    assert calls == [("out", dict(num_steps=2, method="auto", mesh_shape=(2, 4), pictures=True))]
    assert "demo finished in" in capsys.readouterr().out


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv \.venv && \. \.venv/bin/activate && (.+)$",
                          readme, flags=re.MULTILINE)
    assert commands[0].endswith("&& autopar demo"), "the README opens with the demo"
    ci_lines = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert commands[1] == ci_lines[-1], "README's test command and .ci/run must be identical"



def _hand_plan(meshes, inputs, num_microbatches=1):
    """A plan written by hand: one stage per mesh, 1 ms per microbatch each."""
    stages = tuple(
        Stage((i, i + 1), ShardingPlan(mesh, (), (), (), PredictedCost(1e-3, 0, 0, 0), ""))
        for i, mesh in enumerate(meshes)
    )
    return Plan(method="auto", cluster=Cluster.from_profile("cpu-local").to_json(),
                stages=stages, inputs=tuple(inputs), graph_fingerprint="",
                num_microbatches=num_microbatches)


def test_demo_draws_the_schedule_of_a_pipelined_plan(tmp_path):
    meshes = [LogicalMesh.create((2, 2), range(4 * i, 4 * i + 4)) for i in range(2)]
    weight = InputInfo("params/layers/0/w", (8, 8), "float32", "param", ((), ("y",)))
    plan = _hand_plan(meshes, [weight], num_microbatches=4)
    lines = []
    files = _write_files(plan, tmp_path, pictures=True, echo=lines.append)
    assert [f.name for f in files] == [
        "plan.json", "plan_explain.txt", "plan_layout.png", "schedule.png"
    ]
    assert (tmp_path / "schedule.png").read_bytes().startswith(PNG_MAGIC)
    assert lines == ["wrote " + ", ".join(str(f) for f in files)]


def test_demo_without_matplotlib_skips_the_pictures(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    weight = InputInfo("params/w", (8, 8), "float32", "param", (("x",), ()))
    lines = []
    files = _write_files(_hand_plan([LogicalMesh.create((8,))], [weight]), tmp_path,
                         pictures=True, echo=lines.append)
    assert [f.name for f in files] == ["plan.json", "plan_explain.txt"]
    assert lines[0].startswith("pictures skipped:") and "pip install autopar[plot]" in lines[0]
