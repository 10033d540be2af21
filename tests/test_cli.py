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


# ---- the planning flags of `autopar plan` / `autopar compare` ---------------------------


def _plan_argv(tmp_path, *extra):
    return ["plan", "--model", "mlp-tiny", "--profile", "cpu-local", "--hosts", "1",
            "--devices-per-host", "2", "--out", str(tmp_path / "p.json"), *extra]


def test_planning_flags_reach_the_planner(tmp_path, monkeypatch, capsys):
    """Every planning flag arrives as its `PlanOptions` keyword, units converted."""
    import autopar.search

    seen = {}
    real_plan = autopar.search.plan

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_plan(*args, **{**kwargs, "remat": "auto"})

    monkeypatch.setattr(autopar.search, "plan", spy)
    argv = _plan_argv(tmp_path, "--microbatches", "2", "--schedule", "gpipe", "--remat",
                      "full", "--memory-budget", "512MiB", "--quiet")
    assert cli.main(argv) == 0
    assert seen["num_microbatches"] == 2 and seen["schedule"] == "gpipe"
    assert seen["remat"] == "full" and seen["memory_budget"] == 512 * 2**20
    plan = Plan.load(tmp_path / "p.json")
    assert plan.num_microbatches == 2 and plan.schedule == "gpipe"
    out = capsys.readouterr()
    assert "autopar plan —" not in out.out, "--quiet prints no explanation"
    assert out.out.startswith("planned mlp-tiny") and "predicted" in out.out
    assert "autopar: trace" not in out.err, "--quiet prints no progress"


def test_verbose_prints_every_leaf_and_the_planner_details(tmp_path, capsys):
    assert cli.main(_plan_argv(tmp_path, "--method", "data", "--verbose")) == 0
    out = capsys.readouterr()
    assert "opt_state/" in out.out  # detail 2: every optimizer-state leaf
    assert "autopar: trace ..." in out.err


@pytest.mark.parametrize(("value", "message"), [
    ("40GiBs", r"'40GiBs' is not an amount of memory.*40GiB, 512MiB or 80GB"),
    ("-1GiB", r"'-1GiB' is not an amount of memory"),
    ("0GiB", r"must be more than zero"),
])
def test_memory_budget_needs_a_unit_it_knows(tmp_path, capsys, value, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_plan_argv(tmp_path, f"--memory-budget={value}"))
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_memory_budget_too_small_answers_cannot_fit_in_gib(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_plan_argv(tmp_path, "--memory-budget", "1KiB"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot fit" in err and "9.54e-07 GiB (1024 B) per device" in err
    assert not re.search(r"\binf\b", err)


def test_microbatches_must_be_a_count_or_auto(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(_plan_argv(tmp_path, "--microbatches", "0"))
    assert "'0' is not a number of microbatches" in capsys.readouterr().err


def test_seq_len_sets_the_sequence_of_gpt_and_llama(tmp_path, capsys):
    gpt = named_model("gpt-tiny", 2, seq_len=48)
    assert gpt.abstract_batch["tokens"].shape == (2, 48)
    assert gpt.abstract_state.params["wpe"].shape[0] == 48
    llama = named_model("llama-8B", 1, seq_len=131072)  # abstract: nothing is allocated
    assert llama.abstract_batch["tokens"].shape == (1, 131072)
    assert cli.main(["plan", "--model", "gpt-tiny", "--seq-len", "32", "--profile", "cpu-local",
                     "--hosts", "1", "--devices-per-host", "2", "--method", "data",
                     "--out", str(tmp_path / "g.json"), "-q"]) == 0
    plan = Plan.load(tmp_path / "g.json")
    assert {i.path: i.shape for i in plan.inputs}["batch/tokens"] == (8, 32)
    assert "sequence 32" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(_plan_argv(tmp_path, "--seq-len", "8"))
    assert re.search(r"mlp-tiny has no sequence length.*gpt", capsys.readouterr().err)


def test_compare_takes_seq_len_and_memory_budget(capsys):
    argv = ["compare", "--model", "gpt-tiny", "--seq-len", "32", "--configs", "dp8tp1",
            "--no-auto", "--profile", "cpu-local", "--memory-budget", "1GiB", "-q"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "dp=8,tp=1" in out and "compared 1 plan(s) of gpt-tiny" in out


def test_an_uneven_batch_is_warned_about(tmp_path, capsys):
    argv = ["plan", "--model", "mlp-tiny", "--profile", "cpu-local", "--batch", "12",
            "--method", "shard", "--mesh-shape", "8", "--out", str(tmp_path / "p.json"), "-q"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert re.search(r"autopar: warning: the batch \(batch/x, batch/y\): 12 rows are split "
                     r"\d ways, not over all 8 devices", err), err
    assert err.count("warning") == 1


def test_a_cache_hit_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOPAR_PLAN_CACHE", "1")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    argv = _plan_argv(tmp_path, "--method", "data")
    assert cli.main(argv) == 0
    assert "plan cache hit" not in capsys.readouterr().err
    assert cli.main(argv) == 0
    assert capsys.readouterr().err.count("plan cache hit") == 1


def test_demo_extra_holds_only_what_the_demo_needs():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["demo"] == ["autopar[highs,examples,plot]"]
    readme = (REPO / "README.md").read_text()
    first = re.search(r"^python3 -m venv .*$", readme, flags=re.MULTILINE).group(0)
    assert '-e ".[demo]"' in first and first.endswith("autopar demo")
