"""Shared test helpers: run a step with autopar and compare with one device."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import numpy as np
import optax

import autopar
from autopar.lower import count_collectives
from examples import gpt

# XLA:CPU has no reduce-scatter: it lowers one as an all-reduce and a dynamic-slice, with
# the same bytes on the wire as the plan counts for the reduce-scatter; where the slices
# it keeps are not the devices' own in the target layout it moves them with a
# collective-permute (on a 2x4 mesh, ``a @ w`` with a: P(None, 'x'), w: P('x', None),
# result P(None, 'x') compiles to an all-reduce and a collective-permute; so does a
# vocabulary-parallel embedding lookup, table P('x', None), indices P('y'), result
# P('y', 'x', None)).
EQUIVALENT_KINDS = {"reduce_scatter": {"all_reduce", "send_recv"}}


@functools.cache
def cluster(profile: str = "cpu-local", num_hosts: int | None = None,
            devices_per_host: int | None = None) -> autopar.Cluster:
    """A built-in profile's `Cluster`, read once per process (a frozen record: tests share
    it)."""
    return autopar.Cluster.from_profile(profile, num_hosts, devices_per_host)


# Plan options for a test of several microbatches that checks something other than the
# microbatch-math check: that check evaluates the step on the host at the full batch and at
# a microbatch (two more compiles: 6 CPU s against the 3 CPU s of the tiny GPT's 2-stage
# search). Its own tests are tests/test_microbatch_math.py (warns, silent for a mean, strict);
# the tiny GPT's pipelines keep it in test_pipeline.test_gpt_pipeline_sgd and
# test_scan_pipeline, Llama's in test_transformers_models, and across processes in
# test_multihost.
NO_MICROBATCH_CHECK = {"microbatch_check": "off"}

# The tiny GPT with layer marks: 4 blocks + head = 5 layers.
GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)


def tiny_gpt_step(cfg=GPT, optimizer=None, batch_size: int = 8):
    """(train step, abstract (state, batch)) of the tiny GPT (default: AdamW at 1e-2)."""
    optimizer = optimizer or optax.adamw(1e-2)
    step = gpt.make_train_step(cfg, optimizer)
    return step, (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, batch_size))


@functools.cache
def tiny_gpt_graph():
    """The traced train step of `autopar demo`'s tiny GPT (`named_model("gpt-tiny")`, 8 rows),
    traced once per test process."""
    from autopar.app._examples import named_model
    from autopar.graph import trace

    named = named_model("gpt-tiny", batch_size=8)
    return trace(named.train_step, named.abstract_state, named.abstract_batch)


def spy_integral_relaxation(monkeypatch) -> list[bool]:
    """Record, per HiGHS model solved, whether its LP relaxation was integral (the list
    grows as `integral_relaxation` is called)."""
    from autopar.intra._ilp_model import _HighsBuilt

    integral = []
    relaxation = _HighsBuilt.integral_relaxation

    def spy(self, *args):
        values = relaxation(self, *args)
        integral.append(values is not None)
        return values

    monkeypatch.setattr(_HighsBuilt, "integral_relaxation", spy)
    return integral


def run_steps(step, state, batch, num_steps=3):
    """Losses and final state of `num_steps` steps (`step` may be jitted or autopar'd)."""
    losses = []
    for _ in range(num_steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def compiled_hlo(fn, *args) -> str:
    """Optimized HLO text of an autoparallel function for these arguments."""
    compiled = fn._last
    leaves = jax.tree.leaves(args)
    placed = [jax.device_put(x, s) for x, s in zip(leaves, compiled.in_shardings)]
    return compiled.fn.lower(*placed).compile().as_text()


def fidelity(sharding_plan, hlo_text: str) -> tuple[set, float, dict, dict]:
    """(unexpected kinds, measured/predicted bytes, predicted, measured)."""
    predicted = dict(sharding_plan.cost.collectives)
    measured = count_collectives(hlo_text)
    allowed = set(predicted)
    for kind in predicted:
        allowed |= EQUIVALENT_KINDS.get(kind, set())
    unexpected = set(measured) - allowed
    pred_bytes = sum(b for _, b in predicted.values())
    meas_bytes = sum(b for _, b in measured.values())
    if pred_bytes == 0 and meas_bytes == 0:
        ratio = 1.0
    elif pred_bytes == 0:
        ratio = float("inf")
    else:
        ratio = meas_bytes / pred_bytes
    return unexpected, ratio, predicted, measured


class MadeUpTable:
    """A layer cost table of made-up numbers with the real table's properties: a leaner
    level holds less and is no faster; recompute keeps fewer activations and is slower.
    Layer k has structure `kind(k)` (default: its own); `solved` counts the (structure,
    shape, level) costs asked for: the ILPs a search solves. `num_layers`: the per-layer
    partition the stage DP reads the number of layers off (none when not given)."""

    solve = None
    cluster = None
    memory_levels = "price"
    lower_bounds = True

    def __init__(self, rng, num_kinds: int, shapes, num_layers: int | None = None):
        self.base = {(k, s): (rng.uniform(1, 2), rng.uniform(4, 8))
                     for k in range(num_kinds) for s in shapes}
        self.slope = {key: rng.uniform(0.0, 0.3) for key in self.base}
        self.solved: set = set()
        if num_layers is not None:
            self.per_layer = SimpleNamespace(stage_graphs=[None] * num_layers)

    def kind(self, k: int) -> int:
        return k

    def cost(self, k, shape, level=0):
        from autopar.cost import LayerCost

        k = self.kind(k)
        self.solved.add((k, shape, level))
        latency, held = self.base[k, shape]
        lean = 1 - 0.06 * level
        latency *= 1 + self.slope[k, shape] * level
        return LayerCost(latency, held * lean + 0.5, held * lean * 0.2, held * lean * 0.6,
                         held * lean * 0.2)

    def plan(self, k, shape, level=0):
        return type("Plan", (), {"stats": {"status": "optimal"}})

    def footprint_span(self, k, shape):
        held = self.base[self.kind(k), shape][1]
        return 0.4 * held, held

    def is_solved(self, k, shape, level):
        return (self.kind(k), shape, level) in self.solved

    def shared_state_bytes(self, layer_range, shape, level=0):
        return 0.0

    def remat_cost(self, k, shape, level, remat):
        from autopar.cost import LayerCost

        c = self.cost(k, shape, level)
        if remat == "none":
            return c
        keep, extra = (0.5, 0.1) if remat == "selective" else (0.1, 0.3)
        return LayerCost(c.latency * (1 + extra), c.memory, c.activation_memory * keep,
                         c.state_memory, c.gradient_memory)
