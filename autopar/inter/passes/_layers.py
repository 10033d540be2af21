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

from autopar._memo import per_graph
from autopar.graph import OpGraph
from autopar.graph._collector import collector_paused

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


@per_graph("inter.layer_assignments", "graph -> its LayerAssignment")
@collector_paused()  # see `autopar.graph._collector`
def assign_layers(graph: OpGraph) -> LayerAssignment:
    """Layers from the marks in program order (see the module docstring).

    Once per graph: the Megatron grid prices every configuration of one microbatch count
    on the same traced graph, and `autopar space`'s search plans on the grid's traces
    (`gpt-1.3B` on 2 hosts: 91 calls on 4 graphs took a ninth of the profiled run). A
    `LayerAssignment` is frozen; its users only read it."""
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
    _place_with_consumers(graph, layer, phase)
    _place_with_producers(graph, boundary, layer, phase)
    _sum_shared_gradients_once(graph, boundary, layer, phase)
    return LayerAssignment(num_marks + 1, tuple(layer), tuple(phase), boundary)


def _place_with_consumers(graph: OpGraph, layer: list, phase: list) -> None:
    """Move forward work on the step's inputs alone to the first layer that reads it.

    Program order puts work that reads only the step's inputs (parameters, the batch,
    constants) wherever the program wrote it: a mixed-precision step casts every
    parameter to its compute dtype before the first layer (``params = tree_map(astype,
    params)``), so by program order all those casts belong to layer 0, and every later
    layer would receive its weights from the first stage once per microbatch. Such work
    belongs with its earliest reader (Megatron keeps each stage's bf16 weights on that
    stage), so it runs there and nothing crosses stages. Nodes are visited in reverse
    program order, so a chain of such nodes moves together.
    """
    producer = {v: n for n in graph.nodes for v in n.outputs}
    consumers: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            consumers.setdefault(v, []).append(node.id)
    outputs = set(graph.outvars)
    inputs_only: set[int] = set()  # nodes computed from the step's inputs alone
    for node in graph.nodes:
        if node.primitive in ("layer_boundary", "grad_boundary"):
            continue
        if all(producer.get(v) is None or producer[v].id in inputs_only for v in node.inputs):
            inputs_only.add(node.id)
    for node in reversed(graph.nodes):
        if node.id not in inputs_only or phase[node.id] != "forward":
            continue
        if any(v in outputs for v in node.outputs):
            continue
        readers = [c for v in node.outputs for c in consumers.get(v, [])]
        if not readers or any(layer[c] is None for c in readers):
            continue
        first = min(layer[c] for c in readers)
        if first > layer[node.id]:
            layer[node.id] = first


# Operations that change a gradient's dtype or layout only: the tail a mixed-precision
# backward adds between a weight's gradient and the grad boundary.
GRADIENT_TAIL = frozenset(
    {"convert_element_type", "reshape", "transpose", "copy", "squeeze", "expand_dims"}
)


def _place_with_producers(graph: OpGraph, boundary: int, layer: list, phase: list) -> None:
    """Move the last steps of a gradient to the layer whose backward computes it.

    The backward of a mixed-precision step casts each weight's gradient back to the
    master dtype after the whole backward pass (the transpose of the forward's cast), so
    by program order it lands in layer 0, and every layer's gradient would travel to the
    first stage once per microbatch and miss the once-per-step deferred reduction
    (`autopar.inter.passes._deferred`). A cast or layout change (`GRADIENT_TAIL`) whose
    results go only to the grad boundary as gradients (or to other such nodes), and
    whose array operands all come from one layer and phase, joins that layer and phase.
    """
    producer = {v: n for n in graph.nodes for v in n.outputs}
    consumers: dict[int, set[int]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            consumers.setdefault(v, set()).add(node.id)
    outputs = set(graph.outvars)
    losses = set(graph.nodes[boundary].inputs[:1])  # the loss value, not a gradient
    tail: set[int] = set()  # nodes whose results reach the grad boundary only as gradients
    for node in reversed(graph.nodes[:boundary]):
        if node.primitive not in GRADIENT_TAIL:
            continue
        readers = set().union(*(consumers.get(v, set()) for v in node.outputs))
        if (readers and readers <= tail | {boundary}
                and not any(v in outputs or v in losses for v in node.outputs)):
            tail.add(node.id)
    for node in graph.nodes[:boundary]:
        if node.id not in tail or phase[node.id] not in ("forward", "backward"):
            continue
        sources = {
            (layer[producer[v].id], phase[producer[v].id])
            for v in node.inputs if v in producer
        }
        if len(sources) != 1:
            continue
        (k, p), = sources
        if k is not None and p in ("forward", "backward"):
            layer[node.id], phase[node.id] = k, p


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
        # A mixed-precision step casts the joined gradient to the master dtype after the
        # sum (``convert(add_any(head, lookup))``): the cast (`GRADIENT_TAIL`) moves with it.
        tail = []
        while (node is not None and node.primitive in GRADIENT_TAIL and len(node.inputs) == 1
               and readers.get(node.outputs[0]) == 1):
            tail.append(node)
            node = producer.get(node.inputs[0])
        if (node is None or node.primitive != "add_any"
                or readers.get(node.outputs[0]) != 1):
            continue
        parts = [producer.get(v) for v in node.inputs]
        if any(p is None or readers.get(v) != 1 for p, v in zip(parts, node.inputs)):
            continue
        if len({layer[p.id] for p in parts}) > 1:
            for moved in (node, *tail):
                layer[moved.id] = None
                phase[moved.id] = "apply"


def accumulated_values(graph: OpGraph, layers: LayerAssignment) -> tuple[int, ...]:
    """The values summed over microbatches: the grad boundary's operands, or, for a
    gradient whose sum across layers runs in the update, that sum's operands."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    found: dict[int, None] = {}
    for g in graph.nodes[layers.grad_boundary].inputs:
        node = producer.get(g)
        while (node is not None and layers.phase[node.id] == "apply"
               and node.primitive in GRADIENT_TAIL):  # the cast after a moved sum
            node = producer.get(node.inputs[0])
        if node is not None and layers.phase[node.id] == "apply":
            found.update(dict.fromkeys(node.inputs))
        else:
            found.setdefault(g)
    return tuple(found)
