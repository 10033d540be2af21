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
# Measured XLA/predicted on 8 CPU devices (cpu-local): mlp 0.893, gpt 0.983, moe 1.101,
# wide_resnet 1.021 (1.35 before the walk counted convolution inputs' layout copies and
# computed equal reshards once; 1.59 before it counted the kernels' layout copies).


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


# moe (about 60 s on 2 cores) and wide_resnet (about 30 s) run in the extended tier (CI
# time); mlp and gpt stay in the default run.
EXTENDED = ("moe", "wide_resnet")


def _param(name):
    marks = [pytest.mark.extended] if name in EXTENDED else []
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_param(n) for n in EXAMPLES])
def test_one_stage_peak_memory_matches_xla(name):
    predicted, measured = _measure(EXAMPLES[name])
    ratio = measured / predicted
    print(f"\n{name}: predicted {predicted:.0f} B/device, XLA {measured} B/device, "
          f"XLA/predicted {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE, (name, predicted, measured, ratio)


def _conv_step(kernel, x):
    y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.numpy.sum(y * y)


def test_layout_copies_of_convolution_operands_read_in_another_order():
    """The backward's kernel gradient reads the input (N, H, W, C) as (C, H, W, N) and the
    output gradient as its kernel (H, W, N, C), and its input gradient reads the kernel
    (H, W, I, O) as (H, W, O, I): one copy each, made when the value is (a graph input's
    when first read) and live to that convolution; the forward reads both in XLA's order
    and copies nothing. (XLA:CPU makes these `transpose_copy_fusion`s.)"""
    from autopar.graph import trace
    from autopar.intra._liveness import _layout_copies

    kernel = jax.ShapeDtypeStruct((3, 3, 4, 8), "float32")
    x = jax.ShapeDtypeStruct((2, 6, 6, 4), "float32")
    graph = trace(jax.grad(_conv_step, argnums=(0, 1)), kernel, x, batch_argnums=(1,))
    convs = [n.id for n in graph.nodes if n.primitive == "conv_general_dilated"]
    kernel_var, x_var = graph.invars
    kernel_gradient = _reader_of(graph, x_var, convs[1:])
    output_gradient = graph.nodes[kernel_gradient].inputs[1]
    made = next(n.id for n in graph.nodes if output_gradient in n.outputs)
    assert _layout_copies(graph, graph.consumers()) == {
        (x_var, (3, 1, 2, 0)): (convs[0], kernel_gradient),
        (output_gradient, (1, 2, 0, 3)): (made, kernel_gradient),
        (kernel_var, (0, 1, 3, 2)): (convs[0], _reader_of(graph, kernel_var, convs[1:])),
    }


def _reader_of(graph, var, conv_ids):
    """The convolution among `conv_ids` that reads `var` (through layout-only ops)."""
    producer = {v: n for n in graph.nodes for v in n.outputs}
    for c in conv_ids:
        for v in graph.nodes[c].inputs:
            while v in producer and producer[v].primitive in ("rev", "transpose"):
                v = producer[v].inputs[0]
            if v == var:
                return c
    raise AssertionError(f"no convolution reads {var}")


def test_equal_reshards_of_one_value_are_one_temporary():
    """Two consumers asking for one value in the same other layout share one copy (XLA
    computes it once), live from the first to the last; another layout is another copy."""
    from autopar.cluster import LogicalMesh
    from autopar.cost import bytes_per_device
    from autopar.graph import trace
    from autopar.intra._liveness import _reshard_temporaries

    mesh = LogicalMesh.create((2, 4))
    a = jax.ShapeDtypeStruct((8, 16), "float32")
    b = jax.ShapeDtypeStruct((16, 8), "float32")
    graph = trace(lambda a, b: (jax.numpy.sin(a) @ b, jax.numpy.cos(a) @ b), a, b,
                  batch_argnums=())
    dots = [n.id for n in graph.nodes if n.primitive == "dot_general"]
    v = graph.invars[1]
    specs = [None] * len(graph.vars)
    specs[v] = (("x",), ())

    def nbytes(u, spec=None):
        return bytes_per_device(graph.vars[u].shape, "float32", spec or specs[u], mesh)

    gathered, moved = ((), ()), ((), ("x",))
    temporaries = _reshard_temporaries(
        graph, [(dots[0], 1, gathered), (dots[1], 1, gathered), (dots[1], 1, moved)],
        specs, mesh, nbytes,
    )
    assert sorted(temporaries) == [(dots[0], dots[1], 16 * 8 * 4), (dots[1], dots[1], 16 * 4 * 4)]
