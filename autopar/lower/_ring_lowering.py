"""Run the attention of a plan that chose ring context parallelism with the ring kernel.

In: a graph (a step, or a planned scan's body), its plan's layouts (`ShardingPlan` or
`BodyPlan`), the ring's mesh axes and the jax mesh. Out: the graph with each attention's
forward output and backward gradients computed by `autopar.lower._ring_attention`'s
kernel (and its VJP) under `shard_map`; the dense attention they replace is dropped.

Each attention (einsum or `jax.nn.dot_product_attention`) is found and its tensors named
by `autopar.intra._attention_roles`: its output dot becomes the kernel on Q, K, V, and its
dQ, dK, dV dots one node running the kernel's VJP on Q, K, V, dO. The kernel runs on
every device's share: batch and head dims as the plan splits them, the sequence over the
ring's axes. Each device holds a contiguous share of the sequence;
for zig-zag load balancing it swaps chunks into zig-zag order (two `ppermute`s per
tensor) before the ring and back after it (`to_zigzag`, `from_zigzag`).

Runs causal attention with scale ``1/sqrt(head size)``, as the kernel computes: the roles
check that the scores are scaled so and masked before the softmax (the pattern, not the
mask's values), and an attention that does not match raises a ValueError naming its node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from autopar.cluster._mesh import replicated
from autopar.graph import Node, OpGraph, Role
from autopar.intra._attention_roles import AttentionRoles, attention_components
from autopar.intra._context import sequence_length
from autopar.lower._ring_attention import _ring_kernel


def with_ring_attention(graph: OpGraph, var_specs, axes: Sequence[str], mesh: Mesh
                        ) -> OpGraph:
    """`graph` with every attention component run by the ring kernel over mesh `axes`."""
    seq_len = sequence_length(graph)
    if seq_len is None:
        return graph
    components = attention_components(graph, seq_len)
    if not components:
        return graph
    nodes = list(graph.nodes)
    inserted: list[tuple[int, Node]] = []  # (after node position, stand-in)
    dead: set[int] = set()
    for component in components:
        found = AttentionRoles(graph, component, seq_len)
        for node in component:
            dead.add(node.id)
        for stand_in in _stand_ins(found, var_specs, tuple(axes), mesh):
            inserted.append(stand_in)
    order = []
    position = {n.id: i for i, n in enumerate(nodes)}
    producer_pos = {v: position[n.id] for n in nodes for v in n.outputs}
    placed = {}
    for stand_in in inserted:
        after = max((producer_pos.get(v, -1) for v in stand_in.inputs), default=-1)
        placed.setdefault(after, []).append(stand_in)
    for stand_in in placed.get(-1, []):
        order.append(stand_in)
    for i, node in enumerate(nodes):
        if node.id not in dead:
            order.append(node)
        order.extend(placed.get(i, []))
    order = _live(graph, order)
    _check_order(graph, order)
    return replace(graph, nodes=order)


def _live(graph: OpGraph, order: list[Node]) -> list[Node]:
    """`order` without the nodes nothing reads any more (the dense attention's remains)."""
    live = set(graph.outvars)
    kept = []
    for node in reversed(order):
        if any(v in live for v in node.outputs):
            kept.append(node)
            live.update(node.inputs)
    return kept[::-1]


def _check_order(graph: OpGraph, order: Sequence[Node]) -> None:
    ready = set(graph.invars) | {v.id for v in graph.vars if v.role is Role.CONST}
    for node in order:
        missing = [v for v in node.inputs if v not in ready]
        assert not missing, f"ring lowering: {node.primitive} reads {missing} before made"
        ready.update(node.outputs)


def _stand_ins(roles: AttentionRoles, var_specs, axes: tuple[str, ...], mesh: Mesh
               ) -> list[Node]:
    """The ring kernel's nodes for one attention: the output from Q, K, V, and dQ, dK,
    dV together from Q, K, V, dO (each placed by `with_ring_attention`)."""
    q, k = roles.q_var, roles.k_var
    v = roles.v_var
    layout = _Layout(roles.labels[q], roles.labels[k], roles.labels[v])
    spec = _CanonicalSpecs(layout, var_specs[q] or replicated(len(roles.labels[q])),
                           axes)
    out = []
    if "o" in roles.roles:
        o_dot = roles.roles["o"][0]
        o = o_dot.outputs[0]
        out.append(_stand_in(o_dot, (q, k, v), (o,),
                             RingForward(mesh, axes, layout, spec, roles.labels[o])))
    grads = [r for r in ("dq", "dk", "dv") if r in roles.roles]
    if grads:
        if len(grads) != 3:
            raise roles._error(f"the backward has {grads}, not dq, dk and dv")
        dv_dot, _, do_pos = roles.roles["dv"]
        do = dv_dot.inputs[do_pos]
        if do not in roles.labels:
            raise roles._error(f"no layout known for dO of dot #{dv_dot.id}")
        outs = tuple(roles.roles[r][0].outputs[0] for r in grads)
        out.append(_stand_in(dv_dot, (q, k, v, do), outs, RingBackward(
            mesh, axes, layout, spec, roles.labels[do],
            [roles.labels[u] for u in outs])))
    return out


def _stand_in(like: Node, inputs, outputs, prim) -> Node:
    # a negative id: the plan's operand constraints (keyed by node id) are not its own
    return replace(like, id=-1 - like.id, primitive="ring_attention", inputs=inputs,
                   outputs=outputs, params={}, prim=prim)


class _Layout:
    """Where each canonical dimension sits in the graph's Q, K and V.

    Canonical: Q ``[b0.., sq, g0.., d]``, K and V ``[b0.., sk, d]``, the output and dQ
    like Q, dK and dV like K."""

    def __init__(self, q, k, v) -> None:
        self.q_labels, self.k_labels, self.v_labels = q, k, v
        batch = sorted((lab for lab in q if lab.startswith("b")), key=lambda s: int(s[1:]))
        groups = sorted((lab for lab in q if lab.startswith("g")), key=lambda s: int(s[1:]))
        self.q_names = (*batch, "sq", *groups, "d")
        self.kv_names = (*batch, "sk", "d")
        self.num_batch, self.num_groups = len(batch), len(groups)
        for names, have in ((self.kv_names, k), (self.kv_names, v)):
            if sorted(names) != sorted(have):
                raise ValueError(f"ring lowering: K/V dims {have}, expected {names}")

    @staticmethod
    def to_canonical(x, have, names):
        return jnp.transpose(x, [have.index(n) for n in names])

    @staticmethod
    def from_canonical(x, names, want):
        return jnp.transpose(x, [names.index(n) for n in want])


class _CanonicalSpecs:
    """`PartitionSpec`s of the canonical Q and K/V: batch and group dims split as the
    plan splits Q, the sequence over the ring's axes, the head size whole."""

    def __init__(self, layout: _Layout, q_spec, axes: tuple[str, ...]) -> None:
        by_name = {}
        for name, dim_axes in zip(layout.q_labels, q_spec):
            by_name[name] = tuple(a for a in dim_axes if a not in axes) or None
        by_name["sq"] = by_name["sk"] = axes
        by_name["d"] = None
        self.q = PartitionSpec(*(by_name.get(n) for n in layout.q_names))
        self.kv = PartitionSpec(*(by_name.get(n) for n in layout.kv_names))


class RingForward:
    """Stands in for an attention's output: the ring kernel on the graph's Q, K, V."""

    multiple_results = True

    def __init__(self, mesh, axes, layout, spec, out_labels) -> None:
        self.mesh, self.axes, self.layout, self.spec = mesh, axes, layout, spec
        self.out_labels = out_labels

    def bind(self, q, k, v):
        ring = _sharded_ring(self.mesh, self.axes, self.layout, self.spec)
        lay = self.layout
        o = ring(lay.to_canonical(q, lay.q_labels, lay.q_names),
                 lay.to_canonical(k, lay.k_labels, lay.kv_names),
                 lay.to_canonical(v, lay.v_labels, lay.kv_names))
        return [lay.from_canonical(o, lay.q_names, self.out_labels)]


class RingBackward:
    """Stands in for an attention's dQ, dK and dV: the VJP of the ring kernel."""

    multiple_results = True

    def __init__(self, mesh, axes, layout, spec, do_labels, out_labels) -> None:
        self.mesh, self.axes, self.layout, self.spec = mesh, axes, layout, spec
        self.do_labels, self.out_labels = do_labels, out_labels

    def bind(self, q, k, v, do):
        ring = _sharded_ring(self.mesh, self.axes, self.layout, self.spec)
        lay = self.layout
        canon = (lay.to_canonical(q, lay.q_labels, lay.q_names),
                 lay.to_canonical(k, lay.k_labels, lay.kv_names),
                 lay.to_canonical(v, lay.v_labels, lay.kv_names))
        out, vjp = jax.vjp(ring, *canon)
        dq, dk, dv = vjp(lay.to_canonical(do, self.do_labels, lay.q_names).astype(out.dtype))
        names = (lay.q_names, lay.kv_names, lay.kv_names)
        return [lay.from_canonical(g.astype(x.dtype), n, want)
                for g, x, n, want in zip((dq, dk, dv), (q, k, v), names, self.out_labels)]


def _sharded_ring(mesh: Mesh, axes: tuple[str, ...], layout: _Layout, spec: _CanonicalSpecs):
    """The ring kernel on canonical Q, K, V under `shard_map`, in natural sequence order
    (each device's contiguous share swapped into zig-zag order and back)."""
    cp = math.prod(mesh.shape[a] for a in axes)
    axis = axes[0] if len(axes) == 1 else axes
    nb, ng = layout.num_batch, layout.num_groups

    def local(q, k, v):
        bshape, s = q.shape[:nb], q.shape[nb]
        gshape, d = q.shape[nb + 1: nb + 1 + ng], q.shape[-1]
        b, g = math.prod(bshape), math.prod(gshape)
        q = to_zigzag(q.reshape(b, s, g, d), axis, cp)
        k = to_zigzag(k.reshape(b, s, 1, d), axis, cp)
        v = to_zigzag(v.reshape(b, s, 1, d), axis, cp)
        o = from_zigzag(_ring_kernel(q, k, v, axis=axis, cp=cp), axis, cp)
        return o.reshape(*bshape, s, *gshape, d)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec.q, spec.kv, spec.kv),
                         out_specs=spec.q, check_vma=False)


def _zigzag_owner(chunk: int, cp: int) -> int:
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def to_zigzag(x, axis, cp: int):
    """Rank r's contiguous share (chunks 2r, 2r+1 of 2·cp along dim 1) -> its zig-zag
    share (chunks r, 2cp-1-r): two `ppermute`s, the first halves and the second."""
    if cp == 1:
        return x
    half = x.shape[1] // 2
    first = jax.lax.ppermute(x[:, :half], axis,
                             [(r, _zigzag_owner(2 * r, cp)) for r in range(cp)])
    second = jax.lax.ppermute(x[:, half:], axis,
                              [(r, _zigzag_owner(2 * r + 1, cp)) for r in range(cp)])
    even = jax.lax.axis_index(axis) % 2 == 0
    # rank t's chunk t is even exactly when t is: it came with the first halves
    return jnp.where(even, jnp.concatenate([first, second], 1),
                     jnp.concatenate([second, first], 1))


def from_zigzag(x, axis, cp: int):
    """Inverse of `to_zigzag`: each rank sends its even chunk home as a first half and its
    odd chunk as a second half."""
    if cp == 1:
        return x
    half = x.shape[1] // 2
    even = jax.lax.axis_index(axis) % 2 == 0
    even_chunk = jnp.where(even, x[:, :half], x[:, half:])
    odd_chunk = jnp.where(even, x[:, half:], x[:, :half])

    def chunks_of(t):
        return (t, 2 * cp - 1 - t) if t % 2 == 0 else (2 * cp - 1 - t, t)

    first = jax.lax.ppermute(even_chunk, axis,
                             [(t, chunks_of(t)[0] // 2) for t in range(cp)])
    second = jax.lax.ppermute(odd_chunk, axis,
                              [(t, chunks_of(t)[1] // 2) for t in range(cp)])
    return jnp.concatenate([first, second], 1)
