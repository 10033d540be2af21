"""One-stage plans: the predicted peak memory per device against XLA's own analysis.

XLA's figure for the compiled step is `memory_analysis()` of the executable:
argument + output + temp − alias bytes per device. Arguments are the state and batch shards,
outputs the new state and metrics, temp the peak of XLA's heap simulation of everything
else, and alias the outputs written into donated argument buffers (counted in both
arguments and outputs, so subtracted once). The plan predicts it with `peak_live_bytes`
(autopar/intra/_liveness.py). Run with `-s` to print the figures.
"""

from __future__ import annotations

import jax
import optax
import pytest
from test_examples_moe_wrn import moe, wide_resnet

import autopar
from examples import gpt, mlp

# Predicted peak within this share of XLA's (issue 15, item 5).
TOLERANCE = 0.15
BATCH = 8
EXAMPLES = {"mlp": mlp, "gpt": gpt, "moe": moe, "wide_resnet": wide_resnet}
# Known misses, measured (XLA / predicted): the model undercounts what XLA:CPU keeps in
# temp buffers for these (see the report of issue 15 item 5); strict, so a fix shows.
KNOWN_MISSES = {
    "wide_resnet": "XLA/predicted 1.35 on (4, 2) (1.59 before the walk counted the kernels' "
                   "layout copies): at XLA:CPU's peak three all-gathered activations of "
                   "131 KB each are live at once, from sharding constraints on gradient "
                   "sums (add_any) that XLA can only reach by an involuntary full "
                   "rematerialization, and layout copies of convolution inputs "
                   "(transpose_copy_fusion of activations), which the walk does not count",
}


def xla_peak_bytes(compiled) -> int:
    """argument + output + temp − alias bytes per device of a compiled executable."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def _measure(module):
    cfg = module.CONFIGS["tiny"]
    optimizer = optax.adamw(1e-2)
    step = module.make_train_step(cfg, optimizer)
    state = module.init_state(cfg, optimizer, jax.random.key(0))
    batch = module.make_batch(cfg, BATCH, jax.random.key(1))
    par = autopar.autoparallel(step, cluster=autopar.Cluster.from_profile("cpu-local"),
                               method="shard")  # donates the state, as by default
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves((state, batch))]
    par(state, batch)  # plans and compiles; `state` is donated from here on
    last = par._last
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for (shape, dtype), sharding in zip(shapes, last.in_shardings)]
    compiled = last.fn.lower(*args).compile()
    return last.plan.stages[0].sharding.cost.memory_per_device, xla_peak_bytes(compiled)


# moe (about 60 s on 2 cores) and the known miss run in the extended tier (CI time);
# mlp and gpt stay in the default run.
EXTENDED = ("moe", "wide_resnet")


def _param(name):
    marks = [pytest.mark.extended] if name in EXTENDED else []
    if name in KNOWN_MISSES:
        marks.append(pytest.mark.xfail(reason=KNOWN_MISSES[name], strict=True))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_param(n) for n in EXAMPLES])
def test_one_stage_peak_memory_matches_xla(name):
    predicted, measured = _measure(EXAMPLES[name])
    ratio = measured / predicted
    print(f"\n{name}: predicted {predicted:.0f} B/device, XLA {measured} B/device, "
          f"XLA/predicted {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE, (name, predicted, measured, ratio)
