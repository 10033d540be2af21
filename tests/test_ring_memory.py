"""The ring's price outside the one-mesh plan: a ring twin holds its all-gather
strategy's result plus the ring's buffers (`cost.ring_attention_buffer_bytes`: the K/V
blocks in flight, the backward's dK/dV blocks beside them, and the zig-zag swap's copy of
Q or dO), checked against bytes counted by hand on the cp-test Llama's traced step; the
pipeline's layer cost table prices the exact ring under "auto". No compile."""

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


@pytest.fixture(scope="module")
def cp_graph():
    step, state, batch = _setup(CFG)
    return trace(step, state, batch, batch_argnums=(1,))


@pytest.mark.parametrize("forced", [True, False])
def test_ring_twin_holds_the_ring_buffers(forced, cp_graph):
    """On a (2, 4) mesh, every twin that splits the queries over cp devices: the score dot
    (forward) and ``dO V^T`` (backward) hold, besides the all-gather strategy's result,
    2 (4 backward) K/V blocks of ``batch_share x seq/cp x head x 2 bytes x 2`` and one
    more Q-sized share; the other dots hold what their all-gather strategy holds (dK and
    dV: their own sequence share). Under "auto" the score dot alone is twinned and holds
    the backward's buffers."""
    graph = cp_graph
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


def test_layer_table_prices_the_exact_ring_under_auto():
    """The pipeline's layer cost table under "auto" solves the ring's exact ILP where the
    layer's ILP split attention's sequence, and keeps the cheaper (as `plan_on_mesh`):
    one wide-ish layer at 32,768 tokens on one DGX H100, mesh (8,), costs what the
    forced ring's table says, less than the all-gather's. Before, the table saw the
    ring only at its upper bound (every other dot's gathers still paid)."""
    import dataclasses

    import optax

    from autopar.cluster import Cluster
    from autopar.graph import tied_state
    from autopar.inter._layer_table import LayerCostTable
    from autopar.inter.passes._layers import assign_layers
    from autopar.intra._options import ShardOptions
    from examples import llama

    cfg = dataclasses.replace(CFG, num_layers=1, seq_len=32768, hidden=512, num_heads=8,
                              num_kv_heads=8, ffn_hidden=1024, layer_markers=True)
    optimizer = optax.adamw(1e-2, eps=1e-6)
    graph = trace(llama.make_train_step(cfg, optimizer), llama.abstract_state(cfg, optimizer),
                  llama.abstract_batch(cfg, 1), batch_argnums=(1,))
    layers, tied = assign_layers(graph), tied_state(graph, (0,))
    cluster = Cluster.from_profile("dgx-h100")
    tables = {mode: LayerCostTable(graph, layers, cluster,
                                   ShardOptions(context_parallel=mode), tied)
              for mode in ("auto", "ring", "allgather")}
    attention = next(k for k, sub in enumerate(tables["auto"].per_layer.stage_graphs)
                     if ring_dots(sub, cfg.seq_len))
    costs = {mode: t.cost(attention, (8,)).latency for mode, t in tables.items()}
    plans = {mode: t.plan(attention, (8,)) for mode, t in tables.items()}
    assert plans["auto"].context_parallel.algorithm == "ring", plans["auto"].context_parallel
    assert costs["auto"] == pytest.approx(costs["ring"], rel=1e-12)
    assert costs["ring"] < costs["allgather"]
    # Another microbatch count's table prices the ring's layout (no ILP), as the ring.
    kept = LayerCostTable(graph, layers, cluster, ShardOptions(), tied, keep_layouts=True)
    kept.cost(attention, (8,))
    priced = LayerCostTable(graph, layers, cluster, ShardOptions(), tied, reference=kept)
    assert priced.cost(attention, (8,)).latency == pytest.approx(costs["ring"], rel=1e-12)
    assert priced.num_priced == 1


def test_liveness_walk_holds_the_ring_buffers(cp_graph):
    """The plan's peak (the liveness walk) counts the ring's buffers where the plan runs
    the ring, as the ILP's twins do: the forced ring on (2, 4) splitting the batch over x
    and the sequence over y (cp 4) holds, per attention, 12 KiB from ``Q K^T`` to ``P V``
    (2 K/V blocks of 4 KiB and a 4 KiB Q share, by hand in the test above) and 20 KiB
    from the backward's first dot to its last. A temporary live over the whole step adds
    exactly its bytes to the peak; the ring's buffers add between nothing (freed before the
    peak) and their sum."""
    from autopar.intra._liveness import peak_live_bytes
    from autopar.intra._ring_strategies import ring_buffer_temporaries

    graph = cp_graph
    mesh = LogicalMesh.create((2, 4))
    dots = ring_dots(graph, sequence_length(graph))
    roles = next(r for _, r in dots.values())
    # The layout the hand count above names: every tensor of the attention with its
    # batch over x; the score's queries, and Q's, over y (the ring's axis).
    specs = [None] * len(graph.vars)
    for v, labels in roles.labels.items():
        specs[v] = tuple(("x",) if lab == "b0" else ("y",) if lab == "sq" else ()
                         for lab in labels)
    strategies = [""] * (max(n.id for n in graph.nodes) + 1)
    assert ring_buffer_temporaries(graph, specs, strategies, mesh) == []  # no ring chosen
    strategies[roles.qk.id] = "S0 ring"
    temporaries = ring_buffer_temporaries(graph, specs, strategies, mesh)
    backward = [n for n, (r, other) in dots.items()
                if other is roles and r in ("dp", "dq", "dk", "dv")]
    assert temporaries == [(roles.qk.id, roles.roles["o"][0].id, 12 * 1024),
                           (min(backward), max(backward), 20 * 1024)]
    # The walk: a temporary over every node adds its bytes to the peak exactly; the
    # ring's add at most their sum.
    base = peak_live_bytes(graph, specs, mesh)
    last = graph.nodes[-1].id
    assert peak_live_bytes(graph, specs, mesh, extra=[(0, last, 1000.0)]) == base + 1000.0
    with_ring = peak_live_bytes(graph, specs, mesh, extra=temporaries)
    assert base <= with_ring <= base + 32 * 1024


def test_ring_core_skips_the_masked_blocks(cp_graph):
    """Under "ring" the attention's other nodes (scale, mask, softmax, their gradients)
    are priced on the blocks the zig-zag ring computes, as its dots are: a strategy
    splitting the score's queries over cp devices and keeping its keys whole costs
    ``(cp + 1) / (2 cp)`` of its compute (x, cp 2: 3/4; y, cp 4: 5/8; both: 9/16),
    collectives and bytes unchanged; one splitting no query axis (or the keys) is left
    as it is."""
    from autopar.intra._ring_strategies import ring_core_nodes, ring_core_strategies

    graph = cp_graph
    mesh = LogicalMesh.create((2, 4))
    ctx = CostContext(_cpu(), mesh)
    core = ring_core_nodes(ring_dots(graph, sequence_length(graph)))
    exp = next(graph.nodes[n] for n in core if graph.nodes[n].primitive == "exp")
    roles = core[exp.id]
    labels = roles.labels[exp.outputs[0]]
    plain = node_strategies(exp, graph, node_signature(exp, graph), ctx)
    priced = ring_core_strategies(exp, roles, plain, mesh)
    by_hand = {("x",): 3 / 4, ("y",): 5 / 8, ("x", "y"): 9 / 16, ("y", "x"): 9 / 16}
    scaled = set()
    for before, after in zip(plain, priced):
        spec = before.out_specs[0]
        queries = tuple(spec[labels.index("sq")])
        fraction = by_hand.get(queries, 1.0) if not spec[labels.index("sk")] else 1.0
        assert after.compute_cost == pytest.approx(before.compute_cost * fraction)
        assert (after.name, after.comm_cost, after.out_bytes) == (
            before.name, before.comm_cost, before.out_bytes)
        if fraction < 1:
            scaled.add(queries)
    assert {("x",), ("y",)} <= scaled  # the ring's layouts are among exp's strategies
