"""What cutting a train step into stages needs of the whole graph, computed once per graph.

In: the step's `OpGraph` and its `LayerAssignment`. Out: a `Skeleton`: the facts
`partition` reads that no stage split changes (the grad boundary's aliases, the
accumulated gradients, the deferrable ones, every node's operands with the aliases
applied, which values are constants, readers and first readers) and, for every node,
the layer whose stage runs it (`Skeleton.place`).

`place` is the stage assignment of `_partition._assign_update_nodes` run once on layers
instead of stages: a node of a layer is placed by that layer, an optimizer-update node by
the layer of the gradient its group holds (or of the first reader, or the least of its
consumers' or operands' layers), ``-1`` where the rule falls back to the first stage. For
stages holding ordered, disjoint layer ranges the layer -> stage map keeps order, so the
least layer's stage is the least stage, and mapping `place` through it gives the stage
the per-split rule gives (`partition` checks the order; tests compare the two). The
stage-count rows of the explored space (`autopar.space`) cut the same step about 30
ways: each cut now only maps and slices.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from autopar._memo import declare
from autopar.graph import OpGraph, Role
from autopar.inter.passes._deferred import Deferrable, deferrable_gradients
from autopar.inter.passes._layers import LayerAssignment, accumulated_values

FIRST_STAGE = -1  # `Skeleton.place` of a node the rule puts on stage 0 whatever the split


@dataclass(frozen=True, eq=False)
class Skeleton:
    """The split-independent facts of (graph, layers); read, never changed."""

    boundary: int  # the grad boundary's node id
    alias: dict[int, int]  # grad boundary result -> operand
    grad_vars: tuple[int, ...]  # `accumulated_values`
    deferrable: Deferrable
    place: tuple[int | None, ...]  # per node: its stage's layer, FIRST_STAGE, or None
    inputs: tuple[tuple[int, ...], ...]  # per node: operands, aliases applied
    array: tuple[bool, ...]  # per var: not a constant (an operand a segment receives)
    # Per var: whether every segment producing it hands it out (a step result or a
    # gradient the boundary aliases), and the nodes that read it (aliases applied),
    # placed ones only, one per (place, phase).
    always_out: frozenset[int]
    readers: dict[int, tuple[int, ...]]
    apply: tuple[int, ...]  # update nodes, program order
    users: dict[int, tuple[int, ...]]  # var -> every node reading it (aliases applied)
    outvars: frozenset[int]  # the step's results, aliases applied
    first_readers: tuple[tuple[int, int], ...]  # (graph input, first placed non-boundary reader)


def skeleton(graph: OpGraph, layers: LayerAssignment) -> Skeleton:
    """The `Skeleton` of (graph, layers), memoised per graph."""
    held = _SKELETONS.setdefault(graph, {})
    if layers not in held:
        if len(held) >= SKELETONS_PER_GRAPH:
            held.pop(next(iter(held)))
        held[layers] = _skeleton(graph, layers)
    return held[layers]


_SKELETONS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "inter.partition_skeletons",
    "graph -> {layers: Skeleton}")
SKELETONS_PER_GRAPH = 4


def _skeleton(graph: OpGraph, layers: LayerAssignment) -> Skeleton:
    from autopar.inter.passes._partition import _assign_update_nodes  # its rule, on layers

    boundary = graph.nodes[layers.grad_boundary]
    alias = dict(zip(boundary.outputs, boundary.inputs))
    place: list[int | None] = [
        None if n.id == boundary.id else layers.layer[n.id] for n in graph.nodes]
    _assign_update_nodes(graph, layers, place, alias, default=FIRST_STAGE)
    for n in graph.nodes:
        if layers.phase[n.id] == "dead":
            place[n.id] = None
    inputs = tuple(tuple(alias.get(v, v) for v in n.inputs) for n in graph.nodes)
    array = tuple(var.role is not Role.CONST for var in graph.vars)

    outvars = frozenset(alias.get(v, v) for v in graph.outvars)
    readers: dict[int, dict[tuple, int]] = {}
    users: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    invars = set(graph.invars)
    for node in graph.nodes:
        for v in inputs[node.id]:
            users.setdefault(v, []).append(node.id)
        if place[node.id] is None:
            continue
        for v in inputs[node.id]:
            readers.setdefault(v, {}).setdefault(
                (place[node.id], layers.phase[node.id]), node.id)
        if node.primitive != "grad_boundary":
            for v in node.inputs:
                if v in invars and array[v]:
                    first.setdefault(v, node.id)
    return Skeleton(
        boundary=boundary.id, alias=alias, grad_vars=accumulated_values(graph, layers),
        deferrable=deferrable_gradients(graph, layers), place=tuple(place), inputs=inputs,
        array=array, always_out=outvars | frozenset(alias.values()),
        readers={v: tuple(r.values()) for v, r in readers.items()},
        apply=tuple(n.id for n in graph.nodes if layers.phase[n.id] == "apply"),
        users={v: tuple(u) for v, u in users.items()}, outvars=outvars,
        first_readers=tuple(first.items()),
    )
