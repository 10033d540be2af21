"""Peak live bytes per device of a planned step, as XLA will hold them.

In: a graph, the layout chosen for every variable (`ShardingPlan.var_specs`), the operands
the lowering reshards (`ShardingPlan.operand_specs`) and the graph inputs whose buffers the
step's outputs reuse (donated state). Out: `peak_live_bytes`, the largest sum of live bytes
per device over the program points, walked in program order.

The sharding ILP limits memory with a coarser linear model (`_problem._memory_groups`:
every graph input live all step, every variable materialised). The compiled program differs
from that model in four ways, each modelled here:

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
  the consumer's layout: a temporary as large as the largest value on XLA's route there (an
  all-gather's result; the whole tensor where XLA gathers everything and slices). XLA
  computes equal reshards of one value once (common-subexpression elimination), so the
  copies of a value to one layout are one temporary, live from its first consumer to its
  last.
- **Layout copies.** A convolution reads its operands in the backend's layout (XLA's
  `dim_labels` b01f for the input, 01io for the kernel). An operand whose dimensions the
  convolution reads in another order (the kernel gradient's input with batch and feature
  swapped, the input gradient's kernel with its two features swapped) is copied into that
  layout: the copy lives from the value's production (for a graph input, its first reader)
  to the last convolution reading it so.

The identity markers (`layer_boundary`, `grad_boundary`) pass their operands through: an
output is the same buffer as its operand, counted once and live until the last use of
either. Non-donated inputs are live all step. Constants are not counted (XLA folds them into the
program).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from autopar.cost import bytes_per_device
from autopar.graph import OpGraph, Role
from autopar.intra._reshard import reshard_collectives
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
    # Temporaries: (first node, last node, bytes), live from before the first to after the
    # last (resharded operands, layout copies).
    temporaries = [*_reshard_temporaries(graph, operand_specs, var_specs, mesh, nbytes),
                   *((first, last, nbytes(v)) for (v, _), (first, last) in
                     _layout_copies(graph, consumers).items())]
    starting: dict[int, list[int]] = {}
    for t, (first, _, _) in enumerate(temporaries):
        starting.setdefault(first, []).append(t)
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
    active: set[int] = set()
    for node in graph.nodes:
        for v in node.outputs:
            if v in last_use and v not in fused and v not in live:
                live[v] = nbytes(v)
                current += live[v]
        for t in starting.get(node.id, ()):
            active.add(t)
            current += temporaries[t][2]
        peak = max(peak, always + current)
        for v in dict.fromkeys(buffer.get(u, u) for u in (*node.inputs, *node.outputs)):
            if v in live and last_use.get(v, -1) <= node.id:
                current -= live.pop(v)
        for t in [t for t in active if temporaries[t][1] <= node.id]:
            active.remove(t)
            current -= temporaries[t][2]
    return peak


# Ops that read their operands in a layout of the backend's choosing (a convolution's
# input and kernel: XLA's layout assignment picks the layouts its kernels take).
LAYOUT_BOUND = frozenset(("conv_general_dilated",))
# Ops through which a layout-bound operand is still the same data (XLA folds them into the
# layout copy): the backward convolution reads the kernel reversed and transposed.
LAYOUT_ONLY = frozenset(("rev", "transpose", "reshape", "convert_element_type", "copy"))


def _layout_copies(graph: OpGraph, consumers) -> dict[tuple[int, tuple], tuple[int, int]]:
    """Values XLA also holds in a layout-bound op's layout:
    (var, dimension order) -> (first, last) node of the copy's life.

    A convolution reads its input in the order (batch, spatial..., feature) and its kernel
    in (spatial..., in feature, out feature) (XLA's b01f_01io->b01f); an operand whose
    dimension numbers name another order of its dimensions is copied into that one. The
    copy folds in the layout-only ops between the value and the convolution (the input
    gradient's kernel is read reversed) and is made as soon as the value is (a graph
    input's when its first reader runs), so it lives from there to the last convolution
    that reads the value in that order: in the backward, the kernel gradient reads the
    forward's input with batch and feature swapped, and the input gradient reads the kernel
    with its features swapped. (XLA:CPU, wide_resnet: a `transpose_copy_fusion` per
    kernel and per convolution input, live from the forward to the backward.)"""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    spans: dict[tuple[int, tuple], tuple[int, int]] = {}
    for node in graph.nodes:
        if node.primitive not in LAYOUT_BOUND:
            continue
        for v, order in zip(node.inputs, _conv_operand_orders(node)):
            if order == tuple(range(len(order))):
                continue
            while v in producer and producer[v].primitive in LAYOUT_ONLY:
                v = producer[v].inputs[0]
            if graph.vars[v].role is Role.CONST:
                continue
            made = producer[v].id if v in producer else consumers[v][0]
            first, last = spans.get((v, order), (made, node.id))
            spans[(v, order)] = (min(first, made), max(last, node.id))
    return spans


def _conv_operand_orders(node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The order in which a convolution reads the dimensions of its input and kernel: the
    input as (batch, spatial..., feature), the kernel as (spatial..., in, out)."""
    dn = node.params["dimension_numbers"]
    lhs, rhs = tuple(dn.lhs_spec), tuple(dn.rhs_spec)
    return (lhs[0], *lhs[2:], lhs[1]), (*rhs[2:], rhs[1], rhs[0])


def _reshard_temporaries(graph: OpGraph, operand_specs, var_specs, mesh, nbytes):
    """(first, last node, bytes per device) of each resharded copy: one per value and
    target layout (XLA computes equal reshards once), live from its first consumer to its
    last."""
    spans: dict[tuple[int, tuple], tuple[int, int, float]] = {}
    for node_id, position, spec in operand_specs:
        v = graph.nodes[node_id].inputs[position]
        key = (v, spec)
        if key in spans:
            first, last, size = spans[key]
            spans[key] = (min(first, node_id), max(last, node_id), size)
        else:
            size = _reshard_bytes(graph, v, var_specs[v], spec, mesh, nbytes)
            spans[key] = (node_id, node_id, size)
    return spans.values()


def _reshard_bytes(graph: OpGraph, v: int, have, want, mesh, nbytes) -> float:
    """Bytes per device a reshard of `v` from `have` to `want` holds while it runs: the
    largest value along XLA's route (`reshard_collectives`: the result of its biggest
    all-gather; the whole tensor where XLA finds no route but to gather everything and
    slice, its "involuntary full rematerialization"), or the result at `want`."""
    result = nbytes(v, want)
    var = graph.vars[v]
    if have is None or want is None or not var.shape or have == want:
        return result
    route = reshard_collectives(var.shape, var.dtype, have, want, mesh)
    return max([result, *(c.nbytes for c in route)])


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
