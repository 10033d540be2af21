"""The ILP's edges: per operand of a graph node, the resharding seconds from each
strategy of its producer to each of its own (`build_problem`'s `edge_costs`), and the spec
lists they are read from.

In: the ILP nodes (`autopar.intra._problem.IlpNode`: each node's strategies and, where they
copy one, the mesh memo's strategy tuple `origin`), which ILP node makes each variable,
the donated state's ties, the mesh, the cluster and the nodes' weights.
Out: the edges (producer, consumer) and their matrices (seconds, weighted), every entry
`reshard_time` of its two specs (`reshard_matrix`, tests/test_build_memos.py and
tests/test_build_spec_lists.py).

Each matrix is priced between the distinct specs of both ends (`_SpecList`) and memoised
for the mesh (`shared_reshard_cache`), then spread over both ends' strategies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar._memo import declare
from autopar.cluster import Spec, replicated
from autopar.graph import OpGraph, Role
from autopar.intra._reshard import reshard_matrix, shared_reshard_cache


def operands(graph: OpGraph, ilp_nodes):
    """(ILP node index, ILP node, operand index, variable) of every non-constant operand of
    every graph node, in order: the edges of the ILP."""
    for index, ilp_node in enumerate(ilp_nodes):
        if ilp_node.node is None:
            continue
        for p, v in enumerate(graph.nodes[ilp_node.node].inputs):
            var = graph.vars[v]
            if var.role is not Role.CONST:
                yield index, ilp_node, p, var


def build_edges(graph, ilp_nodes, source_of, tied, mesh, cluster, weights):
    """(edges, their matrices): one per non-constant operand of every graph node (from
    the ILP node making it to the node's), then one per tied pair of state (from its
    update to its input) whose ends are two ILP nodes. A matrix is weighted by its
    consumer's weight (the update's for a tie)."""
    cache = shared_reshard_cache(mesh, cluster)

    def weight(index: int) -> float:
        node = ilp_nodes[index].node
        return weights[node][0] if node in weights else 1.0

    edges: list[tuple[int, int]] = []
    costs: list[np.ndarray] = []
    out_specs: dict[tuple[int, int], _SpecList] = {}  # (ILP node, result) -> its specs

    def source(u: int, k: int) -> _SpecList:
        found = out_specs.get((u, k))
        if found is None:
            found = out_specs[u, k] = shared_specs(cache, ilp_nodes[u], "out list", k)
        return found

    def matrix(var, src: _SpecList, dst: _SpecList) -> np.ndarray:
        # Resharding seconds between the distinct specs of each side, memoised for the
        # mesh (`shared_reshard_cache`), then spread over the strategies of both ends.
        key = ("matrix", tuple(var.shape), var.dtype, src.token, dst.token)
        small = cache.get(key)
        if small is None:
            small = cache[key] = reshard_matrix(var.shape, var.dtype, src.unique, dst.unique,
                                                mesh, cluster, cache, (src.token, dst.token))
        return _spread(small, src, dst)

    for index, ilp_node, p, var in operands(graph, ilp_nodes):
        u, k = source_of[var.id]
        dst = shared_specs(cache, ilp_node, "in list", p, len(var.shape))
        edges.append((u, index))
        costs.append(_weighted_matrix(weight(index), matrix(var, source(u, k), dst)))
    for out_var, in_var in tied:
        if out_var not in source_of or in_var not in source_of:
            continue
        u, k = source_of[out_var]
        w, _ = source_of[in_var]
        if u == w:
            continue
        var = graph.vars[out_var]
        edges.append((u, w))
        # moved when the update runs
        costs.append(_weighted_matrix(weight(u), matrix(var, source(u, k), source(w, 0))))
    return edges, costs


def _spread(small: np.ndarray, src: _SpecList, dst: _SpecList) -> np.ndarray:
    """``small[src.index[:, None], dst.index]`` (the matrix between the distinct specs of
    both ends spread over their strategies), the same entries: `small` itself where every
    strategy of both ends has a spec of its own (`_SpecList.distinct`: both indexes are
    the identity), else rows then columns taken one axis at a time (`np.take`, the same
    gather as the 2-D fancy index). `small` is the mesh memo's: the caller must not write
    into the result (`ShardingProblem` copies its matrices)."""
    if src.distinct:
        return small if dst.distinct else small.take(dst.index, axis=1)
    rows = small.take(src.index, axis=0)
    return rows if dst.distinct else rows.take(dst.index, axis=1)


def _weighted_matrix(weight: float, matrix: np.ndarray) -> np.ndarray:
    """``weight * matrix``; `matrix` itself where `weight` is 1 (1.0 * x is x to the bit,
    for every float x), saving a copy per edge of an unweighted node."""
    return matrix if weight == 1.0 else weight * matrix


@dataclass(frozen=True)
class _SpecList:
    """One spec per strategy of a node's operand or result, as its distinct specs (in
    first-seen order, named by `token`) and the position of each strategy's among them."""

    unique: tuple[Spec, ...]
    index: np.ndarray
    token: int
    distinct: bool = False  # every spec appears once: `index` is 0, 1, ..., len - 1


def _spec_list(specs: tuple[Spec, ...]) -> _SpecList:
    found = _SPEC_LISTS.get(specs)
    if found is None:
        unique = tuple(dict.fromkeys(specs))
        token = _UNIQUE_TOKENS.get(unique)
        if token is None:
            if len(_UNIQUE_TOKENS) > _SPEC_LIST_LIMIT:
                _UNIQUE_TOKENS.clear()
            token = _UNIQUE_TOKENS[unique] = next(_TOKENS)
        position = {spec: i for i, spec in enumerate(unique)}
        index = np.array([position[spec] for spec in specs], dtype=np.intp)
        if len(_SPEC_LISTS) > _SPEC_LIST_LIMIT:
            _SPEC_LISTS.clear()
        found = _SPEC_LISTS[specs] = _SpecList(unique, index, token,
                                               len(unique) == len(specs))
    return found


# Distinct spec tuples -> a token that names them in the resharding memo's keys, and spec
# lists -> their `_SpecList`, process-wide (layers, meshes and searches repeat them).
# Tokens are never reused, so a cleared table only costs recomputation.
_TOKENS = itertools.count()
_UNIQUE_TOKENS: dict[tuple[Spec, ...], int] = declare(
    {}, "intra.unique_spec_tokens", "distinct spec tuple -> token")
_SPEC_LISTS: dict[tuple[Spec, ...], _SpecList] = declare(
    {}, "intra.spec_lists", "spec per strategy -> _SpecList")
_SPEC_LIST_LIMIT = 200_000


def _out_specs(ilp_node, k: int) -> tuple[Spec, ...]:
    """The spec of result `k` under each of the node's strategies."""
    return tuple(s.out_specs[k] for s in ilp_node.strategies)


def _in_specs(ilp_node, p: int, ndim: int) -> tuple[Spec, ...]:
    """The spec of operand `p` (of `ndim` dimensions) under each of the node's strategies,
    a constant's (None) as replicated."""
    whole = replicated(ndim)
    return tuple(s.in_specs[p] or whole for s in ilp_node.strategies)


def shared_specs(memo: dict, ilp_node, side: str, k: int, ndim: int = 0):
    """`_out_specs(ilp_node, k)` (`side` "out") or `_in_specs(ilp_node, k, ndim)` ("in"),
    or their `_spec_list` ("out list", "in list"), memoised in the mesh's `memo` per
    strategy tuple of the memo that the node's strategies copy (`IlpNode.origin`): the
    nodes of one key in a graph, and the builds of a graph on one mesh, share one tuple,
    and each rebuilt these spec lists and hashed them whole for `_spec_list`'s table.
    Keyed by the tuple's `id`, the tuple kept in the entry and compared by identity (an
    id is not reused while its object lives), so a hit is that tuple's lists exactly."""
    origin = ilp_node.origin
    if origin is None or len(origin) != len(ilp_node.strategies):
        return _specs_of(memo, ilp_node, side, k, ndim)
    key = ("specs of", id(origin), side, k, ndim)
    found = memo.get(key)
    if found is None or found[0] is not origin:
        found = memo[key] = (origin, _specs_of(memo, ilp_node, side, k, ndim))
    return found[1]


def _specs_of(memo: dict, ilp_node, side: str, k: int, ndim: int):
    """What `shared_specs` memoises, computed (a spec list from the memoised specs)."""
    if side == "out":
        return _out_specs(ilp_node, k)
    if side == "in":
        return _in_specs(ilp_node, k, ndim)
    return _spec_list(shared_specs(memo, ilp_node, side.removesuffix(" list"), k, ndim))
