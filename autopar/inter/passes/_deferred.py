"""Gradients reduced once per step, not once per microbatch.

With data parallelism a weight gradient is a sum over the batch: each device computes a
partial sum over its own rows, and the partial sums are then reduced across the devices
that hold the other rows. A pipeline with B microbatches that reduced inside every
microbatch's backward pass would issue that collective B times per step. Alpa and
Megatron-LM accumulate the unreduced partial sums over the microbatches and reduce once,
before the optimizer update; autopar does the same:

- `deferrable_gradients` finds, from the graph alone, the gradients whose last steps are a
  partial-sum producer (`dot_general` or `reduce_sum`) followed only by linear operations
  (transpose, reshape, convert, add) inside one layer's segment;
- `step_weights` tells the intra-op ILP to charge those producers' reductions, and the
  optimizer update, once per step rather than once per microbatch;
- `stacked_layout` reads from a stage's plan over which mesh axes each such value's partial
  sums run. The runtime keeps those values as a stack of per-device partial sums (a new
  leading dimension split over those axes, so each device holds exactly its own partial
  sum, and adding microbatches needs no communication) and reduces the stack at the start
  of the update (`autopar.lower.lower_segment`'s `stacked`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autopar.cluster import Spec, replicated
from autopar.cost import hideable_weight
from autopar.graph import OpGraph, Role
from autopar.graph._collector import collector_paused
from autopar.inter.passes._layers import LayerAssignment, accumulated_values
from autopar.intra._problem import summed_axes

# Producers whose split contracting or reduced dimensions leave partial sums that can be
# added up later: each device's share of the sum is the operation applied to its shards.
PARTIAL_SUM_PRODUCERS = frozenset({"dot_general", "reduce_sum"})
# Linear operations a stack of partial sums passes through one slice at a time: applying
# them before or after the reduction gives the same result.
LINEAR = frozenset(
    {"transpose", "reshape", "convert_element_type", "copy", "squeeze", "expand_dims", "add_any"}
)


@dataclass(frozen=True)
class Deferrable:
    """Variables (ids shared by the full graph and its stage and layer sub-graphs)."""

    roots: frozenset[int]  # results of partial-sum producers that feed only gradients
    chain: frozenset[int]  # results of linear ops between those and the gradients
    grads: frozenset[int]  # the accumulated gradients they make (`accumulated_values`)

    def __bool__(self) -> bool:
        return bool(self.roots)


NOTHING_DEFERRED = Deferrable(frozenset(), frozenset(), frozenset())


def deferrable_gradients(graph: OpGraph, layers: LayerAssignment) -> Deferrable:
    """The gradients of `graph` whose reduction can wait for the end of the step.

    A gradient qualifies when walking back from it through linear operations reaches only
    partial-sum producers, every value on the way is read by exactly one operation, and all
    of it lies in one layer's backward pass (so in one pipeline stage).
    """
    producer = {v: n for n in graph.nodes for v in n.outputs}
    readers: dict[int, int] = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers[v] = readers.get(v, 0) + 1
    for v in graph.outvars:
        readers[v] = readers.get(v, 0) + 1

    def walk(v: int, place, roots: set, chain: set) -> bool:
        node = producer.get(v)
        if node is None or len(node.outputs) != 1 or readers.get(v) != 1:
            return False
        if (layers.layer[node.id], layers.phase[node.id]) != place:
            return False
        if node.primitive in PARTIAL_SUM_PRODUCERS and not _sums_unit_dims(graph, node):
            roots.add(v)
            return True
        if node.primitive not in LINEAR and not _sums_unit_dims(graph, node):
            return False
        chain.add(v)
        arrays = [u for u in node.inputs if graph.vars[u].role is not Role.CONST]
        return bool(arrays) and all(walk(u, place, roots, chain) for u in arrays)

    roots: set[int] = set()
    chain: set[int] = set()
    grads: set[int] = set()
    for g in accumulated_values(graph, layers):
        node = producer.get(g)
        if node is None or not graph.vars[g].shape:
            continue
        r: set[int] = set()
        c: set[int] = set()
        place = (layers.layer[node.id], layers.phase[node.id])
        if place[1] in ("forward", "backward") and walk(g, place, r, c):
            roots |= r
            chain |= c
            grads.add(g)
    return Deferrable(frozenset(roots), frozenset(chain), frozenset(grads))


def _sums_unit_dims(graph: OpGraph, node) -> bool:
    """A `reduce_sum` over dimensions of size 1 only: a reshape, linear, no partial sum.

    JAX's gradient of a bias broadcast as ``(h,) -> (1, 1, h) -> (b, s, h)`` is two sums:
    over (b, s) into (h,), reshaped to (1, 1, h), then over the two unit dimensions. The
    walk passes through the second, so the first (the one that sums over the batch, whose
    partial sums the data axes hold) is the deferred root, reduced once per step like
    every other weight gradient (it was charged once per microbatch)."""
    if node.primitive != "reduce_sum" or len(node.inputs) != 1:
        return False
    shape = graph.vars[node.inputs[0]].shape
    return all(shape[d] == 1 for d in node.params.get("axes", ()))


@collector_paused()  # see `autopar.graph._collector`
def step_weights(
    graph: OpGraph,
    phases: Mapping[int, str],
    deferrable: Deferrable,
    num_microbatches: int,
    overlap: float = 0.0,
) -> dict[int, tuple[float, ...]]:
    """ILP cost weights of a stage or layer sub-graph, per microbatch of the pipeline.

    **Arguments:**
    - `phases`: node id of `graph` -> "forward", "backward" or "apply".
    - `deferrable`: from `deferrable_gradients` on the full graph.

    **Returns:** node id -> (weight of its whole cost and its operands' resharding, weight of
    its own reduction collectives[, share of their time exposed]), for the nodes whose
    weights are not (1, 1): the update runs once per step, and a deferred reduction
    happens once per step, under the backward: `overlap` (`Cluster.overlap`) of its time is
    hidden (`autopar.cost.hideable_weight`; its count stays whole).
    """
    exposed = hideable_weight(overlap)
    once = 1.0 / num_microbatches
    weights = {}
    for node in graph.nodes:
        if phases[node.id] == "apply":
            weights[node.id] = (once, 1.0)
        elif any(v in deferrable.roots for v in node.outputs):
            weights[node.id] = (1.0, once) if exposed == 1 else (1.0, once, exposed)
    return weights


def gradient_roots(graph: OpGraph, deferrable: Deferrable) -> dict[int, tuple[int, ...]]:
    """Deferrable gradient produced in `graph` -> the partial-sum results it is made of
    (walking back through `deferrable.chain`)."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    roots = {}
    for g in deferrable.grads:
        if g not in producer:
            continue
        found, stack = [], [g]
        while stack:
            v = stack.pop()
            if v in deferrable.roots:
                found.append(v)
            elif v in deferrable.chain and v in producer:
                stack += [u for u in producer[v].inputs if graph.vars[u].role is not Role.CONST]
        if found:
            roots[g] = tuple(sorted(set(found)))
    return roots


def operand_spec(graph: OpGraph, plan, node_id: int, index: int) -> Spec:
    """The spec `plan` has node `node_id` take its operand `index` in."""
    for n, p, spec in plan.operand_specs:
        if n == node_id and p == index:
            return spec
    v = graph.nodes[node_id].inputs[index]
    return plan.var_specs[v] or replicated(len(graph.vars[v].shape))


def stacked_layout(graph: OpGraph, plan, deferrable: Deferrable) -> dict[int, tuple[str, ...]]:
    """Variable -> the mesh axes its stack of partial sums runs over, for every value of
    `graph` (a stage sub-graph planned by `plan`) kept unreduced until the update.

    A producer's partial axes are the mesh axes its plan splits the summed dimensions
    over; a linear op keeps a stack when all its operands are stacks over the same axes
    (otherwise the runtime reduces them first and the op runs as planned).
    """
    if not deferrable:
        return {}
    operand_specs = {(n, p): s for n, p, s in plan.operand_specs}
    axis_order = {a: i for i, a in enumerate(plan.mesh.axis_names)}
    stacked: dict[int, tuple[str, ...]] = {}

    def spec_of(node, p):
        v = node.inputs[p]
        return operand_specs.get((node.id, p)) or plan.var_specs[v] or replicated(
            len(graph.vars[v].shape)
        )

    for node in graph.nodes:
        out = node.outputs[0] if len(node.outputs) == 1 else None
        if out in deferrable.roots:
            axes = summed_axes(node, spec_of)
            if axes:
                stacked[out] = tuple(sorted(axes, key=axis_order.__getitem__))
        elif out in deferrable.chain:
            arrays = [v for v in node.inputs if graph.vars[v].role is not Role.CONST]
            found = {stacked.get(v) for v in arrays}
            if len(found) == 1 and None not in found:
                stacked[out] = found.pop()
    return stacked
