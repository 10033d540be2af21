"""Stage plans stitched from layer plans.

The intra-op ILP is solved per layer (identical layers once per mesh); a stage's plan is
the union of its layers' plans on the same logical mesh. Where a layer expects a value in
another layout than the layer that produced it (a layer edge, or a parameter shared by two
layers), the consumer's operand is resharded, and its cost is added.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.cluster._mesh import LogicalMesh, Spec, replicated
from autopar.graph import OpGraph, Role
from autopar.intra._reshard import reshard_collectives, reshard_time
from autopar.intra._sharding_plan import PredictedCost, ShardingPlan, graph_fingerprint


def canonical_vars(graph: OpGraph) -> list[int]:
    """Non-constant variables in order of first appearance (as the fingerprint names them)."""
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
    """
    weights = dict(weights or {})
    var_specs: list[Spec | None] = [None] * len(stage_graph.vars)
    node_strategies = [""] * len(stage_graph.nodes)
    expected: dict[tuple[int, int], Spec] = {}  # (stage node, operand) -> layout wanted
    layer_view: dict[tuple[int, int], Spec] = {}  # the layout its layer planned it to have
    compute = communication = resharding = memory = 0.0
    collectives: dict[str, list] = {}
    warnings: list[str] = []

    def add(kind, n, nbytes):
        entry = collectives.setdefault(kind, [0, 0.0])
        entry[0] += n
        entry[1] += nbytes

    layout_from: dict[int, int] = {}  # input var -> the layer whose plan set its layout
    produced_by: dict[int, int] = {}  # var -> the layer computing it
    paid_to: dict[int, Spec] = {}  # output var -> the layout its layer paid to move it to
    for k, (layer_graph, layer_index, plan, solved_on) in enumerate(layer_parts):
        specs, operands, _ = translate(plan, solved_on, layer_graph, mesh)
        for out_var, in_var in handed_on[k] if k < len(handed_on) else ():
            if specs.get(in_var) is not None:
                paid_to[out_var] = specs[in_var]
        inverse = {sub: full for full, sub in layer_index.items()}
        for node in layer_graph.nodes:
            full = inverse[node.id]
            stage_node = stage_index[full]
            node_strategies[stage_node] = plan.node_strategies[node.id]
            for v in node.outputs:
                var_specs[v] = specs.get(v)
                produced_by[v] = k
            for p, v in enumerate(node.inputs):
                if layer_graph.vars[v].role is Role.CONST:
                    continue
                view = specs.get(v) or replicated(len(layer_graph.vars[v].shape))
                expected[(stage_node, p)] = operands.get((node.id, p), view)
                layer_view[(stage_node, p)] = view
        for v in layer_graph.invars:
            if var_specs[v] is None and v in stage_graph.invars:
                var_specs[v] = specs.get(v)  # the first layer reading an input sets its layout
                layout_from[v] = k
        cost = plan.cost
        compute += cost.compute
        communication += cost.communication
        resharding += cost.resharding
        memory += cost.memory_per_device
        for kind, (n, nbytes) in cost.collectives.items():
            add(kind, n, nbytes)
        warnings.extend(w for w in plan.warnings if w not in warnings)

    operand_specs = []
    cache: dict = {}
    for node in stage_graph.nodes:
        for p, v in enumerate(node.inputs):
            var = stage_graph.vars[v]
            if var.role is Role.CONST or (node.id, p) not in expected:
                continue
            have = var_specs[v] or replicated(len(var.shape))
            want = expected[(node.id, p)]
            if want != have:
                operand_specs.append((node.id, p, want))
            # The layer plan paid for going from its own view of the input to `want`; at a
            # layer edge the value arrives in the producer's layout: pay for the difference.
            view = layer_view[(node.id, p)]
            if view != have and paid_to.get(v) != view:
                resharding += weights.get(node.id, 1.0) * reshard_time(
                    var.shape, var.dtype, have, view, mesh, cluster, cache
                )
                w = weights.get(node.id, 1.0)
                for c in reshard_collectives(var.shape, var.dtype, have, view, mesh):
                    add(c.kind, w, w * c.nbytes)
    # A tie inside one layer was charged by that layer's ILP (the layer planner ties the
    # state a layer updates); a tie across layers (shared weights) is charged here.
    charged = {
        (o, i) for o, i in tied
        if o in produced_by and produced_by[o] == layout_from.get(i)
        and i in layer_parts[produced_by[o]][0].invars
    }
    overrides = []
    for out_var, in_var in tied:
        if var_specs[out_var] is None or var_specs[in_var] is None:
            continue
        overrides.append((out_var, var_specs[in_var]))
        var = stage_graph.vars[out_var]
        if var_specs[out_var] != var_specs[in_var] and (out_var, in_var) not in charged:
            resharding += tie_weight * reshard_time(
                var.shape, var.dtype, var_specs[out_var], var_specs[in_var], mesh, cluster, cache
            )
    constrained = tuple(
        v for node in stage_graph.nodes for v in node.outputs
        if stage_graph.vars[v].shape and var_specs[v] is not None
    )
    return ShardingPlan(
        mesh=mesh,
        var_specs=tuple(var_specs),
        node_strategies=tuple(node_strategies),
        constrained=constrained,
        cost=PredictedCost(
            compute, communication, resharding, memory,
            {k: (n, b) for k, (n, b) in collectives.items()},
        ),
        graph_fingerprint=graph_fingerprint(stage_graph),
        output_overrides=tuple(sorted(overrides)),
        operand_specs=tuple(operand_specs),
        warnings=tuple(warnings),
        stats={"stitched_from_layers": len(layer_parts)},
    )
