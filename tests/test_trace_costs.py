"""The costs `trace` puts on each node (FLOPs, bytes read and written) against an oracle:
the per-equation definitions (`eqn_flops`, and `Traffic` added and scaled equation by
equation as `autopar.graph._flops` first wrote it), on a scanned GPT and Llama traced one
sub-scan per layer as the pipeline search traces them, and on control flow nested in
calls. The tracer now reads each equation's avals once and walks bodies as pairs of floats
(each aval's bytes once per walk); the graphs must be the same to the last bit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

from autopar.graph import _flops, _trace, split_stacked, trace
from autopar.graph._flops import CALL_JAXPR_PARAM, Traffic
from autopar.inter import layer_scan, scan_layers
from autopar.inter.passes import per_iteration
from examples import gpt, llama

# ---- the oracle: traffic as the dataclass sums it, equation by equation ------------------


def _open(jaxpr):
    return jaxpr.jaxpr if isinstance(jaxpr, jax.extend.core.ClosedJaxpr) else jaxpr


def _oracle_body(primitive, params) -> Traffic:
    if primitive in CALL_JAXPR_PARAM:
        return _oracle_jaxpr(_open(params[CALL_JAXPR_PARAM[primitive]]))
    if primitive == "scan":
        return _oracle_jaxpr(_open(params["jaxpr"])).scaled(params["length"])
    if primitive == "cond":
        branches = [_oracle_jaxpr(_open(b)) for b in params["branches"]]
        return max(branches, key=lambda t: t.bytes_read + t.bytes_written)
    if primitive == "while":
        return _oracle_jaxpr(_open(params["body_jaxpr"])) + _oracle_jaxpr(
            _open(params["cond_jaxpr"]))
    return Traffic(0.0, 0.0)


def _oracle_eqn(eqn) -> Traffic:
    body = _oracle_body(eqn.primitive.name, eqn.params)
    if eqn.primitive.name in CALL_JAXPR_PARAM:
        return body
    own = Traffic(float(sum(_flops.aval_nbytes(a.aval) for a in eqn.invars)),
                  float(sum(_flops.aval_nbytes(v.aval) for v in eqn.outvars)))
    return own + body


def _oracle_jaxpr(jaxpr) -> Traffic:
    total = Traffic(0.0, 0.0)
    for eqn in jaxpr.eqns:
        total = total + _oracle_eqn(eqn)
    return total


class _OracleBuilder(_trace._GraphBuilder):
    """The tracer's builder with each node's costs as first written: `eqn_flops`, the
    operands' and results' bytes summed per equation, and `_oracle_body`'s traffic."""

    def _add_node(self, eqn, ins, remat):
        outs = super()._add_node(eqn, ins, remat)
        node = self.nodes[-1]
        traffic = _oracle_body(eqn.primitive.name, eqn.params)
        self.nodes[-1] = dataclasses.replace(
            node,
            flops=_flops.eqn_flops(eqn),
            bytes_read=sum(_flops.aval_nbytes(a.aval) for a in eqn.invars)
            + traffic.bytes_read,
            bytes_written=sum(_flops.aval_nbytes(v.aval) for v in eqn.outvars)
            + traffic.bytes_written,
        )
        return outs


def _costs(graph):
    return [(n.primitive, n.flops, n.bytes_read, n.bytes_written) for n in graph.nodes]


def _traced_both_ways(monkeypatch, trace_it):
    """The graph `trace_it()` makes, and the one it makes with the oracle's builder."""
    graph = trace_it()
    with monkeypatch.context() as patch:
        patch.setattr(_trace, "_GraphBuilder", _OracleBuilder)
        oracle = trace_it()
    return graph, oracle


def _per_iteration_trace(step, args):
    """`args`' step traced one sub-scan per layer and its stack split, as the pipeline
    search traces a count (`_pipeline._trace_microbatch`)."""
    length = layer_scan(trace(step, *args)).params["length"]
    with scan_layers(per_iteration(length)):
        graph = trace(step, *args)
    return split_stacked(graph, per_iteration(length))


SCANNED_GPT = dataclasses.replace(gpt.CONFIGS["tiny"], num_layers=4, scan_layers=True)
SCANNED_LLAMA = dataclasses.replace(
    llama.CONFIGS["tiny"], num_layers=3, dtype="bfloat16", master_dtype="float32",
    scan_layers=True, remat_layers=True)


@pytest.mark.parametrize("model, cfg", [(gpt, SCANNED_GPT), (llama, SCANNED_LLAMA)],
                         ids=["gpt", "llama-mixed-remat"])
def test_scanned_step_costs_match_the_oracle(monkeypatch, model, cfg):
    optimizer = optax.adamw(1e-3)
    step = model.make_train_step(cfg, optimizer)
    args = (model.abstract_state(cfg, optimizer), model.abstract_batch(cfg, 4))
    graph, oracle = _traced_both_ways(monkeypatch, lambda: _per_iteration_trace(step, args))
    assert sum(n.primitive == "scan" for n in graph.nodes) >= 2 * cfg.num_layers
    assert len(graph.nodes) == len(oracle.nodes) > 100
    assert _costs(graph) == _costs(oracle)
    assert [(v.shape, v.dtype, v.role, v.path) for v in graph.vars] == [
        (v.shape, v.dtype, v.role, v.path) for v in oracle.vars]


def test_nested_control_flow_costs_match_the_oracle(monkeypatch):
    w = jnp.ones((8, 8), jnp.bfloat16)

    @jax.jit
    def inner(c, xs):
        c, ys = jax.lax.scan(lambda c, x: (jax.checkpoint(lambda a: a @ w)(c) * x, c), c, xs)
        c = jax.lax.cond(c.sum() > 0, lambda a: a @ w @ w, lambda a: a @ w, c)
        return jax.lax.while_loop(lambda a: a.sum() < 0, lambda a: a @ w, c), ys

    def fn(c, xs):
        c, ys = jax.lax.scan(lambda c, x: inner(c, x), c, xs)
        return c, ys.astype(jnp.float32).sum()

    c = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
    xs = jax.ShapeDtypeStruct((3, 5), jnp.bfloat16)
    graph, oracle = _traced_both_ways(monkeypatch, lambda: trace(fn, c, xs, batch_argnums=()))
    assert _costs(graph) == _costs(oracle)
    outer = next(n for n in graph.nodes if n.primitive == "scan")
    assert outer.bytes_read > 3 * 5 * (32 + 128)  # three bodies, each with its own scan
    # The public walkers agree with the oracle on every body they can be given.
    body = _open(outer.params["jaxpr"])
    assert _flops.jaxpr_traffic(body) == _oracle_jaxpr(body)
    for eqn in body.eqns:
        assert _flops.eqn_traffic(eqn) == _oracle_eqn(eqn)
        assert _flops.body_traffic(eqn.primitive.name, eqn.params) == _oracle_body(
            eqn.primitive.name, eqn.params)
