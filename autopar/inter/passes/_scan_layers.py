"""Layers from the iterations of a scan over stacked layers (no `layer_boundary` marks).

In: iteration ranges ``[(a0, b0), (a1, b1), ...]`` covering ``range(L)``. Out: the context
manager `scan_layers(ranges)`, under which `autopar.value_and_grad` runs the loss function's
*layer scan* (its longest `scan` whose scanned operands include stacked parameters) as one
sub-scan per range, over static slices ``w[a:b]`` of the stacked operands, the carry handed
from one sub-scan to the next, and marks with `layer_boundary` the carry before the first
sub-scan, between sub-scans and after the last. JAX differentiates what it is given, so the
backward pass runs one reverse sub-scan per range, between the transposed marks; the
gradient of each stacked parameter comes out as ``pad(g_k)`` pieces summed by ``add_any``
(`autopar.graph.split_stacked` turns them back into per-range pieces).

The layers of the traced step are then: everything before the scan (embeddings), one layer
per range, everything after it (the head and the loss), i.e. ``len(ranges) + 2`` layers.
With one range per iteration the stage DP sees L identical layers (one ILP for all) and
may cut the stack anywhere; with the stage ranges it chose, each stage runs one sub-scan
over its slice of the stacked weights.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopar.graph import Node, OpGraph, Role, trace
from autopar.graph._markers import layer_boundary_p, marking_layers
from autopar.inter.passes._remat import has_checkpoint, in_core, score_shapes

Ranges = tuple[tuple[int, int], ...]


# Ops through which a scanned operand still is its stacked parameter: mixed precision
# casts the fp32 master weights to the compute dtype before the scan (`master_dtype` in
# examples/gpt.py and examples/llama.py).
_SAME_VALUE_OPS = ("convert_element_type", "copy", "copy_p")


def layer_scan(graph: OpGraph) -> Node | None:
    """The graph's layer scan: the longest `scan` (length >= 2, most FLOPs among equals)
    one of whose scanned operands (``xs``) is a floating graph input, i.e. a stacked
    parameter, or such an input cast to another dtype; None when there is none."""
    inputs = set(graph.invars)
    producer = {v: node for node in graph.nodes for v in node.outputs}

    def source(v: int) -> int:
        node = producer.get(v)
        while node is not None and node.primitive in _SAME_VALUE_OPS and len(node.inputs) == 1:
            v = node.inputs[0]
            node = producer.get(v)
        return v

    found = []
    for node in graph.nodes:
        if node.primitive != "scan" or node.params["length"] < 2:
            continue
        first_xs = node.params["num_consts"] + node.params["num_carry"]
        if any(
            v in inputs and jnp.issubdtype(graph.vars[v].dtype, jnp.floating)
            and graph.vars[v].role is not Role.BATCH
            for v in map(source, node.inputs[first_xs:])
        ):
            found.append(node)
    if not found:
        return None
    return max(found, key=lambda n: (n.params["length"], n.flops, -n.id))


def per_iteration(length: int) -> Ranges:
    return tuple((k, k + 1) for k in range(length))


@contextlib.contextmanager
def scan_layers(ranges: Ranges | Callable[[int], Ranges], remat: Sequence[str] = ()):
    """Within this block `autopar.value_and_grad` runs the loss function's layer scan as
    sub-scans over `ranges` (or `ranges(L)` for a scan of length L), marking layers
    between them (see the module docstring). `remat`: per range, what its sub-scan
    recomputes ("none", "selective", "full"; empty: nothing), lowered by a
    `jax.checkpoint` around the sub-scan's body (`checkpointed_body`)."""
    split = functools.partial(_split_layer_scan, ranges=ranges, remat=tuple(remat))
    with marking_layers(split):
        yield


def check_ranges(ranges: Sequence[tuple[int, int]], length: int) -> Ranges:
    ranges = tuple((int(a), int(b)) for a, b in ranges)
    ok = bool(ranges) and ranges[0][0] == 0 and ranges[-1][1] == length and all(
        a < b and (i == 0 or ranges[i - 1][1] == a) for i, (a, b) in enumerate(ranges)
    )
    if not ok:
        raise ValueError(
            f"scan ranges {list(ranges)} do not cover the layer scan's {length} iterations "
            "in order without gaps; plan again for this model"
        )
    return ranges


def _split_layer_scan(fun: Callable, ranges, remat: tuple[str, ...] = ()) -> Callable:
    def split(*args: Any) -> Any:
        graph = trace(fun, *args, batch_argnums=())
        scan = layer_scan(graph)
        if scan is None:
            return fun(*args)
        length = scan.params["length"]
        pieces = check_ranges(ranges(length) if callable(ranges) else ranges, length)
        if remat and len(remat) != len(pieces):
            raise ValueError(
                f"{len(remat)} remat choices for the {len(pieces)} ranges {list(pieces)} of "
                "the layer scan; plan again for this model"
            )
        env: dict[int, Any] = dict(zip(graph.invars, jax.tree.leaves(args)))
        for node in graph.nodes:
            if node is scan:
                ins = [_read(graph, env, v) for v in node.inputs]
                env.update(zip(node.outputs, _run_in_pieces(node, ins, pieces, remat)))
            else:
                graph.run_nodes(env, [node])
        outs = [_read(graph, env, v) for v in graph.outvars]
        return jax.tree.unflatten(graph.out_tree, outs)

    return split


def _read(graph: OpGraph, env: dict, v: int) -> Any:
    return graph.vars[v].value if graph.vars[v].role is Role.CONST else env[v]


def _run_in_pieces(node: Node, ins: list, ranges: Ranges, remat: tuple[str, ...] = ()) -> list:
    """`node` (a scan) run as one sub-scan per range, marks around and between them;
    range k's body recomputes as `remat[k]` says."""
    params = dict(node.params)
    remat_of = dict(zip(ranges, remat))
    reverse = params["reverse"]
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    consts = ins[:num_consts]
    carry = list(ins[num_consts:num_consts + num_carry])
    xs = ins[num_consts + num_carry:]
    order = list(reversed(ranges)) if reverse else list(ranges)
    ys_pieces: list[list] = []
    carry = _mark(carry)
    for a, b in order:
        piece_xs = [jax.lax.slice_in_dim(x, a, b, axis=0) for x in xs]
        body = checkpointed_body(params["jaxpr"], remat_of.get((a, b), "none"))
        outs = node.prim.bind(
            *consts, *carry, *piece_xs, **{**params, "length": b - a, "jaxpr": body}
        )
        carry = _mark(list(outs[:num_carry]))
        ys_pieces.append(list(outs[num_carry:]))
    if reverse:
        ys_pieces.reverse()
    ys = [
        jnp.concatenate([p[i] for p in ys_pieces], axis=0) if len(ys_pieces) > 1
        else ys_pieces[0][i]
        for i in range(len(ys_pieces[0]))
    ]
    return [*carry, *ys]


def checkpointed_body(body, remat: str):
    """A scan body (a closed jaxpr) wrapped in `jax.checkpoint` so that its backward
    recomputes as `remat` says: "full" keeps only the body's inputs
    (`nothing_saveable`, Megatron-LM's full recompute of a layer); "selective" keeps
    everything but the attention core, the values shaped like the body's attention scores
    (`score_shapes`: scores, softmax, dropout mask; Korthikanti et al. 2022), rerun from
    the query and key it keeps. "none", or a body that already holds a `jax.checkpoint`
    (the user's, respected as written): the body unchanged.

    Plain JAX: ``jax.lax.scan(jax.checkpoint(layer, policy=...), x, stacked_weights)``.
    """
    if remat == "none" or has_checkpoint(body.jaxpr):
        return body
    if remat == "full":
        policy = jax.checkpoint_policies.nothing_saveable
    else:
        scores = score_shapes(body.jaxpr)

        def policy(prim, *avals, **params) -> bool:
            try:
                out, _ = prim.abstract_eval(*avals, **params)
            except Exception:  # a primitive without a plain abstract rule: keep its result
                return True
            outs = out if isinstance(out, (tuple, list)) else (out,)
            return not any(in_core(getattr(o, "shape", ()), scores) for o in outs)

    def run(*args):
        return jax.core.eval_jaxpr(body.jaxpr, body.consts, *args)

    wrapped = jax.make_jaxpr(jax.checkpoint(run, policy=policy, prevent_cse=False))(
        *(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in body.in_avals)
    )
    return wrapped


def _mark(carry: list) -> list:
    """The carry with its floating values marked as a layer edge."""
    floating = [i for i, c in enumerate(carry) if jnp.issubdtype(c.dtype, jnp.floating)]
    if not floating:
        return carry
    marked = layer_boundary_p.bind(*(carry[i] for i in floating))
    carry = list(carry)
    for i, m in zip(floating, marked):
        carry[i] = m
    return carry
