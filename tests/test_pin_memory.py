"""A pin that fails only by memory (`autopar.search._pin_memory`): the error names the
pinned tensor, its pin and the memory figures."""

import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.intra._ilp_problem import MemoryBudgetError
from tests.test_annotations import inputs, make_step
from tests.test_pins import mesh24

# Bytes per device: the free plan of the MLP step needs 9,604 on the (2, 4) mesh; with both
# weights pinned replicated (w1 32 x 64 float32: 8,192 bytes on every device) it needs 15,236.
BUDGET = 10_000


def test_a_pin_that_fails_only_by_memory_names_the_tensor_pin_and_figures():
    state, batch = inputs()
    step = make_step()
    free = autopar.plan(step, state, batch, method="shard", memory_budget=BUDGET, cache=False,
                        mesh_shape=(2, 4))
    assert free.stages[0].sharding.cost.memory_per_device <= BUDGET  # fits without pins
    mesh = mesh24()
    pins = ({"params": {"w1": NamedSharding(mesh, P()), "w2": NamedSharding(mesh, P())}},
            None)
    message = (r"(?s)the pins do not fit: .*budget of .*\(10000 B\) per device .*"
               r"params/w1 \(shape \(32, 64\), float32\) pinned to P\(\): "
               r".*\(8192 B\) per device; params/w2 .*\(12288 B\) per device together.*"
               r"Raise memory_budget to at least")
    with pytest.raises(MemoryBudgetError, match=message):
        autopar.plan(step, state, batch, method="shard", constraints=pins,
                     memory_budget=BUDGET, cache=False, mesh_shape=(2, 4))
