"""scan / while / cond: planned whole or split along a batch dimension the bodies keep apart.

The rule (autopar/intra/_control_flow.py) reads the bodies; these tests check which
operands it labels "batch", that the planner picks the split for an RNN whose batch is
large next to its weights, that the split run matches one device with no collectives, and
that bodies mixing the batch (sums, contractions, indexing, loop conditions) stay whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import compiled_hlo
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.graph import Role, trace
from autopar.intra import plan_sharding
from autopar.intra._options import ShardOptions
from autopar.intra._strategies import node_signature
from autopar.lower import count_collectives

T, B, H = 6, 16, 8  # time steps, batch, hidden
CONTROL_FLOW = ("scan", "while", "cond")
CPU = autopar.Cluster.from_profile("cpu-local")


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w": jax.random.normal(k[0], (H, H)) * 0.3,
        "u": jax.random.normal(k[1], (H, H)) * 0.3,
        "b": jax.random.normal(k[2], (H,)) * 0.1,
        "gate": jnp.float32(1.0),
    }


def _batch():
    return {"xs": jax.random.normal(jax.random.key(1), (T, B, H))}


def rnn_step(params, batch):
    """An RNN over time (scan), three refinement steps (while), a gated sign flip (cond)."""
    w, u, b = params["w"], params["u"], params["b"]

    def cell(h, x):
        h = jnp.tanh(x @ u + h @ w + b)
        return h, h * 2.0

    h, ys = lax.scan(cell, jnp.zeros((B, H)), batch["xs"])

    def refine(carry):
        i, h = carry
        return i + 1, jnp.tanh(h @ w)

    _, h = lax.while_loop(lambda carry: carry[0] < 3, refine, (0, h))
    h = lax.cond(params["gate"] > 0, lambda h: h * 2.0, lambda h: -h, h)
    return {"h": h, "ys": ys}


def batch_sum_step(params, batch):
    """An RNN that also carries a running sum over the batch: its scan mixes the batch."""

    def cell(carry, x):
        h, total = carry
        h = jnp.tanh(x @ params["u"] + h @ params["w"])
        return (h, total + h.sum(axis=0)), h

    (h, total), ys = lax.scan(cell, (jnp.zeros((B, H)), jnp.zeros(H)), batch["xs"])
    return {"h": h, "total": total, "ys": ys}


def _nodes(graph, primitive):
    return [n for n in graph.nodes if n.primitive == primitive]


def _signature(fn, *args, primitive="scan"):
    graph = trace(fn, *args, batch_argnums=())
    return node_signature(_nodes(graph, primitive)[0], graph)


# float32 sums of O(1) values taken in another order (a split loop against one device; the
# CPU's vector width decides XLA's order) differ by ~1e-7 absolute, which is a large
# relative error on entries near zero (seen: 8.9e-08 on -8.86e-05 on an AMD EPYC host).
F32_ATOL = 1e-6


def _assert_split_runs_apart(fn, *args):
    """Run `fn` with its scan's operands and results split as the rule labels them.

    `fn`'s arguments must be the scan's non-literal operands and its results the scan's
    results. A sound split compiles to a loop with no collective, and matches one device.
    """
    graph = trace(fn, *args, batch_argnums=())
    (scan,) = _nodes(graph, "scan")
    sig = node_signature(scan, graph)
    assert "batch" in sig.labels(), f"{fn.__name__}: expected a batch split, got {sig}"
    operands = [i for i, v in enumerate(scan.inputs) if graph.vars[v].role is not Role.CONST]
    assert len(operands) == len(args), "the arguments must be the scan's operands"
    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices())

    def sharding(labels):
        return NamedSharding(mesh, P(*["x" if lab == "batch" else None for lab in labels]))

    in_shardings = tuple(sharding(sig.inputs[i]) for i in operands)
    out_shardings = tuple(sharding(labels) for labels in sig.outputs)
    split = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
    placed = [jax.device_put(x, s) for x, s in zip(args, in_shardings)]
    assert count_collectives(split.lower(*placed).compile().as_text()) == {}
    for a, b in zip(jax.tree.leaves(split(*placed)), jax.tree.leaves(jax.jit(fn)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=F32_ATOL)


def _check_matches_one_device(step, params, batch):
    """Run `step` split on 8 devices as the planner says; return (graph, plan, parallel fn)."""
    par = autopar.autoparallel(
        step, cluster=CPU, method="shard", mesh_shape=(8,), donate_argnums=()
    )
    got = par(params, batch)
    want = jax.jit(step)(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=F32_ATOL)
    graph = trace(step, params, batch)
    sharding = par.plan.stages[0].sharding
    sharding.check_graph(graph)  # node ids below are those of the planned graph
    return graph, sharding, par


# ---- planned and run on 8 devices --------------------------------------------------------


def test_rnn_loops_are_batch_split_and_match_one_device():
    params, batch = _params(), _batch()
    graph, sharding, par = _check_matches_one_device(rnn_step, params, batch)
    # The scan's body is planned with the step (autopar/intra/_scan.py); while and cond
    # take the rule's batch split.
    expected = {"scan": f"body plan x{T}", "while": "batch:x", "cond": "batch:x"}
    for primitive in CONTROL_FLOW:
        (node,) = _nodes(graph, primitive)
        assert sharding.node_strategies[node.id] == expected[primitive], (
            f"{primitive} should be split on the batch, got {sharding.node_strategies[node.id]}"
        )
    scan, while_, cond = (_nodes(graph, p)[0] for p in CONTROL_FLOW)
    h_final, ys = scan.outputs
    assert sharding.var_specs[h_final] == (("x",), ())
    assert sharding.var_specs[ys] == ((), ("x",), ())  # the time axis stays whole
    assert sharding.var_specs[while_.outputs[1]] == (("x",), ())
    assert sharding.var_specs[cond.outputs[0]] == (("x",), ())
    # XLA splits the loops from the shardings at their boundaries: nothing is gathered.
    assert count_collectives(compiled_hlo(par, params, batch)) == {}
    assert sharding.cost.collectives == {}


def test_body_summing_over_batch_is_planned_replicated():
    params, batch = _params(), _batch()
    graph, sharding, _ = _check_matches_one_device(batch_sum_step, params, batch)
    (scan,) = _nodes(graph, "scan")
    assert node_signature(scan, graph).labels() == (), "the batch split must not be offered"
    # Opened, its body is planned as the ILP finds cheapest (and still matches one device);
    # as one node it is replicated.
    assert sharding.node_strategies[scan.id] == f"body plan x{T}"
    as_node = plan_sharding(graph, CPU, options=ShardOptions(open_scans=False), mesh_shape=(8,))
    assert as_node.node_strategies[scan.id] == "replicated"


# ---- which operands the rule labels ------------------------------------------------------


def _abstract(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_scan_labels_xs_and_ys_after_the_scanned_axis():
    sig = _signature(rnn_step, _params(), _batch())
    # operands: w, u, b (consts), h0 (carry), xs (time, batch, hidden)
    assert sig.inputs == ((None, None), (None, None), (None,), ("batch", None),
                          (None, "batch", None))
    assert sig.outputs == (("batch", None), (None, "batch", None))
    assert not sig.reductions


def test_carry_split_reaches_a_fixed_point_through_other_carries():
    # c2 takes the batch from xs; c1 only from c2 one step later: both must be split.
    def fn(c1, c2, xs):
        def body(carry, x):
            c1, c2 = carry
            return (c2 * 2.0, jnp.sin(x) + c1), None

        return lax.scan(body, (c1, c2), xs)[0]

    sig = _signature(fn, _abstract(B, H), _abstract(B, H), _abstract(T, B, H))
    assert sig.inputs == (("batch", None), ("batch", None), (None, "batch", None))


def test_nested_scan_and_checkpoint_inside_a_body_keep_the_batch():
    def fn(w, h0, xs):
        @jax.checkpoint
        def cell(h, x):
            inner, _ = lax.scan(lambda a, _: (jnp.tanh(a @ w), None), h + x, None, length=2)
            return inner, inner.mean(axis=-1)

        return lax.scan(cell, h0, xs)

    sig = _signature(fn, _abstract(H, H), _abstract(B, H), _abstract(T, B, H))
    assert sig.inputs == ((None, None), ("batch", None), (None, "batch", None))
    assert sig.outputs == (("batch", None), (None, "batch"))


def test_cond_predicate_stays_whole_and_branches_must_agree():
    def agree(p, x):
        return lax.cond(p > 0, lambda x: jnp.exp(x), lambda x: jnp.zeros_like(x), x)

    sig = _signature(agree, _abstract(), _abstract(B, H), primitive="cond")
    assert sig.inputs == ((), ("batch", None))
    assert sig.outputs == (("batch", None),)

    def transposed(p, x):  # one branch moves the batch to the other dimension
        return lax.cond(p > 0, lambda x: x, lambda x: x.T, x)

    sig = _signature(transposed, _abstract(), _abstract(B, B), primitive="cond")
    assert sig.labels() == ()


def test_while_condition_reading_the_batch_is_not_split():
    def reads(x):  # the trip count depends on the values of the batch
        return lax.while_loop(lambda x: x.sum() < 100.0, lambda x: x * 2.0 + 1.0, x)

    assert _signature(reads, _abstract(B, H), primitive="while").labels() == ()

    def counts(x):  # a counter decides: the batch may be split
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))

    sig = _signature(counts, _abstract(B, H), primitive="while")
    assert sig.inputs == ((), ("batch", None))


def test_bodies_that_mix_the_batch_are_not_split():
    def contracts(w, h0, xs):  # h^T h contracts over the batch
        return lax.scan(lambda h, x: (h + x @ (h.T @ h) @ w, None), h0, xs)[0]

    def indexes(h0, xs):  # dynamic_slice picks one batch row per step
        def body(carry, x):
            h, i = carry
            row = lax.dynamic_slice_in_dim(h, i, 1, axis=0)
            return (h + x * row, i + 1), None

        return lax.scan(body, (h0, 0), xs)[0]

    def rolls(h0, xs):  # flattened and rolled: each row takes the last element of another
        def body(h, x):
            return jnp.roll((h * x).reshape(-1), 1).reshape(B, H), None

        return lax.scan(body, h0, xs)[0]

    cases = [
        (contracts, (_abstract(H, H), _abstract(B, H), _abstract(T, B, H))),
        (indexes, (_abstract(B, H), _abstract(T, B, H))),
        (rolls, (_abstract(B, H), _abstract(T, B, H))),
    ]
    for fn, args in cases:
        sig = _signature(fn, *args)
        h0, xs = sig.inputs[-3] if fn is indexes else sig.inputs[-2], sig.inputs[-1]
        # The batch (dim 0 of h, dim 1 of xs) is never split; the hidden dimension may be
        # where the body keeps it apart (indexing takes whole rows).
        assert h0[0] is None and xs[1] is None, f"{fn.__name__}: batch split in {sig}"
        if fn is not indexes:
            assert sig.labels() == (), f"{fn.__name__}: nothing may be split, got {sig}"


def _random(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def test_offered_splits_compile_to_loops_without_collectives():
    def carries(c1, c2, xs):  # the fixed-point case above
        def body(carry, x):
            c1, c2 = carry
            return (c2 * 2.0, jnp.sin(x) + c1), None

        return lax.scan(body, (c1, c2), xs)[0]

    def nested(w, h0, xs):  # the nested scan under a checkpoint above
        @jax.checkpoint
        def cell(h, x):
            inner, _ = lax.scan(lambda a, _: (jnp.tanh(a @ w), None), h + x, None, length=2)
            return inner, inner.mean(axis=-1)

        return lax.scan(cell, h0, xs)

    def rows(h0, xs):  # indexes whole rows: split on the hidden dimension instead
        def body(carry, x):
            h, i = carry
            row = lax.dynamic_slice_in_dim(h, i, 1, axis=0)
            return (jnp.tanh(h + x * row), i + 1), None

        return lax.scan(body, (h0, 0), xs)[0]

    _assert_split_runs_apart(carries, _random(B, H), _random(B, H, seed=1), _random(T, B, H))
    _assert_split_runs_apart(nested, _random(H, H) * 0.3, _random(B, H), _random(T, B, H))
    _assert_split_runs_apart(rows, _random(B, H), _random(T, B, H, seed=2))
