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
# Measured XLA/predicted on 8 CPU devices (cpu-local): mlp 1.013, gpt 1.002, moe 1.072,
# wide_resnet 1.022 (with combined reductions' buffers kept until the combined all-reduce;
# before that, on s11-cost's plans, 0.954, 0.972, 1.055, 1.043; gpt 0.760 and
# wide_resnet 1.154 before the walk took slice reshards where the value is made and
# copied gathered kernels whole; the plans made before the combined-collective rule:
# 0.893, 1.095, 1.131, 1.021). Wide_resnet was 1.35 before the walk counted convolution
# inputs' layout copies and computed equal reshards once, 1.59 before it counted the
# kernels' layout copies.


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
                               method="shard", donate=True)  # the state's buffers reused
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


def test_slice_reshards_are_taken_where_the_value_is_made():
    """A consumer reading a value split further (a local slice, no collective) reads a
    slice taken right after the value's producer: the slice lives from there to its last
    reader and the whole value dies at its last reader in its own layout (XLA fuses the
    `dynamic-slice` into the producer's loop). A gathered read is a temporary at its
    consumer as before."""
    from autopar.cluster import LogicalMesh
    from autopar.cost import bytes_per_device
    from autopar.graph import trace
    from autopar.intra._liveness import (
        _made_at,
        _reshard_temporaries,
        _sliced_reads,
        peak_live_bytes,
    )

    mesh = LogicalMesh.create((2, 4))
    a = jax.ShapeDtypeStruct((8, 16), "float32")
    b = jax.ShapeDtypeStruct((16, 16), "float32")

    def step(a, b):
        s = jax.numpy.sin(a)
        t = s @ b  # reads s in its own layout
        u = jax.numpy.tanh(t) @ b
        return (s @ u.T).sum()  # reads s again, later: the slice's reader

    graph = trace(step, a, b, batch_argnums=())
    dots = [n.id for n in graph.nodes if n.primitive == "dot_general"]
    sine = next(n for n in graph.nodes if n.primitive == "sin")
    s = sine.outputs[0]
    specs = [None] * len(graph.vars)
    specs[s] = (("x",), ())
    sliced_spec, gathered_spec = (("x", "y"), ()), ((), ())
    assert _sliced_reads(graph, [(dots[2], 0, sliced_spec)], specs, mesh) == {(dots[2], 0)}
    assert _sliced_reads(graph, [(dots[2], 0, gathered_spec)], specs, mesh) == set()

    def nbytes(u, spec=None):
        spec = spec or specs[u]
        var = graph.vars[u]
        return bytes_per_device(var.shape, var.dtype, spec, mesh) if spec else var.nbytes

    made = _made_at(graph)
    slices = _sliced_reads(graph, [(dots[2], 0, sliced_spec)], specs, mesh)
    assert list(_reshard_temporaries(graph, [(dots[2], 0, sliced_spec)], specs, mesh, nbytes,
                                     slices, made)) == [(sine.id, dots[2], 8 * 16 * 4 / 8)]
    # Inputs a and b (replicated) 512 + 1024 B all step. Gathered: at the last dot, s (a
    # half, 256), u.T (512), the result (256) and the gathered s (512). Sliced: s dies at
    # the first dot; the peak is at tanh: t and tanh(t) (512 each) and the slice (64).
    gathered = peak_live_bytes(graph, specs, mesh, operand_specs=[(dots[2], 0, gathered_spec)])
    sliced = peak_live_bytes(graph, specs, mesh, operand_specs=[(dots[2], 0, sliced_spec)])
    assert gathered == 1536 + 256 + 512 + 256 + 512
    assert sliced == 1536 + 512 + 512 + 64


def test_layout_copy_of_a_gathered_kernel_is_whole():
    """A kernel split over its input features but read whole by the input gradient (its
    operand resharded to replicated) is copied in the convolution's order at full size."""
    from autopar.cluster import LogicalMesh
    from autopar.cost import bytes_per_device
    from autopar.graph import trace
    from autopar.intra._liveness import _layout_copy_bytes

    mesh = LogicalMesh.create((2, 4))
    kernel = jax.ShapeDtypeStruct((3, 3, 4, 8), "float32")
    x = jax.ShapeDtypeStruct((2, 6, 6, 4), "float32")
    graph = trace(jax.grad(_conv_step, argnums=(0, 1)), kernel, x, batch_argnums=(1,))
    kernel_var = graph.invars[0]
    specs = [None] * len(graph.vars)
    specs[kernel_var] = ((), (), ("x",), ())
    convs = [n.id for n in graph.nodes if n.primitive == "conv_general_dilated"]
    reader = _reader_of(graph, kernel_var, convs[1:])
    position = next(p for p, v in enumerate(graph.nodes[reader].inputs)
                    if graph.vars[v].shape == (3, 3, 4, 8))

    def nbytes(u, spec=None):
        spec = spec or specs[u]
        var = graph.vars[u]
        return bytes_per_device(var.shape, var.dtype, spec, mesh) if spec else var.nbytes

    key = (kernel_var, (0, 1, 3, 2))
    # The reversed kernel the convolution reads is replicated (spec None): a whole copy.
    assert _layout_copy_bytes(graph, graph.consumers(), [], nbytes)[key] == 3 * 3 * 4 * 8 * 4
    # Split along the way too: half; read resharded to replicated: whole again.
    for n in graph.nodes:
        if n.primitive in ("rev", "transpose") and n.inputs[0] == kernel_var:
            specs[n.outputs[0]] = ((), (), ("x",), ())
    assert _layout_copy_bytes(graph, graph.consumers(), [], nbytes)[key] == 3 * 3 * 4 * 8 * 2
    whole = _layout_copy_bytes(graph, graph.consumers(), [(reader, position, ((),) * 4)], nbytes)
    assert whole[key] == 3 * 3 * 4 * 8 * 4
