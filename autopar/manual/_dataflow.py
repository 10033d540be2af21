"""Which Megatron role each parameter plays, found from the dataflow of a traced step.

In: an `OpGraph`. Out: a `Placement` per parameter input: column-parallel, row-parallel,
vocabulary-parallel embedding, bias of a column-parallel weight, replicated, or unplaced.
Names are never read; the decision comes from how each parameter is first used (the
forward pass comes first in a traced `value_and_grad`, so a parameter's first use is its
forward use):

- *split tracking*: walking the nodes in program order, every activation dimension that
  descends from the output features of a column-parallel weight carries that weight's id
  ("tracked"), through elementwise ops, broadcasts, reshapes, transposes, slices and the
  batch and free dimensions of dot products (attention keeps the head dimension tracked);
  a reduction over the dimension, or a contraction without a weight, ends it.
- a weight whose first use is a dot product is **row-parallel** when the activation's
  contracted dimension is tracked (it consumes a column-parallel split: attention output,
  MLP second linear), else **column-parallel** (its first free dimension is split: QKV,
  MLP first linear, output layer). The row-parallel result is whole after its all-reduce,
  so it carries nothing on.
- a weight whose first use is a gather (a table lookup) is a **vocabulary-parallel
  embedding**: the looked-up dimension is split (Megatron's `VocabParallelEmbedding`).
- a parameter whose first use is elementwise is a **bias** split like the tracked dimension
  it meets (column-parallel biases), else **replicated** (layer norms, row-parallel biases,
  position embeddings).
- batch dimensions of a weight's dot product are **expert** dimensions (MoE experts).
- a column-parallel weight that no row-parallel weight consumes and whose output is
  narrower than its input (a router or gate) is demoted to replicated; a wide one is an
  output layer and stays split (vocabulary-parallel logits).
- any other first use (convolution, control flow, a dot of two parameters) is unplaced.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar._memo import declare
from autopar.graph import Node, OpGraph, Role

Tracked = tuple[frozenset[int], ...]  # per dimension: ids of the column weights it carries

# Ops that only move, cast or broadcast a parameter: their result is still "the parameter"
# for deciding its role (e.g. `wte.T` before the logits, a bf16 cast before a matmul).
LAYOUT_PRIMITIVES = frozenset(
    {"broadcast_in_dim", "transpose", "convert_element_type", "reshape", "squeeze",
     "expand_dims", "copy", "copy_p", "slice"}
)
# Ops whose operands and results line up dimension by dimension (same rank), though sizes
# may differ (slices, padding, concatenation).
POSITIONAL_PRIMITIVES = frozenset(
    {"slice", "dynamic_slice", "dynamic_update_slice", "pad", "concatenate", "rev",
     "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "select_n", "clamp"}
)
# Ops that take no dimension-wise relation from operands to results.
OPAQUE_PRIMITIVES = frozenset(
    {"gather", "scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min",
     "scatter_max", "conv_general_dilated", "scan", "while", "cond", "iota", "argsort"}
)
REDUCTION_PARAM = "axes"  # reduce_sum, reduce_max, argmax, ...: the reduced dimensions


class Kind(str, enum.Enum):
    """The Megatron role of a parameter."""

    COLUMN = "column-parallel"
    ROW = "row-parallel"
    VOCAB = "vocab-parallel embedding"
    BIAS = "column-parallel bias"
    REPLICATED = "replicated"
    UNPLACED = "unplaced"


@dataclass(frozen=True)
class Placement:
    """How one parameter is split, independent of the mesh size.

    **Arguments:**
    - `kind`: its role.
    - `model_dim`: the dimension split over the tensor-parallel ("model") axis, or None.
    - `expert_dim`: the dimension split over the data axis (expert parallelism), or None.
    - `reason`: why, for reports and error messages.
    - `sources`: column-parallel weights (var ids) this one pairs with (row weights,
      biases).
    """

    kind: Kind
    model_dim: int | None = None
    expert_dim: int | None = None
    reason: str = ""
    sources: frozenset[int] = frozenset()


@dataclass(frozen=True)
class _Image:
    """A variable that is a parameter moved around: `dims[i]` is the parameter dim of dim i."""

    param: int
    dims: tuple[int | None, ...]


def classify_parameters(graph: OpGraph) -> dict[int, Placement]:
    """The `Placement` of every parameter input of `graph`, keyed by variable id.

    **Arguments:**
    - `graph`: a traced train step (see `autopar.graph.trace`).

    **Returns:** ``{var id: Placement}`` for each input with role PARAM (a new dict; the
    walk is done once per graph: the Megatron grid asks once per configuration).
    """
    if graph not in _PLACEMENTS:
        _PLACEMENTS[graph] = _classify_parameters(graph)
    return dict(_PLACEMENTS[graph])


_PLACEMENTS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "manual.placements",
    "graph -> {parameter: Placement}")


def _classify_parameters(graph: OpGraph) -> dict[int, Placement]:
    params = [v.id for v in graph.inputs_with_role(Role.PARAM)]
    walker = _Walker(graph, params)
    for node in graph.nodes:
        walker.visit(node)
    unused = Placement(Kind.REPLICATED, reason="not used by the step")
    placements = {p: walker.placements.get(p, unused) for p in params}
    return _demote_unpaired(graph, placements, walker.paired)


def split_dimensions(graph: OpGraph) -> dict[int, Tracked]:
    """The activation dimensions that carry a column-parallel split, per variable.

    **Arguments:**
    - `graph`: a traced train step.

    **Returns:** ``{var id: per-dimension ids of the column-parallel weights it carries}``
    for every variable with at least one tracked dimension (see the module docstring);
    a variable missing from the result is whole on every dimension under Megatron TP. Only
    the forward pass is meaningful: backward uses of a weight are not first uses.
    """
    params = [v.id for v in graph.inputs_with_role(Role.PARAM)]
    walker = _Walker(graph, params)
    for node in graph.nodes:
        walker.visit(node)
    return dict(walker.tracked)


class _Walker:
    """One pass over the nodes: tracks split dimensions and classifies first uses."""

    def __init__(self, graph: OpGraph, params: Sequence[int]):
        self.graph = graph
        self.tracked: dict[int, Tracked] = {}
        self.images: dict[int, _Image] = {
            p: _Image(p, tuple(range(len(graph.vars[p].shape)))) for p in params
        }
        self.placements: dict[int, Placement] = {}
        self.paired: set[int] = set()

    def track(self, v: int) -> Tracked:
        return self.tracked.get(v) or (frozenset(),) * len(self.graph.vars[v].shape)

    def visit(self, node: Node) -> None:
        images = [(i, self.images[v]) for i, v in enumerate(node.inputs) if v in self.images]
        fresh = [(i, im) for i, im in images if im.param not in self.placements]
        if fresh and node.primitive in LAYOUT_PRIMITIVES and len(node.outputs) == 1:
            i, image = fresh[0]
            dims = _layout_dims(node, self.graph, image.dims, i)
            if dims is not None:
                self.images[node.outputs[0]] = _Image(image.param, dims)
                return
        out_tracked = [self._propagate(node)] if len(node.outputs) == 1 else None
        for i, image in fresh:
            if image.param in self.placements:
                continue  # two images of one parameter in one node
            placement, column_dim = self._classify(node, i, image, images)
            self.placements[image.param] = placement
            if column_dim is not None and out_tracked is not None:
                dims = list(out_tracked[0])
                dims[column_dim] = dims[column_dim] | {image.param}
                out_tracked[0] = tuple(dims)
        if out_tracked is not None:
            self._set(node.outputs[0], out_tracked[0])
        else:
            self._propagate_multi(node)

    def _set(self, v: int, tracked: Tracked) -> None:
        if any(tracked):
            self.tracked[v] = tracked

    # ---- classification of a parameter's first use ------------------------------------

    def _classify(self, node: Node, i: int, image: _Image, images) -> tuple[Placement, int | None]:
        """The placement of `image.param` used as operand `i` of `node`, and the result
        dimension it splits (column-parallel weights) or None."""
        prim = node.primitive
        if prim == "dot_general":
            if len(images) > 1:
                return Placement(Kind.UNPLACED, reason="its first use multiplies it with "
                                 "another parameter"), None
            return self._classify_dot(node, i, image)
        if prim == "gather" and i == 0:
            index_map = node.params["dimension_numbers"].start_index_map
            if len(index_map) == 1 and image.dims[index_map[0]] is not None:
                dim = image.dims[index_map[0]]
                return Placement(Kind.VOCAB, model_dim=dim, reason="looked up by a gather "
                                 "(vocabulary-parallel embedding)"), None
            return Placement(Kind.UNPLACED, reason="its first use is a gather over "
                             f"{len(index_map)} dimensions"), None
        if _aligned(node, self.graph):
            return self._classify_elementwise(node, i, image), None
        return Placement(Kind.UNPLACED, reason=f"its first use is '{prim}', which "
                         "Megatron-style tensor parallelism has no rule for"), None

    def _classify_dot(self, node: Node, i: int, image: _Image) -> tuple[Placement, int | None]:
        (contract_l, contract_r), (batch_l, batch_r) = node.params["dimension_numbers"]
        contract = (contract_l, contract_r)
        batch = (batch_l, batch_r)
        act = node.inputs[1 - i]
        w_contract, a_contract = contract[i], contract[1 - i]
        w_batch = batch[i]
        w_rank = len(self.graph.vars[node.inputs[i]].shape)
        w_free = [d for d in range(w_rank) if d not in w_contract and d not in w_batch]
        expert_dim = image.dims[w_batch[0]] if w_batch else None
        act_tracked = self.track(act)
        for wd, ad in zip(w_contract, a_contract):
            if act_tracked[ad] and image.dims[wd] is not None:
                self.paired |= act_tracked[ad]
                return Placement(Kind.ROW, model_dim=image.dims[wd], expert_dim=expert_dim,
                                 reason="contracts a column-parallel split",
                                 sources=act_tracked[ad]), None
        free = [d for d in w_free if image.dims[d] is not None]
        if not free:
            return Placement(Kind.REPLICATED, expert_dim=expert_dim,
                             reason="a dot product leaves it no free dimension"), None
        # Result dims of dot_general: batch, lhs free, rhs free.
        a_rank = len(self.graph.vars[act].shape)
        a_free = a_rank - len(a_contract) - len(batch[1 - i])
        offset = len(w_batch) + (a_free if i == 1 else 0)
        out_dim = offset + w_free.index(free[0])
        return Placement(Kind.COLUMN, model_dim=image.dims[free[0]], expert_dim=expert_dim,
                         reason="multiplies an unsplit activation"), out_dim

    def _classify_elementwise(self, node: Node, i: int, image: _Image) -> Placement:
        out_rank = len(self.graph.vars[node.outputs[0]].shape)
        for d, param_dim in enumerate(image.dims):
            if param_dim is None or d >= out_rank:
                continue
            sources = frozenset().union(
                *(self.track(v)[d] for j, v in enumerate(node.inputs)
                  if j != i and len(self.graph.vars[v].shape) == out_rank)
            )
            if sources:
                return Placement(Kind.BIAS, model_dim=param_dim, sources=sources,
                                 reason="added to a column-parallel split")
        return Placement(Kind.REPLICATED, reason="used elementwise on unsplit activations")

    # ---- propagation of tracked dimensions ---------------------------------------------

    def _propagate(self, node: Node) -> Tracked:
        """What the single result of `node` carries."""
        g = self.graph
        prim = node.primitive
        out_rank = len(g.vars[node.outputs[0]].shape)
        empty: Tracked = (frozenset(),) * out_rank
        if prim in OPAQUE_PRIMITIVES or not node.inputs:
            return empty
        if prim == "dot_general":
            return _dot_tracked(node, [self.track(v) for v in node.inputs])
        first = self.track(node.inputs[0])
        if prim == "broadcast_in_dim":
            out = [frozenset()] * out_rank
            for j, d in enumerate(node.params["broadcast_dimensions"]):
                out[d] = first[j]
            return tuple(out)
        if prim == "transpose":
            return tuple(first[p] for p in node.params["permutation"])
        if prim == "reshape":
            shape_in = g.vars[node.inputs[0]].shape
            shape_out = g.vars[node.outputs[0]].shape
            if node.params.get("dimensions") is not None:
                return empty
            return _reshape_tracked(first, shape_in, shape_out)
        if prim == "squeeze":
            dropped = set(node.params["dimensions"])
            return tuple(t for d, t in enumerate(first) if d not in dropped)
        if REDUCTION_PARAM in node.params and len(first) == out_rank + len(
            node.params[REDUCTION_PARAM]
        ):
            dropped = set(node.params[REDUCTION_PARAM])
            return tuple(t for d, t in enumerate(first) if d not in dropped)
        if _aligned(node, g):
            return _union_aligned(node, g, self.track)
        return empty

    def _propagate_multi(self, node: Node) -> None:
        """Identity markers and aligned multi-result ops (e.g. a sort of several keys)."""
        g = self.graph
        if len(node.inputs) == len(node.outputs) and all(
            g.vars[a].shape == g.vars[b].shape for a, b in zip(node.inputs, node.outputs)
        ):
            for a, b in zip(node.inputs, node.outputs):
                if a in self.tracked:
                    self.tracked[b] = self.tracked[a]


def _aligned(node: Node, graph: OpGraph) -> bool:
    """Whether operands and results line up dimension by dimension."""
    if node.primitive in OPAQUE_PRIMITIVES or node.primitive == "dot_general":
        return False
    out_shapes = [graph.vars[v].shape for v in node.outputs]
    rank = len(out_shapes[0]) if out_shapes else 0
    if any(len(s) != rank for s in out_shapes):
        return False
    shapes = [graph.vars[v].shape for v in node.inputs if graph.vars[v].shape]
    if any(len(s) != rank for s in shapes):
        return False
    if node.primitive in POSITIONAL_PRIMITIVES:
        return True
    # Elementwise: every dimension matches the result or broadcasts (size 1).
    return all(a in (b, 1) for s in shapes for a, b in zip(s, out_shapes[0]))


def _union_aligned(node: Node, graph: OpGraph, track) -> Tracked:
    rank = len(graph.vars[node.outputs[0]].shape)
    out = [frozenset()] * rank
    for v in node.inputs:
        if len(graph.vars[v].shape) == rank:
            out = [a | b for a, b in zip(out, track(v))]
    return tuple(out)


def _dot_tracked(node: Node, tracked: Sequence[Tracked]) -> Tracked:
    """Result dims of dot_general: batch (both sides), lhs free, rhs free."""
    (contract_l, contract_r), (batch_l, batch_r) = node.params["dimension_numbers"]
    lhs, rhs = tracked
    out = [lhs[a] | rhs[b] for a, b in zip(batch_l, batch_r)]
    out += [t for d, t in enumerate(lhs) if d not in contract_l and d not in batch_l]
    out += [t for d, t in enumerate(rhs) if d not in contract_r and d not in batch_r]
    return tuple(out)


def reshape_groups(
    shape_in: Sequence[int], shape_out: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Groups of input and output dims of a reshape whose sizes multiply to the same value.

    **Example:** ``(8, 16, 192) -> (8, 16, 3, 4, 16)`` gives ``[([0], [0]), ([1], [1]),
    ([2], [2, 3, 4])]``.
    """
    groups = []
    i = j = 0
    while i < len(shape_in) or j < len(shape_out):
        group_in, group_out = [], []
        size_in = size_out = 1
        while True:
            if size_in <= size_out and i < len(shape_in):
                size_in *= shape_in[i]
                group_in.append(i)
                i += 1
            elif j < len(shape_out):
                size_out *= shape_out[j]
                group_out.append(j)
                j += 1
            else:
                break
            if size_in == size_out and group_in and group_out:
                # Take trailing size-1 output dims into this group.
                while j < len(shape_out) and shape_out[j] == 1 and i == len(shape_in):
                    group_out.append(j)
                    j += 1
                break
        groups.append((group_in, group_out))
    return groups


def _reshape_tracked(tracked: Tracked, shape_in, shape_out) -> Tracked:
    out = [frozenset()] * len(shape_out)
    for group_in, group_out in reshape_groups(shape_in, shape_out):
        carried = frozenset().union(*(tracked[d] for d in group_in))
        for d in group_out:
            if shape_out[d] > 1:
                out[d] = carried
    return tuple(out)


def _layout_dims(node: Node, graph: OpGraph, dims, i: int) -> tuple[int | None, ...] | None:
    """Parameter dims of a layout op's result, or None if the op mixes dimensions."""
    prim = node.primitive
    if i != 0:
        return None
    if prim in ("convert_element_type", "copy", "copy_p", "slice"):
        return tuple(dims)
    if prim == "transpose":
        return tuple(dims[p] for p in node.params["permutation"])
    if prim == "broadcast_in_dim":
        out = [None] * len(graph.vars[node.outputs[0]].shape)
        for j, d in enumerate(node.params["broadcast_dimensions"]):
            out[d] = dims[j]
        return tuple(out)
    if prim == "squeeze":
        dropped = set(node.params["dimensions"])
        return tuple(d for k, d in enumerate(dims) if k not in dropped)
    if prim == "reshape" and node.params.get("dimensions") is None:
        shape_in = graph.vars[node.inputs[0]].shape
        shape_out = graph.vars[node.outputs[0]].shape
        out = [None] * len(shape_out)
        for group_in, group_out in reshape_groups(shape_in, shape_out):
            real_in = [d for d in group_in if shape_in[d] > 1]
            real_out = [d for d in group_out if shape_out[d] > 1]
            if len(real_in) > 1 or len(real_out) > 1:
                return None  # merges or splits parameter dims: no longer one weight dim
            if real_in and real_out:
                out[real_out[0]] = dims[real_in[0]]
        return tuple(out)
    return None


def _demote_unpaired(
    graph: OpGraph, placements: dict[int, Placement], paired: set[int]
) -> dict[int, Placement]:
    """Column weights no row weight consumes: narrow ones (routers) become replicated."""
    demoted = set()
    for p, placement in placements.items():
        if placement.kind is not Kind.COLUMN or p in paired:
            continue
        shape = graph.vars[p].shape
        out_size = shape[placement.model_dim]
        in_size = math.prod(
            s for d, s in enumerate(shape) if d not in (placement.model_dim, placement.expert_dim)
        )
        if out_size < in_size:
            demoted.add(p)
            placements[p] = replace(
                placement, kind=Kind.REPLICATED, model_dim=None,
                reason="its output is narrower than its input and no row-parallel weight "
                "consumes it (a router or gate)",
            )
        else:
            placements[p] = replace(
                placement, reason="an output layer (no row-parallel weight consumes it): "
                "vocabulary-parallel logits"
            )
    for p, placement in placements.items():
        if placement.kind is Kind.BIAS and placement.sources <= demoted:
            placements[p] = replace(placement, kind=Kind.REPLICATED, model_dim=None,
                                    reason="bias of a replicated weight")
    return placements
