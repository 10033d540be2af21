"""Megatron's layout of the residual stream, with and without sequence parallelism.

In: a traced `OpGraph` and a `MegatronConfig`. Out: the spec every value of the residual
stream must take (`residual_specs`), and a built ILP restricted to those specs
(`pin_activations`).

Tensor parallelism (Shoeybi et al. 2019) leaves the regions between its blocks whole on
every tp device: the row-parallel linear's all-reduce hands each device the full
activation, and the layer norm, dropout and residual add run replicated. Sequence
parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"; REFERENCES.md "Megatron-LM plans") splits those regions along the
sequence over the "model" axis: the all-reduce becomes a reduce-scatter onto the
sequence, and the input of each column-parallel linear is all-gathered; backward, the
pair swaps. Here the layout is stated, not the collectives: the forward values of the
residual stream are pinned to ``P("data", None, None)`` without SP and to
``P("data", "model", None)`` with it (batch, sequence, hidden), and the ILP finds the
cheapest way around them: the all-reduce, or the reduce-scatter (a row-parallel dot's
strategy) and the all-gather (a reshard before the column-parallel dot) and, in the
backward pass it leaves free, their transposes. Pinning both ways matters: left free, the
ILP often picks the sequence split by itself, and "Megatron without SP" would not be.

The residual stream, found from the dataflow (`_dataflow.split_dimensions`): every
floating-point value the forward pass computes with shape (batch, sequence, hidden) and
no dimension split by a column-parallel weight, where (batch, sequence) is the leading
shape of the batch inputs (tokens) and hidden the output width of a row-parallel weight.
That is exactly the layer-norm regions: from each row-parallel output (and the embedding)
through the residual add and the layer norm's mean and variance reductions over hidden
to the input of the next column-parallel dot (QKV, MLP first linear, output layer).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace

import jax.numpy as jnp
import numpy as np

from autopar._memo import declare
from autopar.cluster import Spec, spec_str
from autopar.graph import OpGraph, Role
from autopar.intra._problem import BuiltProblem
from autopar.manual._dataflow import Kind, classify_parameters, split_dimensions
from autopar.manual._layout import MegatronConfig, MeshAxis


@dataclass(frozen=True)
class ResidualStream:
    """The residual stream of a traced step.

    **Arguments:**
    - `batch`, `sequence`: the leading sizes of the batch inputs.
    - `hidden`: every row-parallel output width (one for a plain transformer).
    - `vars`: ids of the forward values of shape (batch, sequence, hidden), in order.
    """

    batch: int
    sequence: int
    hidden: frozenset[int]
    vars: tuple[int, ...]


def residual_specs(graph: OpGraph, config: MegatronConfig) -> dict[int, Spec]:
    """Megatron's spec of every residual-stream value on a (dp, tp) stage mesh.

    **Arguments:**
    - `graph`: the traced step (at microbatch size when pipelined).
    - `config`: dp, tp and `sequence_parallel`.

    **Returns:** ``{var id: spec}``: batch on "data", sequence on "model" with sequence
    parallelism and whole without, hidden whole (axes of size 1 left out). Empty when
    tp = 1 (nothing between TP blocks to place), and, without sequence parallelism, when
    the step has no residual stream (no (batch, sequence) input or no row-parallel
    weight): the ILP then places those activations freely. With sequence parallelism
    those cases and a sequence length tp does not divide raise ValueError.
    """
    if config.tp == 1:
        return {}
    try:
        stream = residual_stream(graph)
    except ValueError:
        if config.sequence_parallel:
            raise
        return {}  # not a transformer: no Megatron activation layout to keep
    if config.sequence_parallel and stream.sequence % config.tp:
        raise ValueError(
            f"sequence_parallel=True splits the sequence ({stream.sequence} positions) over "
            f"tp={config.tp} devices, which does not divide it; choose a tp that divides "
            "the sequence length, or use sequence_parallel=False"
        )
    spec = (
        (MeshAxis.DATA.value,) if config.dp > 1 else (),
        (MeshAxis.MODEL.value,) if config.sequence_parallel else (),
        (),
    )
    return dict.fromkeys(stream.vars + _layer_cotangents(graph, stream), spec)


def _layer_cotangents(graph: OpGraph, stream: ResidualStream) -> tuple[int, ...]:
    """The residual stream's gradients where they cross a layer edge: the operands and
    results of the backward `layer_boundary` marks shaped (batch, sequence, hidden).

    Megatron's backward hands each block the gradient of the residual stream in the
    stream's own layout (under sequence parallelism split on the sequence: the reduce-
    scatter that ends a block's backward). Layers planned one at a time see that gradient
    as a free input of the layer below, which would take it in whatever layout suits it
    best (replicated) and leave the gather to the stitched stage; pinning it keeps each
    layer's plan Megatron's.
    """
    forward = forward_nodes(graph)
    found = []
    for node in graph.nodes:
        if node.primitive != "layer_boundary" or node.id in forward:
            continue
        for v in (*node.inputs, *node.outputs):
            var = graph.vars[v]
            if (len(var.shape) == 3 and var.shape[:2] == (stream.batch, stream.sequence)
                    and var.shape[2] in stream.hidden
                    and jnp.issubdtype(jnp.dtype(var.dtype), jnp.inexact)):
                found.append(v)
    return tuple(dict.fromkeys(found))


def residual_stream(graph: OpGraph) -> ResidualStream:
    """The residual stream of `graph` (see the module docstring).

    **Returns:** the `ResidualStream`. Raises ValueError when the step has no batch input
    shaped (batch, sequence, ...), no row-parallel weight, or no single scalar loss from
    `autopar.value_and_grad`. Found once per graph (the Megatron grid asks once per
    configuration).
    """
    if graph not in _STREAMS:
        _STREAMS[graph] = _residual_stream(graph)
    return _STREAMS[graph]


_STREAMS: weakref.WeakKeyDictionary = declare(
    weakref.WeakKeyDictionary(), "manual.residual_streams",
    "graph -> ResidualStream")


def _residual_stream(graph: OpGraph) -> ResidualStream:
    leading = {graph.vars[v].shape[:2] for v in graph.invars
               if graph.vars[v].role is Role.BATCH and len(graph.vars[v].shape) >= 2}
    if len(leading) != 1:
        found = sorted(leading) or "none"
        raise ValueError(
            "sequence_parallel=True needs batch inputs shaped (batch, sequence, ...) to find "
            f"the sequence dimension; their leading (batch, sequence) shapes are {found}. "
            "Pass token ids as one (batch, sequence) array, or use sequence_parallel=False"
        )
    (batch, sequence), = leading
    hidden = frozenset(_row_output_widths(graph))
    if not hidden:
        raise ValueError(
            "sequence_parallel=True needs tensor-parallel blocks (a row-parallel weight "
            "such as an attention output or MLP second linear), and this step has none; "
            "use sequence_parallel=False"
        )
    split = split_dimensions(graph)
    members = []
    for node_id in sorted(forward_nodes(graph)):
        for v in graph.nodes[node_id].outputs:
            var = graph.vars[v]
            if (
                len(var.shape) == 3
                and var.shape[:2] == (batch, sequence)
                and var.shape[2] in hidden
                and jnp.issubdtype(jnp.dtype(var.dtype), jnp.inexact)
                and not any(split.get(v, ()))
            ):
                members.append(v)
    return ResidualStream(batch, sequence, hidden, tuple(members))


def _row_output_widths(graph: OpGraph) -> set[int]:
    """The output width of every row-parallel weight (its dims but the split and expert)."""
    widths = set()
    for v, placement in classify_parameters(graph).items():
        if placement.kind is Kind.ROW:
            skip = (placement.model_dim, placement.expert_dim)
            widths.add(math.prod(s for d, s in enumerate(graph.vars[v].shape) if d not in skip))
    return widths


def forward_nodes(graph: OpGraph) -> set[int]:
    """The nodes the loss depends on: the forward pass of an `autopar.value_and_grad`.

    The loss is the first operand of the step's one grad boundary (the value that
    `value_and_grad` returns first); it must be a scalar.
    """
    from autopar.inter import ancestors

    boundaries = [n for n in graph.nodes if n.primitive == "grad_boundary"]
    producer = {v: n.id for n in graph.nodes for v in n.outputs}
    first = boundaries[0].inputs[0] if len(boundaries) == 1 and boundaries[0].inputs else None
    if first is None or graph.vars[first].shape != () or first not in producer:
        found = (f"{len(boundaries)} gradient boundaries" if first is None else
                 f"a gradient boundary whose first value has shape {graph.vars[first].shape}")
        raise ValueError(
            "the forward pass (whose activations sequence parallelism splits) is what the "
            f"loss depends on, but the step has {found}, not one scalar loss; compute the "
            "gradient once with `loss, grads = autopar.value_and_grad(loss_fn)(params, "
            "batch)`"
        )
    return ancestors(graph, [producer[first]])


def pin_activations(
    built: BuiltProblem, graph: OpGraph, specs: Mapping[int, Spec], *,
    where_possible: bool = False,
) -> BuiltProblem:
    """`built` with each variable of `specs` allowed only its spec there.

    `build_problem(fixed=...)` pins graph inputs; this pins any variable, inputs or
    results, by removing strategies. A pinned result's node may follow a leader
    (elementwise ops share their producer's choice), so the strategies removed are those
    of the root leader whose choice would give the variable another spec; node costs,
    memory, edge matrices and follower maps are sliced to match.

    **Arguments:**
    - `built`: from `build_problem` for `graph`.
    - `graph`: the graph.
    - `specs`: ``{var id: the only spec it may take}``; variables the problem does not
      hold (not in this sub-graph) are skipped.
    - `where_possible`: skip a variable whose node has no strategy giving it its spec
      at all (e.g. a reshape that cannot split the dimension), naming it in the
      problem's warnings; its consumers then reshard it.

    **Returns:** the restricted `BuiltProblem` (same nodes and edges, fewer strategies).
    Raises ValueError naming the variable when no strategy gives it its spec together
    with the other pins (or at all, unless `where_possible`).
    """
    from autopar.intra._ilp import resolve_followers

    problem = built.problem
    root, strategy_of = resolve_followers(problem)
    keep = [np.ones(n, dtype=bool) for n in problem.num_strategies]
    skipped: dict[str, int] = {}
    for v, spec in specs.items():
        if v not in built.source_of:
            continue
        index, k = built.source_of[v]
        allowed = np.array([s.out_specs[k] == spec for s in built.ilp_nodes[index].strategies])
        if where_possible and not allowed.any():
            name = built.ilp_nodes[index].name
            skipped[name] = skipped.get(name, 0) + 1
            continue
        r = int(root[index])
        keep[r] &= allowed[strategy_of[index]]
        if not keep[r].any():
            raise ValueError(
                f"cannot give activation {v} of shape {graph.vars[v].shape} the spec "
                f"{spec_str(spec)}: no strategy of {built.ilp_nodes[index].name} (or of the "
                "node it follows) produces it together with the other pinned specs. Pin a "
                "spec whose split dimensions the mesh axes divide, or, for a Megatron "
                "plan, try another tp or sequence_parallel setting"
            )
    restricted = _restricted(built, [np.flatnonzero(m) for m in keep])
    if skipped:
        restricted.warnings.append(
            "activations left unpinned because their node has no strategy producing the "
            f"pinned spec (resharded after it): {', '.join(sorted(skipped))}"
        )
    return restricted


def _restricted(built: BuiltProblem, kept: list[np.ndarray]) -> BuiltProblem:
    """`built` keeping strategies `kept[i]` of each node (followers keep all theirs)."""
    p = built.problem
    followers = {v: (u, mapping[kept[u]]) for v, (u, mapping) in p.followers.items()}
    assert all(len(kept[v]) == n for v, n in enumerate(p.num_strategies) if v in followers), (
        "only root leaders are restricted; a follower's choice comes from its leader"
    )
    problem = replace(
        p,
        node_costs=tuple(c[kept[i]] for i, c in enumerate(p.node_costs)),
        node_memory=tuple(m[kept[i]] for i, m in enumerate(p.node_memory)),
        edge_costs=tuple(m[np.ix_(kept[u], kept[v])] for (u, v), m in zip(p.edges, p.edge_costs)),
        followers=followers,
    )
    nodes = [
        replace(n, strategies=[n.strategies[j] for j in kept[i]])
        for i, n in enumerate(built.ilp_nodes)
    ]
    return BuiltProblem(problem, nodes, built.source_of, list(built.warnings), built.weights)


def kept_activation_bytes(graph: OpGraph, plan) -> float:
    """Bytes per device of the forward values a `Plan` keeps for the backward pass.

    The activation memory sequence parallelism shrinks (Korthikanti et al. 2022): every
    value the forward pass computes and a later node reads, at its spec in the stage that
    computes it, for one microbatch; the largest stage's total.

    **Arguments:**
    - `graph`: the step the plan was made for (traced at microbatch size when pipelined).
    - `plan`: a `Plan` of `graph` (one stage or a pipeline).

    **Returns:** bytes per device on the stage that keeps the most.
    """
    from autopar.cost import bytes_per_device

    forward = forward_nodes(graph)
    read_later = {v for n in graph.nodes if n.id not in forward for v in n.inputs}
    kept = [v for n in graph.nodes if n.id in forward for v in n.outputs if v in read_later]
    totals = []
    for stage in plan.stages:
        specs, mesh = stage.sharding.var_specs, stage.mesh
        totals.append(sum(
            bytes_per_device(graph.vars[v].shape, graph.vars[v].dtype, specs[v], mesh)
            for v in kept if specs[v] is not None and graph.vars[v].shape
        ))
    return max(totals)
