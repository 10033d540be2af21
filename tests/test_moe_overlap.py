"""The overlapped expert exchange (`moe_overlap`): an expert-parallel grouped GEMM in two
token chunks, one chunk's all-to-all beside the other's compute.

The formula against hand computation; the backends' share of a collective run beside
compute; the strategies each option lists and their costs against the formula; the
chunked lowering against one device (the forward, token-gradient and weight-gradient
grouped GEMMs) and its all-to-alls in the compiled HLO; the option's errors and the body
plan's JSON.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding

import autopar
from autopar.cluster import LogicalMesh
from autopar.cluster._mesh import to_partition_spec
from autopar.cost import (
    OVERLAP_CHUNKS,
    all_to_all_time,
    chunked_exchange_time,
    compute_time,
    pipelined_exchange_time,
)
from autopar.cost.backends import XLA_CPU, XLA_GPU
from autopar.graph import trace
from autopar.intra._sharding_plan import BodyPlan
from autopar.intra._strategies import CostContext, node_signature, node_strategies
from autopar.intra._strategies_moe import OVERLAPPED, expert_parallel_strategies
from autopar.lower import count_collectives, jax_mesh
from autopar.lower._experts import chunk_group_sizes, planned_prim

NUM_EXPERTS, ROWS, HIDDEN, FFN = 16, 64, 8, 12


def test_pipelined_and_chunked_exchange_by_hand():
    # 2 chunks of 1 ms dispatch, 3 ms compute, 1 ms combine: dispatches end at 1 and 2 ms,
    # chunk 1 computes 1-4, chunk 2 4-7, combines 4-5 and 7-8
    assert pipelined_exchange_time(1e-3, 3e-3, 1e-3, 2) == pytest.approx(8e-3)
    # the link is the longer: dispatches 0-3, 3-6; compute 3-4, 6-7; combines 6-9, 9-12
    assert pipelined_exchange_time(3e-3, 1e-3, 3e-3, 2) == pytest.approx(12e-3)
    assert pipelined_exchange_time(1e-3, 3e-3, 1e-3, 1) == pytest.approx(5e-3)  # series
    assert chunked_exchange_time(1e-3, 3e-3, 1e-3, 2, 0.8) == pytest.approx(8.4e-3)
    assert chunked_exchange_time(1e-3, 3e-3, 1e-3, 2, 0.0) == pytest.approx(10e-3)
    with pytest.raises(ValueError, match="concurrency must be in"):
        chunked_exchange_time(1.0, 1.0, 1.0, 2, 1.5)
    with pytest.raises(ValueError, match="num_chunks must be a positive int"):
        pipelined_exchange_time(1.0, 1.0, 1.0, 0)


def test_backends_share_of_a_collective_beside_compute():
    h100 = autopar.Cluster.from_profile("dgx-h100")
    assert XLA_GPU.collective_concurrency(h100) == h100.overlap == 0.8
    # XLA:CPU runs collectives on the device's thread: none, whatever the profile says
    for name in ("cpu-local", "cpu-local-measured"):
        assert XLA_CPU.collective_concurrency(autopar.Cluster.from_profile(name)) == 0.0


def _forward_node(rows=ROWS, hidden=HIDDEN, ffn=FFN, experts=NUM_EXPERTS, dtype=jnp.float32):
    args = (jax.ShapeDtypeStruct((rows, hidden), dtype),
            jax.ShapeDtypeStruct((experts, hidden, ffn), dtype),
            jax.ShapeDtypeStruct((experts,), jnp.int32))
    graph = trace(lambda x, w, g: lax.ragged_dot(x, w, g), *args, batch_argnums=())
    (node,) = [n for n in graph.nodes if n.primitive == "ragged_dot_general"]
    return node, graph


def test_strategies_per_option_and_their_cost_by_hand():
    """A DeepSeek-V3-sized grouped GEMM (256 experts 7168 -> 2048, 8 devices, 32,768
    routed rows each) on one H100 node: the chunked form costs what the formula says,
    and is the faster there; on the CPU profile the chunks only add latency."""
    node, graph = _forward_node(8 * 32768, 7168, 2048, 256, jnp.bfloat16)
    h100 = autopar.Cluster.from_profile("dgx-h100")
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    names = {opt: [s.name for s in expert_parallel_strategies(
        node, graph, CostContext(h100, mesh, moe_overlap=opt))] for opt in ("auto", "off", "on")}
    assert names == {"auto": ["ep:x", "ep:x" + OVERLAPPED], "off": ["ep:x"],
                     "on": ["ep:x" + OVERLAPPED]}
    whole, chunked = expert_parallel_strategies(node, graph, CostContext(h100, mesh))
    # by hand: each chunk dispatches and combines half the rows (bf16, 32,768 x 7168 / 2
    # each way), and its GEMM does half the FLOPs but reads the 32 local experts' weights
    rows = 32768 * 7168 * 2
    weights = 32 * 7168 * 2048 * 2
    out = 32768 * 2048 * 2
    a2a = [all_to_all_time(b / 2, h100, mesh, ("x",)) for b in (rows, out)]
    gemm = compute_time(node.flops / 8 / 2, (rows + out) / 2 + weights + 256 * 4, h100,
                        "bfloat16", matmul=True)
    assert chunked.cost == pytest.approx(chunked_exchange_time(a2a[0], gemm, a2a[1], 2, 0.8))
    assert chunked.compute_cost == pytest.approx(2 * gemm)
    assert len(chunked.collectives) == 2 * len(whole.collectives) == 4
    assert chunked.cost < whole.cost  # so "auto" keeps the chunked form on this node
    sig = node_signature(node, graph)
    kept = {s.name for s in node_strategies(node, graph, sig, CostContext(h100, mesh))}
    assert "ep:x" + OVERLAPPED in kept and "ep:x" not in kept
    cpu = autopar.Cluster.from_profile("cpu-local-measured")
    whole, chunked = expert_parallel_strategies(node, graph, CostContext(cpu, mesh))
    assert chunked.cost > whole.cost
    # a quarter of the rows: the GEMM is bound by reading the weights, which each chunk
    # reads again, more than the all-to-all it hides
    node, graph = _forward_node(8 * 8192, 7168, 2048, 256, jnp.bfloat16)
    whole, chunked = expert_parallel_strategies(node, graph, CostContext(h100, mesh))
    assert chunked.cost > whole.cost


def test_rerun_prices_the_form_the_plan_chose():
    """Recompute (`autopar.inter._layer_pricing.rerun_seconds`) looks a node's cost up by
    the plan's strategy name: each form is found whichever is the cheaper."""
    from types import SimpleNamespace

    from autopar.inter._layer_pricing import rerun_seconds

    node, graph = _forward_node(8 * 32768, 7168, 2048, 256, jnp.bfloat16)
    h100 = autopar.Cluster.from_profile("dgx-h100")
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    whole, chunked = expert_parallel_strategies(node, graph, CostContext(h100, mesh))
    for strategy in (whole, chunked):
        names = [""] * len(graph.nodes)
        names[node.id] = strategy.name
        plan = SimpleNamespace(mesh=mesh, operand_specs=(), node_strategies=names,
                               var_specs=(None,) * len(graph.vars))
        assert rerun_seconds(graph, plan, [node.id], h100) == pytest.approx(strategy.cost)


def test_rows_that_do_not_halve_list_the_whole_exchange_only():
    node, graph = _forward_node(rows=8 * 3)  # 3 rows per device
    ctx = CostContext(autopar.Cluster.from_profile("dgx-h100"),
                      LogicalMesh.create((8,), axis_names=("x",)), moe_overlap="on")
    assert [s.name for s in expert_parallel_strategies(node, graph, ctx)] == ["ep:x"]


def test_chunk_group_sizes_example():
    sizes = jnp.array([3, 5], jnp.int32)  # blocks of 4 rows: chunk 0 holds rows 0, 1, 4, 5
    assert chunk_group_sizes(sizes, 4, 2, 0).tolist() == [2, 2]
    assert chunk_group_sizes(sizes, 4, 2, 1).tolist() == [1, 3]


def test_chunked_lowering_matches_one_device_and_doubles_the_all_to_alls():
    """The forward, token-gradient and weight-gradient grouped GEMMs of `ragged_dot`, run
    expert-parallel over 8 devices whole and in chunks, against one device."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (ROWS, HIDDEN))
    w = jax.random.normal(keys[1], (NUM_EXPERTS, HIDDEN, FFN))
    dy = jax.random.normal(keys[2], (ROWS, FFN))
    groups = jnp.bincount(jax.random.randint(keys[3], (ROWS,), 0, NUM_EXPERTS),
                          length=NUM_EXPERTS).astype(jnp.int32)

    def fn(x, w, dy):
        return jax.vjp(lambda x, w: lax.ragged_dot(x, w, groups), x, w)[1](dy)

    graph = trace(fn, x, w, dy, batch_argnums=())
    env = dict(zip(graph.invars, (x, w, dy)))
    graph.run_nodes(env, graph.nodes)
    mesh = LogicalMesh.create((8,), axis_names=("x",))
    ctx = CostContext(autopar.Cluster.from_profile("cpu-local"), mesh, moe_overlap="on")
    ragged = [n for n in graph.nodes if n.primitive == "ragged_dot_general"]
    assert len(ragged) == 3
    for node in ragged:
        operands = [graph.vars[v].value if graph.vars[v].value is not None else env[v]
                    for v in node.inputs]
        expected = node.prim.bind(*operands, **node.params)
        (strategy,) = expert_parallel_strategies(node, graph, ctx)
        got, hlo = _run(node, graph, operands, strategy, mesh, OVERLAP_CHUNKS)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        if node is ragged[0]:  # the forward: a dispatch and a combine per chunk (the
            # whole exchange's 2: tests/test_rules_moe.py)
            assert count_collectives(hlo)["all_to_all"][0] == OVERLAP_CHUNKS * 2


def _run(node, graph, operands, strategy, mesh, chunks):
    jmesh = jax_mesh(mesh)
    specs = [s or ((),) * np.ndim(a) for a, s in zip(operands, strategy.in_specs)]
    placed = [jax.device_put(a, NamedSharding(jmesh, to_partition_spec(s)))
              for a, s in zip(operands, specs)]
    prim = planned_prim(node, graph, jmesh, specs, strategy.out_specs, chunks)
    compiled = jax.jit(lambda *xs: prim.bind(*xs, **node.params)).lower(*placed).compile()
    return compiled(*placed), compiled.as_text()


def test_option_errors_and_body_plan_json():
    with pytest.raises(ValueError, match="unknown moe_overlap 'always'; choose one of"):
        autopar.PlanOptions(moe_overlap="always")
    body = BodyPlan(3, (((),),), (), (((),),), strategies=((5, "ep:x" + OVERLAPPED),))
    assert BodyPlan.from_json(body.to_json()) == body
    plain = BodyPlan(3, (((),),), (), (((),),))
    assert "strategies" not in plain.to_json()  # plans without chunks read as before


@pytest.mark.extended  # three ~10 s plans; the default suite checks the per-node choice
# (test_strategies_per_option_and_their_cost_by_hand)
def test_search_overlaps_deepseek_layers_on_an_h100_node():
    """Two DeepSeek-V3 layers, 8 sequences of 4,096 (32,768 routed rows per device) on one
    DGX H100: "auto" runs the expert-parallel grouped GEMMs in chunks and predicts a
    faster step than "off" with the same expert layout."""
    import dataclasses

    import optax

    from examples import moe_dropless as moe

    cfg = dataclasses.replace(moe.CONFIGS["deepseek-v3"], num_layers=2, vocab_size=32000,
                              dtype="bfloat16")
    optimizer = optax.adamw(1e-3)
    args = (moe.make_train_step(cfg, optimizer), moe.abstract_state(cfg, optimizer),
            moe.abstract_batch(cfg, 8))
    from autopar.intra._strategies_moe import PER_GEMM

    h100 = autopar.Cluster.from_profile("dgx-h100")
    plans = {opt: autopar.plan(*args, cluster=h100, method="shard", cache=False,
                               moe_overlap=opt)
             for opt in ("off", "auto")}
    # one dispatch per grouped GEMM instead of per expert MLP: the names carry it to the
    # lowering through the scan's body plans
    plans["gemm"] = autopar.plan(*args, cluster=h100, method="shard", cache=False,
                                 moe_overlap="off", moe_dispatch="gemm")
    chosen = {opt: {name for body in p.stages[0].sharding.scan_bodies
                    for _, name in body.strategies} for opt, p in plans.items()}
    assert chosen == {"off": set(), "auto": {"ep:xy" + OVERLAPPED},
                      "gemm": {"ep:xy" + PER_GEMM}}, chosen
    assert plans["auto"].predicted_step_time < plans["off"].predicted_step_time
    assert plans["off"].predicted_step_time < plans["gemm"].predicted_step_time
