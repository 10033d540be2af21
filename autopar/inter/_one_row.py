"""A reference layout carried onto a layer traced at one-row microbatches.

In: a layer's graph traced at one-row microbatches (`mine`), the same layer traced at a
count of larger microbatches (`theirs`, the reference's) and a `chosen_layout` solved on
`theirs`. Out: a layout of `mine` (one entry per ILP node, as `chosen_layout` gives them)
for `price_layout` to price, or None where the two graphs are not one-row twins.

Why: with `num_microbatches="auto"` the counts other than the reference are priced on the
reference's layouts (`autopar.inter._repricing`), where a layer's graph has the
reference's operations in the same order. A one-row microbatch traces to others: JAX's
gradient of a broadcast sums the dimensions that were of size 1 before it
(`_broadcast_in_dim_transpose_rule`: ``expand_dims(reduce_sum(ct, axes), unit_dims)``),
and at one row the batch dimension is one of them. So a sum also sums the unit batch
dimension (``reduce_sum(axes=(2,)) -> (2, s)`` becomes ``reduce_sum(axes=(0, 2)) -> (s,)``)
and a `broadcast_in_dim` puts it back (``(s,) -> (1, s)``), or a sum keeps it where the
other dropped it, or a unit reshape and sum are gone. llama-8B on one DGX H100 at 64 rows
(``autopar plan --model llama-8B --profile dgx-h100 --hosts 1 --batch 64``), count 64
against count 32: 14 to 18 such broadcasts per layer (of 1,561 to 2,216 nodes) and
nothing else differs (``python -m benchmarks.investigations.one_row_layers --row
llama-8B@8-cli --counts 32 64``); unpriced, that count solved 28 ILPs of its own, priced
4 (``python -m benchmarks planning_time --rows llama-8B@8-cli``: 78 ILPs, was 102).

The pairing (`row_map`): the nodes of both in order, each of `mine` the next of `theirs`
(same primitive, operands and results of related shapes, `_dims_of`), or a unit node
(`_unit_node`: an expand_dims, a reshape or a sum of unit dimensions only, the same
values) of its own; a unit node of `theirs` may have none here.

The layout carried over (`RowMap.layout`): each paired node takes its partner's specs on
its own dimensions (`_unit_rows`), with the splits of dimensions of size 1 here (the
rows) dropped, i.e. the row whole on every device of those axes, and those axes dropped
from its results too (no partial sums over them to scatter); a unit node of its own
takes its operand's spec as its producer leaves it and passes its splits on.

Why a priced cost stays the cost of a feasible plan (the contract of `stage_choices`):
nothing here is trusted. `price_layout` checks each entry against this graph's own
strategy lists (`_first`, `_keep_layout`: a pair of specs no strategy of the node has,
or a split these shapes do not divide, raises `LayoutMismatch` and the layer solves its
own ILP) and against the memory budget, and prices the strategies found there on this
graph's shapes. So a layout it prices is a plan of this graph, and its cost no less than
the layer's ILP optimum, whatever this module maps; a poor mapping only prices poorly
(and then the count loses, or wins and is searched again in full, as every priced count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster import spec_axes
from autopar.graph import OpGraph
from autopar.intra._problem import ilp_inputs, passed_on

INPUT = "input"  # `chosen_layout`'s kind of a graph input


@dataclass(frozen=True)
class RowMap:
    """How the ILP nodes of `mine` (one-row microbatches) stand to those of `theirs`:
    `inputs`, pairs of (mine's, theirs') input vars in ILP order; `nodes`, per operator
    ILP node of `mine` in order, (its node index in `mine`, theirs' ILP index or None for
    a unit node of its own, theirs' node index or None)."""

    mine: OpGraph
    theirs: OpGraph
    inputs: tuple[tuple[int, int], ...]
    nodes: tuple[tuple[int, int | None, int | None], ...]
    their_kinds: tuple[str, ...]  # per ILP node of `theirs`, what `chosen_layout` names

    def layout(self, layout: Sequence[tuple]) -> tuple | None:
        """`layout` (solved on `theirs`) carried onto `mine` as the module docstring says;
        None when it is not a layout of `theirs`' ILP nodes."""
        if tuple(kind for kind, _ in layout) != self.their_kinds:
            return None
        mine, theirs = self.mine, self.theirs
        spec_of: dict[int, tuple] = {}  # var of mine -> the spec its producer leaves
        carried = []
        for k, (v, w) in enumerate(self.inputs):
            _, (_, (spec,)) = layout[k]
            spec = _unit_rows(spec, mine.vars[v].shape, theirs.vars[w].shape)
            spec_of[v] = spec
            carried.append((INPUT, ((), (spec,))))
        of_node = {i: (ilp, j) for i, ilp, j in self.nodes}
        for i, node in enumerate(mine.nodes):
            if i not in of_node:  # an identity marker: its results are its operands
                spec_of.update((o, spec_of[v]) for v, o in zip(node.inputs, node.outputs)
                               if v in spec_of)
                continue
            ilp, j = of_node[i]
            if ilp is None:
                entry = _unit_entry(mine, node, spec_of)
            else:
                entry = _carried(mine, node, theirs, theirs.nodes[j], layout[ilp])
                if entry is None:
                    return None
            carried.append(entry)
            spec_of.update(zip(node.outputs, entry[1][1]))
        return tuple(carried)


def row_map(mine: OpGraph, theirs: OpGraph) -> RowMap | None:
    """The `RowMap` of a layer traced at one-row microbatches (`mine`) against the same
    layer at larger ones (`theirs`), its nodes paired as the module docstring says
    (`_aligned`) and every ILP node of one paired with one of the other or a unit node;
    None otherwise, and for graphs with scans (whose ILP is about their opened copy,
    `expand_scans`)."""
    if len(mine.invars) != len(theirs.invars) or _has_scan(mine) or _has_scan(theirs):
        return None
    mine_inputs, theirs_inputs = ilp_inputs(mine), ilp_inputs(theirs)
    if len(mine_inputs) != len(theirs_inputs):
        return None
    found = _aligned(mine, theirs)
    if found is None:
        return None
    aligned, left_out = found
    their_ilp = {j: len(theirs_inputs) + k for k, j in enumerate(_ilp_operators(theirs))}
    nodes = []
    for i in _ilp_operators(mine):
        j = aligned[i]
        if j is not None and j not in their_ilp:
            return None  # an ILP node here, none there
        nodes.append((i, None if j is None else their_ilp[j], j))
    if {j for _, _, j in nodes if j is not None} != set(their_ilp) - left_out:
        return None  # an ILP node there, none here
    kinds = (INPUT,) * len(theirs_inputs) + tuple(
        theirs.nodes[j].primitive for j in sorted(their_ilp))
    return RowMap(mine, theirs, tuple(zip(mine_inputs, theirs_inputs)), tuple(nodes), kinds)


def _has_scan(graph: OpGraph) -> bool:
    return any(n.primitive == "scan" for n in graph.nodes)


def _ilp_operators(graph: OpGraph) -> list[int]:
    """The indices of the nodes `OperatorWalk` gives an ILP node, in its order
    (`passed_on` leaves out the identity markers whose every result has a source)."""
    source_of = dict.fromkeys(ilp_inputs(graph))
    found = []
    for i, node in enumerate(graph.nodes):
        if passed_on(node, source_of):
            continue
        source_of.update(dict.fromkeys(node.outputs))
        found.append(i)
    return found


def _aligned(mine: OpGraph, theirs: OpGraph) -> tuple[list, set] | None:
    """(per node of `mine`, the index of the node of `theirs` it is or None for an
    inserted unit node; the indices of the unit nodes of `theirs` left out here), or None
    when the graphs are not so aligned (`_unit_node`)."""
    found: list[int | None] = []
    left_out: set[int] = set()
    j = 0
    for node in mine.nodes:
        while True:
            their = theirs.nodes[j] if j < len(theirs.nodes) else None
            if their is not None and _same_node(mine, node, theirs, their):
                found.append(j)
                j += 1
            elif _unit_node(mine, node):
                found.append(None)
            elif their is not None and _unit_node(theirs, their):
                left_out.add(j)
                j += 1
                continue
            else:
                return None
            break
    while j < len(theirs.nodes) and _unit_node(theirs, theirs.nodes[j]):
        left_out.add(j)
        j += 1
    return (found, left_out) if j == len(theirs.nodes) else None


def _same_node(mine: OpGraph, node, theirs: OpGraph, their) -> bool:
    """The same primitive on as many operands and results, each of a shape `_dims_of`
    relates to theirs."""
    if (node.primitive != their.primitive or len(node.inputs) != len(their.inputs)
            or len(node.outputs) != len(their.outputs)):
        return False
    return all(_dims_of(mine.vars[v].shape, theirs.vars[w].shape) is not None
               for v, w in [*zip(node.inputs, their.inputs), *zip(node.outputs, their.outputs)])


def _dims_of(shape, their_shape) -> tuple | None:
    """Per dimension of `shape` (one-row microbatches), the dimension of `their_shape`
    it is, or None for a unit dimension of its own; None when they are not so related.

    Of the same rank: dimension for dimension (the batch's rows and what holds them
    differ in size). Else (a sum or reshape that keeps or drops the unit batch dimension
    where the other keeps or drops a dimension of their rows): the longest in-order
    pairing of equal sizes (`_pairing`), which must pair every dimension here larger than
    1 and leave at most one of theirs larger than 1 (their rows) unpaired."""
    if len(shape) == len(their_shape):
        return tuple(range(len(shape)))
    paired = _pairing(tuple(shape), tuple(their_shape))
    if any(d is None and size > 1 for d, size in zip(paired, shape)):
        return None
    left = [size for d, size in enumerate(their_shape) if d not in paired and size > 1]
    return paired if len(left) <= 1 else None


def _pairing(shape: tuple, their_shape: tuple) -> tuple:
    """The longest in-order pairing of equal dimensions larger than 1 (a longest common
    subsequence over the sizes); per dimension of `shape`, its partner or None."""
    n, m = len(shape), len(their_shape)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            same = shape[i] == their_shape[j] and shape[i] > 1
            best[i][j] = max(best[i + 1][j], best[i][j + 1],
                             best[i + 1][j + 1] + 1 if same else 0)
    paired: list[int | None] = []
    i = j = 0
    while i < n:
        if j < m and shape[i] == their_shape[j] and shape[i] > 1 \
                and best[i][j] == best[i + 1][j + 1] + 1:
            paired.append(j)
            i, j = i + 1, j + 1
        elif j < m and best[i][j] == best[i][j + 1]:
            j += 1
        else:
            paired.append(None)
            i += 1
    return tuple(paired)


def _unit_node(graph: OpGraph, node) -> bool:
    """A node that only inserts or removes dimensions of size 1 (the same values): a
    `broadcast_in_dim` that is an expand_dims, a `reshape` between shapes equal but for
    unit dimensions, a `reduce_sum` over unit dimensions only."""
    if len(node.outputs) != 1 or not node.inputs:
        return False
    shape = graph.vars[node.inputs[0]].shape
    out = graph.vars[node.outputs[0]].shape
    if node.primitive == "broadcast_in_dim":
        dims = tuple(int(d) for d in node.params.get("broadcast_dimensions", ()))
        return (len(dims) == len(shape) and tuple(out[d] for d in dims) == tuple(shape)
                and all(out[d] == 1 for d in range(len(out)) if d not in dims))
    if node.primitive == "reshape":
        return ([s for s in shape if s != 1] == [s for s in out if s != 1]
                and len(node.inputs) == 1)
    if node.primitive == "reduce_sum":
        return all(shape[d] == 1 for d in node.params.get("axes", ()))
    return False


def _unit_entry(graph: OpGraph, node, spec_of: dict) -> tuple:
    """The layout entry of an inserted unit node (`_unit_node`): its operand as its
    producer leaves it (no resharding), its dimensions larger than 1 split as the
    operand's, in order, the unit ones whole."""
    v = node.inputs[0]
    shape, out = graph.vars[v].shape, graph.vars[node.outputs[0]].shape
    spec = spec_of.get(v, ((),) * len(shape))
    splits = iter([axes for axes, size in zip(spec, shape) if size != 1])
    out_spec = tuple(next(splits, ()) if size != 1 else () for size in out)
    in_specs = (spec,) + (None,) * (len(node.inputs) - 1)
    return node.primitive, (in_specs, (out_spec,))


def _carried(mine: OpGraph, node, theirs: OpGraph, their, entry) -> tuple | None:
    """`their` node's layout entry with its specs on `node`'s shapes (`_unit_rows`)."""
    kind, (in_specs, out_specs) = entry
    if len(in_specs) != len(node.inputs) or len(out_specs) != len(node.outputs):
        return None
    ins = tuple(None if s is None else _unit_rows(s, mine.vars[v].shape,
                                                  theirs.vars[w].shape)
                for s, v, w in zip(in_specs, node.inputs, their.inputs))
    # The mesh axes that split the rows of an operand there split nothing here: the
    # node's results have none of them either (no partial sums over them to scatter).
    dropped = {a for s, t in zip(ins, in_specs) if s is not None
               for a in set(spec_axes(t)) - set(spec_axes(s))}
    outs = tuple(tuple(tuple(a for a in axes if a not in dropped) for axes in
                       _unit_rows(s, mine.vars[v].shape, theirs.vars[w].shape))
                 for s, v, w in zip(out_specs, node.outputs, their.outputs))
    return kind, (ins, outs)


def _unit_rows(spec, shape, their_shape):
    """`spec`, theirs, on `shape`'s dimensions (`_dims_of`), with the splits of the
    dimensions of size 1 here (not there) dropped."""
    dims = _dims_of(shape, their_shape)
    if dims is None or len(spec) != len(their_shape):
        return spec  # not a spec of theirs: `price_layout` finds no such strategy
    return tuple(() if d is None or (size == 1 and their_shape[d] != 1) else spec[d]
                 for d, size in zip(dims, shape))
