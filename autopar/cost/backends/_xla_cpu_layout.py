"""XLA:CPU's layout copies: where it copies a tensor into another memory order, and how
many bytes the loop that makes the copy reads.

In: an `OpGraph` and one of its nodes. Out: `layout_copies`, the node's operands that the
backend copies transposed (`LayoutCopy`: which operand, and how many bytes the copying
loop reads per byte of that operand). `autopar.cost.backends.XLA_CPU` answers
`Backend.layout_copies` with it; `_xla_cpu.layout_copy_time` prices the copies.

XLA:CPU runs dots on YNNPACK/XNNPACK GEMM kernels that take each operand in one memory
order: batch dimensions leading (in the same order in both operands), then for the left
operand its free dimensions and then its contracting ones, and for the right operand its
contracting and free dimensions in either order. An operand in another order is copied
into that order first, and the copy is fused into the loop that makes the operand: seen
in the optimized HLO of single dots (`tests/test_xla_cpu_costs.py` checks the rule against
it) and of the local GPT's steps, as ``copy_bitcast_fusion`` / ``transpose_copy_fusion``
before each ``ynn_fusion``: the weight gradient ``dot_general(dy, x)`` contracting the
batch and sequence dimensions copies its left operand, the attention's products, whose
batch dimensions (batch, heads) are not leading, copy both. A dot of two rank-2 operands
without batch dimensions runs on Eigen's GEMM, which reads either operand transposed: no
copy. A `transpose` that moves a dimension of size > 1 is such a copy too, unless it
transposes a dot's result that nothing else reads: the dot writes it in that order
(``A.T @ B = (B.T @ A).T``; the weight gradients' transposes of a one-program step).

The copy reads its input in strides: one element per cache line and stream, so it moves
bytes far slower than a straight elementwise loop once its inputs outgrow the caches
(`_xla_cpu.layout_copy_time` prices it by the profile's measured
`Cluster.transpose_bandwidth`). When the operand is made by elementwise ops, the copy runs
inside the loop that makes it, and XLA:CPU duplicates cheap elementwise work into every
loop that reads it rather than writing it once: the copy's loop recomputes the operand
from the last values that are written to memory (results of dots, reductions and other
kernels, the step's inputs), however many other fusions or dots read the operand or the
values on the way. So it reads all of those in strides: `LayoutCopy.fan_in` is their
bytes per byte of the operand. An `EXPENSIVE_ELEMENTWISE` op is not duplicated: once
the chain from it to the copy is read elsewhere too, its result is written and read
from memory (XLA's ``multiply_tanh_fusion`` before a GELU gradient's copy); read by the
copy alone, it runs inside the copy's loop. On a residual stream this makes the copies
grow with depth: in the optimized HLO of the local GPT's step, the copy of each
layer's residual gradient for its weight gradient (``copy_bitcast_fusion``, f32[128,
256] per device under Megatron dp4 tp2) reads 18, 27, 36, ... 77 inputs, every layer's
dot results from the top down, and in a `perf` profile of that step pinned to one core
those copies took 22.6% of its CPU (Megatron dp8's, 4.3%; session 23,
docs/benchmarks.md). `tests/test_xla_cpu_costs.py` checks the count against XLA's on
small chains.

GPUs have no such copies (cuBLAS takes transposed operands; XLA:GPU's transposes are
tiled through shared memory): `autopar.cost.backends.XLA_GPU` names none.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

from autopar._memo import declare
from autopar.cost.backends._base import LayoutCopy
from autopar.graph import Node, OpGraph, Role, dtype_itemsize
from autopar.graph._fusion import EXPENSIVE_ELEMENTWISE, fusion_kind


def layout_copies(graph: OpGraph, node: Node) -> tuple[LayoutCopy, ...]:
    """The operands of `node` that XLA:CPU copies into another memory order (module
    docstring), with the bytes their copying loops read. Empty for nodes that copy
    nothing. Cached per graph.

    **Example:** the weight gradient ``dot_general(dy [b, s, o], x [b, s, h])``
    contracting (b, s) copies `dy` (its contracting dimensions lead): one `LayoutCopy`
    for operand 0.
    """
    cache = _CACHE.setdefault(graph, {})
    key = (node.id, len(graph.nodes))
    if key not in cache:
        cache[key] = tuple(
            _with_fan_in(graph, node, i) for i in _copied_operands(graph, node)
        )
    return cache[key]


_CACHE: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "cost.xla_cpu.layout_copies",
    "graph -> {node: layout copies}")


def _copied_operands(graph: OpGraph, node: Node) -> tuple[int, ...]:
    shapes = [graph.vars[v].shape for v in node.inputs]
    if node.primitive == "transpose":
        perm = tuple(node.params["permutation"])
        if _in_order([d for d in perm if shapes[0][d] != 1]):
            return ()  # moves only dimensions of size 1: a bitcast
        producer = _producer(graph, node.inputs[0])
        if (producer is not None and fusion_kind(producer.primitive) == "matmul"
                and len(_consumers(graph)[node.inputs[0]]) == 1):
            return ()  # the dot writes its result in that order (operands swapped)
        return (0,)
    if node.primitive != "dot_general":
        return ()
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lhs, rhs = shapes
    if not lb and len(lhs) == 2 and len(rhs) == 2:
        return ()  # Eigen's GEMM: either operand may be transposed
    lhs_free = tuple(d for d in range(len(lhs)) if d not in lc + lb)
    rhs_free = tuple(d for d in range(len(rhs)) if d not in rc + rb)
    copied = []
    if not _in_order(_nontrivial(lb + lhs_free + lc, lhs)):
        copied.append(0)
    if not (_in_order(_nontrivial(rb + rc + rhs_free, rhs))
            or _in_order(_nontrivial(rb + rhs_free + rc, rhs))):
        copied.append(1)
    return tuple(copied)


def _nontrivial(order: Sequence[int], shape: Sequence[int]) -> list[int]:
    """`order` without the dimensions of size 1 (moving them is a bitcast)."""
    return [d for d in order if shape[d] != 1]


def _in_order(dims: Sequence[int]) -> bool:
    return all(a < b for a, b in zip(dims, dims[1:]))


def _with_fan_in(graph: OpGraph, node: Node, operand: int) -> LayoutCopy:
    """The copy of `operand`, with the bytes its loop reads: the written inputs of the
    elementwise ops that make the operand, which the copy's loop recomputes (module
    docstring), when it runs inside them."""
    var = node.inputs[operand]
    nbytes = _global_bytes(graph, var)
    producer = _producer(graph, var)
    if (producer is None or nbytes <= 0 or fusion_kind(producer.primitive) != "elementwise"
            or graph.vars[var].role is Role.CONST or var in graph.outvars):
        return LayoutCopy(operand)
    shared = len(_consumers(graph)[var]) > 1
    if shared and producer.primitive in EXPENSIVE_ELEMENTWISE:
        return LayoutCopy(operand)  # written by its maker, then copied alone
    read = _recomputed_reads(graph, producer, shared)
    return LayoutCopy(operand, max(1.0, read / nbytes), True)


def _recomputed_reads(graph: OpGraph, producer: Node, shared: bool) -> float:
    """Bytes a loop that recomputes `producer`'s result reads from memory: walks back over
    elementwise producers, duplicating cheap ones, to the values that are written (the
    results of other kinds of nodes, the graph's inputs and outputs, constants aside) and
    counts each once. An `EXPENSIVE_ELEMENTWISE` producer is walked over only while every
    value between it and the loop is read by the next op alone (`shared` is False for
    the result itself); otherwise its result is written, and read."""
    consumers = _consumers(graph)
    seen_vars: set[int] = set()
    seen_nodes: set[tuple[int, bool]] = set()
    total = 0.0
    stack = [(producer, shared)]
    while stack:
        n, duplicated = stack.pop()
        if (n.id, duplicated) in seen_nodes:
            continue
        seen_nodes.add((n.id, duplicated))
        for v in n.inputs:
            var = graph.vars[v]
            if var.role is Role.CONST:
                continue
            p = _producer(graph, v)
            on_path = duplicated or len(consumers[v]) > 1
            if (p is None or fusion_kind(p.primitive) != "elementwise" or v in graph.outvars
                    or (on_path and p.primitive in EXPENSIVE_ELEMENTWISE)):
                if v not in seen_vars:
                    seen_vars.add(v)
                    total += _global_bytes(graph, v)
            else:
                stack.append((p, on_path))
    return total


def _consumers(graph: OpGraph) -> list[list[int]]:
    cached = _CONSUMERS.get(graph)
    if cached is None or cached[0] != len(graph.nodes):
        cached = (len(graph.nodes), graph.consumers())
        _CONSUMERS[graph] = cached
    return cached[1]


_CONSUMERS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "cost.xla_cpu.consumers",
    "graph -> consumers of each var")


def _producer(graph: OpGraph, var: int) -> Node | None:
    """The node of `graph` that makes `var` (a sub-graph's `Var.producer` may name a node
    of the graph it was cut from, so the nodes' outputs decide)."""
    cached = _PRODUCERS.get(graph)
    if cached is None or cached[0] != len(graph.nodes):
        cached = (len(graph.nodes), {v: n for n in graph.nodes for v in n.outputs})
        _PRODUCERS[graph] = cached
    return cached[1].get(var)


_PRODUCERS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "cost.xla_cpu.producers",
    "graph -> producer of each var")


def _global_bytes(graph: OpGraph, var: int) -> float:
    v = graph.vars[var]
    return float(math.prod(v.shape) * dtype_itemsize(str(v.dtype)))
