"""One dispatch per expert MLP: the regions of grouped GEMMs and row-wise ops that share a
routing (`autopar.intra._moe_regions`), and the expert-parallel cost of a grouped GEMM as
its share of its region's entry dispatches and exit combines, checked by hand.

Traces only, but for one compile of a flat (unscanned) expert MLP's forward and backward
run expert-parallel; the scanned model's all-to-alls are counted in its compiled HLO by
tests/test_moe_dropless.py.
"""

from __future__ import annotations

import optax
import pytest

import autopar
from autopar.cluster._mesh import LogicalMesh
from autopar.cost import (
    DEFAULT_TOKEN_IMBALANCE,
    all_to_all_time,
    ep_buffer_bytes,
    ep_region_exchange_bytes,
)
from autopar.graph import trace
from autopar.intra._moe_regions import expert_regions
from autopar.intra._scan import opened_body
from autopar.intra._strategies import CostContext
from autopar.intra._strategies_moe import expert_parallel_strategies
from examples import moe_dropless as moe

TINY = moe.CONFIGS["tiny"]
BATCH = 8
ROWS = BATCH * TINY.seq_len * TINY.top_k  # 512 routed rows


@pytest.fixture(scope="module")
def bodies():
    """The forward and backward layer-scan bodies of the tiny model's train step."""
    optimizer = optax.adamw(1e-3)
    graph = trace(moe.make_train_step(TINY, optimizer), moe.abstract_state(TINY, optimizer),
                  moe.abstract_batch(TINY, BATCH))
    return [opened_body(n.params) for n in graph.nodes if n.primitive == "scan"]


def _producer(graph, v):
    (node,) = [n for n in graph.nodes if v in n.outputs]
    return node


def test_one_region_per_layer_body_with_one_dispatch_and_one_combine(bodies):
    forward, backward = bodies
    (fwd,) = expert_regions(forward)
    (bwd,) = expert_regions(backward)
    assert len(fwd.gemms) == 3 and len(bwd.gemms) == 6  # gate, up, down; 3 token + 3 weight
    assert len(fwd.row_ops) == 5  # silu (logistic, 1 - s, products) and the gate's product
    # forward: the sorted tokens (the permutation's gather) in, the down projection out
    (x,) = fwd.exchanged_inputs()
    assert _producer(forward, x).primitive == "gather"
    assert forward.vars[x].shape == (ROWS, TINY.hidden)
    (y,) = fwd.exchanged_outputs()
    assert _producer(forward, y).id == fwd.gemms[-1]
    # the activations saved for the backward stay on their expert's device
    assert x in fwd.kept and set(fwd.outputs) - {y} <= fwd.kept
    # backward: their gradient in, the token gradient out; the saved rows arrive dispatched
    (dy,) = bwd.exchanged_inputs()
    assert backward.vars[dy].shape == (ROWS, TINY.hidden)
    assert set(bwd.inputs) - {dy} == bwd.arriving and len(bwd.arriving) == 7
    (dx,) = bwd.exchanged_outputs()
    assert _producer(backward, dx).primitive == "add_any"  # the gate's and up's gradients


def test_each_gemm_carries_its_share_of_the_region_exchange(bodies):
    """On one DGX H100 (8 GPUs, one axis): each forward GEMM's EP strategy is priced a
    third of the dispatch and the combine of the region's 64-row blocks of hidden 32."""
    forward, _ = bodies
    cluster = autopar.Cluster.from_profile("dgx-h100")
    mesh = LogicalMesh.create((8,))
    ctx = CostContext(cluster, mesh, moe_overlap="off")
    (region,) = expert_regions(forward)
    block = ROWS // 8 * TINY.hidden * 4  # f32 rows of the tiny model
    seconds = 2 * all_to_all_time(block, cluster, mesh, ("x",))
    for nid in region.gemms:
        (ep,) = expert_parallel_strategies(forward.nodes[nid], forward, ctx)
        assert ep.name == "ep:x"
        assert ep.comm_cost == pytest.approx(seconds / 3, rel=1e-12)
        assert sum(c.weight for c in ep.collectives) == pytest.approx(2 / 3)
        assert {c.nbytes for c in ep.collectives} == {block}
        # its memory: its result's dispatched rows (a 64-row block of width 16 for the
        # gate and up, 32 for the down projection) and a third of the two receive buffers
        width = forward.vars[forward.nodes[nid].outputs[0]].shape[1]
        assert ep.out_bytes == pytest.approx(ROWS // 8 * width * 4 + 2 * block / 3)


def test_token_imbalance_from_the_profile_scales_exchange_and_buffers(bodies):
    forward, _ = bodies
    h100 = autopar.Cluster.from_profile("dgx-h100")
    skewed = autopar.Cluster.from_json({**h100.to_json(), "token_imbalance": 1.5})
    assert h100.token_imbalance == DEFAULT_TOKEN_IMBALANCE == 1.0
    assert skewed.to_json()["token_imbalance"] == 1.5
    mesh = LogicalMesh.create((8,))
    (region,) = expert_regions(forward)
    node = forward.nodes[region.gemms[0]]
    (even,), (skew,) = (expert_parallel_strategies(node, forward, CostContext(c, mesh,
                                                                               moe_overlap="off"))
                        for c in (h100, skewed))
    assert skew.out_bytes == pytest.approx(1.5 * even.out_bytes)
    assert {c.nbytes for c in skew.collectives} == {1.5 * c.nbytes for c in even.collectives}
    with pytest.raises(ValueError, match="token_imbalance must be a finite number >= 1"):
        autopar.Cluster.from_json({**h100.to_json(), "token_imbalance": 0.9})


def test_buffer_bytes_by_hand():
    # DeepSeek-V3: 4,096 tokens a device, top-8, hidden 7168, bf16, imbalance 1.25
    assert ep_buffer_bytes(4096 * 8, 7168, 2, 1.25) == 4096 * 8 * 1.25 * 7168 * 2
    assert ep_buffer_bytes(4096 * 8, 7168, 2, 1.25, capacity=36864) == 36864 * 7168 * 2
    with pytest.raises(ValueError, match="imbalance"):
        ep_buffer_bytes(10, 4, 2, 0.9)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        ep_buffer_bytes(10, 4, 2, 1.0, capacity=0)


def test_region_exchange_bytes_by_hand():
    dispatched, combined, share = ep_region_exchange_bytes([100.0, 40.0], [100.0], 1.25, 4)
    assert dispatched == [125.0, 50.0] and combined == [125.0] and share == 0.25
    with pytest.raises(ValueError, match="imbalance"):
        ep_region_exchange_bytes([1.0], [1.0], 0.5, 3)
    with pytest.raises(ValueError, match="num_gemms"):
        ep_region_exchange_bytes([1.0], [1.0], 1.0, 0)


def test_unscanned_mlp_forward_and_backward_fuse_into_one_region():
    """A SwiGLU expert MLP's forward and backward traced flat (no scan): one region, its
    saved activations internal; run expert-parallel over the 8 devices it matches one
    device with 3 all-to-alls (dispatch the tokens and their gradient, combine the token
    gradient; the weight gradients stay split over experts)."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from autopar.intra._strategies_moe import ep_layout
    from autopar.lower import count_collectives, jax_mesh
    from autopar.lower._experts import with_expert_dispatch

    rows, hidden, ffn, experts = 64, 8, 16, 8
    keys = jax.random.split(jax.random.key(0), 6)
    x, dy = (jax.random.normal(k, (rows, hidden)) for k in keys[:2])
    wg, wu = (jax.random.normal(k, (experts, hidden, ffn)) / 3 for k in keys[2:4])
    wd = jax.random.normal(keys[4], (experts, ffn, hidden)) / 3
    sizes = jnp.bincount(jax.random.randint(keys[5], (rows,), 0, experts),
                         length=experts).astype(jnp.int32)

    def mlp(x, wg, wu, wd):
        h = jax.nn.silu(lax.ragged_dot(x, wg, sizes)) * lax.ragged_dot(x, wu, sizes)
        return lax.ragged_dot(h, wd, sizes)

    def fn(x, wg, wu, wd, dy):
        return jax.vjp(mlp, x, wg, wu, wd)[1](dy)

    args = (x, wg, wu, wd, dy)
    graph = trace(fn, *args, batch_argnums=())
    (region,) = expert_regions(graph)
    assert len(region.gemms) == 9 and not region.kept and not region.arriving
    exchanges = len(region.exchanged_inputs()) + len(region.exchanged_outputs())
    assert exchanges == 3
    var_specs = [None] * len(graph.vars)
    for nid in region.gemms:
        node = graph.nodes[nid]
        split_dims, out_dim = ep_layout(node, graph)
        for v, d in zip((*node.inputs, node.outputs[0]), (*split_dims, out_dim)):
            ndim = len(graph.vars[v].shape)
            var_specs[v] = tuple(("x",) if i == d else () for i in range(ndim))
    plan = SimpleNamespace(var_specs=var_specs, operand_specs=(),
                           node_strategies=[""] * len(graph.nodes))
    jmesh = jax_mesh(LogicalMesh.create((8,)))
    fused = with_expert_dispatch(graph, plan, jmesh)
    compiled = jax.jit(lambda *a: fused.evaluate(a)).lower(*args).compile()
    for got, want in zip(compiled(*args), fn(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert count_collectives(compiled.as_text())["all_to_all"][0] == exchanges


def test_per_gemm_dispatch_is_priced_and_lowered_per_gemm(bodies):
    """``moe_dispatch="gemm"``: each forward GEMM's EP strategy carries its own dispatch
    and combine (weight 1, named with `PER_GEMM`), and the lowering fuses the region only
    for the names ``"mlp"`` gives; a bad value is refused; the regions' memo is dropped
    when the search ends."""
    from autopar import _memo
    from autopar.intra import _moe_regions
    from autopar.intra._strategies_moe import PER_GEMM, ep_layout
    from autopar.lower._experts import fused_regions

    forward, _ = bodies
    cluster = autopar.Cluster.from_profile("dgx-h100")
    mesh = LogicalMesh.create((8,))
    (region,) = expert_regions(forward)
    block = ROWS // 8 * TINY.hidden * 4
    with _memo.search_scope():
        for nid in region.gemms:
            node = forward.nodes[nid]
            (ep,) = expert_parallel_strategies(node, forward, CostContext(
                cluster, mesh, moe_overlap="off", moe_dispatch="gemm"))
            assert ep.name == "ep:x" + PER_GEMM
            assert [c.weight for c in ep.collectives] == [1.0, 1.0]  # dispatch, combine
            (shared,) = expert_parallel_strategies(node, forward, CostContext(
                cluster, mesh, moe_overlap="off"))
            assert shared.comm_cost == pytest.approx(
                2 * all_to_all_time(block, cluster, mesh, ("x",)) / 3, rel=1e-12)
        assert forward in _moe_regions._BY_GEMM
    assert len(_moe_regions._BY_GEMM) == 0

    def specs(node):
        split_dims, out_dim = ep_layout(node, forward)
        spec = [tuple(("x",) if i == d else () for i in range(len(forward.vars[v].shape)))
                for v, d in zip((*node.inputs, node.outputs[0]), (*split_dims, out_dim))]
        return spec[:-1], spec[-1:]

    named = {suffix: {nid: "ep:x" + suffix for nid in region.gemms} for suffix in ("", PER_GEMM)}
    assert [(r.gemms, axes) for r, axes in fused_regions(forward, specs, named[""])] == [
        (region.gemms, ("x",))]
    assert fused_regions(forward, specs, named[PER_GEMM]) == []
    for options in (autopar.PlanOptions, autopar.intra.ShardOptions):
        with pytest.raises(ValueError, match="unknown moe_dispatch 'once'; choose one of"):
            options(moe_dispatch="once")


def test_strategy_memo_tells_regions_apart():
    """The planner shares strategies between nodes of equal shapes (`_problem`'s memo);
    an expert MLP's forward GEMM alone (a 3-GEMM region) and inside its forward and
    backward (a 9-GEMM region) are priced by their own regions in one search."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from autopar import _memo
    from autopar.intra import ShardOptions
    from autopar.intra._problem import build_problem

    rows, hidden, ffn, experts = 64, 8, 16, 8
    sizes = jnp.full((experts,), rows // experts, jnp.int32)
    x = dy = jnp.ones((rows, hidden))
    wg = wu = jnp.ones((experts, hidden, ffn))
    wd = jnp.ones((experts, ffn, hidden))

    def mlp(x, wg, wu, wd):
        h = jax.nn.silu(lax.ragged_dot(x, wg, sizes)) * lax.ragged_dot(x, wu, sizes)
        return lax.ragged_dot(h, wd, sizes)

    def forward_backward(x, wg, wu, wd, dy):
        return jax.vjp(mlp, x, wg, wu, wd)[1](dy)

    cluster = autopar.Cluster.from_profile("dgx-h100")
    mesh = LogicalMesh.create((8,))
    ctx = CostContext(cluster, mesh, moe_overlap="off")
    costs = []
    with _memo.search_scope():
        for graph in (trace(mlp, x, wg, wu, wd, batch_argnums=()),
                      trace(forward_backward, x, wg, wu, wd, dy, batch_argnums=())):
            built = build_problem(graph, mesh, cluster, ShardOptions(moe_overlap="off"))
            gate = next(n for n in graph.nodes if n.primitive == "ragged_dot_general")
            (planned,) = [s for n in built.ilp_nodes if n.node == gate.id
                          for s in n.strategies if s.name == "ep:x"]
            (own,) = expert_parallel_strategies(gate, graph, ctx)
            assert planned.comm_cost == own.comm_cost
            costs.append(own.comm_cost)
    assert costs[1] < costs[0]  # 3 exchanges shared by 9 GEMMs, 2 by 3
