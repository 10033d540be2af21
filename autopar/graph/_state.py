"""Which outputs of a train step are its updated state: `tied_state`.

In: an `OpGraph` and the donated argument numbers. Out: (output var, input var) pairs,
matched leaf by leaf by pytree path, shape and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from autopar.graph._collector import collector_paused
from autopar.graph._opgraph import OpGraph
from autopar.graph._trace import path_str


@collector_paused()  # see `autopar.graph._collector`
def tied_state(graph: OpGraph, donate_argnums: Sequence[int]) -> list[tuple[int, int]]:
    """(output var, input var) pairs where the step returns its updated state.

    The first output (the new state) is matched leaf by leaf, by pytree path, shape and
    dtype, to the first donated argument (the old state), or to argument 0 when nothing is
    donated.
    """
    state_arg = donate_argnums[0] if donate_argnums else 0
    by_path = {
        path[1:]: v
        for v, path in zip(graph.invars, leaf_paths(graph.in_tree))
        if path and path[0] == state_arg
    }
    pairs = []
    for v, path in zip(graph.outvars, leaf_paths(graph.out_tree)):
        u = by_path.get(path[1:]) if path and path[0] == 0 else None
        if u is None:
            continue
        a, b = graph.vars[u], graph.vars[v]
        if a.shape == b.shape and a.dtype == b.dtype:
            pairs.append((v, u))
    return pairs


def leaf_paths(tree) -> list[tuple]:
    """For each leaf of a treedef, its key path as a tuple of plain keys."""
    if tree is None:
        return []
    skeleton = jax.tree.unflatten(tree, list(range(tree.num_leaves)))
    with_path, _ = jax.tree_util.tree_flatten_with_path(skeleton)
    out = [()] * tree.num_leaves
    for keypath, index in with_path:
        out[index] = tuple(path_str([k]) for k in keypath)
        if out[index] and out[index][0].isdigit():
            out[index] = (int(out[index][0]),) + out[index][1:]
    return out
