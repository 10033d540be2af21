"""The step's own sharding annotations (`autopar.intra._rules_annotations`) and pins
(`autopar.search._pins`): kept, hinted or ignored; pins honoured or refused clearly."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.intra._rules_annotations import AnnotationMismatch
from tests.helpers import compiled_hlo


def user_mesh(shape=(2, 4), names=("data", "model")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def make_step(constrain=None):
    """An MLP step; `constrain(h)` is applied to the hidden activation."""

    def loss_fn(params, batch):
        h = batch["x"] @ params["w1"]
        if constrain is not None:
            h = constrain(h)
        h = jax.nn.relu(h)
        return ((h @ params["w2"] - batch["y"]) ** 2).mean()

    def step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state["params"], batch)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
        return {"params": params}, {"loss": loss}

    return step


def inputs():
    k = jax.random.split(jax.random.key(0), 4)
    state = {"params": {"w1": jax.random.normal(k[0], (32, 64)) * 0.1,
                        "w2": jax.random.normal(k[1], (64, 16)) * 0.1}}
    batch = {"x": jax.random.normal(k[2], (16, 32)), "y": jax.random.normal(k[3], (16, 16))}
    return state, batch


def fresh(tree):
    return jax.tree.map(jnp.copy, tree)


def constrained_specs(fn):
    """The plan's spec of every `sharding_constraint` result of the traced step."""
    graph, sharding = fn.graph, fn.plan.stages[0].sharding
    return [sharding.var_specs[v] for n in graph.nodes
            if n.primitive == "sharding_constraint" for v in n.outputs]


def with_constraint(mesh):
    return make_step(lambda h: jax.lax.with_sharding_constraint(
        h, NamedSharding(mesh, P("data", "model"))))


def test_keep_holds_the_users_spec_in_plan_and_hlo_and_matches_one_device():
    state, batch = inputs()
    step = with_constraint(user_mesh())
    fn = autopar.autoparallel(method="shard")(step)
    _, metrics = fn(fresh(state), batch)
    _, expected = jax.jit(step)(fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    # data -> x (2), model -> y (4): the forward constraint and its transpose
    specs = constrained_specs(fn)
    assert specs and all(s == (("x",), ("y",)) for s in specs), specs
    assert fn.plan.stages[0].sharding.mesh.shape == (2, 4)
    assert not any("no sharding rule" in w for w in fn.plan.warnings), fn.plan.warnings
    # the hidden activation h: [16, 64] is f32[8,16] per device in the compiled program
    hlo = compiled_hlo(fn, fresh(state), batch)
    assert re.search(r"f32\[8,16\]\{[0-9,]*\} dot\(", hlo), "h is not split (2, 4)"


def test_ignore_plans_as_the_step_without_the_constraint():
    state, batch = inputs()
    ignored = autopar.plan(with_constraint(user_mesh()), state, batch, method="shard",
                           annotations="ignore")
    plain = autopar.plan(make_step(), state, batch, method="shard")
    assert ignored.to_json() == plain.to_json()


def test_hint_prefers_without_forcing():
    state, batch = inputs()
    step = with_constraint(user_mesh())
    fn = autopar.autoparallel(method="shard", annotations="hint", mesh_shape=(2, 4))(step)
    _, metrics = fn(fresh(state), batch)
    _, expected = jax.jit(step)(fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    assert not any("no sharding rule" in w for w in fn.plan.warnings)


def test_keep_on_a_mesh_that_cannot_hold_it_is_a_clear_error():
    state, batch = inputs()
    step = with_constraint(user_mesh())
    message = r"(?s)sharding_constraint.*axis 'data' of size 2.*mesh_shape="
    with pytest.raises(AnnotationMismatch, match=message):
        autopar.plan(step, state, batch, method="shard", mesh_shape=(8,))


def test_flax_logical_constraint_is_kept():
    mesh = user_mesh()
    rules = (("batch", "data"), ("hidden", "model"))
    step = make_step(lambda h: nn.with_logical_constraint(h, ("batch", "hidden"), mesh=mesh,
                                                          rules=rules))
    state, batch = inputs()
    fn = autopar.autoparallel(method="shard")(step)
    _, metrics = fn(fresh(state), batch)
    _, expected = jax.jit(step)(fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    specs = constrained_specs(fn)
    assert specs and all(s == (("x",), ("y",)) for s in specs), specs


def test_data_axis_of_eight_maps_onto_two_logical_axes():
    state, batch = inputs()
    mesh = user_mesh((8,), ("data",))
    step = make_step(lambda h: jax.lax.with_sharding_constraint(
        h, NamedSharding(mesh, P("data"))))
    plan = autopar.plan(step, state, batch, method="shard", mesh_shape=(2, 4))
    graph = autopar.graph.trace(step, state, batch)
    specs = [plan.stages[0].sharding.var_specs[v] for n in graph.nodes
             if n.primitive == "sharding_constraint" for v in n.outputs]
    assert specs and all(s == (("x", "y"), ()) for s in specs), specs
