"""Fusion: which bytes of each node cross a kernel boundary, the way XLA's GPU fusion does.

In: an `OpGraph`. Out: `FusionTraffic`, per node and operand whether the operand is read
from device memory, and per result whether it is written there. A node inside a fusion
reads and writes only what crosses the fusion's boundary; the cost model charges a node
those bytes (`autopar.cost.fusion_boundary_bytes`) plus its FLOPs, so the per-node ILP
keeps per-node costs while a chain of elementwise ops costs about one read of its inputs
and one write of its outputs (REFERENCES.md, "Compute on GPUs"), not one round trip per op.

Every primitive has a fusion kind (`FUSION_KINDS`, a registry with a default):

* ``"elementwise"`` (the default): elementwise math, broadcast, convert, reshape,
  transpose, slices, select, iota, gather, the autopar markers. Fuses with producers and
  consumers of the same kind, and into a reduction that consumes it.
* ``"reduce"``: reductions. Fuse with their producers (XLA's input fusion); their results
  leave the kernel.
* ``"matmul"``: dots and convolutions, a library kernel each, with a fused prologue (a
  single-use convert, transpose, reshape or broadcast of an operand) and a fused epilogue
  (the single elementwise consumer of a single-use result: bias add, activation).
* ``"kernel"``: everything else that XLA runs as its own kernel (control flow, sort,
  scatter, cumulative ops, collectives, dynamic_update_slice): nothing fuses with it.
* ``"boundary"``: the markers of an opened scan (`autopar.intra._scan`: ``scan_slice``,
  ``scan_enter``, ``scan_exit``, ``scan_stack``). A loop body is its own computation,
  so no fusion crosses them: what enters the body is read from device memory every
  iteration, what leaves it is written. The markers themselves move no data (0 bytes).

An edge p -> c between fusible nodes fuses only when no reduction or kernel lies on any
path from p to c, i.e. both are at the same *depth* (the most kernels and reductions on a
path from the graph inputs; a matmul with a fused epilogue does not count, since its
epilogue runs in its kernel). Otherwise fusing would make a cycle: a forward activation
read by the backward pass, or `x` in ``x - mean(x)``, is written once and read again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from autopar._memo import declare
from autopar.graph._opgraph import Node, OpGraph

FusionKind = Literal["elementwise", "reduce", "matmul", "kernel", "boundary"]

FUSION_KINDS: dict[str, FusionKind] = {}
DEFAULT_FUSION_KIND: FusionKind = "elementwise"


def register_fusion(kind: FusionKind, *names: str) -> None:
    """Give primitives `names` the fusion kind `kind` (see the module docstring)."""
    for name in names:
        FUSION_KINDS[name] = kind


def fusion_kind(primitive: str) -> FusionKind:
    """The fusion kind of `primitive`; unlisted primitives are elementwise."""
    return FUSION_KINDS.get(primitive, DEFAULT_FUSION_KIND)


register_fusion("matmul", "dot_general", "conv_general_dilated", "ragged_dot_general")
register_fusion(
    "reduce",
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin",
)
register_fusion(
    "kernel",
    "scan", "while", "cond", "sort", "scatter", "scatter-add", "scatter_add", "scatter-mul",
    "scatter_mul", "dynamic_update_slice", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "select_and_scatter_add", "psum", "all_gather", "psum_scatter", "reduce_scatter",
    "all_to_all", "ppermute", "rng_bit_generator", "custom_call", "fft", "top_k",
    "triangular_solve", "cholesky", "lu", "qr", "eigh", "svd",
)

register_fusion("boundary", "scan_slice", "scan_enter", "scan_exit", "scan_stack")

# Elementwise producers a dot or convolution reads through (cuBLAS/Triton GEMM fusions fuse
# an operand's layout or dtype change; XLA's GEMM rewriter folds transposes into the call).
PROLOGUE_PRIMITIVES = frozenset(
    {"convert_element_type", "transpose", "reshape", "broadcast_in_dim", "copy", "copy_p"}
)


@dataclass(frozen=True)
class FusionTraffic:
    """Per node (by node id): `reads[i]` is True when operand i comes from device memory;
    `writes[j]` is True when result j is written there (used outside its fusion, or a graph
    output)."""

    reads: Mapping[int, tuple[bool, ...]]
    writes: Mapping[int, tuple[bool, ...]]


_CACHE: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "graph.fusion_traffic",
    "graph -> {(fused attention, ...): FusionTraffic}")


# The smallest sequence length whose sequence x sequence attention tensors a fused
# attention kernel keeps on chip (`attention_core`); shorter ones are not worth a kernel.
MIN_FUSED_SEQUENCE = 128


def attention_core(graph: OpGraph, outputs: bool = False) -> frozenset[int]:
    """Variables a fused attention kernel (FlashAttention; Dao et al. 2022) never writes to
    device memory: the results of operations shaped (..., s, s) with at least 3
    dimensions and s >= `MIN_FUSED_SEQUENCE` — the scores, mask, softmax and, backward,
    their gradients, per batch and head. The kernel streams Q, K and V through on-chip
    memory in tiles and keeps only the softmax statistics; the FLOPs of the two matmuls
    remain. Weights are 2-D and never match; the step's inputs and outputs are never
    core, unless `outputs` (a layer's sub-graph, whose outputs include what its backward
    reads: the kernel's backward recomputes those too). Cached per graph object and
    `outputs` (keyed by the graph's node count)."""
    cached = _CORE.get(graph, {}).get(outputs)
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    found = _attention_core(graph, outputs)
    _CORE.setdefault(graph, {})[outputs] = (len(graph.nodes), found)
    return found


_CORE: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "graph.attention_core",
    "graph -> {outputs flag: (node count, attention core variable ids)}")


def _attention_core(graph: OpGraph, outputs: bool) -> frozenset[int]:
    """`attention_core`, uncached."""
    outputs = set() if outputs else set(graph.outvars)
    core = set()
    for node in graph.nodes:
        for v in node.outputs:
            shape = graph.vars[v].shape
            if (len(shape) >= 3 and shape[-1] == shape[-2] >= MIN_FUSED_SEQUENCE
                    and v not in outputs):
                core.add(v)
    # A product laid out with its two sequence dimensions elsewhere (a grouped-query
    # attention's ``bqngd,bknd`` scores come out of the dot as (b, n, q, k, g) and are
    # transposed to (b, n, g, q, k)) is core too when it makes or is made from a core value.
    inputs = set(graph.invars)
    for node in graph.nodes:
        if not any(v in core for v in (*node.inputs, *node.outputs)):
            continue
        for v in (*node.inputs, *node.outputs):
            shape = graph.vars[v].shape
            sizes = [d for d in shape if d >= MIN_FUSED_SEQUENCE]
            if (len(shape) >= 3 and v not in outputs and v not in inputs
                    and any(sizes.count(d) >= 2 for d in sizes)):
                core.add(v)
    return frozenset(core)


def fusion_traffic(graph: OpGraph, fused_attention: bool = False) -> FusionTraffic:
    """Which bytes of every node of `graph` cross a fusion boundary (module docstring).

    With `fused_attention` (`Cluster.fused_attention`), the `attention_core` values are
    neither written nor read: they stay inside the attention kernel.

    Cached per graph object (keyed also by its node count, so a graph that grew is redone).

    **Example:** for ``gelu(x @ w + b)`` alone, the dot reads x and w and writes nothing;
    the bias add reads b; the last op of the GELU writes the result; every op in between
    reads and writes nothing.
    """
    cached = _CACHE.get(graph, {}).get(fused_attention)
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    traffic = _compute(graph)
    if fused_attention:
        traffic = _without(traffic, graph, attention_core(graph))
    _CACHE.setdefault(graph, {})[fused_attention] = (len(graph.nodes), traffic)
    return traffic


def kernel_roots(graph: OpGraph, fused_attention: bool = False) -> frozenset[int]:
    """Node ids that each stand for one kernel of `graph`: per group of nodes that
    `fusion_traffic` runs in one kernel, the last one in program order.

    Nodes are grouped by the values that pass between them inside a kernel (read by a
    consumer, but not from device memory); a group of scan markers only (``"boundary"``)
    launches nothing. A cheap producer fused into two consumers' kernels joins them in one
    group, so a step's count is a slight undercount. With `fused_attention`, the
    `attention_core` values, which no kernel writes, join the attention's nodes into one.

    **Example:** ``tanh(x @ w + b)`` is one kernel (the bias add and tanh run in the dot's
    epilogue), rooted at the tanh; ``(x @ w) @ v`` is two.
    """
    cached = _ROOTS.get(graph, {}).get(fused_attention)
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    traffic = fusion_traffic(graph, fused_attention)
    producer_of = {v: node.id for node in graph.nodes for v in node.outputs}
    parent = {node.id: node.id for node in graph.nodes}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    boundary = {n.id for n in graph.nodes if fusion_kind(n.primitive) == "boundary"}
    for node in graph.nodes:
        for v, from_memory in zip(node.inputs, traffic.reads[node.id]):
            producer = producer_of.get(v)
            # A loop body is its own computation: no kernel spans a scan marker.
            if producer is not None and not from_memory and producer not in boundary \
                    and node.id not in boundary:
                parent[find(producer)] = find(node.id)
    groups: dict[int, list] = {}
    for node in graph.nodes:
        groups.setdefault(find(node.id), []).append(node)
    roots = frozenset(
        max(n.id for n in members) for members in groups.values()
        if any(fusion_kind(n.primitive) != "boundary" for n in members)
    )
    _ROOTS.setdefault(graph, {})[fused_attention] = (len(graph.nodes), roots)
    return roots


_ROOTS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "graph.kernel_roots",
    "graph -> {fused attention: kernel roots}")


def _without(traffic: FusionTraffic, graph: OpGraph, core: frozenset[int]) -> FusionTraffic:
    """`traffic` with no read or write of the variables in `core`."""
    if not core:
        return traffic
    reads = {
        node.id: tuple(r and v not in core for r, v in zip(traffic.reads[node.id], node.inputs))
        for node in graph.nodes
    }
    writes = {
        node.id: tuple(w and v not in core
                       for w, v in zip(traffic.writes[node.id], node.outputs))
        for node in graph.nodes
    }
    return FusionTraffic(reads, writes)


def _compute(graph: OpGraph) -> FusionTraffic:
    consumers = graph.consumers()
    outputs = set(graph.outvars)
    depth = _depths(graph, consumers, outputs)
    producer_of = {v: node for node in graph.nodes for v in node.outputs}
    readers_of = _readers_through_bitcasts(graph, consumers, outputs)
    num_readers = [len(r) for r in readers_of]

    def source(var: int) -> int:
        """`var` through the bitcast reshapes that made it."""
        while var in producer_of and _is_bitcast(producer_of[var]) and var not in outputs:
            var = producer_of[var].inputs[0]
        return var

    def fused(var: int, consumer: Node) -> bool:
        var = source(var)
        producer = producer_of.get(var)
        if producer is not None and (fusion_kind(producer.primitive) == "matmul"
                                     or producer.id in epilogue):
            return _in_epilogue(var, producer, consumer)
        return _fuses(var, producer, consumer, num_readers[var] == 1, depth, outputs)

    def _in_epilogue(var: int, producer: Node, consumer: Node) -> bool:
        """A GEMM's result, or a value its epilogue makes, stays in the GEMM's kernel
        when every reader is an elementwise op of that kernel (at the GEMM's depth; any
        number of them: the epilogue reads it from registers); a reduction, another
        kernel or a later pass among its readers makes the kernel write it, and every
        reader read it."""
        d = depth[producer.id]
        return var not in outputs and all(
            fusion_kind(r.primitive) == "elementwise" and depth[r.id] == d
            for r in readers_of[var]) and any(r is consumer for r in readers_of[var])

    epilogue = _epilogue(graph, producer_of, source, _in_epilogue)
    return _traffic(graph, outputs, readers_of, fused)


def _readers_through_bitcasts(graph: OpGraph, consumers, outputs) -> list[list[Node]]:
    """Per value, the nodes reading it, through bitcast reshapes."""
    by_id = {node.id: node for node in graph.nodes}

    def readers(var: int) -> list[Node]:
        found = []
        for c in consumers[var]:
            node = by_id[c]
            if _is_bitcast(node) and node.outputs[0] not in outputs:
                found.extend(readers(node.outputs[0]))
            else:
                found.append(node)
        return found

    return [readers(v) for v in range(len(consumers))]


def _epilogue(graph: OpGraph, producer_of, source, in_epilogue) -> set[int]:
    """The elementwise nodes running in a GEMM's kernel (its epilogue), found in program
    order: a node reading (through `source`) a GEMM's result or an epilogue node's, which
    `in_epilogue(value, producer, node)` keeps in that kernel."""
    epilogue: set[int] = set()
    for node in graph.nodes:
        if fusion_kind(node.primitive) != "elementwise" or _is_bitcast(node):
            continue
        for v in node.inputs:
            v = source(v)
            producer = producer_of.get(v)
            if producer is not None and (fusion_kind(producer.primitive) == "matmul"
                                         or producer.id in epilogue) \
                    and in_epilogue(v, producer, node):
                epilogue.add(node.id)
                break
    return epilogue


def _traffic(graph: OpGraph, outputs, readers_of, fused) -> FusionTraffic:
    """Which operands each node reads from memory and which results it writes, given
    `fused(value, reader)`: whether `value` stays inside the kernel running `reader`."""

    def boundary(node: Node) -> bool:
        return fusion_kind(node.primitive) == "boundary" or _is_bitcast(node)

    reads = {
        node.id: tuple(not boundary(node) and not fused(v, node) for v in node.inputs)
        for node in graph.nodes
    }
    writes = {
        node.id: tuple(
            (v in outputs and fusion_kind(node.primitive) != "boundary") if boundary(node)
            else (v in outputs or any(not fused(v, c) for c in readers_of[v]))
            for v in node.outputs
        )
        for node in graph.nodes
    }
    return FusionTraffic(reads, writes)


def _is_bitcast(node: Node) -> bool:
    """A row-major `reshape` (no `dimensions` permutation): XLA lowers it to a bitcast of
    its operand's buffer, no kernel and no bytes of its own; its readers read (or fuse
    with) its operand."""
    return node.primitive == "reshape" and not node.params.get("dimensions")


def _fuses(var: int, producer: Node | None, consumer: Node, single_use: bool, depth,
           outputs) -> bool:
    """Whether `var` (made by `producer`, read by one node or several: `single_use`)
    stays inside the kernel that runs `consumer`."""
    if producer is None:
        return False
    p, c = fusion_kind(producer.primitive), fusion_kind(consumer.primitive)
    if p == "matmul":  # epilogue
        return single_use and c == "elementwise" and var not in outputs
    if p != "elementwise":
        return False
    if c == "matmul":  # prologue
        return single_use and producer.primitive in PROLOGUE_PRIMITIVES
    return c in ("elementwise", "reduce") and depth[producer.id] == depth[consumer.id]


def stored_residuals(
    graph: OpGraph, forward: Sequence[int], kept: Iterable[int], leaving: Iterable[int] = (),
    free: Callable[[int], bool] = lambda v: False, core: Collection[int] = (),
) -> set[int]:
    """The values a forward pass writes to device memory for its backward, when the
    backward reads `kept` (values the `forward` nodes make; `leaving`: forward values read
    outside both passes, e.g. by the next layer).

    One rule, XLA's fusion seen from the backward: a kept value that the forward writes
    to memory anyway (made by a matmul, a reduction, a kernel or a scan marker, or an
    elementwise result that crosses a fusion boundary of the forward alone: read by a
    matmul or a kernel, leaving, or an expensive one (`EXPENSIVE_ELEMENTWISE`) read at
    another fusion depth; a cheap one is recomputed in each reader's loop) is stored as
    it is. A kept value made
    inside a forward fusion (an elementwise chain: GELU's tanh and powers, layer norm's
    centred input, a broadcast mask) is never written: the backward's own fusion
    recomputes it from what the chain reads, so those reads are stored in its place,
    found by walking back through such values. Values for which `free(v)` holds
    (parameters, optimizer state, constants: held anyway) are left out. Values in
    `core` (a fused attention kernel's scores and softmax, `attention_core`) are never
    written: the kernel's backward recomputes them from what they are made of (Q, K, V;
    Dao et al. 2022, FlashAttention, sec. 3.1), which is stored in their place.

    **Example:** for ``gelu(x @ w1 + b1) @ w2`` the backward reads the GELU's input and
    its inner tanh and powers, and its output; stored are the dot's result ``x @ w1`` (the
    chain's input, `b1` being a parameter) and the GELU's output (read by the second
    matmul), 2 x 4h per token, as Korthikanti et al. 2022 (section 4.1) count them.
    """
    forward = [graph.nodes[n] for n in forward]
    producer_of = {v: node for node in forward for v in node.outputs}
    consumers: dict[int, list[int]] = {v: [] for v in producer_of}
    for node in forward:
        for v in (v for v in node.inputs if v in consumers):
            consumers[v].append(node.id)
    leaving = set(leaving)
    depth = _depths_of(forward, consumers, leaving)
    by_id = {node.id: node for node in forward}

    def duplicated(producer: Node, consumer: Node) -> bool:
        # XLA fuses a cheap producer into each consumer's loop, recomputing it there.
        return producer.primitive not in EXPENSIVE_ELEMENTWISE and fusion_kind(
            consumer.primitive
        ) in ("elementwise", "reduce")

    core = frozenset(core)

    def written(v: int) -> bool:
        producer = producer_of.get(v)
        if v in core and producer is not None:
            return False
        if producer is None or fusion_kind(producer.primitive) != "elementwise":
            return True
        return v in leaving or any(
            not _fuses(v, producer, by_id[c], len(consumers[v]) == 1, depth, leaving)
            and not duplicated(producer, by_id[c])
            for c in consumers[v]
        )

    return _walk_back(kept, free, written, producer_of)


def _walk_back(kept: Iterable[int], free, written, producer_of) -> set[int]:
    """The values stored for `kept`: each that is `written` as it is, else (recomputed)
    what its producer reads, walking back; `free` values are left out."""
    stored: set[int] = set()
    seen: set[int] = set()
    stack = list(kept)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if free(v):
            continue
        if written(v):
            stored.add(v)
        else:
            stack.extend(producer_of[v].inputs)
    return stored


# Elementwise primitives XLA counts as expensive (`InstructionFusion::IsExpensive`): it
# does not duplicate them into several consumers' fusions, so a result of one read by two
# kernels is written once; cheaper ones (add, multiply, select, compare, convert,
# broadcast, layout changes, integer powers) are recomputed inside each consumer's loop.
EXPENSIVE_ELEMENTWISE = frozenset({
    "div", "rem", "pow", "exp", "exp2", "expm1", "log", "log1p", "logistic", "sqrt", "rsqrt",
    "cbrt", "tanh", "tan", "sin", "cos", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma", "igamma",
    "random_bits", "threefry2x32",
})


def _depths(graph: OpGraph, consumers, outputs) -> dict[int, int]:
    """Per node, the most non-elementwise nodes (reductions, matmuls, kernels) on a path
    from the graph inputs to it, not counting itself. A matmul's result that goes only to
    an elementwise epilogue does not count: the epilogue runs in the matmul's kernel, so
    its other operands (a bias) may fuse with it."""
    return _depths_of(graph.nodes, consumers, outputs)


def _depths_of(nodes: Sequence[Node], consumers, outputs) -> dict[int, int]:
    """`_depths` over `nodes` (program order), `consumers[v]` the ids of v's readers."""
    depth: dict[int, int] = {}
    var_depth: dict[int, int] = {}
    kinds = {node.id: fusion_kind(node.primitive) for node in nodes}
    for node in nodes:
        d = max((var_depth.get(v, 0) for v in node.inputs), default=0)
        depth[node.id] = d
        for v in node.outputs:
            epilogue = (
                kinds[node.id] == "matmul" and len(consumers[v]) >= 1 and v not in outputs
                and all(kinds[c] == "elementwise" for c in consumers[v])
            )
            var_depth[v] = d + int(kinds[node.id] != "elementwise" and not epilogue)
    return depth
