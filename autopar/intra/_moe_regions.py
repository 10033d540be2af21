"""Expert MLP regions: the grouped GEMMs and row-wise ops that one dispatch serves.

A dropless MoE layer runs its routed tokens through several grouped GEMMs (gate, up,
down; in the backward their token and weight gradients) joined by row-wise ops (SiLU,
the gate's product, their gradients). Expert-parallel, DeepSeek-V3 and Megatron-Core
dispatch the tokens to their expert's device once before the expert MLP and combine once
after it: every GEMM and row-wise op between runs on the device holding the expert.

In: a graph (a train step or a scan body). Out: its `ExpertRegion`s, found from the
graph alone:

- the **GEMMs**: `ragged_dot_general` nodes with an expert-parallel layout
  (`autopar.intra._strategies_moe.ep_layout`), grouped by their group-sizes variable (the
  routing that orders their rows);
- the **row ops**: single-result elementwise nodes whose non-scalar operands and result
  share one shape with the GEMMs' row count leading, and at least one operand produced
  inside the region (they join it);
- the **inputs**: row operands of the region's nodes produced outside it (dispatched
  on entry), and the **outputs**: row variables produced inside it and read outside it or
  returned by the graph (combined on exit). A scan body's (named `SCAN_BODY`) returned
  rows are the layer's residuals for the backward: `exchanged_inputs` /
  `exchanged_outputs` say which rows cross the region's boundary by all-to-all (a
  residual read only inside the backward's region stays on its expert's device,
  `autopar.lower._experts`).

The cost of an expert-parallel GEMM (`_strategies_moe`) is its share of its region's
boundary exchanges; `autopar.lower._experts` runs the region on dispatched rows when
the plan puts every GEMM of it in the all-to-all layout over the same mesh axes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from autopar._memo import declare
from autopar.graph import OpGraph
from autopar.intra._rules import ELEMENTWISE
from autopar.intra._rules_moe import ragged_form

ROW_OPS = frozenset(ELEMENTWISE) - {"optimization_barrier"}

@dataclass
class ExpertRegion:
    """One expert MLP's grouped GEMMs and row ops sharing a routing (module docstring)."""

    group_sizes: int  # the variable of the group sizes
    rows: int  # M, the routed rows (sorted tokens · top-k)
    gemms: list[int] = field(default_factory=list)  # node ids, program order
    row_ops: list[int] = field(default_factory=list)
    members: set[int] = field(default_factory=set)  # every node id of the region
    produced: set[int] = field(default_factory=set)  # row vars produced inside
    inputs: list[int] = field(default_factory=list)  # row vars entering (dispatched)
    outputs: list[int] = field(default_factory=list)  # row vars leaving (combined)
    # Body results: inputs and outputs returned by the graph and read nowhere else
    # outside the region (residuals kept on their expert's device).
    kept: set[int] = field(default_factory=set)
    # Inputs that are the graph's own inputs (residuals that arrive dispatched).
    arriving: set[int] = field(default_factory=set)

    def exchanged_inputs(self) -> list[int]:
        """The inputs a dispatch all-to-all brings in (not the arriving residuals)."""
        return [v for v in self.inputs if v not in self.arriving]

    def exchanged_outputs(self) -> list[int]:
        """The outputs a combine all-to-all sends back (not the kept residuals)."""
        return [v for v in self.outputs if v not in self.kept]


def row_operands(node, graph: OpGraph) -> list[int]:
    """The row variables a grouped GEMM reads: form 1 its lhs, form 2 lhs and rhs."""
    if ragged_form(node.params) == 2:
        return [node.inputs[0], node.inputs[1]]
    return [node.inputs[0]]


def expert_regions(graph: OpGraph) -> list[ExpertRegion]:
    """The expert MLP regions of `graph` (module docstring), in program order."""
    from autopar.intra._strategies_moe import ep_layout

    regions: dict[int, ExpertRegion] = {}
    owner: dict[int, ExpertRegion] = {}  # row var produced inside -> its region
    for node in graph.nodes:
        if node.primitive == "ragged_dot_general" and ep_layout(node, graph) is not None:
            sizes = node.inputs[2]
            rows = graph.vars[node.inputs[0]].shape[0]
            region = regions.setdefault(sizes, ExpertRegion(sizes, rows))
            if region.rows != rows:
                continue
            region.gemms.append(node.id)
            region.members.add(node.id)
            if ragged_form(node.params) == 1:
                (out,) = node.outputs
                region.produced.add(out)
                owner[out] = region
            continue
        if node.primitive not in ROW_OPS or len(node.outputs) != 1:
            continue
        inside = {id(owner[v]): owner[v] for v in node.inputs if v in owner}
        if len(inside) != 1:
            continue
        (region,) = inside.values()
        (out,) = node.outputs
        shape = graph.vars[out].shape
        if not shape or shape[0] != region.rows or any(
                graph.vars[v].shape not in ((), shape) for v in node.inputs):
            continue
        region.row_ops.append(node.id)
        region.members.add(node.id)
        region.produced.add(out)
        owner[out] = region
    found = [r for r in regions.values() if r.gemms]
    consumers = graph.consumers()
    body = graph.name == SCAN_BODY
    for region in found:
        _boundary(region, graph, consumers, body)
    return found


def regions_by_gemm(graph: OpGraph) -> dict[int, ExpertRegion]:
    """Grouped GEMM node id -> its expert MLP region, for every region of `graph`
    (`expert_regions`), computed once per graph in a search."""
    found = _BY_GEMM.get(graph)
    if found is None:
        found = _BY_GEMM[graph] = {g: r for r in expert_regions(graph) for g in r.gemms}
    return found


# graph -> {grouped GEMM node id: its region}; dropped when the search ends, and forgets
# graphs nothing else holds.
_BY_GEMM: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "intra.expert_regions",
    "graph -> {grouped GEMM node id: its expert MLP region}")


# The name `autopar.intra._scan.opened_body` gives a scan's body graph, as both the
# planner and the lowering build it.
SCAN_BODY = "scan body"


def _boundary(region: ExpertRegion, graph: OpGraph, consumers, body: bool) -> None:
    """The region's inputs and outputs; in a scan body (`body`), which rows are the
    layer's residuals that stay dispatched (elsewhere the graph's own inputs and results
    are the caller's, in block form)."""
    graph_in = set(graph.invars) if body else set()
    graph_out = set(graph.outvars)
    kept_out = graph_out if body else set()
    seen: dict[int, None] = {}
    for nid in sorted(region.members):
        node = graph.nodes[nid]
        rows = (row_operands(node, graph) if node.primitive == "ragged_dot_general"
                else [v for v in node.inputs if graph.vars[v].shape])
        for v in rows:
            if v not in region.produced:
                seen.setdefault(v)
    region.inputs = list(seen)
    region.arriving = {v for v in region.inputs if v in graph_in
                       and all(c in region.members for c in consumers[v])}
    for v in region.inputs:
        if v in kept_out and all(c in region.members for c in consumers[v]):
            region.kept.add(v)
    for v in sorted(region.produced):
        outside = [c for c in consumers[v] if c not in region.members]
        if outside or v in graph_out:
            region.outputs.append(v)
            if not outside and v in kept_out:
                region.kept.add(v)
