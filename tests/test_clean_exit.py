"""A script that used autopar ends without noise: nothing printed after its own output.

A weak reference's callback that runs while the interpreter shuts down (a graph a script
kept in a global) once hashed a `Cluster` whose module had been cleared, and Python
printed "Exception ignored in: ... TypeError: 'NoneType' object is not callable" at exit
(`autopar.intra._planner._BuiltProblems`). Each check here runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Plans with the process's objects held in module globals until exit: the decorated step
# (planned and run), a traced graph and a plan of it on one mesh (the layer ILP's built
# problems cached per graph).
SCRIPT = """
import jax, optax
import autopar
from autopar.cluster import LogicalMesh
from autopar.intra import plan_on_mesh
from examples import mlp

cfg = mlp.CONFIGS["tiny"]
opt = optax.sgd(0.1)
cluster = autopar.Cluster.from_profile("cpu-local")
state = mlp.init_state(cfg, opt, jax.random.key(0))
batch = mlp.make_batch(cfg, 16, jax.random.key(1))
step = autopar.autoparallel(mlp.make_train_step(cfg, opt), cluster=cluster)
state, metrics = step(state, batch)
graph = autopar.graph.trace(mlp.make_train_step(cfg, opt), state, batch)
sharded = plan_on_mesh(graph, cluster, LogicalMesh.create((8,)))
print("last line", float(metrics["loss"]))
"""


def _run(args, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["AUTOPAR_PLAN_CACHE"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_clean(done: subprocess.CompletedProcess, last_line: str) -> None:
    assert done.returncode == 0, done.stderr[-4000:]
    for noise in ("Exception ignored", "Traceback"):
        assert noise not in done.stderr, done.stderr[-4000:]
    assert done.stdout.rstrip().splitlines()[-1].startswith(last_line), done.stdout[-2000:]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_script_that_planned_exits_quietly(tmp_path, monkeypatch, jobs):
    monkeypatch.setenv("AUTOPAR_JOBS", jobs)  # in this process, or in worker processes
    _assert_clean(_run(["-c", SCRIPT], tmp_path), "last line")


def test_the_plan_command_exits_quietly(tmp_path):
    done = _run(["-m", "autopar.app.cli", "plan", "--model", "mlp-tiny", "--profile",
                 "cpu-local", "--out", str(tmp_path / "plan.json")], tmp_path)
    _assert_clean(done, "planned mlp-tiny")


@pytest.mark.extended  # the demo GPT trains beside one device (minutes on 2 busy cores);
# in the default run `test_the_plan_command_exits_quietly` covers the CLI process's exit and
# `test_a_script_that_planned_exits_quietly` an `autoparallel` step held until exit.
def test_the_readme_demo_prints_nothing_after_its_last_line(tmp_path):
    """`autopar demo`, the README's first command (two steps on one fixed mesh, so that no
    search runs): its last line is "demo finished in ... s", and nothing reaches stderr
    after it."""
    done = _run(["-m", "autopar.app.cli", "demo", "--steps", "2", "--method", "shard",
                 "--mesh-shape", "8", "--no-pictures", "--out-dir", str(tmp_path)], tmp_path)
    _assert_clean(done, "demo finished in")
