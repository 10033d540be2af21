"""Layers of a differentiated train step, found from `layer_boundary` marks.

A train step traced at microbatch size holds, in program order: the forward pass (with one
`layer_boundary` per marked layer edge), the backward pass (JAX transposes each mark into a
mark on the cotangent, in reverse order), one `grad_boundary` (from `autopar.value_and_grad`),
then the optimizer update. With M marks there are M + 1 layers: layer k's forward runs up
to forward mark k, the last layer (the "head", e.g. final norm, logits and loss) runs from
the last forward mark to the first backward mark, and layer k's backward runs from
backward mark k to backward mark k - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autopar.graph import OpGraph

Phase = Literal["forward", "backward", "apply", "dead"]


@dataclass(frozen=True)
class LayerAssignment:
    """Which layer and phase every node belongs to.

    `layer[n]` is None for the optimizer update ("apply" phase) nodes.
    """

    num_layers: int
    layer: tuple[int | None, ...]
    phase: tuple[Phase, ...]
    grad_boundary: int  # node id of the grad boundary


def find_grad_boundary(graph: OpGraph) -> int:
    ids = [n.id for n in graph.nodes if n.primitive == "grad_boundary"]
    if len(ids) != 1:
        raise ValueError(
            f"pipeline planning needs exactly one autopar.value_and_grad (or autopar.grad) "
            f"call in the train step, found {len(ids)}: compute the loss gradient with "
            "`loss, grads = autopar.value_and_grad(loss_fn)(params, batch)`"
        )
    return ids[0]


def gradient_nodes(graph: OpGraph, boundary: int) -> set[int]:
    """The grad boundary and every node it depends on: the per-microbatch work."""
    return ancestors(graph, [boundary])


def ancestors(graph: OpGraph, roots) -> set[int]:
    """The nodes `roots` and every node they depend on."""
    producer = {v: n.id for n in graph.nodes for v in n.outputs}
    needed = set(roots)
    stack = list(roots)
    while stack:
        node = graph.nodes[stack.pop()]
        for v in node.inputs:
            p = producer.get(v)
            if p is not None and p not in needed:
                needed.add(p)
                stack.append(p)
    return needed


def assign_layers(graph: OpGraph) -> LayerAssignment:
    """Layers from the marks in program order (see the module docstring)."""
    boundary = find_grad_boundary(graph)
    grad_nodes = gradient_nodes(graph, boundary)
    marks = [n.id for n in graph.nodes if n.primitive == "layer_boundary" and n.id in grad_nodes]
    if len(marks) % 2:
        raise ValueError(
            f"found {len(marks)} layer_boundary marks in the gradient computation; each mark "
            "must sit on a differentiated value (its backward mark is missing). Mark the "
            "activations between layers, not constants or integer values."
        )
    num_marks = len(marks) // 2
    forward_marks, backward_marks = marks[:num_marks], marks[num_marks:]
    producer = {v: n.id for n in graph.nodes for v in n.outputs}
    live = ancestors(graph, [producer[v] for v in graph.outvars if v in producer]) | grad_nodes
    layer: list[int | None] = []
    phase: list[Phase] = []
    for node in graph.nodes:
        if node.id not in live:
            layer.append(None)
            phase.append("dead")  # computed by the trace, used by nothing
            continue
        if node.id not in grad_nodes:
            layer.append(None)
            phase.append("apply")
            continue
        k_fwd = sum(1 for m in forward_marks if m < node.id)
        if k_fwd < num_marks or (num_marks and node.id == forward_marks[-1]):
            layer.append(min(k_fwd, num_marks))
            phase.append("forward")
            continue
        k_bwd = sum(1 for m in backward_marks if m <= node.id)
        if k_bwd == 0:
            layer.append(num_marks)  # the head: forward and backward together
            phase.append("forward")
        else:
            layer.append(num_marks - k_bwd)
            phase.append("backward")
    _sum_shared_gradients_once(graph, boundary, layer, phase)
    return LayerAssignment(num_marks + 1, tuple(layer), tuple(phase), boundary)


def _sum_shared_gradients_once(graph: OpGraph, boundary: int, layer: list, phase: list) -> None:
    """Move to the update the sums that join a shared weight's gradient across layers.

    A weight used by two layers (tied input and output embeddings) gets one gradient
    contribution from each, added by an `add_any`. Sums are linear, so each contribution
    can be accumulated over the microbatches by the layer (and stage) computing it, and
    added once per step, as Megatron-LM does with its embedding group. Otherwise the later
    layer's contribution would travel to the earlier stage once per microbatch.
    """
    producer = {v: n for n in graph.nodes for v in n.outputs}
    readers: dict[int, int] = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers[v] = readers.get(v, 0) + 1
    for g in dict.fromkeys(graph.nodes[boundary].inputs):
        node = producer.get(g)
        if node is None or node.primitive != "add_any" or readers.get(g) != 1:
            continue
        parts = [producer.get(v) for v in node.inputs]
        if any(p is None or readers.get(v) != 1 for p, v in zip(parts, node.inputs)):
            continue
        if len({layer[p.id] for p in parts}) > 1:
            layer[node.id] = None
            phase[node.id] = "apply"


def accumulated_values(graph: OpGraph, layers: LayerAssignment) -> tuple[int, ...]:
    """The values summed over microbatches: the grad boundary's operands, or, for a
    gradient whose sum across layers runs in the update, that sum's operands."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    found: dict[int, None] = {}
    for g in graph.nodes[layers.grad_boundary].inputs:
        node = producer.get(g)
        if node is not None and layers.phase[node.id] == "apply":
            found.update(dict.fromkeys(node.inputs))
        else:
            found.setdefault(g)
    return tuple(found)
