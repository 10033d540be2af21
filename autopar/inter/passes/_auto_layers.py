"""Automatic layers for models without `autopar.layer_boundary` marks.

In: a number of layers L. Out: the context manager `auto_layers(L)`, under which
`autopar.value_and_grad` cuts the loss function's forward equations into L layers of
balanced FLOPs with the least bytes crossing the cuts (Alpa's layer construction,
`cluster_layers`) and marks the values crossing each cut before differentiating, so the
backward pass carries the matching marks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax

from autopar.graph import Role, trace
from autopar.graph._markers import layer_boundary_p, marking_layers
from autopar.inter.passes._clustering import cluster_layers


@contextlib.contextmanager
def auto_layers(num_layers: int | None):
    """Within this block, `autopar.value_and_grad` marks `num_layers` layers itself
    (None: it marks nothing, the model's own marks count)."""
    marker = None if num_layers is None else functools.partial(
        _with_auto_marks, num_layers=num_layers
    )
    with marking_layers(marker):
        yield


def _with_auto_marks(fun: Callable, num_layers: int) -> Callable:
    def marked(*args: Any) -> Any:
        graph = trace(fun, *args, batch_argnums=())
        if len(graph.nodes) < 2 * num_layers:
            return fun(*args)
        index = {n.id: i for i, n in enumerate(graph.nodes)}
        producer = {v: n.id for n in graph.nodes for v in n.outputs}
        edges = [
            (index[producer[v]], index[n.id], float(graph.vars[v].nbytes))
            for n in graph.nodes
            for v in n.inputs
            if v in producer
        ]
        flops = [max(n.flops, 1.0) for n in graph.nodes]
        cuts = [end for _, end in cluster_layers(flops, edges, num_layers)][:-1]
        last_use = {}
        for n in graph.nodes:
            for v in n.inputs:
                last_use[v] = n.id
        for v in graph.outvars:
            last_use[v] = len(graph.nodes)
        env: dict[int, Any] = dict(zip(graph.invars, jax.tree.leaves(args)))
        start = 0
        for cut in [*cuts, len(graph.nodes)]:
            graph.run_nodes(env, graph.nodes[start:cut])
            if cut < len(graph.nodes):
                crossing = [
                    v for v in env
                    if graph.vars[v].role is Role.ACTIVATION
                    and last_use.get(v, -1) >= cut
                    and jax.numpy.issubdtype(graph.vars[v].dtype, jax.numpy.floating)
                ]
                if crossing:
                    marked_values = layer_boundary_p.bind(*(env[v] for v in crossing))
                    env.update(zip(crossing, marked_values))
            start = cut
        outs = [graph.vars[v].value if graph.vars[v].role is Role.CONST else env[v]
                for v in graph.outvars]
        return jax.tree.unflatten(graph.out_tree, outs)

    return marked
