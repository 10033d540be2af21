"""Context parallelism (CP) in the sharding ILP: attention with its sequence split.

In: a graph (the step, a layer, or a scan's planning graph), a node's strategies from the
rule registry and `ShardOptions.context_parallel`. Out: the strategies that option keeps
(`keep_strategies`), and, from a solved plan, which CP it chose (`describe_context`).

Attention needs no primitive of its own here: einsum attention and
`jax.nn.dot_product_attention` (XLA's implementation, the one JAX traces off GPU) both
trace into a score matmul ``Q K^T``, a mask, a softmax over the keys and ``P V``. Their
*score tensors* are the values shaped ``[batch, heads..., S_q, S_k]`` with ``S_q == S_k
== S`` (`score_vars`): the scores, mask, softmax and, backward, their gradients. Their
*sequence matmuls* are the dots of a ``[batch, S, features]`` activation by a 2-D weight
(`sequence_dots`): the Q/K/V/O projections, the MLP and the output layer, forward and
backward.

What each CP algorithm looks like in those terms, on the mesh axes A it uses:

- "allgather": the sequence matmuls split the sequence over A; the score tensors split
  the query dimension S_q over A and keep the keys S_k whole, so K and V are gathered
  whole on every device before attention (the edge into the score matmul pays the
  all-gather, its gradient's edge the reduce-scatter). Llama 3's CP (Dubey et al. 2024,
  sec. 3.3.2).
- "ulysses": the sequence matmuls split the sequence over A; the score tensors split heads
  and keep both sequences whole, so Q, K and V move from a sequence split to a heads split
  with an all-to-all, and the attention output back (DeepSpeed-Ulysses, Jacobs et al.
  2023).
- "ring": the layouts of "allgather" (sequence split outside attention, the score
  tensors' queries split), with the attention itself run by the ring kernel
  (`autopar.lower._ring_lowering`): K/V blocks passed round the axes A, zig-zag load
  balanced, so the sequence must split into 2·|A| equal chunks.
- "none": neither sequence of the score tensors splits and the sequence matmuls keep the
  sequence whole (norms and residuals may still split it, as Megatron's sequence
  parallelism does).
- "auto": every strategy stays; the ILP prices them all (`describe_context` names what it
  chose).

Every cost is the ILP's own: the score matmul's compute per device from `autopar.cost`,
the all-gather or all-to-all on the edges from `autopar.intra._reshard`. XLA computes the
dense score matrix whatever the mask, so a contiguous split has no causal imbalance here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster import LogicalMesh, Spec
from autopar.graph import Node, OpGraph, Role
from autopar.intra._ilp_problem import MemoryBudgetError

# The algorithms the planner can plan and lower (all that `ContextParallel` names).
PLANNED = ("auto", "none", "allgather", "ring", "ulysses")


@dataclass(frozen=True)
class ContextSplit:
    """The context parallelism a plan chose: `algorithm` ("none", "allgather",
    "ulysses"), its `degree` (devices sharing one sequence) and the mesh `axes`."""

    algorithm: str = "none"
    degree: int = 1
    axes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "degree": self.degree, "axes": list(self.axes)}

    @staticmethod
    def from_json(d: dict) -> ContextSplit:
        return ContextSplit(str(d["algorithm"]), int(d["degree"]), tuple(d["axes"]))

    def __str__(self) -> str:
        if self.algorithm == "none":
            return "none"
        return f"{self.algorithm} x{self.degree} over {''.join(self.axes)}"


NO_CONTEXT = ContextSplit()


class ContextParallelError(MemoryBudgetError):
    """A forced `context_parallel` algorithm cannot split attention on a mesh. A kind of
    `MemoryBudgetError` (no plan on that mesh), so that the mesh search moves on to the
    next mesh shape as it does for one that does not fit; raised to the caller when no
    mesh can."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.budget = math.inf
        self.least_memory = math.inf
        self.kind = "context_parallel"


def _is_score(shape: Sequence[int]) -> bool:
    # [batch, heads..., S_q, S_k]: a [batch, S, features] activation whose feature count
    # happens to equal S (an MLP of width S) has 3 dimensions and is not one.
    return len(shape) >= 4 and shape[-1] == shape[-2] >= 2


def sequence_length(graph: OpGraph) -> int | None:
    """The attention sequence length S of `graph`: the last dimension of its first score
    tensor (`score_vars`), or None when it has no attention."""
    for v in score_vars(graph):
        return graph.vars[v].shape[-1]
    return None


def score_vars(graph: OpGraph) -> list[int]:
    """Ids of the attention score tensors: node results shaped ``[..., S, S]`` (4 or more
    dimensions) where S is the longest such length that a matmul of two activations
    (``Q K^T``, or the gradient ``dO V^T``) produces a dimension of (a ``[batch, S, heads,
    head_dim]`` value with as many heads as head_dim is shaped alike, with a shorter S)."""
    dot_sizes = {
        s for node in graph.nodes if node.primitive == "dot_general"
        and _two_activations(node, graph) for v in node.outputs for s in graph.vars[v].shape
    }
    candidates = [
        v for node in graph.nodes for v in node.outputs
        if _is_score(graph.vars[v].shape) and graph.vars[v].shape[-1] in dot_sizes
    ]
    if not candidates:
        return []
    seq_len = max(graph.vars[v].shape[-1] for v in candidates)
    return [v for v in candidates if graph.vars[v].shape[-1] == seq_len]


def _two_activations(node: Node, graph: OpGraph) -> bool:
    roles = [graph.vars[v].role for v in node.inputs]
    return len(roles) == 2 and all(r is Role.ACTIVATION for r in roles)


def is_sequence_dot(node: Node, graph: OpGraph, seq_len: int) -> bool:
    """A matmul of a ``[batch, S, features]`` activation by a 2-D operand over its last
    dimension (`sequence_dots` in the module docstring)."""
    if node.primitive != "dot_general" or len(node.inputs) != 2:
        return False
    lhs, rhs = (graph.vars[v] for v in node.inputs)
    (lc, _), (lb, _) = node.params["dimension_numbers"]
    return (len(lhs.shape) == 3 and len(rhs.shape) == 2 and lhs.shape[1] == seq_len
            and tuple(lc) == (2,) and not lb and lhs.role is not Role.CONST)


def _score_ok(spec: Spec, mode: str, shape: Sequence[int], mesh: LogicalMesh) -> bool:
    query, keys, heads = spec[-2], spec[-1], spec[1:-2]
    if mode == "auto":
        return True
    if keys:
        return False
    if mode == "none":
        return not query
    # A forced algorithm runs attention on every device's own share: no mesh axis left
    # computing the same scores twice (a broadcast mask, of size-1 batch and heads, aside).
    used = {a for axes in spec for a in axes}
    if any(n > 1 for n in shape[:-2]) and not all(
            a in used for a, n in zip(mesh.axis_names, mesh.shape) if n > 1):
        return False
    if mode == "allgather":
        return bool(query)
    if mode == "ring":  # zig-zag: the sequence in 2·cp equal chunks
        cp = math.prod(mesh.axis_size(a) for a in query) if query else 1
        return bool(query) and shape[-2] % (2 * cp) == 0
    # ulysses: heads split, both sequences whole
    return not query and (any(heads) or all(n == 1 for n in shape[1:-2]))


def _sequence_ok(spec: Spec, mode: str) -> bool:
    return bool(spec[1]) if mode in ("allgather", "ring", "ulysses") else not spec[1]


def keep_strategies(node: Node, graph: OpGraph, strategies: list, mode: str,
                    seq_len: int | None, score_ids: frozenset[int],
                    mesh: LogicalMesh) -> list:
    """The strategies of `node` that context parallelism `mode` allows (module
    docstring); `strategies` itself when it constrains nothing here. Raises
    `ContextParallelError` naming the tensor and the fix when it allows none."""
    if mode == "auto" or seq_len is None or mesh.num_devices == 1:
        return strategies  # one device: nothing to split (the search warns, see _api)
    checks = []
    for k, v in enumerate(node.outputs):
        if v in score_ids:
            shape = graph.vars[v].shape
            checks.append(lambda s, k=k, shape=shape: _score_ok(s.out_specs[k], mode, shape,
                                                                mesh))
    if is_sequence_dot(node, graph, seq_len):
        checks.append(lambda s: s.in_specs[0] is None or _sequence_ok(s.in_specs[0], mode))
    if not checks:
        return strategies
    kept = [s for s in strategies if all(check(s) for check in checks)]
    if not kept:
        raise ContextParallelError(_no_split_message(node, graph, mode, seq_len, mesh))
    return kept


def _no_split_message(node: Node, graph: OpGraph, mode: str, seq_len: int,
                      mesh: LogicalMesh) -> str:
    var = graph.vars[node.outputs[0]]
    sizes = [n for n in mesh.shape if n > 1]
    if mode == "ulysses":
        what = (f"its head dimensions {var.shape[1:-2]} (or, for a {node.primitive} of the "
                f"sequence, the sequence {seq_len}) by an axis of mesh {tuple(mesh.shape)}")
        fix = "use a head count divisible by the context-parallel degree, or 'allgather'"
    elif mode == "ring":
        what = (f"the sequence {seq_len} in 2·cp equal chunks (zig-zag load balancing) "
                f"for a ring over axes of mesh {tuple(mesh.shape)}")
        fix = (f"use a sequence length divisible by twice one of {sizes}, or "
               "context_parallel='allgather'")
    elif mode == "allgather":
        what = f"the sequence {seq_len} by an axis of mesh {tuple(mesh.shape)}"
        fix = f"use a sequence length divisible by one of {sizes}, or context_parallel='auto'"
    else:
        what = f"without splitting the sequence {seq_len} on mesh {tuple(mesh.shape)}"
        fix = "use context_parallel='auto'"
    source = f" ({node.source})" if node.source else ""
    return (
        f"context_parallel={mode!r} cannot split attention tensor {var.shape} of "
        f"{node.primitive} #{node.id}{source}: it needs {what}; {fix}"
    )


def constrains(node: Node, graph: OpGraph, mode: str, seq_len: int | None,
               score_ids: frozenset[int]) -> bool:
    """Whether `keep_strategies` may cut `node`'s strategies (such a node is planned on
    its own, not as a follower of its operand)."""
    if mode == "auto" or seq_len is None:
        return False
    return any(v in score_ids for v in node.outputs) or is_sequence_dot(node, graph, seq_len)


def describe_context(graph: OpGraph, var_specs: Sequence[Spec | None],
                     mesh: LogicalMesh, mode: str = "auto") -> ContextSplit:
    """Which context parallelism the layouts `var_specs` of `graph` give attention: that of
    its first score tensor (the forward scores), read as the module docstring says. With
    `mode` "ring", the all-gather layouts are the ring's."""
    scores = score_vars(graph)
    if not scores:
        return NO_CONTEXT
    spec = var_specs[scores[0]]
    if spec is None:
        return NO_CONTEXT
    query, keys, heads = spec[-2], spec[-1], [a for axes in spec[1:-2] for a in axes]
    if keys:
        return NO_CONTEXT
    if query:
        algorithm = "ring" if mode == "ring" else "allgather"
        return ContextSplit(algorithm, _size(mesh, query), tuple(query))
    # Ulysses: heads split inside attention over the axes that split the sequence outside
    # it, read at the layer's first sequence matmul (the query projection).
    seq_len = graph.vars[scores[0]].shape[-1]
    first = next((node for node in graph.nodes if is_sequence_dot(node, graph, seq_len)
                  and var_specs[node.inputs[0]] is not None), None)
    sequence_axes = set(var_specs[first.inputs[0]][1]) if first is not None else set()
    shared = tuple(a for a in heads if a in sequence_axes)
    if shared:
        return ContextSplit("ulysses", _size(mesh, shared), shared)
    return NO_CONTEXT


def _size(mesh: LogicalMesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)


def combine(splits: Sequence[ContextSplit]) -> ContextSplit:
    """One stage's split from its layers': the first layer with attention split."""
    return next((s for s in splits if s.algorithm != "none"), NO_CONTEXT)
