"""Rematerialization: which forward values a layer drops and what its backward reruns.

In: a (stage or layer) `OpGraph`, the ids of one layer's forward nodes, the values its
backward reads from that forward (`kept`), and a `Remat` choice. Out: a `Recompute`: the
values no longer kept, the forward nodes the backward reruns to get them back, and what
those nodes read instead (kept in their place). The cost model prices it
(`autopar.cost.recomputed_layer_cost`) and the pipeline runtime lowers it
(`with_remat`: the rerun nodes join the stage's backward program, just before the first
node that needs them, and the forward program no longer returns the dropped values).

- "full" (Megatron-LM's full recompute): the layer keeps only what its forward reads from
  outside the layer (its input; parameters are state anyway) and its backward reruns the
  whole forward.
- "selective" (Korthikanti et al. 2022, section 4.1): the layer drops the attention core's
  sequence x sequence tensors (scores, softmax, dropout mask; `attention_core`) and reruns
  the forward nodes that make them from the kept query and key.

Whatever the choice, the pipeline runtime's forward program keeps only what the planner
counts (`with_remat`): a kept value the forward makes inside a fusion (GELU's tanh and
powers, a layer norm's centred input; `autopar.graph.stored_residuals`) is not returned
by the forward but rerun in the backward from the values it is made of, as XLA's own
fusion would (`fused_recompute`). Without it the runtime held every value JAX's backward
reads, more than the plan predicts.

Why not `jax.checkpoint` itself: the traced step is already differentiated (its jaxpr
holds the backward), so a checkpoint can no longer be inserted where JAX's autodiff would
see it. The rewrite does what `jax.checkpoint` lowers to: the backward program recomputes
the values from the kept inputs. In the pipeline runtime forward and backward are separate
programs, so XLA cannot merge the rerun with the original (what `prevent_cse` guards
against inside one program). A user's own `jax.checkpoint` is already in the traced
graph (the backward holds its rerun, marked `Node.remat`); such layers are left as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jax.extend import core as jex_core

from autopar.choices import REMATS, check_choice
from autopar.graph import OpGraph, Role, stored_residuals

STATE_ROLES = (Role.PARAM, Role.OPT_STATE, Role.CONST)


@dataclass(frozen=True)
class Recompute:
    """What one layer's remat choice changes (var ids and node ids of the graph given)."""

    dropped: frozenset[int]  # values the forward no longer keeps for the backward
    nodes: tuple[int, ...]  # forward nodes the backward reruns, in program order
    reads: frozenset[int]  # what the rerun reads from outside itself, state included
    added: frozenset[int]  # activations kept for the rerun that were not kept before
    # Selective recompute inside a layer scan's body: `nodes` are the scans, of whose
    # body only the attention core (values shaped like its `score_shapes`) reruns.
    core_only: bool = False


NO_RECOMPUTE = Recompute(frozenset(), (), frozenset(), frozenset())

CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint"})


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation runs (calls, control flow, checkpoints), opened."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex_core.Jaxpr):
                found.append(item)
    return found


def _leaf_eqns(jaxpr):
    """The equations of `jaxpr` and of the jaxprs it calls, calls themselves left out."""
    for eqn in jaxpr.eqns:
        subs = _sub_jaxprs(eqn)
        if subs and eqn.primitive.name != "scan":
            for sub in subs:
                yield from _leaf_eqns(sub)
        else:
            yield eqn


def has_checkpoint(jaxpr) -> bool:
    """Whether `jaxpr` (or one it calls) holds a `jax.checkpoint`."""
    return any(
        eqn.primitive.name in CHECKPOINT_PRIMITIVES or any(map(has_checkpoint, _sub_jaxprs(eqn)))
        for eqn in jaxpr.eqns
    )


def scan_body(node):
    body = node.params["jaxpr"]
    return body.jaxpr if isinstance(body, jex_core.ClosedJaxpr) else body


def user_checkpointed(graph: OpGraph, nodes: Iterable[int]) -> bool:
    """Whether any of `nodes` comes from the user's own `jax.checkpoint` (in a
    differentiated step: the backward's rerun of the checkpointed forward), or is a scan
    whose body holds one (a checkpoint around a scanned layer's body, the user's or the
    one `scan_layers` puts there for a stage's recompute)."""
    return any(
        graph.nodes[n].remat
        or (graph.nodes[n].primitive == "scan" and has_checkpoint(scan_body(graph.nodes[n])))
        for n in nodes
    )


def score_shapes(jaxpr) -> set[tuple[int, tuple[int, ...]]]:
    """(rank, last two dims) of the attention scores a jaxpr computes: the results of a
    `dot_general` with batch dimensions (heads, batch: no weight matmul has them) of rank
    >= 3 whose last two dimensions are equal (queries x keys)."""
    shapes = set()
    for eqn in _leaf_eqns(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        (_, _), (batch, _) = eqn.params["dimension_numbers"]
        shape = tuple(eqn.outvars[0].aval.shape)
        if batch and len(shape) >= 3 and shape[-1] == shape[-2] and shape[-1] > 1:
            shapes.add((len(shape), shape[-2:]))
    return shapes


def in_core(shape, scores) -> bool:
    """Whether a value of `shape` belongs to the attention core whose `score_shapes` are
    `scores` (same rank, same last two dimensions)."""
    shape = tuple(shape)
    return len(shape) >= 3 and (len(shape), shape[-2:]) in scores


def attention_core(graph: OpGraph, forward: Sequence[int], kept: Iterable[int]) -> set[int]:
    """The kept sequence x sequence values of a layer's forward: its attention scores,
    softmax and dropout mask (Korthikanti et al. 2022's "selective" set).

    An attention score is the result of a `dot_general` of two activations (no parameter
    operand) of rank >= 3 whose last two dimensions are equal (queries x keys); every kept
    value of the same rank and the same last two dimensions belongs to the core. A layer
    scan's scores are found in its body (`score_shapes`), its kept values stacked.
    """
    scores = set()
    for n in forward:
        node = graph.nodes[n]
        if node.primitive == "scan":  # a layer scan: its residuals stack one per iteration
            scores.update((rank + 1, last) for rank, last in score_shapes(scan_body(node)))
            continue
        if node.primitive != "dot_general" or len(node.outputs) != 1:
            continue
        if any(graph.vars[v].role in STATE_ROLES for v in node.inputs):
            continue
        shape = graph.vars[node.outputs[0]].shape
        if len(shape) >= 3 and shape[-1] == shape[-2] and shape[-1] > 1:
            scores.add((len(shape), shape[-2:]))
    return {
        v for v in kept
        if (len(graph.vars[v].shape), graph.vars[v].shape[-2:]) in scores
    }


def recompute(
    graph: OpGraph, forward: Sequence[int], kept: Iterable[int], remat: str,
    backward: Sequence[int] = (),
) -> Recompute:
    """What `remat` drops and reruns for the layer whose forward nodes are `forward`
    (program order) and whose backward reads `kept` from them (see the module docstring).
    Nothing when the layer's `backward` nodes already rerun a user's `jax.checkpoint`."""
    check_choice("remat", remat, REMATS)
    kept = set(kept)
    if remat == "none" or user_checkpointed(graph, (*forward, *backward)):
        return NO_RECOMPUTE
    producer = {v: n for n in forward for v in graph.nodes[n].outputs}
    if remat == "full":
        dropped = {v for v in kept if v in producer}
        nodes = list(forward)
    else:
        # Only what this layer makes: a score-shaped value it reads from elsewhere (a
        # mask made once for every layer) is not its to drop.
        dropped = {v for v in attention_core(graph, forward, kept) if v in producer}
        scans = [n for n in forward if graph.nodes[n].primitive == "scan"
                 and set(graph.nodes[n].outputs) & dropped]
        if scans:
            return _selective_in_scans(graph, scans, dropped)
        nodes = _rerun_nodes(graph, forward, producer, kept, dropped)
    if not dropped:
        return NO_RECOMPUTE
    return _recompute_of(graph, nodes, kept, dropped)


def _selective_in_scans(graph: OpGraph, scans: list[int], dropped: set[int]) -> Recompute:
    """Selective recompute of a layer scan (lowered by a `jax.checkpoint` around its body
    that saves everything but the attention core, `scan_layers`): the scan's stacked core
    residuals are dropped and each iteration's backward reruns its core from the query
    and key it keeps, so nothing is added."""
    dropped = {v for v in dropped if any(v in graph.nodes[n].outputs for n in scans)}
    reads = {
        v for n in scans for v in graph.nodes[n].inputs if graph.vars[v].role is not Role.CONST
    }
    return Recompute(frozenset(dropped), tuple(scans), frozenset(reads), frozenset(), True)


def fused_recompute(
    graph: OpGraph, forward: Sequence[int], kept: Iterable[int], leaving: Iterable[int] = (),
    backward: Sequence[int] = (),
) -> Recompute:
    """The kept values the layer's `forward` makes inside a fusion, rerun in the backward
    from what the forward writes to memory (`stored_residuals`, as the planner counts a
    layer's kept bytes): what XLA's fusion does when one program runs both passes.
    `leaving`: forward values read outside the layer's two passes. Nothing when the
    layer's `backward` already reruns a user's `jax.checkpoint`."""
    kept = set(kept)
    if user_checkpointed(graph, (*forward, *backward)):
        return NO_RECOMPUTE
    producer = {v: n for n in forward for v in graph.nodes[n].outputs}
    stored = stored_residuals(graph, forward, kept, leaving,
                              free=lambda v: graph.vars[v].role in STATE_ROLES)
    dropped = {v for v in kept - stored if v in producer}
    return _rerun(graph, forward, producer, stored | (kept - dropped), dropped)


def _rerun(graph: OpGraph, forward, producer, kept: set[int], dropped: set[int]) -> Recompute:
    """`dropped` made again from `kept` values by the forward nodes that make it."""
    if not dropped:
        return NO_RECOMPUTE
    return _recompute_of(graph, _rerun_nodes(graph, forward, producer, kept, dropped),
                         kept, dropped)


def _rerun_nodes(graph: OpGraph, forward, producer, kept: set[int], dropped: set[int]):
    """The forward nodes that make `dropped` again from `kept` values (and what is made
    outside `forward`), in program order."""
    needed, stack = set(), [producer[v] for v in dropped]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        for v in graph.nodes[n].inputs:
            if v in producer and (v not in kept or v in dropped):
                stack.append(producer[v])
    return [n for n in forward if n in needed]


def _recompute_of(graph: OpGraph, nodes, kept: set[int], dropped: set[int]) -> Recompute:
    """`dropped` made again by rerunning `nodes`, with what they read and what of that
    the layer did not keep already (state aside)."""
    made = {v for n in nodes for v in graph.nodes[n].outputs}
    reads = {
        v for n in nodes for v in graph.nodes[n].inputs
        if v not in made and graph.vars[v].role is not Role.CONST
    }
    added = {v for v in reads - kept if graph.vars[v].role not in STATE_ROLES}
    return Recompute(frozenset(dropped), tuple(nodes), frozenset(reads), frozenset(added))


def _merged(graph: OpGraph, forward, kept: set[int], plans: Sequence[Recompute]) -> Recompute:
    """One layer's recomputes together (a selective one and `fused_recompute`): what any
    drops, rerun from what any keeps in its place and none drops (a layer scan's selective
    core stays as it is)."""
    plans = [p for p in plans if p.nodes]
    if len(plans) <= 1 or any(p.core_only for p in plans):
        return plans[0] if plans else NO_RECOMPUTE
    dropped = set().union(*(p.dropped for p in plans))
    reads = set().union(*(p.reads for p in plans))
    producer = {v: n for n in forward for v in graph.nodes[n].outputs}
    return _rerun(graph, forward, producer, (kept | reads) - dropped, dropped)


def with_remat(graph: OpGraph, partition, layers, stage_remat: Sequence[Sequence[str]]):
    """`partition` whose segments recompute as `stage_remat` says (per stage, per layer of
    the stage: a `Remat`; empty: "none" for every layer) and as XLA's fusion would
    (`fused_recompute`): each layer's rerun nodes go into its stage's backward segment
    before the first node reading a dropped value, the dropped values leave the forward
    segment's outputs, and what the rerun reads becomes a forward output and a backward
    input. A partition with nothing to recompute is returned unchanged."""
    forward, backward = list(partition.forward), list(partition.backward)
    for s in range(len(forward)):
        fwd, bwd = forward[s], backward[s]
        sub = partition.stage_graphs[s]
        index = partition.node_index[s]
        layer_of = {i: layers.layer[full] for full, i in index.items()}
        stage_layers = sorted({layer_of[n] for n in fwd.nodes if layer_of[n] is not None})
        remats = stage_remat[s] if s < len(stage_remat) and stage_remat[s] else ()
        bwd_inputs = set(bwd.inputs)
        bwd_nodes = set(bwd.nodes)
        readers: dict[int, set[int]] = {}
        for n in (*fwd.nodes, *bwd.nodes):
            for v in sub.nodes[n].inputs:
                readers.setdefault(v, set()).add(n)
        fwd_outputs = set(fwd.outputs) | set(sub.outvars)
        reruns: list[Recompute] = []
        for offset, layer in enumerate(stage_layers):
            remat = remats[offset] if offset < len(remats) else "none"
            nodes = [n for n in fwd.nodes if layer_of[n] == layer]
            backs = [n for n in bwd.nodes if layer_of[n] == layer]
            made = {v for n in nodes for v in sub.nodes[n].outputs}
            kept = made & bwd_inputs
            own = set(nodes)
            leaving = {
                v for v in made
                if (v in fwd_outputs and v not in bwd_inputs)
                or readers.get(v, set()) - own - bwd_nodes
            }
            plans = [recompute(sub, nodes, kept, remat, backs)]
            if remat != "full":  # "full" keeps only the layer's input anyway
                plans.append(fused_recompute(sub, nodes, kept, leaving, backs))
            plan = _merged(sub, nodes, kept, plans)
            if plan.nodes:
                reruns.append(plan)
        if not reruns:
            continue
        dropped = set().union(*(r.dropped for r in reruns))
        reads = set().union(*(r.reads for r in reruns))
        needed_elsewhere = {partition.resolve(v) for v in graph.outvars}
        for seg in (*forward, *backward, *partition.apply):
            if seg is not bwd and seg is not fwd:
                needed_elsewhere.update(seg.inputs)
        order = list(bwd.nodes)
        for plan in reruns:
            first_use = next(
                (k for k, n in enumerate(order) if set(sub.nodes[n].inputs) & plan.dropped),
                len(order),
            )
            order[first_use:first_use] = list(plan.nodes)
        fwd_made = {v for n in fwd.nodes for v in sub.nodes[n].outputs}
        outputs = [v for v in fwd.outputs if v not in dropped or v in needed_elsewhere]
        outputs += sorted(v for v in reads if v in fwd_made and v not in outputs)
        inputs = [v for v in bwd.inputs if v not in dropped]
        inputs += sorted(v for v in reads if v not in inputs)
        forward[s] = dataclasses.replace(fwd, outputs=tuple(outputs))
        backward[s] = dataclasses.replace(bwd, nodes=tuple(order), inputs=tuple(inputs))
    return dataclasses.replace(partition, forward=forward, backward=backward)
