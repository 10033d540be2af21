"""Recompute inside a scanned layer stack (issue 15, deliver 2: "per scanned layer group").

A stack of layers run by `jax.lax.scan` and cut into pipeline stages runs one sub-scan per
stage (`scan_layers`). Its recompute is a choice of the stage DP like any layer's: each
iteration is priced by the forward work its backward reruns and the bytes it stops keeping
(`LayerCostTable.remat_cost`), and a stage's sub-scan is lowered with a `jax.checkpoint`
around its body (`checkpointed_body`: "full" keeps only the body's inputs, "selective"
everything but the attention core). A body the user already wrapped in `jax.checkpoint` is
left as written.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import optax
import pytest
from helpers import NO_MICROBATCH_CHECK

import autopar
from autopar.graph import split_stacked, tied_state, trace
from autopar.inter import LayerCostTable, assign_layers, partition, scan_layers
from autopar.inter.passes import per_iteration
from autopar.inter.passes._remat import recompute, user_checkpointed
from autopar.inter.passes._scan_layers import checkpointed_body
from autopar.intra import ShardOptions
from autopar.plan import Plan
from examples import gpt

SMALL = dataclasses.replace(gpt.CONFIGS["tiny"], num_layers=4, hidden=16, scan_layers=True)
BATCH = 8
RANGES = ((0, 2), (2, 4))
# Two devices: one per stage (or one stage of two), so that the plans need few ILPs.
TWO = autopar.Cluster.from_profile("cpu-local", num_hosts=1, devices_per_host=2)


def _step(cfg=SMALL):
    optimizer = optax.adamw(1e-2)
    return gpt.make_train_step(cfg, optimizer), optimizer


def _split_graph(remat, cfg=SMALL, rows=4):
    step, optimizer = _step(cfg)
    abstract = gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, rows)
    with scan_layers(RANGES, remat):
        return split_stacked(trace(step, *abstract), RANGES)


def _residuals(graph):
    """(shape, bytes) of what the forward sub-scans hand their backward sub-scans."""
    scans = [n for n in graph.nodes if n.primitive == "scan"]
    made = {v for n in scans for v in n.outputs}
    read = {v for n in scans for v in n.inputs}
    return sorted(graph.vars[v].shape for v in made & read)


def test_checkpointed_body_keeps_less():
    """What the forward sub-scans keep for the backward, by remat (the numbers are checked
    by the parity test below)."""
    kept = {}
    for remat in ("none", "selective", "full"):
        graph = _split_graph((remat, remat))
        kept[remat] = _residuals(graph)
        scans = [n.id for n in graph.nodes if n.primitive == "scan"]
        assert user_checkpointed(graph, scans) == (remat != "none")
    s = SMALL.seq_len

    def core(shape):
        return len(shape) == 5 and shape[-2:] == (s, s)  # (iterations, b, heads, s, s)

    # Selective drops the attention core (scores, softmax) of every iteration, no more.
    assert any(core(x) for x in kept["none"])
    assert not any(core(x) for x in kept["selective"])
    nbytes = {r: sum(math.prod(x) for x in shapes) for r, shapes in kept.items()}
    core_bytes = sum(math.prod(x) for x in kept["none"] if core(x))
    assert nbytes["selective"] >= nbytes["none"] - core_bytes
    # Full keeps only the body's inputs: the carry entering each iteration.
    assert nbytes["full"] < nbytes["selective"] < nbytes["none"]


def test_a_users_checkpoint_in_the_body_is_kept_as_written():
    def layer(x, w):
        return jax.numpy.tanh(x @ w), None

    x, w = jax.ShapeDtypeStruct((4, 8), "float32"), jax.ShapeDtypeStruct((8, 8), "float32")
    for body in (jax.make_jaxpr(jax.checkpoint(layer))(x, w), jax.make_jaxpr(layer)(x, w)):
        wrapped = checkpointed_body(body, "full")
        assert "checkpoint" in str(wrapped) or "remat" in str(wrapped)
        assert (wrapped is body) == ("remat" in str(body) or "checkpoint" in str(body))
    # In the traced step the user's checkpoint is in the backward sub-scans; recompute adds
    # nothing to such an iteration.
    cfg = dataclasses.replace(SMALL, remat_layers=True)
    graph = _split_graph(("none", "none"), cfg)
    layers = assign_layers(graph)
    part = partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)])
    sub, fwd, bwd = part.stage_graphs[1], part.forward[1], part.backward[1]
    kept = set(fwd.outputs) & set(bwd.inputs)
    for remat in ("selective", "full"):
        assert recompute(sub, fwd.nodes, kept, remat, bwd.nodes).nodes == ()


def test_an_iteration_is_priced_by_its_rerun_and_its_kept_bytes():
    step, optimizer = _step()
    abstract = gpt.abstract_state(SMALL, optimizer), gpt.abstract_batch(SMALL, 4)
    ranges = per_iteration(SMALL.num_layers)
    with scan_layers(ranges):
        graph = split_stacked(trace(step, *abstract), ranges)
    table = LayerCostTable(graph, assign_layers(graph), TWO, ShardOptions(),
                           tied_state(graph, (0,)))
    base = table.cost(1, (1,))
    selective = table.remat_cost(1, (1,), 0, "selective")
    full = table.remat_cost(1, (1,), 0, "full")
    sub = table.per_layer.stage_graphs[1]
    s = SMALL.seq_len
    core = sum(sub.vars[v].nbytes for v in table.kept_for_backward(1)
               if sub.vars[v].shape[-2:] == (s, s) and len(sub.vars[v].shape) == 5)
    assert core > 0
    assert base.activation_memory - selective.activation_memory == core
    # Full keeps only what the iteration's forward reads: its input (batch x seq x hidden).
    assert full.activation_memory == 4 * s * SMALL.hidden * 4
    assert base.latency < selective.latency < full.latency


def _plan(remat="auto", num_stages=2, **kw):
    step, optimizer = _step()
    devices = 2 // num_stages
    return autopar.plan(
        step, gpt.abstract_state(SMALL, optimizer), gpt.abstract_batch(SMALL, BATCH),
        cluster=TWO, cache=False, remat=remat, num_stages=num_stages, num_microbatches=2,
        submeshes=[(1, devices)], logical_shapes=[(devices,)], **NO_MICROBATCH_CHECK, **kw,
    )


def test_a_scanned_stack_that_does_not_fit_gets_recompute():
    roomy = _plan("none")
    full = _plan("full")
    assert roomy.scan_remat == ("none", "none") and full.scan_remat == ("full", "full")
    peak = max(s.memory_per_device for s in roomy.stages)
    lean = max(s.memory_per_device for s in full.stages)
    assert lean < peak
    budget = (peak + lean) / 2
    tight = _plan(memory_budget=budget)
    assert tight.scan_remat != ("none", "none")
    assert max(s.memory_per_device for s in tight.stages) <= budget
    assert roomy.predicted_step_time < tight.predicted_step_time
    # Shown in explain() and kept in the plan JSON, which runs the same sub-scans again.
    assert "remat: layers" in tight.explain()
    again = Plan.from_json(tight.to_json())
    assert again == tight and again.scan_remat == tight.scan_remat


def _planned_loss(remat, num_stages, state, batch):
    step, _ = _step()
    devices = 2 // num_stages
    train = autopar.autoparallel(
        step, cluster=TWO, remat=remat, num_stages=num_stages, num_microbatches=2,
        submeshes=[(1, devices)], logical_shapes=[(devices,)], cache=False,
        donate_argnums=(),
    )
    _, metrics = train(state, batch)
    return train.plan, metrics["loss"]


@pytest.mark.extended  # 35-70 s each on a loaded 2-core machine (compiling the stages);
# the default-tier twins: test_checkpointed_body_keeps_less (the lowering) and
# test_a_scanned_stack_that_does_not_fit_gets_recompute (the search)
@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("remat", ["selective", "full"])
def test_scanned_remat_matches_one_device(remat, num_stages):
    step, optimizer = _step()
    state = gpt.init_state(SMALL, optimizer, jax.random.key(0))
    batch = gpt.make_batch(SMALL, BATCH, jax.random.key(1))
    want = jax.jit(step)(state, batch)[1]["loss"]
    plan, loss = _planned_loss(remat, num_stages, state, batch)
    assert remat in plan.scan_remat
    np.testing.assert_allclose(loss, want, rtol=1e-5)
