"""Scanned layers planned as one layer: a `scan` node opened into its body for the ILP.

Production models stack their layers' parameters on a leading layer axis and run one layer
body with `jax.lax.scan`; the tracer keeps such a loop as one node. For planning, every
top-level `scan` of a graph is replaced by one copy of its body (`trace_jaxpr`), wired to
the rest of the graph by four kinds of marker nodes that move no data:

- ``scan_slice``: a stacked operand (an ``xs``) -> its per-iteration slice; the leading
  (scanned) dimension is never split, the others keep their labels;
- ``scan_enter``: a loop-invariant operand or the initial carry -> the body's input;
- ``scan_exit``: the body's final carry -> the scan's carry result;
- ``scan_stack``: the body's per-iteration result -> the stacked ``ys`` (leading dim whole).

The body's nodes weigh `length` (their compute, collectives and the resharding of their
operands happen every iteration), the markers weigh 1 (a stacked weight is resharded once,
before the loop). Each carry's body result is tied to the carry's body input by an edge
weighing `length`, so the ILP picks one carry layout or pays the per-iteration reshard.
So the ILP chooses the body's strategies once, jointly with the rest of the step (the
forward and backward scans, the optimizer update): a scanned stack of L layers is planned
like one layer of its unrolled twin, weighed L times. A weight gradient summed over a
split batch in the backward body is reduced once per iteration, as in the unrolled model.

`expand_scans` builds that planning graph; `collapse_plan` turns its plan back into one of
the original graph, with a `BodyPlan` per scan that the lowering applies inside the body.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from autopar.graph import Node, OpGraph, Role, trace_jaxpr
from autopar.intra._control_flow import ENTER, EXIT, SLICE, STACK
from autopar.intra._sharding_plan import BodyPlan, ShardingPlan, graph_fingerprint
from autopar.intra._strategies_moe import OVERLAPPED, PER_GEMM

SCAN_MARKERS = frozenset({SLICE, ENTER, EXIT, STACK})

# ---- the planning graph -----------------------------------------------------------------


@dataclass(frozen=True)
class OpenedScan:
    """Where one scan's body sits in the planning graph.

    `body` is `trace_jaxpr(params["jaxpr"])`; its variable `i` is planning variable
    `var_offset + i`, its node `j` planning node `node_offset + j`. `markers[k]` is the
    planning node that brings scan operand `k` in; `exits[k]` the one that puts result `k`
    out.
    """

    scan: int
    body: OpGraph
    var_offset: int
    node_offset: int
    markers: tuple[int, ...]
    exits: tuple[int, ...]
    num_carry: int


@dataclass(frozen=True)
class Expansion:
    """The planning graph of `original` with its scans opened (see the module docstring).

    Variables of `original` keep their ids; nodes are renumbered (`planning_node[g]` is
    the planning id of original node `g`, or None for an opened scan). `weights` and
    `tied` are the arguments to plan the planning graph with.
    """

    original: OpGraph
    graph: OpGraph
    planning_node: tuple[int | None, ...]
    scans: tuple[OpenedScan, ...]
    weights: Mapping[int, tuple[float, float]]
    tied: tuple[tuple[int, int], ...]


def opened_body(params: Mapping) -> OpGraph:
    """The body graph of a scan equation, as both the planner and the lowering build it."""
    return trace_jaxpr(params["jaxpr"], name="scan body")


def expand_scans(
    graph: OpGraph,
    weights: Mapping[int, tuple[float, float]] | None = None,
    tied: Sequence[tuple[int, int]] = (),
) -> Expansion | None:
    """Open every top-level `scan` of `graph` into one copy of its body; None if none.

    **Arguments:**
    - `weights`, `tied`: as `build_problem` takes them, for `graph`.

    **Returns:** an `Expansion` whose `weights` and `tied` cover the planning graph.
    """
    if not any(n.primitive == "scan" for n in graph.nodes):
        return None
    weights = dict(weights or {})
    vars_ = list(graph.vars)
    nodes: list[Node] = []
    planning_node: list[int | None] = []
    new_weights: dict[int, tuple[float, float]] = {}
    new_tied = list(tied)
    scans = []

    def add(node: Node, weight: tuple[float, float] | None) -> int:
        node = replace(node, id=len(nodes))
        nodes.append(node)
        for v in node.outputs:
            vars_[v] = replace(vars_[v], producer=node.id)
        if weight is not None and weight != (1.0, 1.0):
            new_weights[node.id] = weight
        return node.id

    for node in graph.nodes:
        weight = weights.get(node.id)
        if node.primitive != "scan":
            planning_node.append(add(node, weight))
            continue
        planning_node.append(None)
        scans.append(_open_scan(node, graph, vars_, nodes, add, weight, new_tied))
    planning = OpGraph(
        vars_, nodes, graph.invars, graph.outvars, graph.in_tree, graph.out_tree,
        name=graph.name,
    )
    return Expansion(
        graph, planning, tuple(planning_node), tuple(scans), new_weights, tuple(new_tied)
    )


def _open_scan(node, graph, vars_, nodes, add, weight, tied) -> OpenedScan:
    params = node.params
    body = opened_body(params)
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    first_xs = num_consts + num_carry
    length = float(params["length"])
    outer = weight or (1.0, 1.0)
    inner = (outer[0] * length, *outer[1:])
    var_offset = len(vars_)
    for var in body.vars:
        role = Role.CONST if var.role is Role.CONST else Role.ACTIVATION
        vars_.append(replace(var, id=var_offset + var.id, role=role, producer=None))

    def marker(kind, src, dst):
        nbytes = graph.vars[src].nbytes if src < len(graph.vars) else vars_[src].nbytes
        return Node(0, kind, (src,), (dst,), {}, 0.0, nbytes, vars_[dst].nbytes, remat=node.remat)

    markers = []
    for k, (v, b) in enumerate(zip(node.inputs, body.invars)):
        kind = SLICE if k >= first_xs else ENTER
        markers.append(add(marker(kind, v, var_offset + b), weight))
    node_offset = len(nodes)
    for body_node in body.nodes:
        shifted = replace(
            body_node,
            inputs=tuple(var_offset + v for v in body_node.inputs),
            outputs=tuple(var_offset + v for v in body_node.outputs),
            remat=body_node.remat or node.remat,
        )
        add(shifted, inner)
    exits = []
    for k, (b, v) in enumerate(zip(body.outvars, node.outputs)):
        kind = EXIT if k < num_carry else STACK
        exits.append(add(marker(kind, var_offset + b, v), weight))
    for j in range(num_carry):
        carry_out = var_offset + body.outvars[j]
        carry_in = var_offset + body.invars[num_consts + j]
        if carry_out != carry_in:
            tied.append((carry_out, carry_in))  # weighed by the body producer: per iteration
    return OpenedScan(
        node.id, body, var_offset, node_offset, tuple(markers), tuple(exits), num_carry
    )


# ---- back to the original graph ---------------------------------------------------------


def collapse_plan(plan: ShardingPlan, expansion: Expansion) -> ShardingPlan:
    """The plan of `expansion.original` from the plan of its planning graph.

    Specs of original variables are kept; a scan's operand specs are its markers' operand
    specs; its body's specs become a `BodyPlan`, with each body result pinned to the layout
    its exit marker takes (a carry: the carry's layout on entry).
    """
    original = expansion.original
    num_vars = len(original.vars)
    back = {p: g for g, p in enumerate(expansion.planning_node) if p is not None}
    marker_operand = {m: (s.scan, k) for s in expansion.scans for k, m in enumerate(s.markers)}
    operand_specs = []
    body_operands: dict[int, list] = {s.scan: [] for s in expansion.scans}
    where = [
        (s.node_offset, s.node_offset + len(s.body.nodes), s) for s in expansion.scans
    ]
    for n, p, spec in plan.operand_specs:
        if n in back:
            operand_specs.append((back[n], p, spec))
        elif n in marker_operand:
            scan, k = marker_operand[n]
            operand_specs.append((scan, k, spec))
        else:
            for start, end, s in where:
                if start <= n < end:
                    body_operands[s.scan].append((n - start, p, spec))
    bodies = []
    node_strategies = [
        plan.node_strategies[p] if p is not None else "" for p in expansion.planning_node
    ]
    for s in expansion.scans:
        specs = plan.var_specs[s.var_offset : s.var_offset + len(s.body.vars)]
        first_carry = original.nodes[s.scan].params["num_consts"]
        out_specs = []
        for k, b in enumerate(s.body.outvars):
            if k < s.num_carry:  # tied: the carry keeps its layout on entry
                out_specs.append(specs[s.body.invars[first_carry + k]])
            else:
                out_specs.append(_stack_operand_spec(plan, s.exits[k], specs[b]))
        bodies.append(
            BodyPlan(
                node=s.scan,
                var_specs=tuple(specs),
                operand_specs=tuple(body_operands[s.scan]),
                out_specs=tuple(out_specs),
                strategies=tuple(
                    (n, plan.node_strategies[s.node_offset + n])
                    for n in range(len(s.body.nodes))
                    if plan.node_strategies[s.node_offset + n].endswith((OVERLAPPED, PER_GEMM))
                ),
            )
        )
        length = original.nodes[s.scan].params["length"]
        node_strategies[s.scan] = f"body plan x{length}"
    return replace(
        plan,
        var_specs=plan.var_specs[:num_vars],
        node_strategies=tuple(node_strategies),
        constrained=tuple(v for v in plan.constrained if v < num_vars),
        output_overrides=tuple((v, s) for v, s in plan.output_overrides if v < num_vars),
        operand_specs=tuple(operand_specs),
        graph_fingerprint=graph_fingerprint(original),
        scan_bodies=tuple(bodies),
    )


def _stack_operand_spec(plan: ShardingPlan, exit_node: int, produced):
    """The layout a `scan_stack` marker takes its per-iteration operand in."""
    for n, p, spec in plan.operand_specs:
        if n == exit_node and p == 0:
            return spec
    return produced
