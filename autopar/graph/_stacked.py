"""`split_stacked`: stacked layer leaves cut into per-range pieces, a graph-level rewrite.

In: a train step's `OpGraph` traced with its layer scan run as sub-scans over iteration
ranges (`autopar.inter.passes.scan_layers`), and those ranges. There each stacked leaf
``w`` (leading dim L) is read by static slices ``w[a:b]``, its gradient is the sum of
``pad(g_k)`` pieces, and the optimizer updates it (and its optimizer state) elementwise.
Out: the same step where every such leaf is one input per range (``w[a:b]``, its path
suffixed ``[a:b]``), the gradient is one piece per range, the update runs piecewise, and
the updated leaf is one output per range. So a pipeline stage that runs iterations
``[a, b)`` holds, differentiates and updates only its slice; no whole stacked array is
formed. The new graph's `stacked` (a `StackedSplit`) says how its inputs and outputs map
to the caller's leaves.

How (one pass in program order, `eval_jaxpr` shape): variables with leading dim L joined
by elementwise equations (the operands and result of the same shape), by `pad`s of a
piece, by `add_any`, and through the grad and layer marks form groups; a group that holds
a sliced input or a padded gradient piece is *split*: its inputs become pieces, its
elementwise equations run once per piece, a slice ``w[a:b]`` of it is piece ``[a, b)``,
a ``pad`` makes a piece (the others are zeros, never formed unless something needs them),
and a value of it computed whole (e.g. ``zeros_like``) is sliced. Anything else that
reads a split value gets it whole (a `concatenate`: correct, but that equation then holds
the whole array; the update of a model written as scanned layers has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax

from autopar.graph._collector import collector_paused
from autopar.graph._opgraph import Node, OpGraph, Role, Var

# Equations applied element by element: split operands give split results.
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "sqrt", "rsqrt", "integer_pow", "pow",
    "exp", "log", "log1p", "expm1", "abs", "sign", "max", "min", "square", "tanh",
    "logistic", "convert_element_type", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "not", "clamp", "copy", "copy_p", "erf", "stop_gradient", "nextafter",
    "is_finite", "reduce_precision", "real", "imag",
})
MARKS = frozenset({"grad_boundary", "layer_boundary"})


@dataclass(frozen=True)
class StackedSplit:
    """How a split graph's inputs and outputs map to the caller's leaves.

    - `ranges`: the iteration ranges ``[a, b)``, one piece each.
    - `original`: the step's graph before the split (the caller's view: its `in_tree`,
      `out_tree`, input paths and shapes).
    - `inputs` / `outputs`: for each flat leaf of the caller's arguments / results,
      the positions of its pieces among the split graph's `invars` / `outvars`, or a
      single position for a leaf that is not split.
    - `split_inputs` / `split_outputs`: the caller's leaf positions that are split.
    """

    ranges: tuple[tuple[int, int], ...]
    original: OpGraph
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    split_inputs: frozenset[int]
    split_outputs: frozenset[int]

    def graph_leaves(self, leaves: Sequence[Any], split) -> list[Any]:
        """The split graph's flat inputs from the caller's: ``split(x, positions)`` gives
        the pieces of a split leaf ``x`` (their positions among the graph's inputs), in
        range order; other leaves pass as they are."""
        out: list[Any] = [None] * sum(len(p) for p in self.inputs)
        for i, (x, where) in enumerate(zip(leaves, self.inputs)):
            if i in self.split_inputs:
                for w, piece in zip(where, split(x, where)):
                    out[w] = piece
            else:
                out[where[0]] = x
        return out

    def caller_outputs(self, outs: Sequence[Any], join) -> list[Any]:
        """The caller's flat results from the split graph's: ``join(pieces, positions)``
        for a split result (its pieces and their positions among the graph's outputs),
        the value itself otherwise."""
        return [
            join([outs[w] for w in where], where) if i in self.split_outputs
            else outs[where[0]]
            for i, where in enumerate(self.outputs)
        ]


def split_stacked(graph: OpGraph, ranges: Sequence[tuple[int, int]]) -> OpGraph:
    """The step with its stacked leaves cut into `ranges` (see the module docstring).
    With one range (or no stacked leaf found) the graph is returned unchanged."""
    ranges = tuple((int(a), int(b)) for a, b in ranges)
    if len(ranges) < 2:
        return graph
    with collector_paused():  # see `autopar.graph._collector`
        return _Splitter(graph, ranges).run()


class _Splitter:
    def __init__(self, graph: OpGraph, ranges):
        self.g = graph
        self.ranges = ranges
        self.length = ranges[-1][1]
        self.vars: list[Var] = list(graph.vars)
        self.nodes: list[Node] = []
        self.rename: dict[int, int] = {}  # original var -> var holding the same value
        self.pieces: dict[int, list[int | None]] = {}  # split var -> piece vars (None: 0)
        self.whole: dict[int, int] = {}  # split var -> its materialized whole
        self.sliced: dict[int, list] = {}  # unsplit var -> its slices, one per piece
        self.computed_whole: set[int] = set()  # split values some equation computes whole
        self.split = self._split_groups()

    # ---- which values are split ----------------------------------------------------------

    def _stacked(self, v: int) -> bool:
        var = self.g.vars[v]
        return var.role is not Role.CONST and len(var.shape) > 0 and var.shape[0] == self.length

    def _range_of_slice(self, node: Node) -> int | None:
        """The piece a `slice` node takes, or None."""
        if node.primitive != "slice" or not self._stacked(node.inputs[0]):
            return None
        shape = self.g.vars[node.inputs[0]].shape
        start, limit = node.params["start_indices"], node.params["limit_indices"]
        strides = node.params["strides"]
        if strides is not None and any(s != 1 for s in strides):
            return None
        if tuple(start[1:]) != (0,) * (len(shape) - 1) or tuple(limit[1:]) != shape[1:]:
            return None
        return self._piece_index(int(start[0]), int(limit[0]))

    def _range_of_pad(self, node: Node) -> int | None:
        """The piece a `pad` node (of zeros, on the leading dim only) makes, or None."""
        if node.primitive != "pad" or not self._stacked(node.outputs[0]):
            return None
        fill = self.g.vars[node.inputs[1]]
        if fill.role is not Role.CONST or fill.value is None or np.any(np.asarray(fill.value)):
            return None
        config = node.params["padding_config"]
        if any(int(x) for c in config[1:] for x in c) or int(config[0][2]):
            return None
        low, high = int(config[0][0]), int(config[0][1])
        return self._piece_index(low, self.length - high)

    def _piece_index(self, a: int, b: int) -> int | None:
        return self.ranges.index((a, b)) if (a, b) in self.ranges else None

    def _joins(self, node: Node) -> list[tuple[int, int]] | None:
        """Pairs of stacked values one split group must hold for this node to run
        piecewise, or None when it cannot."""
        if node.primitive in MARKS:
            return [(i, o) for i, o in zip(node.inputs, node.outputs) if self._stacked(i)]
        if node.primitive in ELEMENTWISE and len(node.outputs) == 1:
            out = node.outputs[0]
            if not self._stacked(out):
                return None
            shape = self.g.vars[out].shape
            ins = [v for v in node.inputs if self.g.vars[v].shape]
            if any(self.g.vars[v].shape != shape for v in ins):
                return None
            return [(v, out) for v in ins if self.g.vars[v].role is not Role.CONST]
        return None

    def _split_groups(self) -> set[int]:
        parent: dict[int, int] = {}

        def find(v):
            while parent.get(v, v) != v:
                parent[v] = parent.get(parent[v], parent[v])  # path halving
                v = parent[v]
            return v

        sources: set[int] = set()
        for node in self.g.nodes:
            joins = self._joins(node)
            if joins:
                for a, b in joins:
                    ra, rb = find(a), find(b)
                    if ra != rb:
                        parent[max(ra, rb)] = min(ra, rb)
            if self._range_of_slice(node) is not None and node.inputs[0] in self.g.invars:
                sources.add(node.inputs[0])
            if self._range_of_pad(node) is not None:
                sources.add(node.outputs[0])
        roots = {find(v) for v in sources}
        return {
            v for v in range(len(self.g.vars)) if self._stacked(v) and find(v) in roots
        }

    # ---- building ----------------------------------------------------------------------

    def _new_var(self, shape, dtype, role=Role.ACTIVATION, path=None, value=None) -> int:
        var = Var(len(self.vars), tuple(shape), dtype, role, path, None, value)
        self.vars.append(var)
        return var.id

    def _emit(self, like: Node | None, prim, params, inputs, out_shapes, dtypes,
              scale=1.0) -> list[int]:
        """Append an equation of `prim`; `like` (scaled by `scale`) gives its costs and
        source, else it costs nothing (a slice, concatenate or zeros the rewrite adds)."""
        outs = [self._new_var(s, d) for s, d in zip(out_shapes, dtypes)]
        node = Node(
            id=len(self.nodes),
            primitive=like.primitive if like is not None else prim.name,
            inputs=tuple(inputs),
            outputs=tuple(outs),
            params=params,
            flops=(like.flops * scale) if like is not None else 0.0,
            bytes_read=(like.bytes_read * scale) if like is not None else 0.0,
            bytes_written=(like.bytes_written * scale) if like is not None else 0.0,
            prim=prim,
            remat=like.remat if like is not None else False,
            source=like.source if like is not None else None,
        )
        self.nodes.append(node)
        return outs

    def _piece_shape(self, v: int, k: int) -> tuple[int, ...]:
        a, b = self.ranges[k]
        return (b - a, *self.g.vars[v].shape[1:])

    def _pieces_of(self, v: int) -> list[int | None]:
        """Piece vars of a split value (slicing it where it was computed whole)."""
        if v not in self.pieces:
            self.pieces[v] = [self._piece_of_whole(v, k) for k in range(len(self.ranges))]
        return self.pieces[v]

    def _piece(self, v: int, k: int) -> int:
        """Piece `k` of a split value, zeros formed where it is a zero piece."""
        p = self._pieces_of(v)[k]
        if p is None:
            dtype = self.g.vars[v].dtype
            zero = self._new_var((), dtype, Role.CONST, value=np.zeros((), dtype))
            params = dict(shape=self._piece_shape(v, k), broadcast_dimensions=(), sharding=None)
            p = self._emit(None, lax.broadcast_in_dim_p, params, [zero],
                           [self._piece_shape(v, k)], [dtype])[0]
            self.pieces[v][k] = p
        return p

    def _whole(self, v: int) -> int:
        """A value whole: as computed, or a split value's pieces concatenated."""
        if v not in self.split or v not in self.pieces or v in self.computed_whole:
            return self.rename.get(v, v)
        if v not in self.whole:
            parts = [self._piece(v, k) for k in range(len(self.ranges))]
            var = self.g.vars[v]
            self.whole[v] = self._emit(None, lax.concatenate_p, dict(dimension=0), parts,
                                       [var.shape], [var.dtype])[0]
        return self.whole[v]

    def _run_node(self, node: Node) -> None:
        k = self._range_of_slice(node)
        if k is not None and node.inputs[0] in self.split:
            self.rename[node.outputs[0]] = self._piece(node.inputs[0], k)
            return
        out_split = [v in self.split for v in node.outputs]
        if any(out_split) and node.primitive in MARKS:
            return self._run_mark(node)
        if out_split == [True] and (k := self._range_of_pad(node)) is not None:
            pieces: list[int | None] = [None] * len(self.ranges)
            pieces[k] = self.rename.get(node.inputs[0], node.inputs[0])
            self.pieces[node.outputs[0]] = pieces
            return
        if out_split == [True] and self._joins(node) is not None:
            return self._run_piecewise(node)
        inputs = [self._whole(v) for v in node.inputs]
        self.computed_whole.update(v for v, s in zip(node.outputs, out_split) if s)
        self.nodes.append(_replaced(node, id=len(self.nodes), inputs=tuple(inputs)))

    def _run_piecewise(self, node: Node) -> None:
        out = node.outputs[0]
        result: list[int | None] = []
        sum_of_pieces = node.primitive in ("add", "add_any") and len(node.inputs) == 2 and all(
            v in self.split for v in node.inputs)
        for k, (a, b) in enumerate(self.ranges):
            if sum_of_pieces:
                present = [self._pieces_of(v)[k] for v in node.inputs]
                present = [p for p in present if p is not None]
                if len(present) < 2:
                    result.append(present[0] if present else None)
                    continue
            ins = []
            for v in node.inputs:
                var = self.g.vars[v]
                if v in self.split:
                    ins.append(self._piece(v, k))
                elif var.shape:  # computed whole (or a constant): sliced
                    ins.append(self._piece_of_whole(v, k))
                else:
                    ins.append(self.rename.get(v, v))
            scale = (b - a) / self.length
            params = node.params
            result.append(self._emit(node, node.prim, params, ins, [self._piece_shape(out, k)],
                                     [self.g.vars[out].dtype], scale)[0])
        self.pieces[out] = result

    def _piece_of_whole(self, v: int, k: int) -> int:
        """Piece `k` of a value that is not split (sliced once per piece)."""
        cache = self.sliced.setdefault(v, [None] * len(self.ranges))
        if cache[k] is None:
            a, b = self.ranges[k]
            shape = self.g.vars[v].shape
            params = dict(
                start_indices=(a,) + (0,) * (len(shape) - 1),
                limit_indices=(b, *shape[1:]),
                strides=(1,) * len(shape),
            )
            cache[k] = self._emit(None, lax.slice_p, params, [self.rename.get(v, v)],
                                  [(b - a, *shape[1:])], [self.g.vars[v].dtype])[0]
        return cache[k]

    def _run_mark(self, node: Node) -> None:
        ins: list[int] = []
        outs: list[tuple[int, int | None]] = []  # (original output, piece index)
        for v, o in zip(node.inputs, node.outputs):
            if o in self.split:
                for k in range(len(self.ranges)):
                    ins.append(self._piece(v, k))
                    outs.append((o, k))
            else:
                ins.append(self._whole(v))
                outs.append((o, None))
        shapes = [self.vars[v].shape for v in ins]
        dtypes = [self.vars[v].dtype for v in ins]
        new = self._emit(node, node.prim, node.params, ins, shapes, dtypes)
        for (o, k), n in zip(outs, new):
            if k is None:
                self.rename[o] = n
            else:
                self.pieces.setdefault(o, [None] * len(self.ranges))[k] = n

    def run(self) -> OpGraph:
        g = self.g
        invars: list[int] = []
        in_where: list[tuple[int, ...]] = []
        for v in g.invars:
            if v in self.split:
                var = g.vars[v]
                got = []
                for a, b in self.ranges:
                    path = f"{var.path}[{a}:{b}]" if var.path else None
                    got.append(self._new_var((b - a, *var.shape[1:]), var.dtype, var.role, path))
                self.pieces[v] = got
                in_where.append(tuple(range(len(invars), len(invars) + len(got))))
                invars.extend(got)
            else:
                in_where.append((len(invars),))
                invars.append(v)
        for node in g.nodes:
            self._run_node(node)
        outvars: list[int] = []
        out_where: list[tuple[int, ...]] = []
        for v in g.outvars:
            if v in self.split:
                got = [self._piece(v, k) for k in range(len(self.ranges))]
                out_where.append(tuple(range(len(outvars), len(outvars) + len(got))))
                outvars.extend(got)
            else:
                out_where.append((len(outvars),))
                outvars.append(self._whole(v))
        producer = {o: n.id for n in self.nodes for o in n.outputs}
        variables = [_replaced(var, producer=producer.get(var.id)) for var in self.vars]
        split_in = frozenset(i for i, v in enumerate(g.invars) if v in self.split)
        split_out = frozenset(i for i, v in enumerate(g.outvars) if v in self.split)
        out = OpGraph(
            vars=variables,
            nodes=self.nodes,
            invars=tuple(invars),
            outvars=tuple(outvars),
            in_tree=_with_pieces(g.in_tree, split_in, len(self.ranges)),
            out_tree=_with_pieces(g.out_tree, split_out, len(self.ranges)),
            name=g.name,
            arg_names=g.arg_names,
        )
        out.stacked = StackedSplit(
            self.ranges, g, tuple(in_where), tuple(out_where), split_in, split_out
        )
        return out


def _replaced(record, **changes):
    """`dataclasses.replace(record, **changes)` for a frozen `Node` or `Var` (neither has
    an `__init__` check or `__post_init__`) without replace's per-field work: a split
    rewrites every node and variable of the step."""
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update(changes)
    return new


def _with_pieces(tree, split: frozenset[int], num_pieces: int):
    """`tree` with each leaf in `split` replaced by a tuple of `num_pieces` leaves (so that
    leaf paths pair a piece of the new state with the same piece of the old)."""
    if tree is None:
        return None
    leaves = [tuple([0] * num_pieces) if i in split else 0 for i in range(tree.num_leaves)]
    return jax.tree.structure(jax.tree.unflatten(tree, leaves))
