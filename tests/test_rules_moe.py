"""Sharding rules of dropless MoE dispatch, split by split against one device.

Every strategy the planner lists for the primitives a dropless MoE layer traces
(`examples/moe_dropless.py`: `top_k`, `sort` from `argsort`, `cumsum`, the `scatter-add`
of `bincount`, the `gather` of the sorted tokens, the grouped GEMM `ragged_dot_general`
in its three uses and the `scatter-add` that combines) is run on 8 devices as its specs
say and compared with one device. The grouped GEMM's expert-parallel strategies run
through `autopar.lower._experts` (dispatch and combine all-to-all), with routing skewed
so that some experts get no token and some device's experts get most of them; their
compiled HLO holds the all-to-alls the strategy lists and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding

import autopar
from autopar.cluster import LogicalMesh
from autopar.cluster._mesh import to_partition_spec
from autopar.graph import Role, trace
from autopar.intra._strategies import CostContext, node_signature, node_strategies
from autopar.intra._strategies_moe import PER_GEMM
from autopar.lower import count_collectives, jax_mesh
from autopar.lower._experts import planned_prim

MESH_SHAPE = (2, 4)
NUM_EXPERTS, TOKENS, TOP_K, HIDDEN, FFN = 8, 16, 2, 8, 16


def _strategies(fn, *args, primitive, index=0):
    """Node `index` of `primitive` in `fn`'s graph, its operands' values on one device,
    and every strategy of it on a (2, 4) mesh. Each node runs on its own here
    (`planned_prim`: its own dispatch and combine), so its strategies are priced per node
    (``moe_dispatch="gemm"``); the expert MLP regions' pricing and lowering are tested in
    tests/test_moe_regions.py and tests/test_moe_dropless.py."""
    graph = trace(fn, *args, batch_argnums=())
    node = [n for n in graph.nodes if n.primitive == primitive][index]
    env = dict(zip(graph.invars, jax.tree.leaves(args)))
    graph.run_nodes(env, graph.nodes[: node.id])
    operands = [graph.vars[v].value if graph.vars[v].role is Role.CONST else env[v]
                for v in node.inputs]
    sig = node_signature(node, graph)
    assert sig is not None, f"no sharding rule for {primitive}"
    mesh = LogicalMesh.create(MESH_SHAPE, range(8))
    ctx = CostContext(autopar.Cluster.from_profile("cpu-local"), mesh, moe_dispatch="gemm")
    return node, graph, operands, node_strategies(node, graph, sig, ctx), mesh


def _sharding(mesh, spec, ndim):
    return NamedSharding(jax_mesh(mesh), to_partition_spec(spec or ((),) * ndim))


def _run_split(node, graph, operands, strategy, mesh):
    """The node's primitive on `operands`, placed as `strategy` says (an expert-parallel
    strategy through the lowering's all-to-all dispatch); (results, compiled HLO)."""
    placed = [jax.device_put(a, _sharding(mesh, s, np.ndim(a)))
              for a, s in zip(operands, strategy.in_specs)]
    specs = [s or ((),) * np.ndim(a) for a, s in zip(operands, strategy.in_specs)]
    prim = planned_prim(node, graph, jax_mesh(mesh), specs, strategy.out_specs) or node.prim

    def run(*xs):
        outs = prim.bind(*xs, **node.params)
        outs = list(outs) if prim.multiple_results else [outs]
        return [lax.with_sharding_constraint(y, _sharding(mesh, s, y.ndim))
                for y, s in zip(outs, strategy.out_specs)]

    fn = jax.jit(run)
    return fn(*placed), fn.lower(*placed).compile().as_text()


def _routing():
    """Skewed routing of the routed copies: experts 0 and 5 get none, expert 7 most."""
    ids = jax.random.choice(jax.random.key(0), jnp.array([1, 2, 3, 4, 6, 7, 7, 7]),
                            (TOKENS * TOP_K,))
    return jnp.bincount(ids, length=NUM_EXPERTS).astype(jnp.int32)


def _check_every_split(fn, args, primitive, index=0, min_splits=1):
    node, graph, operands, strategies, mesh = _strategies(fn, *args, primitive=primitive,
                                                   index=index)
    expected = node.prim.bind(*operands, **node.params)
    expected = list(expected) if node.prim.multiple_results else [expected]
    split = [s for s in strategies if any(any(spec) for spec in s.out_specs)]
    assert len(split) >= min_splits, [s.name for s in strategies]
    for s in strategies:
        got, hlo = _run_split(node, graph, operands, s, mesh)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{primitive}: {s.name}")
        counted = count_collectives(hlo)
        if s.name.startswith("ep:"):
            assert set(counted) == {"all_to_all"}, (s.name, counted)
            assert counted["all_to_all"][0] == len(s.collectives), (s.name, counted)
        elif not s.collectives:
            # nothing moves but, for a grouped GEMM, the group sizes (int32[G], a few
            # bytes) that XLA gathers where it splits their cumulative sum
            small = sum(b for _, b in counted.values())
            assert small <= 2 * 4 * NUM_EXPERTS * (primitive == "ragged_dot_general"), (
                primitive, s.name, counted)
    return strategies


def _ragged_operands():
    group_sizes = _routing()
    k = jax.random.split(jax.random.key(1), 3)
    rows = jax.random.normal(k[0], (TOKENS * TOP_K, HIDDEN))
    weights = jax.random.normal(k[1], (NUM_EXPERTS, HIDDEN, FFN))
    cotangent = jax.random.normal(k[2], (TOKENS * TOP_K, FFN))
    return rows, weights, cotangent, group_sizes


def test_ragged_dot_forward_every_split():
    rows, weights, _, group_sizes = _ragged_operands()
    strategies = _check_every_split(lax.ragged_dot, (rows, weights, group_sizes),
                                    "ragged_dot_general", min_splits=4)
    names = {s.name for s in strategies}
    ep = {f"ep:{axes}{PER_GEMM}" for axes in ("x", "y", "xy")}
    assert {"m0:x", "n0:y", "g:x", *ep} <= names, names


@pytest.mark.parametrize("which", [0, 1], ids=["weight_grad", "token_grad"])
def test_ragged_dot_gradients_every_split(which):
    rows, weights, cotangent, group_sizes = _ragged_operands()

    def vjp(rows, weights, cotangent):
        _, pullback = jax.vjp(lambda x, w: lax.ragged_dot(x, w, group_sizes), rows, weights)
        return pullback(cotangent)

    # the backward's two grouped GEMMs: the weight gradient (the ragged dimension
    # contracted) and the token gradient (contracted over the FFN dimension)
    strategies = _check_every_split(vjp, (rows, weights, cotangent), "ragged_dot_general",
                                    index=which, min_splits=4)
    assert any(s.name == "ep:xy" + PER_GEMM for s in strategies)


def test_routing_primitives_every_split():
    scores = jax.nn.softmax(jax.random.normal(jax.random.key(2), (TOKENS, NUM_EXPERTS)))
    _check_every_split(lambda s: lax.top_k(s, TOP_K)[1], (scores,), "top_k")
    ids = lax.top_k(scores, TOP_K)[1]
    flat = ids.reshape(-1)
    _check_every_split(lambda e: jnp.argsort(e, stable=True), (flat,), "sort", min_splits=0)
    # a batch of routings: argsort along the last dimension splits the others
    _check_every_split(lambda e: jnp.argsort(e, axis=-1, stable=True), (ids.T,), "sort")
    _check_every_split(lambda e: jnp.bincount(e, length=NUM_EXPERTS), (flat,), "scatter-add")
    counts = jnp.bincount(flat, length=NUM_EXPERTS)
    _check_every_split(lambda c: jnp.cumsum(c.reshape(2, -1), axis=1), (counts,), "cumsum")


def test_permutation_gather_and_combine_every_split():
    tokens = jax.random.normal(jax.random.key(3), (TOKENS, HIDDEN))
    order = jax.random.permutation(jax.random.key(4), TOKENS * TOP_K)
    token_of = (order // TOP_K).astype(jnp.int32)
    _check_every_split(lambda x, t: x[t], (tokens, token_of), "gather", min_splits=2)
    routed = jax.random.normal(jax.random.key(5), (TOKENS * TOP_K, HIDDEN))
    _check_every_split(lambda y, t: jnp.zeros((TOKENS, HIDDEN)).at[t].add(y),
                       (routed, token_of), "scatter-add", min_splits=2)
