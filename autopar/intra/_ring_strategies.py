"""Ring attention in the sharding ILP: the ring's strategies on attention's dots.

In: a graph, its attention sequence length, a node's strategies and the mesh/cluster
(`CostContext`). Out: `ring_dots` (node id -> its role in one attention,
`autopar.intra._attention_roles`) and, per such node, `ring_strategies`: for every
strategy that splits the scores' queries over mesh axes A and keeps their keys whole (the
all-gather's layout), a *ring twin* whose K/V-side tensor keeps its sequence split over A
as well, as the ring kernel holds it (no all-gather into the dot, no reduce-scatter out
of it), priced as the ring runs:

- every dot of the attention computes ``cost.context_compute_fraction("ring", cp)``
  (`ring_compute_fraction`) of its dense share (the zig-zag ring skips the masked
  blocks); the Megatron grid prices its ring with the same function
  (`autopar.manual._context_experts.context_terms`, `cost.context_core_time`);
- the forward score dot ``Q K^T`` also pays the forward ring's exposed communication,
  ``cost.ring_attention_time`` (forward) less its compute, and the zig-zag swaps of Q,
  K, V in and the output out (``cost.zigzag_swap_time``);
- the backward's ``dO V^T`` dot pays the backward ring's exposed communication and the
  swaps of dO in and dQ, dK, dV out;
- the dK and dV dots, which contract the split queries, reduce nothing;
- the score dot's result (forward) and the ``dO V^T`` dot's (backward) hold the ring's
  buffers besides, ``cost.ring_attention_buffer_bytes``: the K/V blocks in flight (the
  backward's dK/dV blocks too) and the zig-zag swap's copy of Q (dO). The all-gather
  strategies they twin count no gathered K/V in their results (the ILP's model; the
  plan's liveness counts it as a resharding temporary).

A twin's strategy name ends in `RING`; the plan's context split is "ring" when a chosen
strategy is one (`chose_ring`). Under `context_parallel="ring"` the twins replace the
all-gather strategies of all six dots. Under "auto" only the forward score dot gets a
twin, beside its other strategies, and it pays both directions' exposed ring time and
swaps: were every dot offered one, the ILP would mix them (the twins that save a gather
without the ones that pay for the ring), and no program runs half a ring. The other dots
then keep the all-gather's layouts and their gathers are still charged, so "auto" prices
the ring as an upper bound.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from autopar.cluster._mesh import Spec
from autopar.cost import (
    bytes_per_device,
    context_compute_fraction,
    kv_block_bytes,
    ring_attention_buffer_bytes,
    ring_attention_time,
    zigzag_swap_time,
)
from autopar.graph import Node, OpGraph
from autopar.intra._attention_roles import AttentionRoles, attention_components
from autopar.intra._context import sequence_length

RING = " ring"


def ring_dots(graph: OpGraph, seq_len: int | None) -> dict[int, tuple[str, AttentionRoles]]:
    """Node id -> (role, its attention) for the dots the ring runs: "qk" (the forward
    score dot), "o", "dp" (the backward's ``dO V^T``), "dq", "dk", "dv". An attention
    the roles cannot name is left out (the ILP offers it no ring)."""
    if seq_len is None:
        return {}
    found: dict[int, tuple[str, AttentionRoles]] = {}
    for component in attention_components(graph, seq_len):
        try:
            roles = AttentionRoles(graph, component, seq_len)
        except ValueError:
            continue
        found[roles.qk.id] = ("qk", roles)
        for node in component:
            if (node.primitive == "dot_general" and node is not roles.qk
                    and node.outputs[0] in roles.score
                    and not any(v in roles.score for v in node.inputs)):
                found[node.id] = ("dp", roles)
        for role, (node, _, _) in roles.roles.items():
            found[node.id] = (role, roles)
    return found


def ring_strategies(node: Node, graph: OpGraph, role: str, roles: AttentionRoles,
                    strategies: list, ctx, forced: bool) -> list:
    """`strategies` with the ring twins of `node` added (module docstring); with
    `forced`, the twins alone where there are any."""
    if not forced and role != "qk":
        return strategies
    twins = [t for s in strategies
             if (t := _twin(node, graph, role, roles, s, ctx, both=not forced))]
    if forced:
        return twins or strategies
    return [*strategies, *twins]


def ring_core_nodes(dots: dict[int, tuple[str, AttentionRoles]]) -> dict[int, AttentionRoles]:
    """Node id -> its attention for the nodes of each attention the ring runs (`dots`,
    as `ring_dots` found them) that are not its dots: the scale, mask, softmax and their
    gradients, each reading or making a score tensor."""
    found: dict[int, AttentionRoles] = {}
    for role, roles in dots.values():
        if role != "qk":
            continue
        for node in roles.nodes:
            if node.primitive != "dot_general":
                found[node.id] = roles
    return found


def ring_core_strategies(node: Node, roles: AttentionRoles, strategies: list, mesh
                         ) -> list:
    """`strategies` of a node of the ring's attention beside its dots (`ring_core_nodes`),
    priced as the ring runs it under "ring": where a strategy splits the score's queries
    over mesh axes A (cp devices) and keeps its keys whole, the zig-zag ring computes its
    score elements on the blocks it does not skip, ``context_compute_fraction("ring")`` of
    them, as it does its dots' (the masked blocks are neither multiplied nor scaled,
    masked or exponentiated). Other strategies are left as they are."""
    out = []
    for strategy in strategies:
        fraction = _core_fraction(node, roles, strategy, mesh)
        out.append(strategy if fraction == 1.0 else type(strategy)(
            strategy.name, strategy.in_specs, strategy.out_specs,
            strategy.compute_cost * fraction, strategy.comm_cost, strategy.out_bytes,
            strategy.collectives))
    return out


def _core_fraction(node: Node, roles: AttentionRoles, strategy, mesh) -> float:
    pairs = [*zip(node.outputs, strategy.out_specs), *zip(node.inputs, strategy.in_specs)]
    for v, spec in pairs:
        labels = roles.labels.get(v)
        if v not in roles.score or spec is None or labels is None:
            continue
        axes = tuple(spec[labels.index("sq")])
        if not axes or spec[labels.index("sk")]:
            return 1.0
        cp = math.prod(mesh.axis_size(a) for a in axes)
        return (context_compute_fraction("ring", cp) if roles.seq_len % (2 * cp) == 0
                else 1.0)
    return 1.0


def ring_core_seconds(graph: OpGraph, cluster, mesh, seq_len: int, axis: str) -> float:
    """Seconds per device of the first attention of `graph` (sequence `seq_len`) as the
    ILP prices it on the ring whose queries are split over mesh axis `axis`: each of its
    nodes (dots and the score-sized element-wise work, forward and backward) at its
    cheapest strategy whose scores keep their queries split over `axis` alone and their
    keys whole, the dots' ring twins (`ring_strategies`) and the rest as
    `ring_core_strategies` prices them. For comparing the Megatron grid's CP core
    (`autopar.manual._context_experts.context_terms`) with the planner's on one ring."""
    from autopar.intra._strategies import CostContext, node_signature, node_strategies

    dots = ring_dots(graph, seq_len)
    roles = AttentionRoles(graph, attention_components(graph, seq_len)[0], seq_len)
    ctx = CostContext(cluster, mesh)
    total = 0.0
    for node in roles.nodes:
        sig = node_signature(node, graph)
        if sig is None:
            continue
        strategies = node_strategies(node, graph, sig, ctx)
        if node.id in dots:
            strategies = ring_strategies(node, graph, dots[node.id][0], roles, strategies,
                                         ctx, forced=True)
        else:
            strategies = ring_core_strategies(node, roles, strategies, mesh)
        ring = [t for t in strategies if _queries_over(node, roles, t, axis)]
        total += min(t.compute_cost for t in ring or strategies)
    return total


def _queries_over(node: Node, roles: AttentionRoles, strategy, axis: str) -> bool:
    """Whether `strategy` splits the node's score tensor's queries over `axis` alone and
    keeps its keys whole."""
    pairs = [*zip(node.outputs, strategy.out_specs), *zip(node.inputs, strategy.in_specs)]
    for v, spec in pairs:
        if v in roles.score and spec is not None:
            labels = roles.labels[v]
            return spec[labels.index("sq")] == (axis,) and not spec[labels.index("sk")]
    return False


def chose_ring(strategy_names) -> bool:
    """Whether a solved plan's strategies (their names) run a ring."""
    return any(name.endswith(RING) for name in strategy_names)


def ring_buffer_temporaries(graph: OpGraph, var_specs, node_strategies, mesh
                            ) -> list[tuple[int, int, float]]:
    """The ring's buffers in a solved plan, as the liveness walk counts temporaries
    (`autopar.intra._liveness`): ``(first node id, last node id, bytes per device)``, one
    per attention and direction the plan runs on the ring (its score dot's strategy is a
    twin, `RING`). The forward's (`cost.ring_attention_buffer_bytes`: the K/V blocks in
    flight and the zig-zag copy of Q) lives from the score dot ``Q K^T`` to the output
    dot ``P V``; the backward's (the dK/dV blocks too, and the copy of dO) from the first
    of its dots (``dO V^T``, dQ, dK, dV) to the last. Sizes as the ILP's twins price them
    (`_ring_sizes`): the score's query axes are the ring's, K split over them as the
    ring kernel holds it. Empty where no ring runs."""
    if not chose_ring(node_strategies):
        return []
    found = ring_dots(graph, sequence_length(graph))
    by_id = {node.id: node for node in graph.nodes}
    out = []
    for nid, (role, roles) in found.items():
        if role != "qk" or not node_strategies[nid].endswith(RING):
            continue
        node = by_id[nid]
        score_labels = roles.labels.get(node.outputs[0])
        score_spec = var_specs[node.outputs[0]]
        if score_labels is None or score_spec is None:
            continue
        axes = tuple(score_spec[score_labels.index("sq")])
        if not axes:
            continue
        cp = math.prod(mesh.axis_size(a) for a in axes)
        in_specs = []
        for v in node.inputs:
            spec = var_specs[v]
            if spec is None:
                spec = ((),) * len(graph.vars[v].shape)
            if "sk" in roles.labels.get(v, ()):
                spec = _split(spec, roles.labels[v].index("sk"), axes)
            in_specs.append(spec)
        sizes = _ring_sizes(node, graph, roles, in_specs, cp, mesh)
        forward_end = roles.roles["o"][0].id if "o" in roles.roles else nid
        out.append((nid, forward_end, ring_attention_buffer_bytes(sizes.block, sizes.q_bytes)))
        backward = [n for n, (r, other) in found.items()
                    if other is roles and r in ("dp", "dq", "dk", "dv")]
        if backward:
            out.append((min(backward), max(backward),
                        ring_attention_buffer_bytes(sizes.block, sizes.q_bytes, True)))
    return out


def _twin(node: Node, graph: OpGraph, role: str, roles: AttentionRoles, strategy, ctx,
          both: bool = False):
    mesh = ctx.mesh
    score_pos = _score_position(node, roles)
    score_var = node.outputs[0] if score_pos is None else node.inputs[score_pos]
    score_spec = (strategy.out_specs[0] if score_pos is None
                  else strategy.in_specs[score_pos])
    labels = roles.labels.get(score_var)
    if score_spec is None or labels is None:
        return None
    axes = tuple(score_spec[labels.index("sq")])
    if not axes or score_spec[labels.index("sk")]:
        return None
    cp = math.prod(mesh.axis_size(a) for a in axes)
    if roles.seq_len % (2 * cp):
        return None
    in_specs, out_specs = list(strategy.in_specs), list(strategy.out_specs)
    for p, v in enumerate(node.inputs):
        if p != score_pos and in_specs[p] is not None and "sk" in roles.labels.get(v, ()):
            in_specs[p] = _split(in_specs[p], roles.labels[v].index("sk"), axes)
    comm, collectives = strategy.comm_cost, strategy.collectives
    out_bytes = strategy.out_bytes
    if role in ("dk", "dv"):
        out = node.outputs[0]
        out_specs[0] = _split(out_specs[0], roles.labels[out].index("sk"), axes)
        comm, collectives = 0.0, ()
        var = graph.vars[out]
        out_bytes = bytes_per_device(var.shape, var.dtype, out_specs[0], mesh)
    fraction = context_compute_fraction("ring", cp)
    compute = strategy.compute_cost * fraction
    if role == "qk" or role == "dp":
        directions = (False, True) if both else (role == "dp",)
        sizes = _ring_sizes(node, graph, roles, in_specs, cp, mesh)
        comm += sum(_ring_exposed(sizes, compute, axes, ctx, backward)
                    for backward in directions)
        # The ring's buffers beside its result (`ring_attention_buffer_bytes`): the K/V
        # blocks in flight and the zig-zag copy; under "auto" the score dot stands for
        # both directions, so it holds the larger, the backward's.
        out_bytes += max(ring_attention_buffer_bytes(sizes.block, sizes.q_bytes, backward)
                         for backward in directions)
    return type(strategy)(strategy.name + RING, tuple(in_specs), tuple(out_specs), compute,
                          comm, out_bytes, collectives)


class _RingSizes(NamedTuple):
    """Bytes per device of one attention on the ring: its K/V block (`kv_block_bytes`),
    the Q (or dO) share and the K (or V) share the zig-zag swaps move."""

    block: float
    q_bytes: float
    k_bytes: float


def _ring_sizes(node, graph, roles, in_specs, cp, mesh) -> _RingSizes:
    k_pos = next(p for p, v in enumerate(node.inputs) if "sk" in roles.labels.get(v, ()))
    q_pos = 1 - k_pos
    k_var, q_var = graph.vars[node.inputs[k_pos]], graph.vars[node.inputs[q_pos]]
    k_bytes = bytes_per_device(k_var.shape, k_var.dtype, in_specs[k_pos], mesh)
    q_bytes = bytes_per_device(q_var.shape, q_var.dtype, in_specs[q_pos], mesh)
    itemsize = k_var.nbytes / k_var.size
    head = k_var.shape[roles.labels[k_var.id].index("d")]
    rows = k_bytes / (itemsize * (roles.seq_len / cp) * head)
    block = kv_block_bytes(rows, roles.seq_len, cp, 1, head, itemsize)
    return _RingSizes(block, q_bytes, k_bytes)


def _ring_exposed(sizes: _RingSizes, dot_compute, axes, ctx, backward):
    """The ring's communication left exposed in one direction, and its zig-zag swaps."""
    mesh = ctx.mesh
    attention = 2 * dot_compute  # Q K^T and P V (or dO V^T and dS K) alike
    forward, back = ring_attention_time(attention, sizes.block, ctx.cluster, mesh, axes)
    exposed = back - 2 * attention if backward else forward - attention
    swaps = sum(zigzag_swap_time(b, ctx.cluster, mesh, axes)
                for b in (sizes.q_bytes, sizes.q_bytes, sizes.k_bytes, sizes.k_bytes))
    return max(exposed, 0.0) + swaps


def _score_position(node: Node, roles: AttentionRoles) -> int | None:
    """Which operand of `node` is a score tensor; None when its result is."""
    if node.outputs[0] in roles.score:
        return None
    return next(p for p, v in enumerate(node.inputs) if v in roles.score)


def _split(spec: Spec, dim: int, axes: tuple[str, ...]) -> Spec:
    """`spec` with dimension `dim` split over `axes` (and no other dimension on them)."""
    dims = [tuple(a for a in d if a not in axes) for d in spec]
    dims[dim] = axes
    return tuple(dims)
