"""Peak live bytes per device of a planned step, as XLA will hold them.

In: a graph, the layout chosen for every variable (`ShardingPlan.var_specs`), the operands
the lowering reshards (`ShardingPlan.operand_specs`) and the graph inputs whose buffers the
step's outputs reuse (donated state). Out: `peak_live_bytes`, the largest sum of live bytes
per device over the program points, walked in program order.

The sharding ILP limits memory with a coarser linear model (`_problem._memory_groups`:
every graph input live all step, every variable materialised). The compiled program differs
from that model in three ways, each modelled here:

- **Donation.** A donated input's buffer is aliased to the output that updates it
  (`jax.jit(donate_argnums=...)`; XLA's `alias_size_in_bytes`), so the old state dies at its
  last use and the new state lives from its producer on: the two are counted once, not twice.
- **Fusion.** XLA fuses an elementwise op (or a broadcast, reshape, convert) into its
  consumer: a value produced by such an op and read by exactly one op, itself fusible, is
  never written to memory. A value read by several ops is counted as materialised (XLA
  duplicates a producer into several fusions only when it is cheap, which this model does
  not guess), as is one read by a non-fusible op (a matmul, a convolution, a gather, a
  collective) or returned by the step.
- **Resharding.** An operand whose layout changes on the way to its consumer is copied to
  the consumer's layout: a temporary at that layout, live while the consumer runs.

The identity markers (`layer_boundary`, `grad_boundary`) pass their operands through: an
output is the same buffer as its operand, counted once and live until the last use of
either. Non-donated inputs are live all step. Constants are not counted (XLA folds them into the
program).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from autopar.cost import bytes_per_device
from autopar.graph import OpGraph, Role
from autopar.intra._rules import ELEMENTWISE

# Ops XLA fuses into their consumers, besides the elementwise ones: layout-only ops and
# broadcasts (loop fusion takes them as part of the fused loop).
FUSIBLE = frozenset(ELEMENTWISE) | frozenset(
    ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota")
)
# Identity markers (autopar/graph/_markers.py): their outputs are their operands' buffers.
PASS_THROUGH = frozenset(("layer_boundary", "grad_boundary"))


def peak_live_bytes(
    graph: OpGraph,
    var_specs: Sequence,
    mesh,
    donated: Collection[int] = (),
    operand_specs: Sequence[tuple[int, int, tuple]] = (),
) -> float:
    """Largest live bytes per device at any program point of `graph` under these layouts.

    **Arguments:**
    - `var_specs`: per variable id, its layout (None: replicated).
    - `donated`: input variable ids whose buffers the step's outputs reuse.
    - `operand_specs`: (node id, operand position, layout) of operands resharded for their
      consumer (`ShardingPlan.operand_specs`).

    **Returns:** bytes per device (float).
    """

    def nbytes(v: int, spec=None) -> float:
        var = graph.vars[v]
        spec = var_specs[v] if spec is None else spec
        if spec is None or not var.shape:
            return float(var.nbytes)
        return bytes_per_device(var.shape, var.dtype, spec, mesh)

    consumers = graph.consumers()
    returned = set(graph.outvars)
    buffer = _buffers(graph)  # var -> the var whose buffer holds it
    last_use: dict[int, int] = {}
    end = len(graph.nodes)
    for v, node_ids in enumerate(consumers):
        if node_ids or v in returned:
            b = buffer.get(v, v)
            last_use[b] = max(last_use.get(b, -1), end if v in returned else node_ids[-1])
    fused = _fused_values(graph, consumers, returned)
    reshards: dict[int, float] = {}
    for node_id, position, spec in operand_specs:
        v = graph.nodes[node_id].inputs[position]
        reshards[node_id] = reshards.get(node_id, 0.0) + nbytes(v, spec)
    donated = set(donated)
    always = 0.0  # non-donated inputs
    live: dict[int, float] = {}
    for v in dict.fromkeys(graph.invars):
        if graph.vars[v].role is Role.CONST:
            continue
        if v in donated and v not in returned:
            if v in last_use:
                live[v] = nbytes(v)
        else:
            always += nbytes(v)
    current = sum(live.values())
    peak = always + current
    for node in graph.nodes:
        for v in node.outputs:
            if v in last_use and v not in fused and v not in live:
                live[v] = nbytes(v)
                current += live[v]
        peak = max(peak, always + current + reshards.get(node.id, 0.0))
        for v in dict.fromkeys(buffer.get(u, u) for u in (*node.inputs, *node.outputs)):
            if v in live and last_use.get(v, -1) <= node.id:
                current -= live.pop(v)
    return peak


def _buffers(graph: OpGraph) -> dict[int, int]:
    """Outputs of pass-through markers -> the variable whose buffer they share."""
    buffer: dict[int, int] = {}
    for node in graph.nodes:
        if node.primitive in PASS_THROUGH:
            for operand, result in zip(node.inputs, node.outputs):
                buffer[result] = buffer.get(operand, operand)
    return buffer


def _fused_values(graph: OpGraph, consumers, returned) -> set[int]:
    """Values XLA computes inside a fused loop and never writes to memory."""
    fused = set()
    for node in graph.nodes:
        if node.primitive not in FUSIBLE:
            continue
        for v in node.outputs:
            readers = consumers[v]
            if v in returned or not readers:
                continue
            if len(readers) == 1 and graph.nodes[readers[0]].primitive in FUSIBLE:
                fused.add(v)
    return fused
