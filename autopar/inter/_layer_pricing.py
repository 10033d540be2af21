"""A layer's plan priced by the cost model: what `LayerCostTable` hands `autopar.cost`.

In: a layer's graph and its `ShardingPlan` (solved for a layer of the same structure), or
the whole step's graph and its layers. Out: the plain numbers `cost`'s formulas take
(tensors as (shape, dtype, spec), per-node seconds, bytes crossing a layer boundary) and
the figures those formulas give: a layer's bytes per device by part, the seconds its
recompute reruns, its `LayerCost` with a remat choice, and the bytes a stage boundary
moves. The formulas themselves live in `autopar.cost`; this module only reads the graph
and the plan.
"""

from __future__ import annotations

import math
import weakref

from autopar._memo import declare
from autopar.cost import (
    LayerCost,
    bytes_per_device,
    crossing_bytes,
    full_recompute_cost,
    fused_attention_bytes,
    fused_rerun_seconds,
    fusion_boundary_bytes,
    gradient_bytes,
    planned_rerun_seconds,
    rate_dtype,
    scan_rerun_seconds,
    selective_recompute_cost,
    sharded_bytes,
)
from autopar.graph import OpGraph, Role, attention_core, fusion_traffic, trace_jaxpr
from autopar.inter.passes._deferred import stacked_layout
from autopar.inter.passes._layers import LayerAssignment
from autopar.inter.passes._partition import Partition
from autopar.inter.passes._remat import STATE_ROLES, in_core, scan_body, score_shapes
from autopar.intra import ShardingPlan
from autopar.intra._problem import unstacked_spec


def _scan_rerun_seconds(node, nbytes, graph: OpGraph, core_only: bool, cluster) -> float:
    """`scan_rerun_seconds` of a scan node's forward (`core_only`: only its body's attention
    core, the values shaped like the body's `score_shapes`): each body node's FLOPs, the
    bytes crossing its fusion's boundary (`autopar.graph.fusion_traffic`) and its rate
    dtype, at the share of the scan's results a device holds (`nbytes(v)` per device)."""
    body = trace_jaxpr(node.params["jaxpr"], name="scan body")
    scores = score_shapes(scan_body(node))
    traffic = fusion_traffic(body, cluster.fused_attention)
    work = []
    for b in body.nodes:
        outs = [body.vars[v] for v in b.outputs]
        if core_only and not any(in_core(o.shape, scores) for o in outs):
            continue
        ins = [body.vars[v] for v in b.inputs]
        hbm = fusion_boundary_bytes(
            [0 if i.role is Role.CONST else i.nbytes for i in ins], [o.nbytes for o in outs],
            traffic.reads[b.id], traffic.writes[b.id],
        )
        dtype = rate_dtype(b.primitive, [i.dtype for i in ins],
                           outs[0].dtype if outs else "float32")
        work.append((b.flops, hbm, dtype))
    return scan_rerun_seconds(
        work, node.params["length"], (nbytes(v) for v in node.outputs),
        [graph.vars[v].nbytes for v in node.outputs], cluster,
    )


def rerun_seconds(graph: OpGraph, plan: ShardingPlan, node_ids, cluster) -> float:
    """Predicted seconds to rerun forward nodes `node_ids` of `graph` as `plan` runs them
    (`planned_rerun_seconds`): each node's chosen strategy's compute (its FLOPs per device,
    at the rate of its operand dtypes, GEMMs by the efficiency table, bytes across fusion
    boundaries) and its own collectives (a row-parallel dot's all-reduce), plus the
    resharding of its operands the plan does (sequence parallelism's all-gathers): exactly
    what the forward cost."""
    from autopar.intra import reshard_time
    from autopar.intra._strategies import CostContext, node_signature, node_strategies
    from autopar.intra._strategies_moe import OVERLAPPED, PER_GEMM

    # An expert-parallel grouped GEMM's forms share their specs, so the strategies are
    # listed with the one the plan chose ("on": chunked, "off": whole; "gemm": whole and
    # priced with its own exchange, "mlp": by its expert MLP region).
    modes = {"on": ("on", "mlp"), "off": ("off", "mlp"), "gemm": ("off", "gemm")}
    contexts = {mode: CostContext(cluster, plan.mesh, moe_overlap=overlap,
                                  moe_dispatch=dispatch)
                for mode, (overlap, dispatch) in modes.items()}
    wanted = set(node_ids)
    operand_specs = {(n, p): spec for n, p, spec in plan.operand_specs if n in wanted}
    # A layer is priced at several levels and remat choices on one mesh: each node's
    # strategies are costed once per (mesh, cluster).
    by_node = _RERUN_STRATEGIES.setdefault(graph, {})

    def strategy_seconds(n: int) -> float:
        node = graph.nodes[n]
        name = plan.node_strategies[n]
        mode = ("on" if name.endswith(OVERLAPPED) else
                "gemm" if name.endswith(PER_GEMM) else "off")
        key = (n, plan.mesh, cluster, mode)
        if key not in by_node:
            costs = by_node[key] = {}
            for s in node_strategies(node, graph, node_signature(node, graph),
                                     contexts[mode]):
                costs.setdefault(s.name, s.compute_cost + s.comm_cost)  # the first of a name
        # No entry: an identity marker or a node planned without a rule.
        return by_node[key].get(plan.node_strategies[n], 0.0)

    def reshard_seconds(n: int):
        for p, v in enumerate(graph.nodes[n].inputs):
            var = graph.vars[v]
            have, want = plan.var_specs[v], operand_specs.get((n, p))
            if want is not None and have is not None and want != have:
                yield reshard_time(var.shape, var.dtype, have, want, plan.mesh, cluster)

    return planned_rerun_seconds((strategy_seconds(n), reshard_seconds(n)) for n in node_ids)


# graph -> {(node id, mesh, cluster): {strategy name: seconds}} for `rerun_seconds`;
# forgets graphs nothing else holds.
_RERUN_STRATEGIES: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "inter.rerun_strategies",
    "graph -> {(node id, mesh, cluster): {strategy name: seconds}}")


def _var_map(sub: OpGraph, solved_on: OpGraph) -> dict[int, int]:
    """Var ids of `sub` -> those of `solved_on`, a graph of the same structure, matched by
    position (invars, then node outputs in order); empty when they are the same graph."""
    if sub is solved_on:
        return {}
    pairs = dict(zip(sub.invars, solved_on.invars))
    for a, b in zip(sub.nodes, solved_on.nodes):
        pairs.update(zip(a.outputs, b.outputs))
    return pairs


def _state_bytes(sub: OpGraph, plan: ShardingPlan) -> float:
    """Bytes per device of the parameters and optimizer state the layer reads."""
    return sharded_bytes(
        ((sub.vars[v].shape, sub.vars[v].dtype, plan.var_specs[v]) for v in sub.invars
         if sub.vars[v].role in (Role.PARAM, Role.OPT_STATE) and plan.var_specs[v] is not None),
        plan.mesh,
    )


def _gradient_bytes(sub: OpGraph, plan: ShardingPlan, part: Partition) -> float:
    """Bytes per device of the gradients the layer computes, as they are accumulated."""
    stacked = stacked_layout(sub, plan, part.deferrable)
    produced = {v for n in sub.nodes for v in n.outputs}
    held = []
    for v in set(part.grad_vars) & produced:
        var, spec = sub.vars[v], plan.var_specs[v]
        if spec is None or not var.shape:
            continue
        if v in stacked:
            spec = unstacked_spec(spec, stacked[v])
        held.append((var.shape, var.dtype, spec))
    return gradient_bytes(held, plan.mesh)


def _activation_bytes(sub: OpGraph, plan: ShardingPlan, kept: set[int],
                      fused_attention: bool = False) -> float:
    """Bytes per device the layer's forward keeps for its backward (one microbatch); with
    `fused_attention`, a kept value inside the fused attention kernel (`attention_core`)
    is kept as its per-row softmax statistics (`fused_attention_bytes`)."""
    core = attention_core(sub) if fused_attention else frozenset()
    held = [v for v in kept if plan.var_specs[v] is not None and sub.vars[v].shape]
    return sharded_bytes(
        ((sub.vars[v].shape, sub.vars[v].dtype, plan.var_specs[v]) for v in held
         if v not in core),
        plan.mesh,
    ) + sum(fused_attention_bytes(sub.vars[v].shape, plan.var_specs[v], plan.mesh)
            for v in held if v in core)


def layer_fused_seconds(table, layer: int, solved_on: OpGraph, plan: ShardingPlan) -> float:
    """`fused_rerun_seconds` of `table`'s layer's fused rerun under `plan` (solved on
    `solved_on`, a layer of the same structure): each rerun node's FLOPs at the share of
    its result a device holds."""
    sub = table.per_layer.stage_graphs[layer]
    to_solved = _var_map(sub, solved_on)
    work = []
    for n in table.fused_rerun(layer).nodes:
        node = sub.nodes[n]
        if not node.outputs or node.flops <= 0:
            continue
        out = sub.vars[node.outputs[0]]
        spec = plan.var_specs[to_solved.get(out.id, out.id)]
        share = 1.0
        if spec is not None and out.shape and out.nbytes > 0:
            share = bytes_per_device(out.shape, out.dtype, spec, plan.mesh) / out.nbytes
        work.append((node.flops * share, out.dtype))
    return fused_rerun_seconds(work, table.cluster)


def price_remat(table, layer: int, shape, level: int, remat: str, base: LayerCost) -> LayerCost:
    """`table`'s layer at (`shape`, `level`) with `remat` (`LayerCostTable.remat_cost`):
    `base` with the rerun nodes' seconds as the plan runs them and the bytes per device of
    what the recompute drops and keeps (`full_recompute_cost`, `selective_recompute_cost`)."""
    plan, solved_on = table.solved_plan(layer, shape, level)
    rerun = table.recompute_of(layer, remat)
    if not rerun.nodes:
        return base
    # The plan was solved on a layer of the same structure: map this layer's ids onto
    # its graph by position (same fingerprint, same numbering of nodes and vars).
    sub = table.per_layer.stage_graphs[layer]
    to_solved = _var_map(sub, solved_on)
    to_node = {} if sub is solved_on else {
        a.id: b.id for a, b in zip(sub.nodes, solved_on.nodes)
    }

    def nbytes(v):
        var = sub.vars[v]
        spec = plan.var_specs[to_solved.get(v, v)]
        if spec is None or not var.shape:
            return float(var.nbytes)
        return bytes_per_device(var.shape, var.dtype, spec, plan.mesh)

    # Nodes the fused rerun already runs (priced in `base`) are not priced again.
    fused_nodes = set() if remat == "full" else set(table.fused_rerun(layer).nodes)
    seconds = rerun_seconds(solved_on, plan, [to_node.get(n, n) for n in rerun.nodes
                                              if n not in fused_nodes], table.cluster)
    for n in rerun.nodes:  # a scan's body plan is no node strategy: priced by its work
        node = sub.nodes[n]
        if node.primitive == "scan":
            seconds += _scan_rerun_seconds(node, nbytes, sub, rerun.core_only, table.cluster)
    dropped = math.fsum(nbytes(v) for v in rerun.dropped)
    added = math.fsum(nbytes(v) for v in rerun.added)
    fused = table.fused_seconds(layer, shape, level)
    if remat == "full":  # it drops all it kept, and keeps what its forward reads
        inputs = math.fsum(
            nbytes(v) for v in rerun.reads if sub.vars[v].role not in STATE_ROLES
        )
        # The whole forward rerun replaces the fused rerun `base` has in its latency.
        return full_recompute_cost(base, max(0.0, seconds - fused), inputs)
    return selective_recompute_cost(base, seconds, dropped, added)


def boundary_bytes(graph, layers: LayerAssignment) -> list[float]:
    """Per layer k (0..num_layers), bytes of the forward values made in layers before k and
    read in layer k or later (`crossing_bytes`): what a stage starting at layer k receives
    per microbatch (its gradients go back the same size)."""
    made: dict[int, int] = {}
    for node in graph.nodes:
        if layers.phase[node.id] == "forward" and layers.layer[node.id] is not None:
            made.update((v, layers.layer[node.id]) for v in node.outputs)
    reads = []
    for node in graph.nodes:
        k = layers.layer[node.id]
        if layers.phase[node.id] != "forward" or k is None:
            continue
        for v in node.inputs:
            if made.get(v, k) < k:
                reads.append((v, made[v], k))
    return crossing_bytes(reads, {v: graph.vars[v].nbytes for v in made}, layers.num_layers)
