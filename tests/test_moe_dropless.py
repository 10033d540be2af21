"""The dropless MoE example (top-4 of 16 experts, a shared SwiGLU expert, argsort +
gather + ragged_dot + scatter-add, aux loss, scanned layers) under autopar.

On 8 virtual devices it trains like one device under "shard" and "auto" with no node left
without a sharding rule; where the cost model says expert parallelism pays (a DeepSeek-V3
layer on an H100 node) the plan splits the expert weights over experts and predicts the
dispatch/combine all-to-alls; the compiled HLO of an expert-parallel plan holds them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import jax
import numpy as np
import optax
import pytest
from helpers import compiled_hlo, run_steps

import autopar
from autopar.graph import trace
from autopar.intra._scan import opened_body
from autopar.intra._strategies_moe import OVERLAPPED, ep_layout
from autopar.lower import count_collectives
from examples import moe_dropless as moe

TINY = moe.CONFIGS["tiny"]
BATCH = 8
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


def _optimizer():
    return optax.adamw(1e-2, eps=1e-6)


@pytest.fixture(scope="module")
def reference():
    """State, batch and the one-device losses of 3 AdamW steps of the tiny model."""
    optimizer = _optimizer()
    state = moe.init_state(TINY, optimizer, jax.random.key(0))
    batch = moe.make_batch(TINY, BATCH, jax.random.key(1))
    step = moe.make_train_step(TINY, optimizer)
    losses, _ = run_steps(jax.jit(step), state, batch)
    return step, state, batch, losses


def _run(reference, **options):
    step, state, batch, ref_losses = reference
    par = autopar.autoparallel(step, cluster=autopar.Cluster.from_profile("cpu-local"),
                               donate_argnums=(), cache=False, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    said = [str(w.message) for w in caught] + list(par.plan.warnings)
    assert not [w for w in said if "no sharding rule" in w], said
    return par


def test_shard_matches_one_device(reference):
    _run(reference, method="shard")


@pytest.mark.extended  # 3x the shard test's time (the stage search); same rules and lowering
def test_auto_matches_one_device(reference):
    _run(reference, method="auto")


def _expert_specs(plan):
    return {i.path.rsplit("/", 1)[-1]: i.spec for i in plan.inputs
            if i.path.startswith("params/layers/experts/")}


def test_deepseek_layer_on_an_h100_node_splits_experts_over_experts():
    """DeepSeek-V3's MoE layer (256 routed experts of width 2048, top-8, hidden 7168; two
    layers, 8 sequences of 1024) on one DGX H100: replicated expert weights (7.5 GB a
    matrix and layer) do not fit, splitting their width (expert-tensor parallelism) costs
    an all-gather of the 65,536 routed rows, so the all-to-all dispatcher wins."""
    cfg = dataclasses.replace(moe.CONFIGS["deepseek-v3"], num_layers=2, vocab_size=32000,
                              seq_len=1024, dtype="bfloat16")
    optimizer = optax.adamw(1e-3)
    plan = autopar.plan(
        moe.make_train_step(cfg, optimizer), moe.abstract_state(cfg, optimizer),
        moe.abstract_batch(cfg, 8), cluster=autopar.Cluster.from_profile("dgx-h100"),
        method="shard", cache=False,
    )
    specs = _expert_specs(plan)
    assert set(specs) == set(EXPERT_PARAMS), specs
    for name, spec in specs.items():  # [layers, experts, ...]: experts split 8 ways
        assert spec[1] and not any(spec[2:]), (name, spec)
        assert math.prod(plan.stages[0].sharding.mesh.shape) == 8
        assert set(spec[1]) == set(plan.stages[0].sharding.mesh.axis_names), (name, spec)
    count, nbytes = plan.stages[0].sharding.cost.collectives["all_to_all"]
    assert count > 0 and nbytes > 0


def test_tiny_model_on_cpu_keeps_experts_whole(reference):
    """The other side of the same cost model: the tiny model's 32 KiB expert matrices on
    the CPU profile are cheaper replicated than split over experts."""
    step, state, batch, _ = reference
    plan = autopar.plan(step, state, batch, cluster=autopar.Cluster.from_profile("cpu-local"),
                        method="shard", cache=False)
    assert all(not any(spec) for spec in _expert_specs(plan).values()), _expert_specs(plan)


def _expert_parallel(plan, graph, overlapped=False):
    """`plan` with every grouped GEMM of its layer scan in the all-to-all layout over all
    of its mesh axes (the layout `autopar.intra._strategies_moe` lists): its operands
    and result as the strategy says, the rest as planned; in two token chunks when
    `overlapped` (the strategy's `OVERLAPPED` form)."""
    stage = plan.stages[0]
    sharding = stage.sharding
    axes = tuple(a for a, n in zip(sharding.mesh.axis_names, sharding.mesh.shape) if n > 1)
    bodies = []
    num_ragged = 0
    for body_plan in sharding.scan_bodies:
        body = opened_body(graph.nodes[body_plan.node].params)
        var_specs = list(body_plan.var_specs)
        ragged = {n.id for n in body.nodes if n.primitive == "ragged_dot_general"}
        operand_specs = [o for o in body_plan.operand_specs if o[0] not in ragged]
        num_ragged += len(ragged)
        for node in body.nodes:
            if node.id not in ragged:
                continue
            split_dims, out_dim = ep_layout(node, body)
            for p, (v, d) in enumerate(zip(node.inputs, split_dims)):
                ndim = len(body.vars[v].shape)
                operand_specs.append((node.id, p, tuple(axes if i == d else ()
                                                        for i in range(ndim))))
            (out,) = node.outputs
            ndim = len(body.vars[out].shape)
            var_specs[out] = tuple(axes if i == out_dim else () for i in range(ndim))
        name = f"ep:{''.join(axes)}" + (OVERLAPPED if overlapped else "")
        bodies.append(dataclasses.replace(
            body_plan, var_specs=tuple(var_specs), operand_specs=tuple(operand_specs),
            strategies=tuple((n, name) for n in sorted(ragged)) if overlapped else ()))
    sharding = dataclasses.replace(sharding, scan_bodies=tuple(bodies))
    stage = dataclasses.replace(stage, sharding=sharding)
    return dataclasses.replace(plan, stages=(stage,)), num_ragged


def test_expert_parallel_plan_compiles_to_dispatch_and_combine_all_to_alls(reference):
    step, state, batch, ref_losses = reference
    searched = autopar.plan(step, state, batch,
                            cluster=autopar.Cluster.from_profile("cpu-local"),
                            method="shard", mesh_shape=(8,), cache=False)
    graph = trace(step, state, batch)
    plan, num_ragged = _expert_parallel(searched, graph)
    assert num_ragged == 9  # the forward scan's 3, the backward's 3 token and 3 weight
    par = autopar.autoparallel(step, plan=plan, donate_argnums=(), cache=False)
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    hlo = compiled_hlo(par, state, batch)
    counted = count_collectives(hlo)
    base = autopar.autoparallel(step, plan=searched, donate_argnums=(), cache=False)
    base(state, batch)
    before = count_collectives(compiled_hlo(base, state, batch)).get("all_to_all", (0, 0.0))
    # One dispatch and one combine per expert MLP (`autopar.intra._moe_regions`): the
    # forward scan's dispatch of the sorted tokens and combine of the down projection, the
    # backward's dispatch of their gradient and combine of the token gradient; the
    # activations saved for the backward stay on their expert's device. Each is an
    # all-to-all of [ep=8] blocks of the 64 rows (512 routed rows / 8) of hidden 32.
    rows = TINY.top_k * BATCH * TINY.seq_len // 8
    blocks = _all_to_all_blocks(hlo)
    assert blocks.count((1, rows, TINY.hidden)) == 4, blocks
    # The hand-made EP layout may add a few resharding all-to-alls where it meets the
    # searched layouts around it (which layouts those are depends on the search's costs).
    assert counted["all_to_all"][0] - before[0] - 4 <= 6, (counted, before, blocks)


def _all_to_all_blocks(hlo: str) -> list[tuple[int, ...]]:
    """The block shape of each all-to-all in optimized HLO (its first result's dims)."""
    found = re.findall(r"= \(?[a-z0-9]+\[([0-9,]*)\][^\n]*? all-to-all\(", hlo)
    return [tuple(int(d) for d in dims.split(",") if d) for dims in found]


@pytest.mark.extended  # one more compile and run of the EP step (~1 min on 2 cores); the
# chunked lowering of every grouped GEMM form is checked against one device in the
# default suite by tests/test_moe_overlap.py
def test_overlapped_expert_parallel_plan_matches_one_device(reference):
    step, state, batch, ref_losses = reference
    searched = autopar.plan(step, state, batch,
                            cluster=autopar.Cluster.from_profile("cpu-local"),
                            method="shard", mesh_shape=(8,), cache=False)
    plan, num_ragged = _expert_parallel(searched, trace(step, state, batch), overlapped=True)
    assert num_ragged == 9
    saved = autopar.Plan.from_json(plan.to_json())  # the chunks survive a save
    par = autopar.autoparallel(step, plan=saved, donate_argnums=(), cache=False)
    losses, _ = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    counted = count_collectives(compiled_hlo(par, state, batch))["all_to_all"][0]
    # twice the whole exchange's 18 (the hand-made test above): each chunk its own
    assert counted >= 36, counted


def test_cli_names_and_published_shapes():
    from autopar.app._examples import model_names, named_model

    assert {"moe_dropless-tiny", "moe_dropless-mixtral-8x7B",
            "moe_dropless-deepseek-v3"} <= set(model_names())
    model = named_model("moe_dropless-deepseek-v3", batch_size=2)  # abstract
    experts = model.abstract_state.params["layers"]["experts"]
    assert experts["w_gate"].shape == (61, 256, 7168, 2048)
    assert experts["w_down"].shape == (61, 256, 2048, 7168)
    params = jax.eval_shape(lambda k: moe.init_params(TINY, k), jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == TINY.num_params
