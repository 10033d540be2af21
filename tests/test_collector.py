"""`autopar.graph._collector.collector_paused`: the collector off inside, back on after, and
left alone where the caller switched it off; the front end's phases run under it."""

import gc

import jax
import jax.numpy as jnp
import pytest

from autopar.graph import trace
from autopar.graph._collector import collector_paused


def test_paused_inside_and_back_after_even_on_error():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the outer block switches it back
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_caller_who_switched_it_off_keeps_it_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_trace_runs_the_step_with_the_collector_paused():
    seen = []

    def step(x):
        seen.append(gc.isenabled())
        return jnp.sin(x) * 2.0

    graph = trace(step, jax.ShapeDtypeStruct((4,), jnp.float32), batch_argnums=())
    assert seen == [False] and gc.isenabled()
    assert [n.primitive for n in graph.nodes] == ["sin", "mul"]
