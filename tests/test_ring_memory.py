"""The ring's memory: a ring twin holds its all-gather strategy's result plus the ring's
buffers (`cost.ring_attention_buffer_bytes`: the K/V blocks in flight, the backward's
dK/dV blocks beside them, and the zig-zag swap's copy of Q or dO), checked against bytes
counted by hand on the cp-test Llama's traced step (no compile)."""

from __future__ import annotations

import pytest
from test_context_parallel import CFG, _cpu, _setup

from autopar.cluster._mesh import LogicalMesh
from autopar.cost import (
    ring_attention_buffer_bytes,
    ring_kv_buffer_bytes,
    zigzag_swap_buffer_bytes,
)
from autopar.graph import trace
from autopar.intra._context import sequence_length
from autopar.intra._ring_strategies import ring_dots, ring_strategies
from autopar.intra._strategies import CostContext, node_signature, node_strategies


def test_ring_buffer_formula_by_hand():
    mib = 2**20
    # Llama 3 405B at 131,072 tokens, cp 16, one K/V head per device, head 128, bf16:
    # K and V of 8,192 tokens = 2 x 8192 x 128 x 2 = 4 MiB; Q of 16 heads = 32 MiB.
    assert ring_kv_buffer_bytes(4 * mib) == 8 * mib
    assert zigzag_swap_buffer_bytes(32 * mib) == 32 * mib
    assert ring_attention_buffer_bytes(4 * mib, 32 * mib) == 40 * mib
    assert ring_attention_buffer_bytes(4 * mib, 32 * mib, backward=True) == 48 * mib
    with pytest.raises(ValueError, match="kv_block must be >= 0"):
        ring_attention_buffer_bytes(-1, 0)


@pytest.mark.parametrize("forced", [True, False])
def test_ring_twin_holds_the_ring_buffers(forced):
    """On a (2, 4) mesh, every twin that splits the queries over cp devices: the score dot
    (forward) and ``dO V^T`` (backward) hold, besides the all-gather strategy's result,
    2 (4 backward) K/V blocks of ``batch_share x seq/cp x head x 2 bytes x 2`` and one
    more Q-sized share; the other dots hold what their all-gather strategy holds (dK and
    dV: their own sequence share). Under "auto" the score dot alone is twinned and holds
    the backward's buffers."""
    step, state, batch = _setup(CFG)
    graph = trace(step, state, batch, batch_argnums=(1,))
    mesh = LogicalMesh.create((2, 4))
    ctx = CostContext(_cpu(), mesh)
    dots = ring_dots(graph, sequence_length(graph))
    assert {role for role, _ in dots.values()} == {"qk", "o", "dp", "dq", "dk", "dv"}
    found = []
    for node_id, (role, roles) in dots.items():
        if not forced and role != "qk":
            continue
        node = graph.nodes[node_id]
        plain = node_strategies(node, graph, node_signature(node, graph), ctx)
        twins = [t for t in ring_strategies(node, graph, role, roles, plain, ctx, forced)
                 if t.name.endswith(" ring")]
        assert twins, role
        for twin in twins:
            base = next(s for s in plain if s.name + " ring" == twin.name)
            k_pos = next(p for p, v in enumerate(node.inputs)
                         if "sk" in roles.labels.get(v, ()))
            k_var, q_var = (graph.vars[node.inputs[p]] for p in (k_pos, 1 - k_pos))
            # by hand: each share is the tensor over the devices its spec splits it on;
            # a K/V block is K's share and V's (the same shape)
            block = 2 * k_var.nbytes / _ways(twin.in_specs[k_pos], mesh)
            q_share = q_var.nbytes / _ways(twin.in_specs[1 - k_pos], mesh)
            if role in ("qk", "dp"):
                backward = role == "dp" or not forced
                extra = (2 if backward else 1) * 2 * block + q_share
                assert twin.out_bytes == pytest.approx(base.out_bytes + extra), (role, twin)
                found.append((role, twin.in_specs, twin.out_bytes - base.out_bytes))
            elif role not in ("dk", "dv"):
                assert twin.out_bytes == base.out_bytes, (role, twin)
    assert {role for role, _, _ in found} == ({"qk", "dp"} if forced else {"qk"})
    # Written out for the twin splitting the batch over x (2) and the sequence over y
    # (cp 4): K [2, 64, 4 kv heads, 8] float32 is 16 KiB, 2 KiB a device; a K/V block
    # 4 KiB; Q [2, 64, 4, 2, 8] 32 KiB, 4 KiB a device: forward 2 x 4 + 4 = 12 KiB,
    # backward 2 x 2 x 4 + 4 = 20 KiB.
    by_specs = {(role, specs[0]): extra for role, specs, extra in found}
    assert by_specs[("qk", (("x",), ("y",), (), ()))] == (12 if forced else 20) * 1024


def _ways(spec, mesh) -> int:
    """How many ways `spec` splits its tensor."""
    ways = 1
    for axes in spec:
        for a in axes:
            ways *= mesh.axis_size(a)
    return ways
