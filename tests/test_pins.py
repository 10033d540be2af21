"""Pins (`constraints=`, `autopar.search._pins`): a pytree of shardings or logical-axis
rules; honoured by the search, refused clearly before anything is consumed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.search import LogicalPins
from tests.test_annotations import fresh, inputs, make_step


def mesh24():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def spec_of(plan, path):
    (info,) = [i for i in plan.inputs if i.path == path]
    return info.spec


def test_pytree_pin_appears_unchanged_and_the_rest_is_searched():
    mesh = mesh24()
    state, batch = inputs()
    pins = ({"params": {"w1": NamedSharding(mesh, P(None, "model")), "w2": None}},
            {"x": NamedSharding(mesh, P("data")), "y": None})
    step = make_step()
    fn = autopar.autoparallel(method="shard", constraints=pins)(step)
    _, metrics = fn(fresh(state), batch)
    _, expected = jax.jit(step)(fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    plan = fn.plan
    assert plan.stages[0].sharding.mesh.shape == (2, 4)
    assert spec_of(plan, "params/w1") == ((), ("y",))
    assert spec_of(plan, "batch/x") == (("x",), ())


def test_logical_rules_pin():
    state, batch = inputs()
    pins = LogicalPins(mesh={"fsdp": 4, "tensor": 2}, rules=[("embed", "fsdp"), ("mlp", "tensor")],
                       axes={"*/w1": ("embed", "mlp"), "*/w2": ("mlp", "embed")})
    step = make_step()
    fn = autopar.autoparallel(method="shard", constraints=pins)(step)
    _, metrics = fn(fresh(state), batch)
    _, expected = jax.jit(step)(fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    plan = fn.plan
    assert plan.stages[0].sharding.mesh.shape == (4, 2)
    assert spec_of(plan, "params/w1") == (("x",), ("y",))
    assert spec_of(plan, "params/w2") == (("y",), ("x",))


def odd_inputs():
    """The MLP with a hidden width of 66: not divisible by 4."""
    state, batch = inputs()
    state["params"] = {"w1": jnp.ones((32, 66)) * 0.01, "w2": jnp.ones((66, 16)) * 0.01}
    return state, batch


@pytest.mark.parametrize("case", ["unknown axis", "indivisible"])
def test_impossible_pin_raises_before_consuming_anything(case):
    mesh = mesh24()
    state, batch = odd_inputs()
    if case == "unknown axis":  # a bare spec resolved against the constraints' mesh
        pins = ({"params": {"w1": P(None, "expert"), "w2": NamedSharding(mesh, P())}}, None)
        message = r"cannot pin params/w1 \(shape \(32, 66\)\) .*no axis 'expert'"
    else:
        pins = ({"params": {"w1": NamedSharding(mesh, P(None, "model")), "w2": None}}, None)
        message = (r"cannot pin params/w1 \(shape \(32, 66\)\) to P\(None, "
                   r"'model'\): dimension 1 of size 66 does not divide into 4 parts")
    fn = autopar.autoparallel(method="shard", constraints=pins)(make_step())
    with pytest.raises(ValueError, match=message):
        fn(state, batch)
    assert not state["params"]["w1"].is_deleted()  # the donated state was not consumed


def test_constraints_of_the_wrong_shape_name_the_arguments():
    state, batch = inputs()
    with pytest.raises(TypeError, match=r"one entry per positional argument .*state, batch"):
        autopar.plan(make_step(), state, batch, method="shard", constraints={"w1": P()})
