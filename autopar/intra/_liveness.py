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
  last. A reshard that is a local slice alone (the consumer's layout splits the value
  further, no collective on the route) is taken where the value is made and kept in its
  place: the slice lives from the value's producer to its last reader through it, and those
  readers do not keep the whole value alive (XLA fuses the `dynamic-slice` into the
  producer's loop; gpt on (2, 4) keeps a quarter of each attention input for the backward).
- **Layout copies.** A convolution reads its operands in the backend's layout (XLA's
  `dim_labels` b01f for the input, 01io for the kernel). An operand whose dimensions the
  convolution reads in another order (the kernel gradient's input with batch and feature
  swapped, the input gradient's kernel with its two features swapped) is copied into that
  layout: the copy lives from the value's production (for a graph input, its first reader)
  to the last convolution reading it so. It is a copy of the operand as the convolution
  reads it: a kernel split over its features but gathered for the convolution is copied
  whole.

A kernel's own buffers (`extra`: the ring attention's K/V blocks in flight and its zig-zag
copies, `autopar.intra._ring_strategies.ring_buffer_temporaries`) are temporaries like the
resharded operands, live over the nodes the kernel replaces.

The identity markers (`layer_boundary`, `grad_boundary`) pass their operands through: an
output is the same buffer as its operand, counted once and live until the last use of
either. On a cluster whose attention runs as one fused kernel (`fused_attention`), the
values inside it (`attention_core`: scores, probabilities, their gradients) hold only their
per-row softmax statistics. Non-donated inputs are live all step. Constants are not
counted (XLA folds them into the program).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from autopar.cluster import spec_axes
from autopar.cost import bytes_per_device, fused_attention_bytes
from autopar.graph import OpGraph, Role, attention_core
from autopar.intra._reshard import reshard_collectives
from autopar.intra._rules import ELEMENTWISE
from autopar.intra._strategies import step_effects

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
    free: Collection[int] = (),
    fused_attention: bool = False,
    extra: Sequence[tuple[int, int, float]] = (),
) -> float:
    """Largest live bytes per device at any program point of `graph` under these layouts.

    **Arguments:**
    - `var_specs`: per variable id, its layout (None: replicated).
    - `donated`: input variable ids whose buffers the step's outputs reuse.
    - `operand_specs`: (node id, operand position, layout) of operands resharded for their
      consumer (`ShardingPlan.operand_specs`).
    - `free`: variable ids that never occupy device memory: counted as 0 bytes.
    - `fused_attention`: attention runs as one fused kernel (`Cluster.fused_attention`):
      each value of `attention_core` holds only its per-row softmax statistics
      (`autopar.cost.fused_attention_bytes`).
    - `extra`: (first node id, last node id, bytes per device) of buffers a kernel holds
      beside its operands and results, live from before the first node to after the last
      (the ring's K/V blocks: `autopar.intra._ring_strategies.ring_buffer_temporaries`).

    **Returns:** bytes per device (float).
    """
    return _walk(graph, var_specs, mesh, donated, operand_specs, free=free,
                 fused_attention=fused_attention, extra=extra)[0]


def split_peak_live_bytes(
    graph: OpGraph,
    var_specs: Sequence,
    mesh,
    split: int,
    operand_specs: Sequence[tuple[int, int, tuple]] = (),
    free: Collection[int] = (),
    extra: Sequence[tuple[int, int, float]] = (),
) -> tuple[float, float]:
    """`peak_live_bytes` over the program points before node `split` and over those from
    it on: (peak before, peak from). A layer's per-microbatch forward and backward come
    before its optimizer update, which runs once per step after the last microbatch's
    backward (`autopar.inter.passes.partition`'s apply fragments), when no microbatch's
    kept activations are held: the two peaks never coincide with the same activations."""
    _, _, before, after = _walk(graph, var_specs, mesh, (), operand_specs, free=free,
                                split=split, extra=extra)
    return before, after


def _walk(graph, var_specs, mesh, donated=(), operand_specs=(), record=False, free=(),
          fused_attention=False, split=None, extra=()):
    """`peak_live_bytes` and, with `record`, what is live at the peak: (node id, {var:
    bytes}, [(first, last, bytes) of live temporaries], bytes of the always-live inputs).
    With `split` (a node id), also the peaks before that node and from it on."""

    nbytes = _byte_counter(graph, var_specs, mesh, frozenset(free), fused_attention)
    consumers = graph.consumers()
    returned = set(graph.outvars)
    buffer = _buffers(graph)  # var -> the var whose buffer holds it
    sliced = _sliced_reads(graph, operand_specs, var_specs, mesh)
    made = _made_at(graph)
    last_use = _last_uses(graph, var_specs, buffer, sliced, made, returned)
    fused = _fused_values(graph, consumers, returned)
    copy_bytes = _layout_copy_bytes(graph, consumers, operand_specs, nbytes)
    # Temporaries: (first node, last node, bytes), live from before the first to after the
    # last (resharded operands, layout copies).
    temporaries = [*_reshard_temporaries(graph, operand_specs, var_specs, mesh, nbytes,
                                         sliced, made),
                   *((first, last, copy_bytes[key]) for key, (first, last) in
                     _layout_copies(graph, consumers).items()),
                   *extra]
    starting: dict[int, list[int]] = {}
    for t, (first, _, _) in enumerate(temporaries):
        starting.setdefault(first, []).append(t)
    always, live = _live_inputs(graph, set(donated), returned, last_use, nbytes)
    current = sum(live.values())
    peak = always + current
    at_peak = (-1, dict(live), [], always) if record else None
    halves = [peak, 0.0]  # peaks before `split` and from it on
    active: set[int] = set()
    for node in graph.nodes:
        for v in node.outputs:
            if v in last_use and v not in fused and v not in live:
                live[v] = nbytes(v)
                current += live[v]
        for t in starting.get(node.id, ()):
            active.add(t)
            current += temporaries[t][2]
        if split is not None:
            half = int(node.id >= split)
            halves[half] = max(halves[half], always + current)
        if always + current > peak:
            peak = always + current
            if record:
                at_peak = (node.id, dict(live), [temporaries[t] for t in active], always)
        for v in dict.fromkeys(buffer.get(u, u) for u in (*node.inputs, *node.outputs)):
            if v in live and last_use.get(v, -1) <= node.id:
                current -= live.pop(v)
        for t in [t for t in active if temporaries[t][1] <= node.id]:
            active.remove(t)
            current -= temporaries[t][2]
    if split is not None:
        return peak, at_peak, halves[0], halves[1]
    return peak, at_peak


def _byte_counter(graph, var_specs, mesh, free: frozenset, fused_attention: bool):
    """``nbytes(var, spec=None)``: bytes per device a variable holds at `spec` (default its
    own layout): 0 for `free` ones, the softmax statistics for the fused attention core."""
    core = attention_core(graph) if fused_attention else frozenset()

    def nbytes(v: int, spec=None) -> float:
        if v in free:
            return 0.0
        var = graph.vars[v]
        spec = var_specs[v] if spec is None else spec
        if v in core:
            return fused_attention_bytes(var.shape, spec, mesh)
        if spec is None or not var.shape:
            return float(var.nbytes)
        return bytes_per_device(var.shape, var.dtype, spec, mesh)

    return nbytes


def _last_uses(graph, var_specs, buffer, sliced, made, returned) -> dict[int, int]:
    """Buffer -> the last node that reads it (`len(graph.nodes)` for a returned one; the
    combined all-reduce's node for the reductions XLA merges)."""
    last_use: dict[int, int] = {}
    end = len(graph.nodes)
    for node in graph.nodes:
        for position, v in enumerate(node.inputs):
            b = buffer.get(v, v)
            # A read of a slice made at production is no read of the value itself.
            use = made.get(v, node.id) if (node.id, position) in sliced else node.id
            last_use[b] = max(last_use.get(b, -1), use)
    for v in returned:
        last_use[buffer.get(v, v)] = end
    # Reductions XLA's combiner merges run as one collective after the last of them is
    # made, reducing each buffer in place: each stays live until then at least.
    combined = _combined_reductions(graph, var_specs)
    if combined:
        bucket = max(made[v] for v in combined)
        for v in combined:
            b = buffer.get(v, v)
            last_use[b] = max(last_use.get(b, -1), bucket)
    return last_use


def _live_inputs(graph, donated: set, returned: set, last_use, nbytes
                 ) -> tuple[float, dict[int, float]]:
    """(bytes of the inputs live all step: those not donated, or returned; {donated input:
    bytes} live until their last use)."""
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
    return always, live


def _combined_reductions(graph: OpGraph, var_specs) -> list[int]:
    """Results of the reductions XLA merges into the step's combined all-reduce: nodes
    `step_effects` calls combinable (only sums and elementwise work follow) that contract
    or reduce over a mesh axis their result is not split on (a weight or bias gradient
    summed over a split batch), as their costs charge them (`combined_collective_time`)."""
    combinable = step_effects(graph).combinable
    found = []
    for node in graph.nodes:
        if node.id not in combinable or node.primitive not in REDUCING:
            continue
        out = node.outputs[0]
        out_spec = var_specs[out] if out < len(var_specs) else None
        out_axes = set(spec_axes(out_spec)) if out_spec else set()
        in_axes = {a for v in node.inputs if v < len(var_specs) and var_specs[v]
                   for a in spec_axes(var_specs[v])}
        if in_axes - out_axes and graph.vars[out].shape:
            found.append(out)
    return found


REDUCING = frozenset(("dot_general", "conv_general_dilated", "reduce_sum"))


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
    spans: dict[tuple[int, tuple], tuple[int, int]] = {}
    for v, order, made, node, _ in _layout_reads(graph, consumers):
        first, last = spans.get((v, order), (made, node.id))
        spans[(v, order)] = (min(first, made), max(last, node.id))
    return spans


def _layout_reads(graph: OpGraph, consumers):
    """(value, dimension order, node that makes it, convolution, [(node, operand position)]
    of the reads from the value to the convolution through layout-only ops) of every
    convolution operand read in another order than the backend's."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    for node in graph.nodes:
        if node.primitive not in LAYOUT_BOUND:
            continue
        for position, (v, order) in enumerate(zip(node.inputs, _conv_operand_orders(node))):
            if order == tuple(range(len(order))):
                continue
            reads = [(node.id, position)]
            while v in producer and producer[v].primitive in LAYOUT_ONLY:
                reads.append((producer[v].id, 0))
                v = producer[v].inputs[0]
            if graph.vars[v].role is Role.CONST:
                continue
            made = producer[v].id if v in producer else consumers[v][0]
            yield v, order, made, node, reads


def _layout_copy_bytes(graph: OpGraph, consumers, operand_specs, nbytes) -> dict:
    """(var, dimension order) -> bytes per device of its layout copy: the value as the
    convolution reads it, the largest layout along the layout-only ops there (a kernel
    split over its input features but read whole by the input gradient is copied whole:
    XLA:CPU, wide_resnet on (2, 4), a `transpose_copy_fusion` of the gathered kernel)."""
    resharded = {(n, p): spec for n, p, spec in operand_specs}
    sizes: dict[tuple[int, tuple], float] = {}
    for v, order, _, _, reads in _layout_reads(graph, consumers):
        size = nbytes(v)
        for node_id, position in reads:
            u = graph.nodes[node_id].inputs[position]
            size = max(size, nbytes(u), nbytes(u, resharded.get((node_id, position))))
        sizes[(v, order)] = max(sizes.get((v, order), 0.0), size)
    return sizes


def _conv_operand_orders(node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The order in which a convolution reads the dimensions of its input and kernel: the
    input as (batch, spatial..., feature), the kernel as (spatial..., in, out)."""
    dn = node.params["dimension_numbers"]
    lhs, rhs = tuple(dn.lhs_spec), tuple(dn.rhs_spec)
    return (lhs[0], *lhs[2:], lhs[1]), (*rhs[2:], rhs[1], rhs[0])


def _reshard_temporaries(graph: OpGraph, operand_specs, var_specs, mesh, nbytes,
                         sliced=frozenset(), made=None):
    """(first, last node, bytes per device) of each resharded copy: one per value and
    target layout (XLA computes equal reshards once), live from its first consumer to its
    last; a slice (`sliced`) from where the value is made (`made`) on."""
    spans: dict[tuple[int, tuple], tuple[int, int, float]] = {}
    for node_id, position, spec in operand_specs:
        v = graph.nodes[node_id].inputs[position]
        key = (v, spec)
        first = made.get(v, node_id) if (node_id, position) in sliced else node_id
        if key in spans:
            was, last, size = spans[key]
            spans[key] = (min(was, first), max(last, node_id), size)
        else:
            size = _reshard_bytes(graph, v, var_specs[v], spec, mesh, nbytes)
            spans[key] = (first, node_id, size)
    return spans.values()


def _sliced_reads(graph: OpGraph, operand_specs, var_specs, mesh) -> set[tuple[int, int]]:
    """(node id, operand position) of operands resharded by a local slice alone (no
    collective on XLA's route: the consumer's layout splits the value further). XLA takes
    such a slice once, right where the value is made (the `dynamic-slice` fuses into the
    producer's loop), and keeps only the slice for a later reader: the attention's
    query, key and value and a layer norm's output read by the backward with the batch
    split over more devices (XLA:CPU, gpt on (2, 4): `dynamic-slice_bitcast_fusion`s of
    a quarter, live from the forward to the backward, while the whole values die). A
    graph input's slice is taken where it is read, as any reshard."""
    sliced = set()
    for node_id, position, spec in operand_specs:
        v = graph.nodes[node_id].inputs[position]
        var = graph.vars[v]
        if not var.shape or spec is None or var.producer is None:
            continue  # a graph input is sliced where it is read
        have = var_specs[v] or ((),) * len(var.shape)
        if have != spec and not reshard_collectives(var.shape, var.dtype, have, spec, mesh):
            sliced.add((node_id, position))
    return sliced


def _made_at(graph: OpGraph) -> dict[int, int]:
    """Var -> the node that makes it (graph inputs have none)."""
    return {v: n.id for n in graph.nodes for v in n.outputs}


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
