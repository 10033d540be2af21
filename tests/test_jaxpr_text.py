"""`autopar.graph._jaxpr_text.params_text`: the same text as ``sorted(map(str,
params.items()))``, a sub-jaxpr printed once per structure."""

import jax
import jax.numpy as jnp
import pytest
from jax._src import core as jax_core

from autopar._memo import clear_all
from autopar.graph import _jaxpr_text, trace


def _step(x, w):
    """Two scans of one structure (distinct jaxpr objects), a third of another (a literal
    differs), a while and a cond; a custom_jvp (relu) and a jit inside the bodies."""

    def body(c, wi):
        return jax.nn.relu(c @ wi) + 1.0, jnp.sum(c)

    def other(c, wi):
        return jax.nn.relu(c @ wi) + 2.0, jnp.sum(c)

    c, ys = jax.lax.scan(body, x, w)
    c, ys2 = jax.lax.scan(lambda c, wi: body(c, wi), c, w)
    c, ys3 = jax.lax.scan(other, c, w)
    c = jax.lax.while_loop(lambda v: jnp.sum(v) < 0.0, lambda v: jax.jit(jnp.tanh)(v), c)
    c = jax.lax.cond(jnp.sum(c) > 0, jnp.sin, jnp.cos, c)
    return c, ys + ys2 + ys3


def _graph():
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)
    return trace(_step, x, w, batch_argnums=())


def test_params_text_is_the_printed_text():
    clear_all()
    for node in _graph().nodes:
        assert _jaxpr_text.params_text(node.params) == sorted(map(str, node.params.items()))


def test_a_structure_is_printed_once(monkeypatch):
    clear_all()
    graph = _graph()
    printed = []
    pretty_print = jax_core.Jaxpr.pretty_print

    def spy(self, *args, **kwargs):
        printed.append(self)
        return pretty_print(self, *args, **kwargs)

    monkeypatch.setattr(jax_core.Jaxpr, "pretty_print", spy)
    scans = [n for n in graph.nodes if n.primitive == "scan"]
    assert len(scans) == 3 and scans[0].params["jaxpr"] is not scans[1].params["jaxpr"]
    texts = [_jaxpr_text.params_text(n.params) for n in scans]
    assert texts[0] == texts[1] != texts[2]  # the literal 2.0 tells the third apart
    assert len(printed) == 2  # the first two share one print


def test_a_tuple_of_jaxprs_and_values_is_printed_as_before():
    clear_all()
    closed = jax.make_jaxpr(jnp.sin)(1.0)
    params = {"mixed": (closed, 3), "branches": (closed, closed), "n": 2}
    assert _jaxpr_text.params_text(params) == sorted(map(str, params.items()))


@pytest.mark.parametrize("shape", [(4, 8), (2, 8)])
def test_shapes_tell_structures_apart(shape):
    clear_all()
    big = trace(_step, jax.ShapeDtypeStruct((4, 8), jnp.float32),
                jax.ShapeDtypeStruct((3, 8, 8), jnp.float32), batch_argnums=())
    other = trace(_step, jax.ShapeDtypeStruct(shape, jnp.float32),
                  jax.ShapeDtypeStruct((3, 8, 8), jnp.float32), batch_argnums=())
    first = next(n for n in big.nodes if n.primitive == "scan")
    second = next(n for n in other.nodes if n.primitive == "scan")
    same = _jaxpr_text.params_text(first.params) == _jaxpr_text.params_text(second.params)
    assert same == (shape == (4, 8))
    assert _jaxpr_text.params_text(second.params) == sorted(map(str, second.params.items()))
