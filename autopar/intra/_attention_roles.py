"""Attention's parts by role, for the ring: which nodes form one attention, and which of
their tensors are Q, K, V, dO and which dots make O, dQ, dK, dV.

In: a graph (a step, a layer, a scan body or a pipeline segment's nodes) and its
attention sequence length S. Out: `attention_components` (the nodes making or reading a
score tensor ``[..., S, S]``, one group per attention) and, per component,
`AttentionRoles`: the *score dot* ``Q K^T`` (two operands without the score dims, a
score result, an ``exp`` after it; its side whose sequence the softmax's ``reduce_max``
reduces is K), the *output dots* (a score tensor times a ``[..., S, ...]`` operand X, a
non-score result), each named by the score dimension it contracts (keys or queries) and
whether the score is downstream of the backward's ``dO V^T`` dot: the output O (P·V,
keys), dV (P^T·dO, queries), dQ (dS·K, keys), dK (dS^T·Q, queries); and every tensor's
dimension labels (batch b0, b1…, ``sq``/``sk``, query groups g0…, head size ``d``),
propagated through the component from the score dot. The planner prices the ring on
these dots (`autopar.intra._ring_strategies`); the lowering replaces them
(`autopar.lower._ring_lowering`). A component that does not match raises a ValueError
naming its node.
"""

from __future__ import annotations

from autopar.graph import Node, OpGraph, Role


def is_score(shape, seq_len: int) -> bool:
    return len(shape) >= 4 and sum(d == seq_len for d in shape) >= 2


def attention_components(graph: OpGraph, seq_len: int) -> list[list[Node]]:
    """The nodes of each attention component (module docstring), in graph order."""
    score = {v.id for v in graph.vars if is_score(v.shape, seq_len)}
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
    by_id = {node.id: node for node in graph.nodes}  # (a segment's nodes are a subset)
    groups: dict[int, list[int]] = {}
    for n in members:
        groups.setdefault(find(n), []).append(n)
    out = []
    for group in groups.values():
        if any(by_id[n].primitive == "exp" for n in group):
            out.append([by_id[n] for n in sorted(group)])
    return out


class AttentionRoles:
    """One component's roles and tensor layouts (module docstring)."""

    def __init__(self, graph: OpGraph, component: list[Node], seq_len: int) -> None:
        self.graph, self.seq_len = graph, seq_len
        self.nodes = list(component)
        self.score = {v for n in self.nodes for v in (*n.inputs, *n.outputs)
                      if is_score(graph.vars[v].shape, seq_len)}
        dots = [n for n in self.nodes if n.primitive == "dot_general"]
        score_dots = [n for n in dots if n.outputs[0] in self.score
                      and not any(v in self.score for v in n.inputs)]
        exp_ancestors = self._ancestors([n for n in self.nodes if n.primitive == "exp"])
        forward = [n for n in score_dots if n.id in exp_ancestors]
        if len(forward) != 1:
            raise self._error(f"{len(forward)} score dots Q K^T before a softmax, not one")
        self.qk = forward[0]
        self._check_softmax_input(exp_ancestors)
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
        self.v_var = self._value_operand(score_dots)
        for role in ("o", "dv", "dq", "dk"):
            if role in self.roles:
                node = self.roles[role][0]
                if node.outputs[0] not in self.labels:
                    raise self._error(f"no layout known for the result of dot #{node.id}")

    def _check_softmax_input(self, exp_ancestors: set[int]) -> None:
        """The scores between ``Q K^T`` and the softmax are scaled by 1/sqrt(head size)
        and masked (a `select_n`), as the ring kernel's causal attention is: the check
        is of the pattern, not of the mask's values."""
        after_qk = self._descendants([self.qk])
        chain = [n for n in self.nodes if n.id in exp_ancestors and n.id in after_qk]
        if not any(n.primitive == "select_n" for n in chain):
            raise self._error("no mask between Q K^T and the softmax (the ring is causal)")
        q_shape = self.graph.vars[self.qk.inputs[0]].shape
        (lc, _), _ = self.qk.params["dimension_numbers"]
        head = q_shape[lc[0]]
        for n in chain:
            consts = [self.graph.vars[v] for v in n.inputs
                      if self.graph.vars[v].role is Role.CONST and not self.graph.vars[v].shape]
            if n.primitive not in ("mul", "div") or not consts or consts[0].value is None:
                continue
            value = float(consts[0].value)
            scale = 1 / value if n.primitive == "div" else value
            if abs(scale * head**0.5 - 1) < 1e-3:
                return
        raise self._error(f"no scale 1/sqrt({head}) of the scores before the softmax")

    def _value_operand(self, score_dots: list[Node]) -> int:
        """V: the other operand of the output dot P·V, or (a backward whose forward is
        elsewhere) the key-side operand of ``dO V^T``."""
        if "o" in self.roles:
            dot, _, pos = self.roles["o"]
            v = dot.inputs[pos]
        else:
            v = next((x for n in score_dots if n is not self.qk for x in n.inputs
                      if "sk" in self.labels.get(x, ())), None)
        if v is None or v not in self.labels:
            raise self._error("no value tensor V with a known layout")
        return v

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
