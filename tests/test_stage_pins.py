"""Pins in the stage search (`autopar.inter._layer_table.LayerCostTable(fixed=...)`): each
layer's ILP holds the pins mapped onto its stage's mesh by axis names and sizes; a stage
mesh that cannot hold a pin is skipped, and when none can, the error names the pin."""

import dataclasses
import math

import optax
import pytest

import autopar
from autopar.search import LogicalPins
from examples import gpt

CFG = dataclasses.replace(gpt.CONFIGS["tiny"], layer_markers=True)
OPT = optax.sgd(1e-2)


def plan_with(pin_mesh):
    pins = LogicalPins(mesh=pin_mesh, rules=[("vocab", "model")],
                       axes={"*wte": ("vocab", None)})
    return autopar.plan(gpt.make_train_step(CFG, OPT), gpt.abstract_state(CFG, OPT),
                        gpt.abstract_batch(CFG, 16),
                        cluster=autopar.Cluster.from_profile("cpu-local"), num_stages=2,
                        num_microbatches=2, constraints=pins, cache=False,
                        # stages of 4 devices, one or two mesh axes: a small search
                        submeshes=((1, 4),), logical_shapes=((4,), (2, 2)))


# A 2-stage search of the tiny GPT takes ~20 s of CPU with or without pins. The default
# suite still covers the stage path's pins through the error test below (the same mapping
# onto each stage mesh, every mesh refused) and single-mesh pins in tests/test_pins.py.
@pytest.mark.extended
def test_a_pin_is_held_by_the_stage_that_reads_it():
    # "model" of size 4 maps onto a 4-device stage's one axis; the embedding's rows split
    plan = plan_with({"model": 4})
    assert len(plan.stages) == 2 and plan.method == "auto"
    assert not any("one mesh" in w for w in plan.warnings), plan.warnings
    (wte,) = [i for i in plan.inputs if i.path == "params/wte"]
    mesh = plan.stages[wte.stage].sharding.mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    assert math.prod(sizes[a] for a in wte.spec[0]) == 4 and wte.spec[1] == (), wte.spec


def test_a_pin_no_stage_mesh_can_hold_names_the_tensor_and_pin():
    # 8 devices in one axis: no stage of a 2-stage pipeline (4 devices each) holds it
    message = (r"(?s)no pipeline plan of 2 microbatch\(es\) holds the user's shardings: .*"
               r"params/wte: the pin (P|PartitionSpec)\('model', None\).*'model': 8")
    with pytest.raises(ValueError, match=message):
        plan_with({"model": 8})
