"""Run the attention of a plan that chose ring context parallelism with the ring kernel.

In: a graph (a step, or a planned scan's body), its plan's layouts (`ShardingPlan` or
`BodyPlan`), the ring's mesh axes and the jax mesh. Out: the graph with each attention's
forward output and backward gradients computed by `autopar.lower._ring_attention`'s
kernel (and its VJP) under `shard_map`; the traced dense attention they replace is left
dead, and XLA removes it.

The traced attention (einsum or `jax.nn.dot_product_attention`) is a *component*: the
nodes that make or read a score tensor (``[..., S, S]``, `autopar.intra._context`). In
it:

- the *score dot* ``Q K^T`` (two operands without the score dims, a score result, and
  an ``exp`` after it): its operands are Q and K;
- the *output dots*: a score tensor times a ``[..., S, ...]`` operand X, a non-score
  result. Which dimension of the score the dot contracts (the keys' or the queries'),
  and whether the score is downstream of the backward's ``dO V^T`` dot, say which
  result it is: the output O (P·V, keys), dV (P^T·dO, queries), dQ (dS·K, keys) or dK
  (dS^T·Q, queries).

Dimension labels (batch dims b0, b1…, ``sq``/``sk``, query groups, head size ``d``) are
propagated through the component from the score dot, so each tensor's layout is known.
The kernel runs on every device's share: batch and head dims as the plan splits them,
the sequence over the ring's axes. Each device holds a contiguous share of the sequence;
for zig-zag load balancing it swaps chunks into zig-zag order (two `ppermute`s per
tensor) before the ring and back after it (`to_zigzag`, `from_zigzag`).

Assumes causal attention with scale ``1/sqrt(head size)``, as the kernel computes; a
component that does not match the pattern above raises a ValueError naming its node.
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
from autopar.lower._ring_attention import _ring_kernel


def with_ring_attention(graph: OpGraph, var_specs, axes: Sequence[str], mesh: Mesh
                        ) -> OpGraph:
    """`graph` with every attention component run by the ring kernel over mesh `axes`."""
    seq_len = _sequence(graph)
    if seq_len is None:
        return graph
    components = _components(graph, seq_len)
    if not components:
        return graph
    nodes = list(graph.nodes)
    inserted: list[tuple[int, Node]] = []  # (after node position, stand-in)
    dead: set[int] = set()
    for component in components:
        found = _Attention(graph, component, seq_len)
        for node_id in component:
            dead.add(node_id)
        for stand_in in found.stand_ins(var_specs, tuple(axes), mesh):
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


def _sequence(graph: OpGraph) -> int | None:
    from autopar.intra._context import sequence_length
    return sequence_length(graph)


def _is_score(shape, seq_len: int) -> bool:
    return len(shape) >= 4 and sum(d == seq_len for d in shape) >= 2


def _components(graph: OpGraph, seq_len: int) -> list[list[int]]:
    """Node ids of each attention component (module docstring), in graph order."""
    score = {v.id for v in graph.vars if _is_score(v.shape, seq_len)}
    parent: dict[int, int] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[int, int] = {}
    members = []
    for node in graph.nodes:
        touched = [v for v in (*node.inputs, *node.outputs) if v in score]
        if not touched:
            continue
        members.append(node.id)
        for v in touched:
            if v in owner:
                parent[find(node.id)] = find(owner[v])
            else:
                owner[v] = node.id
    groups: dict[int, list[int]] = {}
    for n in members:
        groups.setdefault(find(n), []).append(n)
    out = []
    for group in groups.values():
        if any(graph.nodes[n].primitive == "exp" for n in group):
            out.append(sorted(group))
    return out


class _Attention:
    """One component's roles and tensor layouts (module docstring)."""

    def __init__(self, graph: OpGraph, component: list[int], seq_len: int) -> None:
        self.graph, self.seq_len = graph, seq_len
        self.nodes = [graph.nodes[n] for n in component]
        self.score = {v for n in self.nodes for v in (*n.inputs, *n.outputs)
                      if _is_score(graph.vars[v].shape, seq_len)}
        dots = [n for n in self.nodes if n.primitive == "dot_general"]
        score_dots = [n for n in dots if n.outputs[0] in self.score
                      and not any(v in self.score for v in n.inputs)]
        exp_ancestors = self._ancestors([n for n in self.nodes if n.primitive == "exp"])
        forward = [n for n in score_dots if n.id in exp_ancestors]
        if len(forward) != 1:
            raise self._error(f"{len(forward)} score dots Q K^T before a softmax, not one")
        self.qk = forward[0]
        grad_side = self._descendants([n for n in score_dots if n is not self.qk])
        self.labels: dict[int, tuple[str, ...]] = {}
        self._seed()
        self._propagate()
        self.roles: dict[str, tuple[Node, int, int]] = {}  # role -> (dot, score op, other op)
        for node in dots:
            if node is self.qk or node.outputs[0] in self.score:
                continue
            s_pos = 0 if node.inputs[0] in self.score else 1
            (contract, _), = [node.params["dimension_numbers"]]
            s_contract = contract[s_pos]
            lab = self.labels.get(node.inputs[s_pos])
            if lab is None:
                raise self._error(f"no layout known for the score operand of dot #{node.id}")
            keys = "sk" in [lab[d] for d in s_contract]
            grad = node.id in grad_side
            role = {(False, True): "o", (False, False): "dv", (True, True): "dq",
                    (True, False): "dk"}[grad, keys]
            if role in self.roles:
                raise self._error(f"two dots compute {role} (#{self.roles[role][0].id}, "
                                  f"#{node.id})")
            self.roles[role] = (node, s_pos, 1 - s_pos)
        for role in ("o", "dv", "dq", "dk"):
            if role in self.roles:
                node = self.roles[role][0]
                if node.outputs[0] not in self.labels:
                    raise self._error(f"no layout known for the result of dot #{node.id}")

    # -- structure ---------------------------------------------------------------------

    def _error(self, why: str) -> ValueError:
        first = self.nodes[0]
        source = f" ({first.source})" if first.source else ""
        return ValueError(
            f"context_parallel='ring' cannot run the attention at {first.primitive} "
            f"#{first.id}{source} with the ring kernel: {why}. The ring replaces causal "
            "softmax attention (einsum or jax.nn.dot_product_attention); use "
            "context_parallel='allgather' for this attention"
        )

    def _ancestors(self, roots: list[Node]) -> set[int]:
        made_by = {v: n for n in self.nodes for v in n.outputs}
        seen, stack = set(), list(roots)
        while stack:
            node = stack.pop()
            for v in node.inputs:
                up = made_by.get(v)
                if up is not None and up.id not in seen:
                    seen.add(up.id)
                    stack.append(up)
        return seen

    def _descendants(self, roots: list[Node]) -> set[int]:
        readers: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                readers.setdefault(v, []).append(n)
        seen, stack = {n.id for n in roots}, list(roots)
        while stack:
            node = stack.pop()
            for v in node.outputs:
                for r in readers.get(v, []):
                    if r.id not in seen:
                        seen.add(r.id)
                        stack.append(r)
        return seen

    # -- dimension labels --------------------------------------------------------------

    def _seed(self) -> None:
        """Labels of the score dot's operands and result from its dimension numbers: the
        side whose sequence the softmax reduces (its ``reduce_max``) is K."""
        node, shape = self.qk, lambda v: self.graph.vars[v].shape
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        if len(lc) != 1 or len(rc) != 1:
            raise self._error(f"the score dot #{node.id} contracts {len(lc)} dimensions")
        side_labels = []
        for side, (v, c, b) in enumerate(zip(node.inputs, (lc, rc), (lb, rb))):
            lab = [""] * len(shape(v))
            for i, d in enumerate(b):
                lab[d] = f"b{i}"
            lab[c[0]] = "d"
            free = [d for d in range(len(lab)) if not lab[d]]
            seq = [d for d in free if shape(v)[d] == self.seq_len]
            if len(seq) != 1:
                raise self._error(f"operand {side} of the score dot #{node.id} has "
                                  f"{len(seq)} sequence dimensions, not one")
            g = 0
            for d in free:
                lab[d] = f"s{side}" if d == seq[0] else f"g{side}{g}"
                g += d != seq[0]
            side_labels.append(lab)
        self.labels[node.inputs[0]] = tuple(side_labels[0])
        self.labels[node.inputs[1]] = tuple(side_labels[1])
        self.labels[node.outputs[0]] = _dot_out(*side_labels, lc, rc, lb, rb)
        self._propagate()
        reduced = {self.labels[n.inputs[0]][a] for n in self.nodes
                   if n.primitive == "reduce_max" and n.inputs[0] in self.labels
                   for a in n.params["axes"]}
        if len(reduced) != 1 or not reduced <= {"s0", "s1"}:
            raise self._error(f"the softmax reduces {sorted(reduced)}, not one sequence")
        key = int(next(iter(reduced))[1])
        if any(lab.startswith(f"g{key}") for lab in side_labels[key]):
            raise self._error("the keys have dimensions besides batch, sequence and head")
        q, k = node.inputs[1 - key], node.inputs[key]
        self.q_var, self.k_var = q, k
        rename = {f"s{key}": "sk", f"s{1 - key}": "sq"}

        def renamed(lab):
            if lab.startswith("g"):
                return f"g{lab[2:]}"
            return rename.get(lab, lab)

        self.labels = {v: tuple(renamed(x) for x in lab) for v, lab in self.labels.items()}

    def _propagate(self) -> None:
        for _ in range(4):
            changed = False
            for node in self.nodes:
                changed |= self._rule(node)
            if not changed:
                return

    def _set(self, v: int, lab) -> bool:
        lab = tuple(lab)
        if v in self.labels or "" in lab or len(set(lab)) != len(lab):
            return False
        self.labels[v] = lab
        return True

    def _rule(self, node: Node) -> bool:
        vars_, labels = self.graph.vars, self.labels
        p, changed = node.primitive, False
        if p == "transpose":
            (x,), (y,) = node.inputs, node.outputs
            perm = node.params["permutation"]
            if x in labels:
                changed |= self._set(y, [labels[x][i] for i in perm])
            if y in labels and x not in labels:
                inv = [0] * len(perm)
                for i, j in enumerate(perm):
                    inv[j] = i
                changed |= self._set(x, [labels[y][i] for i in inv])
        elif p == "dot_general":
            (lc, rc), (lb, rb) = node.params["dimension_numbers"]
            a, b = node.inputs
            out = node.outputs[0]
            if a in labels and b in labels:
                changed |= self._set(out, _dot_out(labels[a], labels[b], lc, rc, lb, rb))
            for known, unknown, kc, uc, kb, ub in ((a, b, lc, rc, lb, rb),
                                                  (b, a, rc, lc, rb, lb)):
                # a score times a [.., S, .., head size] operand: its one free dim is d
                if known in self.score and known in labels and unknown not in labels:
                    lab = [""] * len(vars_[unknown].shape)
                    for x, y in (*zip(kb, ub), *zip(kc, uc)):
                        lab[y] = labels[known][x]
                    if lab.count("") == 1:
                        lab[lab.index("")] = "d"
                    changed |= self._set(unknown, lab)
            if a in labels and b in labels:
                changed |= self._set(out, _dot_out(labels[a], labels[b], lc, rc, lb, rb))
            for known, unknown, kc, uc, kb, ub, first in (
                    (a, b, lc, rc, lb, rb, True), (b, a, rc, lc, rb, lb, False)):
                if known in labels and unknown not in labels and out in labels:
                    changed |= self._set(unknown, _dot_operand(
                        labels[known], labels[out], vars_[unknown].shape, kc, uc, kb, ub,
                        first, len(vars_[known].shape)))
        elif p == "broadcast_in_dim":
            (x, *_), (y,) = node.inputs, node.outputs
            dims = node.params["broadcast_dimensions"]
            if y in labels and x not in labels and len(dims) == len(vars_[x].shape):
                changed |= self._set(x, [labels[y][d] for d in dims])
        elif p in ("reduce_max", "reduce_sum", "reduce_min", "argmax"):
            (x,), (y, *_) = node.inputs, node.outputs
            axes = node.params["axes"]
            if x in labels:
                changed |= self._set(y, [lab for d, lab in enumerate(labels[x])
                                         if d not in axes])
        else:  # elementwise: operands and results of one shape share a layout
            group = [v for v in (*node.inputs, *node.outputs)
                     if vars_[v].role is not Role.CONST]
            by_shape: dict[tuple, list[int]] = {}
            for v in group:
                by_shape.setdefault(vars_[v].shape, []).append(v)
            for same in by_shape.values():
                known = next((labels[v] for v in same if v in labels), None)
                if known is not None:
                    for v in same:
                        changed |= self._set(v, known)
        return changed

    # -- stand-ins ---------------------------------------------------------------------

    def stand_ins(self, var_specs, axes: tuple[str, ...], mesh: Mesh) -> list[Node]:
        q, k = self.q_var, self.k_var
        if "o" not in self.roles:
            raise self._error("no output dot P V")
        o_dot, _, v_pos = self.roles["o"]
        v = o_dot.inputs[v_pos]
        if v not in self.labels:
            raise self._error(f"no layout known for V of dot #{o_dot.id}")
        layout = _Layout(self.labels[q], self.labels[k], self.labels[v])
        spec = _CanonicalSpecs(layout, var_specs[q] or replicated(len(self.labels[q])),
                               axes)
        out = []
        o = o_dot.outputs[0]
        out.append(self._node(o_dot, (q, k, v), (o,),
                              RingForward(mesh, axes, layout, spec, self.labels[o])))
        grads = [r for r in ("dq", "dk", "dv") if r in self.roles]
        if grads:
            if len(grads) != 3:
                raise self._error(f"the backward has {grads}, not dq, dk and dv")
            dv_dot, _, do_pos = self.roles["dv"]
            do = dv_dot.inputs[do_pos]
            if do not in self.labels:
                raise self._error(f"no layout known for dO of dot #{dv_dot.id}")
            outs = tuple(self.roles[r][0].outputs[0] for r in grads)
            out.append(self._node(dv_dot, (q, k, v, do), outs, RingBackward(
                mesh, axes, layout, spec, self.labels[do],
                [self.labels[u] for u in outs])))
        return out

    def _node(self, like: Node, inputs, outputs, prim) -> Node:
        # a negative id: the plan's operand constraints (keyed by node id) are not its own
        return replace(like, id=-1 - like.id, primitive="ring_attention", inputs=inputs,
                       outputs=outputs, params={}, prim=prim)


def _dot_out(lhs, rhs, lc, rc, lb, rb) -> tuple[str, ...]:
    out = [lhs[d] for d in lb]
    out += [lab for d, lab in enumerate(lhs) if d not in lc and d not in lb]
    out += [lab for d, lab in enumerate(rhs) if d not in rc and d not in rb]
    return tuple(out)


def _dot_operand(known, out, shape, kc, uc, kb, ub, known_is_lhs, known_rank):
    """Labels of a dot's unknown operand from its other operand's and its result's."""
    lab = [""] * len(shape)
    for a, b in zip(kb, ub):
        lab[b] = known[a]
    for a, b in zip(kc, uc):
        lab[b] = known[a]
    num_batch = len(kb)
    known_free = known_rank - len(kc) - len(kb)
    free_out = out[num_batch + known_free:] if known_is_lhs else out[num_batch:
                                                                     len(out) - known_free]
    free = [d for d in range(len(shape)) if d not in uc and d not in ub]
    for d, name in zip(free, free_out):
        lab[d] = name
    return lab


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
