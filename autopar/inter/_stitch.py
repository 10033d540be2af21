"""Stage plans stitched from layer plans.

The intra-op ILP is solved per layer (identical layers once per mesh); a stage's plan is
the union of its layers' plans on the same logical mesh. Where a layer expects a value in
another layout than the layer that produced it (a layer edge, or a parameter shared by two
layers), the consumer's operand is resharded, and its cost is added. So are the bytes a
layout copy reads across a layer edge (`_copies_across_layers`), which no layer's ILP saw.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autopar._memo import declare, per_graph
from autopar.cluster import LogicalMesh, Spec, replicated
from autopar.cost import repriced_copy_seconds
from autopar.cost.backends import backend_for
from autopar.graph import OpGraph, Role
from autopar.intra import PredictedCost, ShardingPlan, graph_fingerprint
from autopar.intra._context import combine
from autopar.intra._reshard import reshard_collectives, reshard_time
from autopar.intra._strategies import CostContext, _layout_seconds


def canonical_vars(graph: OpGraph) -> tuple[int, ...]:
    """Non-constant variables in order of first appearance (as the fingerprint names them);
    once per graph (a layer's sub-graph is carried into every stage stitched with it)."""
    held = _CANONICAL.get(graph)
    if held is None:
        held = _CANONICAL[graph] = tuple(_canonical_vars(graph))
    return held


# graph -> `canonical_vars(graph)`
_CANONICAL: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "inter.canonical_vars",
    "graph -> its non-constant variables in order of first appearance")


@per_graph("inter.graph_fingerprints", "graph -> its graph_fingerprint")
def fingerprint_of(graph: OpGraph) -> str:
    """`graph_fingerprint(graph)`, once per graph: a partition's stage sub-graphs are
    stitched again for other meshes and layer plans, and the Megatron grid's plans of one
    microbatch count share their traced graph."""
    return graph_fingerprint(graph)


def _canonical_vars(graph: OpGraph) -> list[int]:
    seen: dict[int, None] = {}
    for v in graph.invars:
        seen.setdefault(v)
    for node in graph.nodes:
        for v in (*node.inputs, *node.outputs):
            if graph.vars[v].role is not Role.CONST:
                seen.setdefault(v)
    for v in graph.outvars:
        seen.setdefault(v)
    return list(seen)


def translate(plan: ShardingPlan, source: OpGraph, target: OpGraph, mesh: LogicalMesh):
    """A plan solved for `source` carried to the structurally identical `target`."""
    mapping = dict(zip(canonical_vars(source), canonical_vars(target)))
    specs: dict[int, Spec | None] = {}
    for v_src, v_dst in mapping.items():
        specs[v_dst] = plan.var_specs[v_src]
    operands = {(n, p): spec for n, p, spec in plan.operand_specs}
    return specs, operands, plan


@dataclass
class _Stitched:
    """What `stitch` gathers from the layer plans, then adds edge and tie costs to."""

    var_specs: list[Spec | None]
    node_strategies: list[str]
    expected: dict[tuple[int, int], Spec] = field(default_factory=dict)  # operand -> wanted
    layer_view: dict[tuple[int, int], Spec] = field(default_factory=dict)  # its layer's view
    layout_from: dict[int, int] = field(default_factory=dict)  # input -> layer setting it
    produced_by: dict[int, int] = field(default_factory=dict)  # var -> layer computing it
    paid_to: dict[int, Spec] = field(default_factory=dict)  # output -> layout paid for
    compute: float = 0.0
    communication: float = 0.0
    resharding: float = 0.0
    memory: float = 0.0
    collectives: dict[str, list] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def add_collective(self, kind: str, count: float, nbytes: float) -> None:
        entry = self.collectives.setdefault(kind, [0, 0.0])
        entry[0] += count
        entry[1] += nbytes


def stitch(
    stage_graph: OpGraph,
    stage_index: dict[int, int],
    layer_parts: Sequence[tuple[OpGraph, dict[int, int], ShardingPlan, OpGraph]],
    mesh: LogicalMesh,
    cluster,
    tied: Sequence[tuple[int, int]] = (),
    *,
    weights: Mapping[int, float] | None = None,
    tie_weight: float = 1.0,
    handed_on: Sequence[Sequence[tuple[int, int]]] = (),
) -> ShardingPlan:
    """The plan of a stage from the plans of its layers.

    **Arguments:**
    - `stage_graph`, `stage_index`: the stage sub-graph and full node id -> its node id.
    - `layer_parts`: per layer (in order) its sub-graph, full node id -> layer node id, the
      plan solved for a layer of that structure, and the sub-graph that plan was solved on.
    - `tied`: (output var, input var) state pairs; outputs take their input's layout.
    - `weights`: stage node id -> weight of resharding its operands (the layer ILPs'
      weights: the update runs once per step, its costs are shared by the microbatches);
      `tie_weight`: the same for moving updated state back to its input's layout.
    - `handed_on`: per layer, (output var, input var) activation pairs its ILP tied (see
      `LayerCostTable.chain_ties`): that layer already paid for moving the output to its
      input's layout, so a next layer taking it in that layout costs nothing more here.

    Steps: the union of the layer plans (`_place_layers`), the resharding where a layer
    takes a value in another layout than it arrives in (`_edge_resharding`), and moving
    updated state shared across layers back to its input's layout (`_tie_overrides`).
    """
    found = _Stitched([None] * len(stage_graph.vars), [""] * len(stage_graph.nodes))
    for k, part in enumerate(layer_parts):
        _place_layers(found, k, part, stage_graph, stage_index, mesh,
                      handed_on[k] if k < len(handed_on) else ())
    found.compute += _copies_across_layers(found, stage_graph, stage_index, layer_parts, mesh,
                                           cluster, dict(weights or {}))
    cache: dict = {}
    operand_specs = _edge_resharding(found, stage_graph, mesh, cluster, dict(weights or {}), cache)
    overrides = _tie_overrides(found, stage_graph, layer_parts, tied, mesh, cluster,
                               tie_weight, cache)
    constrained = tuple(
        v for node in stage_graph.nodes for v in node.outputs
        if stage_graph.vars[v].shape and found.var_specs[v] is not None
    )
    return ShardingPlan(
        mesh=mesh,
        var_specs=tuple(found.var_specs),
        node_strategies=tuple(found.node_strategies),
        constrained=constrained,
        cost=PredictedCost(
            found.compute, found.communication, found.resharding, found.memory,
            {k: (n, b) for k, (n, b) in found.collectives.items()},
        ),
        graph_fingerprint=fingerprint_of(stage_graph),
        output_overrides=tuple(sorted(overrides)),
        operand_specs=tuple(operand_specs),
        warnings=tuple(found.warnings),
        stats={"stitched_from_layers": len(layer_parts)},
        context_parallel=combine([part[2].context_parallel for part in layer_parts]),
    )


def _place_layers(found: _Stitched, k, part, stage_graph, stage_index, mesh, handed_on):
    """Layer `k`'s plan carried onto the stage graph, its costs added."""
    layer_graph, layer_index, plan, solved_on = part
    specs, operands, _ = translate(plan, solved_on, layer_graph, mesh)
    for out_var, in_var in handed_on:
        if specs.get(in_var) is not None:
            found.paid_to[out_var] = specs[in_var]
    inverse = {sub: full for full, sub in layer_index.items()}
    for node in layer_graph.nodes:
        stage_node = stage_index[inverse[node.id]]
        found.node_strategies[stage_node] = plan.node_strategies[node.id]
        for v in node.outputs:
            found.var_specs[v] = specs.get(v)
            found.produced_by[v] = k
        for p, v in enumerate(node.inputs):
            if layer_graph.vars[v].role is Role.CONST:
                continue
            view = specs.get(v) or replicated(len(layer_graph.vars[v].shape))
            found.expected[(stage_node, p)] = operands.get((node.id, p), view)
            found.layer_view[(stage_node, p)] = view
    for v in layer_graph.invars:
        if found.var_specs[v] is None and v in stage_graph.invars:
            found.var_specs[v] = specs.get(v)  # the first layer reading an input sets its layout
            found.layout_from[v] = k
    cost = plan.cost
    found.compute += cost.compute
    found.communication += cost.communication
    found.resharding += cost.resharding
    found.memory += cost.memory_per_device
    for kind, (n, nbytes) in cost.collectives.items():
        found.add_collective(kind, n, nbytes)
    found.warnings.extend(w for w in plan.warnings if w not in found.warnings)


def _copies_across_layers(found: _Stitched, stage_graph, stage_index, layer_parts, mesh,
                          cluster, weights) -> float:
    """Seconds the stage's layout copies cost beyond what its layers' ILPs charged them.

    XLA:CPU recomputes a copied operand's elementwise ops inside the copy, back to values
    written to memory (its backend's `layout_copies`); on a residual stream those reach
    back over layer edges (each layer's copy of the residual gradient reads every later
    layer's dot results). A layer's ILP sees its own graph, which starts at the layer's
    inputs, so its copies' fan-in stops there: each node's copies are priced on both
    graphs by the ILP's own function (`_layout_seconds`), at the layouts the layer's plan
    takes the operands in, and the difference added (`autopar.cost.repriced_copy_seconds`;
    `weights` per stage node, as for the resharding). 0 where the cluster's backend
    prices no copies (XLA:GPU, or XLA:CPU without `transpose_bandwidth`)."""
    backend = backend_for(cluster)
    if not backend.prices_layout_copies(cluster):
        return 0.0
    ctx = CostContext(cluster, mesh)
    stage_nodes = {n.id: n for n in stage_graph.nodes}
    copies = []
    for layer_graph, layer_index, _, _ in layer_parts:
        layer_nodes = {n.id: n for n in layer_graph.nodes}
        for full, sub in layer_index.items():
            node = stage_nodes[stage_index[full]]
            if not backend.layout_copies(stage_graph, node):
                continue
            specs = [found.expected.get((node.id, p)) for p in range(len(node.inputs))]
            copies.append((weights.get(node.id, 1.0),
                           _layout_seconds(node, stage_graph, specs, ctx),
                           _layout_seconds(layer_nodes[sub], layer_graph, specs, ctx)))
    return repriced_copy_seconds(copies)


def _edge_resharding(found: _Stitched, stage_graph, mesh, cluster, weights, cache) -> list:
    """Operands a layer takes in another layout than they arrive in: the operand specs the
    lowering reshards, and the cost no layer's ILP paid. **Returns:** the operand specs."""
    operand_specs = []
    for node in stage_graph.nodes:
        for p, v in enumerate(node.inputs):
            var = stage_graph.vars[v]
            if var.role is Role.CONST or (node.id, p) not in found.expected:
                continue
            have = found.var_specs[v] or replicated(len(var.shape))
            want = found.expected[(node.id, p)]
            if want != have:
                operand_specs.append((node.id, p, want))
            # The layer plan paid for going from its own view of the input to `want`; at a
            # layer edge the value arrives in the producer's layout: pay for the difference.
            view = found.layer_view[(node.id, p)]
            if view != have and found.paid_to.get(v) != view:
                w = weights.get(node.id, 1.0)
                found.resharding += w * reshard_time(
                    var.shape, var.dtype, have, view, mesh, cluster, cache
                )
                for c in reshard_collectives(var.shape, var.dtype, have, view, mesh):
                    found.add_collective(c.kind, w, w * c.nbytes)
    return operand_specs


def _tie_overrides(found: _Stitched, stage_graph, layer_parts, tied, mesh, cluster,
                   tie_weight, cache) -> list:
    """Updated state returned in its input's layout, and the cost of moving it there when
    no layer's ILP paid it. **Returns:** (output var, spec) overrides."""
    # A tie inside one layer was charged by that layer's ILP (the layer planner ties the
    # state a layer updates); a tie across layers (shared weights) is charged here.
    charged = {
        (o, i) for o, i in tied
        if o in found.produced_by and found.produced_by[o] == found.layout_from.get(i)
        and i in layer_parts[found.produced_by[o]][0].invars
    }
    specs = found.var_specs
    overrides = []
    for out_var, in_var in tied:
        if specs[out_var] is None or specs[in_var] is None:
            continue
        overrides.append((out_var, specs[in_var]))
        var = stage_graph.vars[out_var]
        if specs[out_var] != specs[in_var] and (out_var, in_var) not in charged:
            found.resharding += tie_weight * reshard_time(
                var.shape, var.dtype, specs[out_var], specs[in_var], mesh, cluster, cache
            )
    return overrides
