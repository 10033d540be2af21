"""Gradient reductions deferred to once per step: which gradients, ILP weights, runtime."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import NO_MICROBATCH_CHECK, assert_trees_close, run_steps

import autopar
from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import bytes_per_device
from autopar.graph import trace
from autopar.inter.passes._deferred import (
    deferrable_gradients,
    stacked_layout,
    step_weights,
)
from autopar.inter.passes._layers import accumulated_values, assign_layers
from autopar.intra._options import ShardOptions
from autopar.intra._problem import build_problem, unstacked_spec
from autopar.lower import count_collectives, stack_spec
from examples import gpt

GPT = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)


def _gpt_graph(batch_size=8):
    optimizer = optax.sgd(0.1)
    step = gpt.make_train_step(GPT, optimizer)
    args = (gpt.abstract_state(GPT, optimizer), gpt.abstract_batch(GPT, batch_size))
    return trace(step, *args, batch_argnums=(1,))


def _sgd_run():
    optimizer = optax.sgd(0.1)
    step = gpt.make_train_step(GPT, optimizer)
    state = gpt.init_state(GPT, optimizer, jax.random.key(0))
    batch = gpt.make_batch(GPT, 128, jax.random.key(1))
    return step, state, batch


@pytest.fixture(scope="module")
def one_device():
    """One device's 2 steps of `_matches_one_device`'s run: (losses, state)."""
    step, state, batch = _sgd_run()
    return run_steps(jax.jit(step), state, batch, num_steps=2)


def _matches_one_device(reference, **pipeline):
    """The tiny GPT with SGD, 2 steps on batch 128 under `autoparallel(**pipeline)`: losses
    and parameters equal one device's (`reference`, the `one_device` fixture); returns the
    autoparallel step."""
    step, state, batch = _sgd_run()
    ref_losses, ref_state = reference
    par = autopar.autoparallel(
        step, cluster=Cluster.from_profile("cpu-local"), donate_argnums=(), **pipeline,
        **NO_MICROBATCH_CHECK,
    )
    losses, par_state = run_steps(par, state, batch, num_steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state, ref_state, 1e-5)
    return par


def _grad_w_graph():
    """A weight gradient x^T @ dy over a batch of 64 rows."""

    def grad_w(x, dy):
        return jax.numpy.einsum("bi,bo->io", x, dy)

    x = jax.ShapeDtypeStruct((64, 32), "float32")
    dy = jax.ShapeDtypeStruct((64, 16), "float32")
    return trace(grad_w, x, dy, batch_argnums=(0, 1))


def test_weight_and_bias_gradients_are_deferrable():
    graph = _gpt_graph()
    layers = assign_layers(graph)
    deferred = deferrable_gradients(graph, layers)
    by_path = {graph.vars[v].path: v for v in graph.invars}
    boundary = graph.nodes[layers.grad_boundary]
    grad_of = dict(zip(boundary.outputs, boundary.inputs))
    producer = {v: n for n in graph.nodes for v in n.outputs}
    # Every block's matrices and biases: their gradients end in a dot or a sum over rows.
    matrices = [p for p in by_path if p and "layers" in p and p.endswith(("w1", "w2", "wo"))]
    assert matrices
    grads = set(deferred.grads)
    assert len(grads) >= len(matrices)
    accumulated = set(accumulated_values(graph, layers))
    assert set(grad_of.values()) - accumulated  # the shared embedding's sum moved out
    assert grads <= accumulated
    for r in deferred.roots:
        assert producer[r].primitive in ("dot_general", "reduce_sum")
    # Nothing the forward pass or the update computes is deferred.
    for v in deferred.roots | deferred.chain:
        assert layers.phase[producer[v].id] in ("forward", "backward")


def test_bias_gradient_root_is_the_sum_over_the_batch():
    graph = _gpt_graph()
    layers = assign_layers(graph)
    deferred = deferrable_gradients(graph, layers)
    producer = {v: n for n in graph.nodes for v in n.outputs}
    # A bias broadcast (h,) -> (1, 1, h) -> (b, s, h) has a gradient of two sums: over
    # (b, s), then over the two unit dims. The root is the first, which sums over the
    # batch rows (the data axes' partial sums); the second is a reshape on the way, so no
    # sum over the batch is left reduced once per microbatch.
    for v in deferred.roots:
        node = producer[v]
        if node.primitive == "reduce_sum":
            shape = graph.vars[node.inputs[0]].shape
            assert any(shape[d] > 1 for d in node.params["axes"]), (node, shape)
    unit_sums = [producer[v] for v in deferred.chain if producer[v].primitive == "reduce_sum"]
    for node in unit_sums:
        (x,) = node.inputs
        assert producer[x].primitive == "reshape"
        assert producer[x].inputs[0] in deferred.roots
    assert len(unit_sums) >= 2 * GPT.num_layers  # both layer norms' biases, at least


def test_step_weights_charge_update_and_deferred_reductions_once():
    graph = _gpt_graph()
    layers = assign_layers(graph)
    deferred = deferrable_gradients(graph, layers)
    phases = dict(enumerate(layers.phase))
    weights = step_weights(graph, phases, deferred, num_microbatches=4)
    for node in graph.nodes:
        w = weights.get(node.id, (1.0, 1.0))
        if layers.phase[node.id] == "apply":
            assert w == (0.25, 1.0)
        elif node.outputs[0] in deferred.roots:
            assert w == (1.0, 0.25)
        else:
            assert w == (1.0, 1.0)


def test_weights_scale_strategy_costs_by_hand():
    """A weight gradient x^T @ dy split on the batch: its all-reduce costs 1/4 at weight
    (1, 1/4); the node's compute keeps its full cost."""

    graph = _grad_w_graph()
    cluster = Cluster.from_profile("dgx-a100-80g")
    mesh = LogicalMesh.create((8,))
    (dot,) = [n for n in graph.nodes if n.primitive == "dot_general"]
    plain = build_problem(graph, mesh, cluster, ShardOptions())
    weighted = build_problem(graph, mesh, cluster, ShardOptions(), weights={dot.id: (1.0, 0.25)})
    index = next(i for i, n in enumerate(plain.ilp_nodes) if n.node == dot.id)
    reducing = 0
    for a, b in zip(plain.ilp_nodes[index].strategies, weighted.ilp_nodes[index].strategies):
        assert b.compute_cost == pytest.approx(a.compute_cost)
        assert b.comm_cost == pytest.approx(0.25 * a.comm_cost)
        reducing += a.comm_cost > 0
    assert reducing > 0  # the batch split's partial sums


def test_stack_specs():
    assert unstacked_spec((("x",), ("y",)), ("x",)) == ((), ("y",))
    assert stack_spec(((), ("y",)), ("x",)) == (("x",), (), ("y",))
    assert stack_spec((("x", "y"),), ("x", "y")) == (("x", "y"), ())


def _compiled_collectives(executable, compiled, stacked):
    args = []
    for v, sharding in zip(compiled.segment.inputs, compiled.in_shardings):
        var = executable.graph.vars[v]
        shape = var.shape
        if v in stacked:
            shape = (sharding.mesh.size, *shape)
        args.append(jax.ShapeDtypeStruct(shape, var.dtype, sharding=sharding))
    return count_collectives(compiled.fn.lower(*args).compile().as_text())


def test_data_parallel_pipeline_reduces_gradients_once_per_step(one_device):
    """One stage of data parallelism over 4 microbatches: the backward segment keeps the
    weight gradients unreduced; the update reduces them; results match one device."""
    par = _matches_one_device(one_device, num_stages=1, num_microbatches=4,
                              logical_shapes=[(8,)])

    executable = par.pipeline
    (stacked,) = executable.stacked
    assert set(stacked.values()) == {("x",)}
    stacked_grads = [v for v in executable.partition.grad_vars if v in stacked]
    stacked_bytes = sum(executable.graph.vars[v].nbytes for v in stacked_grads)
    assert stacked_bytes > 0
    per_microbatch = 0.0
    for compiled in executable.tasks.values():
        if compiled.segment.nodes:
            measured = _compiled_collectives(executable, compiled, stacked)
            per_microbatch += sum(b for k, (_, b) in measured.items() if "reduce" in k)
    once = 0.0
    for compiled in executable.apply:
        measured = _compiled_collectives(executable, compiled, stacked)
        once += sum(b for k, (_, b) in measured.items() if "reduce" in k)
    # Inside a microbatch only the gradients that cannot wait (the embedding's scatter-add)
    # and the loss are reduced; the stacked gradients' bytes are reduced in the update.
    others = sum(
        executable.graph.vars[v].nbytes
        for v in executable.partition.grad_vars
        if v not in stacked
    )
    assert others < stacked_bytes / 4
    assert per_microbatch <= others, (per_microbatch, others, stacked_bytes)
    assert once >= stacked_bytes, (once, stacked_bytes)


def test_accumulated_gradients_count_in_stage_memory():
    """With data parallelism every device accumulates whole gradients (unreduced partial
    sums): a layer's gradient memory is the bytes of its gradients, and a stage's memory is
    state + gradients + in-flight activations + one layer's working memory."""
    from autopar.cost import LayerCost, in_flight_microbatches, stage_memory
    from autopar.inter._layer_table import LayerCostTable

    graph = _gpt_graph(batch_size=64)
    layers = assign_layers(graph)
    cluster = Cluster.from_profile("cpu-local")
    table = LayerCostTable(graph, layers, cluster, ShardOptions(method="data"), (),
                           num_microbatches=4)
    cost = table.cost(1, (8,))
    sub = table.per_layer.stage_graphs[1]
    produced = {v for n in sub.nodes for v in n.outputs}
    grads = set(table.per_layer.grad_vars) & produced
    assert grads
    plan = table.plan(1, (8,))  # layer 1 is the first of its structure: its own ids
    stacked = stacked_layout(sub, plan, table.per_layer.deferrable)
    assert len(grads & set(stacked)) >= 4  # the block's matrices at least
    # A stacked gradient is a whole partial sum on every device; the others as planned.
    expected = sum(
        sub.vars[v].nbytes if v in stacked
        else bytes_per_device(sub.vars[v].shape, sub.vars[v].dtype, plan.var_specs[v],
                              plan.mesh)
        for v in grads
    )
    assert cost.gradient_memory == expected

    a = LayerCost(1.0, memory=100.0, activation_memory=10.0, state_memory=50.0,
                  gradient_memory=20.0)
    b = LayerCost(1.0, memory=90.0, activation_memory=5.0, state_memory=40.0,
                  gradient_memory=20.0)
    assert a.transient_memory == 20.0 and b.transient_memory == 25.0
    assert stage_memory([a, b], in_flight=3) == (50 + 20 + 30) + (40 + 20 + 15) + 25
    assert in_flight_microbatches("gpipe", 8, 2) == 8
    assert in_flight_microbatches("1f1b", 8, 2) == 2
    assert in_flight_microbatches("1f1b", 1, 4) == 1


def test_shared_embedding_gradient_is_summed_once_per_step(one_device):
    """The tied embedding's two contributions (the lookup in the first layer, the logits in
    the head) are accumulated on their own stages and added in the update; the head's is
    reduced on its stage before it moves. Two stages, 4 microbatches: matches one device."""
    graph = _gpt_graph()
    layers = assign_layers(graph)
    producer = {v: n for n in graph.nodes for v in n.outputs}
    boundary = graph.nodes[layers.grad_boundary]
    moved = [producer[g] for g in boundary.inputs
             if g in producer and layers.phase[producer[g].id] == "apply"]
    assert [n.primitive for n in moved] == ["add_any"]  # wte: lookup + logits
    accumulated = accumulated_values(graph, layers)
    assert set(moved[0].inputs) <= set(accumulated)
    assert moved[0].outputs[0] not in accumulated

    par = _matches_one_device(
        one_device, num_stages=2, num_microbatches=4, submeshes=[(1, 4)],
        logical_shapes=[(4,)],
    )
    handoff = [set(h) for h in par.pipeline.handoff]
    assert handoff[0] == set() and len(handoff[1]) == 1
    (v,) = handoff[1]
    assert graph.vars[v].shape == (GPT.vocab_size, GPT.hidden)


def test_once_per_step_collectives_count_once_per_step_in_compare():
    """A weighted reduction is reported per planned unit at its weight, so that compare's
    per-step volume counts a deferred reduction once, not once per microbatch."""
    from autopar.intra._planner import plan_on_mesh

    graph = _grad_w_graph()
    (dot,) = [n for n in graph.nodes if n.primitive == "dot_general"]
    cluster = Cluster.from_profile("dgx-a100-80g")
    mesh = LogicalMesh.create((8,))
    fixed = {v: (("x",), ()) for v in graph.invars}  # batch split: partial sums over x
    plain = plan_on_mesh(graph, cluster, mesh, fixed=fixed)
    weighted = plan_on_mesh(graph, cluster, mesh, fixed=fixed, weights={dot.id: (1.0, 0.25)})
    assert plain.node_strategies[dot.id] == weighted.node_strategies[dot.id]
    (kind,) = plain.cost.collectives
    n, nbytes = plain.cost.collectives[kind]
    assert weighted.cost.collectives[kind] == pytest.approx((0.25 * n, 0.25 * nbytes))
    assert weighted.cost.communication == pytest.approx(0.25 * plain.cost.communication)


def test_mixed_precision_tied_embedding_sum_and_cast_run_in_the_update():
    """bf16 compute with fp32 master weights casts the tied embedding's joined gradient
    after the sum: ``convert(add_any(head, lookup))``. The sum and its cast move to the
    update together, so the head's part (a dot over the batch) is a deferred gradient of
    the head's layer, reduced once per step like every weight's, and nothing crosses from
    the last stage to the first per microbatch (Megatron-LM reduces the embedding group
    once per step). `tests/test_deferred.py::test_shared_embedding_gradient_is_summed_
    once_per_step` runs the fp32 form of the same split against one device."""
    cfg = dataclasses.replace(GPT, dtype="bfloat16", master_dtype="float32")
    optimizer = optax.adamw(1e-4)
    step = gpt.make_train_step(cfg, optimizer)
    graph = trace(step, gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 8),
                  batch_argnums=(1,))
    layers = assign_layers(graph)
    producer = {v: n for n in graph.nodes for v in n.outputs}
    boundary = graph.nodes[layers.grad_boundary]
    moved = [producer[g] for g in boundary.inputs
             if g in producer and layers.phase[producer[g].id] == "apply"]
    assert [n.primitive for n in moved] == ["convert_element_type"]  # wte, to fp32
    (joined,) = moved[0].inputs
    assert producer[joined].primitive == "add_any"
    assert layers.phase[producer[joined].id] == "apply"
    head, lookup = (producer[v] for v in producer[joined].inputs)
    assert {layers.layer[head.id], layers.layer[lookup.id]} == {0, layers.num_layers - 1}
    accumulated = set(accumulated_values(graph, layers))
    assert set(producer[joined].inputs) <= accumulated
    assert moved[0].outputs[0] not in accumulated and joined not in accumulated
    deferred = deferrable_gradients(graph, layers)
    head_part = next(v for v in producer[joined].inputs
                     if layers.layer[producer[v].id] == layers.num_layers - 1)
    assert head_part in deferred.grads


@pytest.mark.extended
def test_mixed_precision_tied_embedding_pipeline_matches_one_device():
    """The split of `test_mixed_precision_tied_embedding_sum_and_cast_run_in_the_update`
    run: bf16 compute, fp32 master weights, two stages of 4 microbatches, 2 SGD steps
    against one device; the head's part of the tied embedding's gradient is the one value
    handed back to stage 0 (once per step). Extended (a second pipeline compile); the
    default suite covers the split by graph (that test) and the runtime's moved sum in
    fp32 (`test_shared_embedding_gradient_is_summed_once_per_step`)."""
    cfg = dataclasses.replace(GPT, dtype="bfloat16", master_dtype="float32")
    optimizer = optax.sgd(0.1)
    step = gpt.make_train_step(cfg, optimizer)
    state = gpt.init_state(cfg, optimizer, jax.random.key(0))
    batch = gpt.make_batch(cfg, 128, jax.random.key(1))
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch, num_steps=2)
    par = autopar.autoparallel(
        step, cluster=Cluster.from_profile("cpu-local"), donate_argnums=(), num_stages=2,
        num_microbatches=4, submeshes=[(1, 4)], logical_shapes=[(4,)],
    )
    losses, par_state = run_steps(par, state, batch, num_steps=2)
    # bf16 gradients summed in another order: rounding-level differences only
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert_trees_close(par_state, ref_state, 1e-3)
    handoff = [set(h) for h in par.pipeline.handoff]
    assert handoff[0] == set() and len(handoff[1]) == 1
    (v,) = handoff[1]
    assert par.pipeline.graph.vars[v].shape == (cfg.vocab_size, cfg.hidden)
