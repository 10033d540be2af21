"""The check before the search: a model that cannot fit is told so in seconds, with GiB
per part and the fixes, and a model that fits is never stopped by it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import optax
import pytest

import autopar
from autopar.search._feasibility import DoesNotFitError, check_fits, state_parts
from autopar.search._options import PlanOptions
from examples import mlp

ROOT = Path(__file__).resolve().parent.parent
CFG = mlp.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
OPT = optax.adam(1e-2)
NO_INF = re.compile(r"\binf\b", re.IGNORECASE)


def _mlp():
    state = mlp.init_state(CFG, OPT, jax.random.key(0))
    batch = mlp.make_batch(CFG, 16, jax.random.key(1))
    return mlp.make_train_step(CFG, OPT), state, batch


def test_llama_70b_on_one_dgx_cannot_fit_in_seconds():
    from autopar.app._examples import named_model

    start = time.perf_counter()
    model = named_model("llama-70B", 8)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    with pytest.raises(DoesNotFitError) as err:
        autopar.plan(model.train_step, model.abstract_state, model.abstract_batch,
                     cluster=cluster, cache=False)
    seconds = time.perf_counter() - start
    assert seconds < 5, f"'cannot fit' took {seconds:.1f} s"
    text = str(err.value)
    assert text.startswith("cannot fit")
    for part in ("parameters", "gradients", "optimizer state", "activations"):
        assert re.search(rf"{part} +[\d.,e+-]+ GiB( \(\d+ B\))? in all", text), part
    assert "80.0 GiB per device (640.0 GiB in all)" in text
    assert "more devices: at least" in text and "remat" in text and "batch" in text
    assert not NO_INF.search(text)
    assert isinstance(err.value, autopar.errors.MemoryBudgetError)
    assert err.value.least_memory > err.value.budget


def test_data_parallel_counts_the_state_whole_and_names_zero():
    step, state, batch = _mlp()
    parts = state_parts(step, (state, batch), (1,))
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert parts["parameters"] == parts["gradients"] == params
    assert parts["optimizer state"] == sum(x.nbytes for x in jax.tree.leaves(state.opt_state)
                                           if jax.numpy.issubdtype(x.dtype, jax.numpy.floating))
    cluster = autopar.Cluster.from_profile("cpu-local")
    budget = 2.5 * params  # fits split over 8 devices, not whole on each
    check_fits(step, (state, batch), cluster, PlanOptions(method="zero3", memory_budget=budget))
    with pytest.raises(DoesNotFitError, match=r"method='zero3' \(or 'auto'\) splits"):
        check_fits(step, (state, batch), cluster,
                   PlanOptions(method="data", memory_budget=budget))


def test_a_tiny_budget_says_so_without_inf_or_a_wrong_layer_count():
    step, state, batch = _mlp()
    for method in ("auto", "shard"):
        start = time.perf_counter()
        with pytest.raises(ValueError) as err:
            autopar.plan(step, state, batch, cluster="cpu-local", memory_budget=1e3,
                         method=method, cache=False)
        assert time.perf_counter() - start < 5
        text = str(err.value)
        assert "cannot fit" in text and "GiB" in text and "(1000 B)" in text
        assert not NO_INF.search(text)
        assert not re.search(r"\b8 layers\b", text)


def test_the_bound_never_stops_a_plan_that_fits():
    step, state, batch = _mlp()
    cluster = autopar.Cluster.from_profile("cpu-local")
    plan = autopar.plan(step, state, batch, cluster=cluster, method="shard",
                        mesh_shape=(8,), cache=False)
    used = max(s.memory_per_device for s in plan.stages)
    for method in ("auto", "shard", "zero3"):  # a budget this plan meets passes the check
        check_fits(step, (state, batch), cluster,
                   PlanOptions(method=method, memory_budget=used))


def test_the_cli_answers_cannot_fit_with_gib():
    env = dict(os.environ, PYTHONPATH=str(ROOT), AUTOPAR_PLAN_CACHE="0")
    done = subprocess.run(
        [sys.executable, "-m", "autopar.app.cli", "plan", "--model", "llama-70B",
         "--hosts", "1", "--out", os.devnull],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot fit" in done.stderr and "GiB" in done.stderr
    assert not NO_INF.search(done.stderr + done.stdout)
