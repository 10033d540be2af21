"""One dispatch per expert MLP: the regions of grouped GEMMs and row-wise ops that share a
routing (`autopar.intra._moe_regions`), and the expert-parallel cost of a grouped GEMM as
its share of its region's entry dispatches and exit combines, checked by hand.

Trace only, no compile: the lowering's all-to-alls are counted in the compiled HLO by
tests/test_moe_dropless.py.
"""

from __future__ import annotations

import optax
import pytest

import autopar
from autopar.cluster._mesh import LogicalMesh
from autopar.cost import all_to_all_time, ep_region_exchange_bytes
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


def test_region_exchange_bytes_by_hand():
    dispatched, combined, share = ep_region_exchange_bytes([100.0, 40.0], [100.0], 1.25, 4)
    assert dispatched == [125.0, 50.0] and combined == [125.0] and share == 0.25
    with pytest.raises(ValueError, match="imbalance"):
        ep_region_exchange_bytes([1.0], [1.0], 0.5, 3)
    with pytest.raises(ValueError, match="num_gemms"):
        ep_region_exchange_bytes([1.0], [1.0], 1.0, 0)
