"""`jax.sharding.reshard` in a step traced under an explicit mesh (`jax.set_mesh`), end to
end: planned with the user's spec kept, run on the plan's own mesh, equal to one device.

(JAX 0.10.2, pinned in constraints.txt, has `jax.sharding.reshard` but no public
`mesh_cast`; `autopar.lower._spmd.with_planned_reshards` lowers both the same way.)
"""

import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from tests.helpers import compiled_hlo
from tests.test_annotations import fresh, inputs, make_step


def test_reshard_on_an_explicit_mesh_is_kept_and_matches_one_device():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    step = make_step(lambda h: jax.sharding.reshard(h, P("data", "model")))
    state, batch = inputs()
    with jax.set_mesh(mesh):
        state = jax.device_put(state, NamedSharding(mesh, P()))
        batch = jax.device_put(batch, NamedSharding(mesh, P()))
        _, expected = jax.jit(step)(fresh(state), batch)
        fn = autopar.autoparallel(method="shard")(step)
        _, metrics = fn(fresh(state), batch)
        hlo = compiled_hlo(fn, fresh(state), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)
    sharding = fn.plan.stages[0].sharding
    forward = next(n for n in fn.graph.nodes if n.primitive == "reshard")
    # data -> x (2), model -> y (4), as for a with_sharding_constraint on an auto mesh
    assert sharding.var_specs[forward.outputs[0]] == (("x",), ("y",))
    assert not any("no sharding rule" in w for w in fn.plan.warnings), fn.plan.warnings
    # the hidden activation h: [16, 64] is f32[8,16] per device in the compiled program
    assert re.search(r"f32\[8,16\]\{[0-9,]*\} dot\(", hlo), "h is not split (2, 4)"
