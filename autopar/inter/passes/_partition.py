"""Cut a differentiated train step into pipeline stages.

In: the step's `OpGraph` (traced at microbatch size), its `LayerAssignment`, and the layer
range of every stage. Out: a `Partition`: for each stage a sub-graph (the stage's forward,
backward and optimizer-update nodes, renumbered, sharing the full graph's variables) and
the segments the runtime runs: per microbatch a forward and a backward segment per stage,
then, once per step, update fragments.

The grad boundary is not run: its results alias its operands (the accumulated gradients).
Each optimizer-update node runs on the stage that owns the parameter it updates: nodes
joined by non-scalar values form groups, and a group belongs to the stage that computes
the gradient in it. Scalar-only update nodes run on the stage of their first consumer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from autopar._memo import declare
from autopar.cost import MATMUL_PRIMITIVES, compute_time
from autopar.graph import Node, OpGraph, Role
from autopar.graph._collector import collector_paused
from autopar.inter.passes._deferred import NOTHING_DEFERRED, Deferrable
from autopar.inter.passes._layers import LayerAssignment
from autopar.inter.passes._partition_skeleton import FIRST_STAGE, Skeleton, skeleton


@dataclass(frozen=True)
class Segment:
    """Nodes of one stage run together: `phase` is "forward", "backward" or "apply"."""

    stage: int
    phase: str
    nodes: tuple[int, ...]  # node ids in the stage sub-graph
    inputs: tuple[int, ...]  # var ids read from outside the segment
    outputs: tuple[int, ...]  # var ids needed outside the segment
    round: int = 0  # apply fragments: execution round (rounds run in order)


@dataclass
class Partition:
    num_stages: int
    stage_graphs: list[OpGraph]
    node_stage: list[int | None]  # per full-graph node; None for the grad boundary
    alias: dict[int, int]  # grad boundary result -> operand
    grad_vars: tuple[int, ...]  # accumulated over microbatches (`accumulated_values`)
    forward: list[Segment]
    backward: list[Segment]
    apply: list[Segment]  # in execution order
    home: dict[int, int] = field(default_factory=dict)  # graph input var -> stage holding it
    node_index: list[dict[int, int]] = field(default_factory=list)  # full id -> stage sub id
    deferrable: Deferrable = NOTHING_DEFERRED  # gradients reduced once per step

    def resolve(self, v: int) -> int:
        return self.alias.get(v, v)


def partition(
    graph: OpGraph, layers: LayerAssignment, stage_layers: list[tuple[int, int]]
) -> Partition:
    """Split `graph` into stages; `stage_layers[i]` = [start, end) layers of stage i.

    Memoised per graph (the last `PARTITIONS_PER_GRAPH` splits): the Megatron grid asks for
    the same per-layer and per-stage splits once per configuration, and they took most of
    its time (py-spy of `run_benchmarks.py` on gpt-13B@16: 64% of the grid in `partition`).
    A `Partition` is read, never changed, by its users."""
    key = (layers, tuple((int(a), int(b)) for a, b in stage_layers))
    held = _PARTITIONS.setdefault(graph, {})
    if key not in held:
        if len(held) >= PARTITIONS_PER_GRAPH:
            held.pop(next(iter(held)))
        held[key] = _partition(graph, layers, stage_layers)
    return held[key]


# graph -> {(layers, stage layers): Partition}, oldest first.
_PARTITIONS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "inter.partitions",
    "graph -> {(layers, stage layers): Partition}")
PARTITIONS_PER_GRAPH = 8


@collector_paused()  # see `autopar.graph._collector`
def _partition(graph: OpGraph, layers: LayerAssignment, stage_layers) -> Partition:
    """The split-independent facts come from the graph's `Skeleton` (computed once);
    here they are only mapped to stages and sliced."""
    num_stages = len(stage_layers)
    layer_stage = {}
    for s, (start, end) in enumerate(stage_layers):
        for layer in range(start, end):
            layer_stage[layer] = s
    sk = skeleton(graph, layers)
    if _ordered(stage_layers):
        node_stage: list[int | None] = [
            None if p is None else 0 if p == FIRST_STAGE else layer_stage[p]
            for p in sk.place]
    else:
        node_stage = node_stages_per_split(graph, layers, layer_stage)

    stage_graphs, renumber = _stage_graphs(graph, sk, node_stage, num_stages)
    placed: dict[tuple, list[int]] = {}  # (stage, phase) -> its nodes, in program order
    for n, s in enumerate(node_stage):
        placed.setdefault((s, layers.phase[n]), []).append(n)
    forward, backward = [], []
    for s in range(num_stages):
        for phase, bucket in (("forward", forward), ("backward", backward)):
            nodes = placed.get((s, phase), [])
            bucket.append(_segment(graph, sk, node_stage, layers.phase, s, phase, nodes,
                                   renumber[s]))
    apply = _apply_fragments(graph, sk, node_stage, renumber)
    home = {v: node_stage[n] for v, n in sk.first_readers}
    for v in graph.invars:
        home.setdefault(v, 0)
    return Partition(
        num_stages, stage_graphs, node_stage, dict(sk.alias), sk.grad_vars, forward,
        backward, apply, home, renumber, sk.deferrable,
    )


def _ordered(stage_layers) -> bool:
    """Whether every stage's layers come before the next non-empty stage's (`Skeleton`'s
    condition: the layer -> stage map keeps order)."""
    ranges = [(a, b) for a, b in stage_layers if a < b]
    return all(b <= c for (_, b), (c, _) in zip(ranges, ranges[1:]))


def node_stages_per_split(graph: OpGraph, layers: LayerAssignment, layer_stage: dict
                          ) -> list[int | None]:
    """Every node's stage by the rule applied to this split itself (stages given out of
    layer order; tests compare it with the `Skeleton`'s)."""
    boundary = graph.nodes[layers.grad_boundary]
    alias = dict(zip(boundary.outputs, boundary.inputs))
    node_stage: list[int | None] = [None] * len(graph.nodes)
    for node in graph.nodes:
        if node.id != boundary.id and layers.layer[node.id] is not None:
            node_stage[node.id] = layer_stage[layers.layer[node.id]]
    _assign_update_nodes(graph, layers, node_stage, alias)
    for n in graph.nodes:
        if layers.phase[n.id] == "dead":
            node_stage[n.id] = None
    return node_stage


def _is_array(graph: OpGraph, v: int) -> bool:
    var = graph.vars[v]
    return var.role is not Role.CONST and len(var.shape) > 0


def _assign_update_nodes(graph, layers, node_stage, alias, default: int = 0) -> None:
    """Give each optimizer-update node the stage that computes its gradient (`default`:
    where no rule gives one)."""
    parent: dict[int, int] = {}

    def find(v: int) -> int:
        while parent.get(v, v) != v:
            parent[v] = parent.get(parent[v], parent[v])
            v = parent[v]
        return v

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    producer = {v: n.id for n in graph.nodes for v in n.outputs}
    update = [n for n in graph.nodes if layers.phase[n.id] == "apply"]
    for node in update:
        arrays = [alias.get(v, v) for v in (*node.inputs, *node.outputs) if _is_array(graph, v)]
        for a, b in zip(arrays, arrays[1:]):
            union(a, b)
    owner: dict[int, int] = {}
    for v_in in alias.values():
        p = producer.get(v_in)
        if p is not None and node_stage[p] is not None and _is_array(graph, v_in):
            owner.setdefault(find(v_in), node_stage[p])
    # A group with no gradient (e.g. a parameter only read) goes where its values are used.
    for node in graph.nodes:
        if node_stage[node.id] is None or layers.phase[node.id] == "apply":
            continue
        for v in node.inputs:
            if _is_array(graph, v):
                owner.setdefault(find(v), node_stage[node.id])
    for node in update:
        arrays = [alias.get(v, v) for v in (*node.inputs, *node.outputs) if _is_array(graph, v)]
        if arrays:
            node_stage[node.id] = owner.get(find(arrays[0]))
    # Scalar-only update nodes (and groups owned by nobody): the stage of the first
    # consumer, in reverse program order, else the stage of an input, else stage 0.
    users: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            users.setdefault(v, []).append(node.id)
    for node in reversed(update):
        if node_stage[node.id] is not None:
            continue
        stages = [
            node_stage[u]
            for v in node.outputs
            for u in users.get(v, ())
            if node_stage[u] is not None
        ]
        if not stages:
            stages = [
                _stage_of(alias.get(v, v), producer, node_stage)
                for v in node.inputs
                if _stage_of(alias.get(v, v), producer, node_stage) is not None
            ]
        node_stage[node.id] = min(stages) if stages else default
    assert all(
        s is not None
        for n, s in zip(graph.nodes, node_stage)
        if n.primitive != "grad_boundary" and layers.phase[n.id] != "dead"
    ), "every live node but the grad boundary must have a stage"


def _stage_of(v, producer, node_stage):
    p = producer.get(v)
    return None if p is None else node_stage[p]


def _renumbered(node: Node, new_id: int, inputs: tuple[int, ...]) -> Node:
    """`dataclasses.replace(node, id=new_id, inputs=inputs)` without its per-field checks
    (a frozen `Node` has no `__post_init__`; 5x faster, and a cut makes one per node)."""
    new = object.__new__(Node)
    fields = new.__dict__
    fields.update(node.__dict__)
    fields["id"] = new_id
    fields["inputs"] = inputs
    return new


def _stage_graphs(graph: OpGraph, sk: Skeleton, node_stage, num_stages: int
                  ) -> tuple[list[OpGraph], list[dict[int, int]]]:
    """The sub-graph of each stage (nodes renumbered from 0, variables shared) and each
    one's renumbering, in two passes over the graph rather than two per stage (a split
    into 16 stages walked the graph 32 times)."""
    nodes: list[list[Node]] = [[] for _ in range(num_stages)]
    ids: list[dict[int, int]] = [{} for _ in range(num_stages)]
    produced: list[set[int]] = [set() for _ in range(num_stages)]
    invars: list[dict[int, None]] = [{} for _ in range(num_stages)]
    array = sk.array
    for node in graph.nodes:
        s = node_stage[node.id]
        if s is None or not 0 <= s < num_stages:
            continue
        inputs = sk.inputs[node.id]
        made = produced[s]
        for v in inputs:
            if v not in made and array[v]:
                invars[s].setdefault(v)
        ids[s][node.id] = len(nodes[s])
        nodes[s].append(_renumbered(node, len(nodes[s]), inputs))
        made.update(node.outputs)
    makers: dict[int, list[int]] = {}  # var -> the stages producing it
    for s in range(num_stages):
        for v in produced[s]:
            makers.setdefault(v, []).append(s)
    needed_outside: list[dict[int, None]] = [{} for _ in range(num_stages)]
    for node in graph.nodes:
        here = node_stage[node.id]
        for v in sk.inputs[node.id]:
            for s in makers.get(v, ()):
                if s != here:
                    needed_outside[s].setdefault(v)
    for v in graph.outvars:
        v = sk.alias.get(v, v)
        for s in makers.get(v, ()):
            needed_outside[s].setdefault(v)
    subs = [
        OpGraph(vars=graph.vars, nodes=nodes[s], invars=tuple(invars[s]),
                outvars=tuple(needed_outside[s]), name=f"{graph.name}/stage{s}")
        for s in range(num_stages)
    ]
    return subs, ids


def _read_from_outside(graph, sk: Skeleton, nodes) -> tuple[int, ...]:
    """Variables the nodes read that none of them produce (constants aside), in order."""
    produced: set[int] = set()
    inputs: dict[int, None] = {}
    array = sk.array
    for n in nodes:
        for v in sk.inputs[n]:
            if v not in produced and array[v]:
                inputs.setdefault(v)
        produced.update(graph.nodes[n].outputs)
    return tuple(inputs)


def _segment(graph, sk: Skeleton, node_stage, phases, stage, phase, nodes, ids) -> Segment:
    """A stage's nodes of one phase; its outputs: what a reader elsewhere (another stage
    or phase), the step's results or the grad boundary needs."""

    def handed_out(v: int) -> bool:
        return v in sk.always_out or any(
            node_stage[u] != stage or phases[u] != phase for u in sk.readers.get(v, ()))

    outputs = tuple(v for n in nodes for v in graph.nodes[n].outputs if handed_out(v))
    inputs = _read_from_outside(graph, sk, nodes)
    return Segment(stage, phase, tuple(ids[n] for n in nodes), inputs, outputs)


def _apply_fragments(graph, sk: Skeleton, node_stage, renumber) -> list[Segment]:
    """Update nodes grouped by stage into rounds: a round waits for values of other stages."""
    producer_round: dict[int, tuple[int, int]] = {}  # var -> (round, stage)
    node_round: dict[int, int] = {}
    for n in sk.apply:
        s = node_stage[n]
        r = 0
        for v in sk.inputs[n]:
            if v in producer_round:
                pr, ps = producer_round[v]
                r = max(r, pr + (ps != s))
        node_round[n] = r
        for v in graph.nodes[n].outputs:
            producer_round[v] = (r, s)
    groups: dict[tuple[int, int], list[int]] = {}
    for n, r in node_round.items():
        groups.setdefault((r, node_stage[n]), []).append(n)
    fragments = []
    for r, s in sorted(groups):
        nodes = sorted(groups[(r, s)])
        node_set = set(nodes)
        outputs = tuple(
            v
            for n in nodes
            for v in graph.nodes[n].outputs
            if v in sk.outvars or any(u not in node_set for u in sk.users.get(v, ()))
        )
        inputs = _read_from_outside(graph, sk, nodes)
        ids = renumber[s]
        fragments.append(Segment(s, "apply", tuple(ids[n] for n in nodes), inputs, outputs, r))
    return fragments


def split_backward(seg: Segment, graph: OpGraph, grad_set: set) -> tuple[Segment, Segment]:
    """A backward segment as its input-gradient part B and its weight-gradient part W
    (zero-bubble schedules, Qi et al. 2024).

    B: the nodes the segment's outputs other than accumulated gradients need (the
    gradients handed to the previous stage); W: the rest, which only the accumulated
    (weight) gradients need. Values B makes and W reads become B's outputs and W's inputs.
    """
    node_set = set(seg.nodes)
    made_by = {v: n for n in seg.nodes for v in graph.nodes[n].outputs}
    needed = {v for v in seg.outputs if v not in grad_set}
    in_b = set()
    for n in reversed(seg.nodes):
        if any(v in needed for v in graph.nodes[n].outputs):
            in_b.add(n)
            needed.update(graph.nodes[n].inputs)
    w_nodes = tuple(n for n in seg.nodes if n not in in_b)
    w_reads = {v for n in w_nodes for v in graph.nodes[n].inputs}
    handed = tuple(sorted(v for v in w_reads if made_by.get(v) in in_b))
    b = Segment(
        seg.stage, seg.phase, tuple(n for n in seg.nodes if n in in_b),
        tuple(v for v in seg.inputs if v in needed),
        tuple(dict.fromkeys(
            (*(v for v in seg.outputs if made_by.get(v) not in node_set - in_b), *handed)
        )),
    )
    w = Segment(
        seg.stage, seg.phase, w_nodes,
        tuple(v for v in seg.inputs if v in w_reads) + handed,
        tuple(v for v in seg.outputs if made_by.get(v) in node_set - in_b),
    )
    return b, w


def phase_times(part: Partition, cluster) -> tuple[float, float, float]:
    """Seconds of one microbatch's forward, input-gradient (B) and weight-gradient (W)
    passes over every stage, each node timed alone on one device by the cost model's
    roofline (`autopar.cost.compute_time`), each stage's backward split as the zero-bubble
    runtime splits it (`split_backward`). Their ratios are what the cost model's schedule
    simulation takes as the shares of a stage's time (`autopar.cost.pipeline_latency`);
    Qi et al. 2024 likewise time F, B and W apart. For a matmul, B and W each cost a
    forward; elementwise and normalisation backwards fall in B, so B outweighs W where
    they matter (small layers, CPU).
    """
    grad_set = set(part.grad_vars)
    # The roofline of each distinct (flops, bytes, dtype, matmul): a model's identical
    # layers repeat them, and the same sum comes out (each node's seconds, added in order).
    timed: dict[tuple, float] = {}

    def seconds(graph: OpGraph, nodes) -> float:
        total = 0.0
        for n in nodes:
            node = graph.nodes[n]
            dtype = graph.vars[node.outputs[0]].dtype if node.outputs else "float32"
            key = (node.flops, node.bytes_read + node.bytes_written, dtype,
                   node.primitive in MATMUL_PRIMITIVES)
            took = timed.get(key)
            if took is None:
                took = timed[key] = compute_time(key[0], key[1], cluster, dtype,
                                                 matmul=key[3])
            total += took
        return total

    forward = input_grad = weight_grad = 0.0
    for seg in part.forward:
        forward += seconds(part.stage_graphs[seg.stage], seg.nodes)
    for seg in part.backward:
        graph = part.stage_graphs[seg.stage]
        b, w = split_backward(seg, graph, grad_set)
        input_grad += seconds(graph, b.nodes)
        weight_grad += seconds(graph, w.nodes)
    return forward, input_grad, weight_grad
