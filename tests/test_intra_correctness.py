"""Intra-operator plans run on 8 virtual devices and match the single-device step.

For each model and logical mesh: 3 steps, loss equal to one device (rtol 1e-5), parameters
equal (atol 1e-5 with SGD, 0.1 x learning rate with adamw), and the compiled HLO's
collectives agree with the plan's prediction (no unpredicted kind, bytes within 2x). The
two parts of that prediction are also checked alone against XLA: every resharding between
two specs of a matrix, and the reduce-scatter strategies of a matmul.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from itertools import permutations, product

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EQUIVALENT_KINDS, assert_trees_close, compiled_hlo, fidelity, run_steps
from jax.sharding import Mesh, NamedSharding

import autopar
from autopar.cluster import LogicalMesh
from autopar.cluster._mesh import to_partition_spec
from autopar.graph import trace
from autopar.intra._reshard import reshard_collectives
from autopar.intra._strategies import CostContext, node_signature, node_strategies
from autopar.lower import count_collectives
from examples import gpt, mlp, moe, wide_resnet

MESHES = [(8,), (2, 4), (4, 2)]
# The longer parity runs check every mesh in the `extended` tier; the default run keeps
# the 2-D (2, 4) mesh, whose plans split the most ways (CI time).
LONG_RUN_MESHES = [m if m == (2, 4) else pytest.param(m, marks=pytest.mark.extended)
                   for m in MESHES]
LR = 1e-2


def _cluster():
    # The CPU profile: small models already pay for splitting, so plans are not trivial.
    return autopar.Cluster.from_profile("cpu-local")


def _check(module, cfg, optimizer, batch_size, mesh_shape, atol):
    state = module.init_state(cfg, optimizer, jax.random.key(0))
    batch = module.make_batch(cfg, batch_size, jax.random.key(1))
    step = module.make_train_step(cfg, optimizer)
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(
        step, cluster=_cluster(), method="shard", mesh_shape=mesh_shape, donate_argnums=()
    )
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state, ref_state, atol)
    sharding = par.plan.stages[0].sharding
    assert sharding.mesh.shape == mesh_shape
    unexpected, ratio, predicted, measured = fidelity(sharding, compiled_hlo(par, state, batch))
    assert not unexpected, f"HLO has collectives the plan did not predict: {unexpected} " \
        f"(predicted {predicted}, compiled {measured})"
    assert 0.5 <= ratio <= 2.0, f"HLO bytes / predicted = {ratio:.2f} ({predicted} vs {measured})"
    return par


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_mlp_sgd(mesh_shape):
    cfg = mlp.MLPConfig(in_dim=256, hidden=512, out_dim=256, num_layers=3)
    par = _check(mlp, cfg, optax.sgd(LR), 32, mesh_shape, atol=1e-5)
    specs = par.plan.specs_by_path()
    assert any(any(d) for d in specs.values()), "expected some tensor to be split"


@pytest.mark.parametrize("mesh_shape", LONG_RUN_MESHES)
def test_gpt_adamw(mesh_shape):
    cfg = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, seq_len=32)
    _check(gpt, cfg, optax.adamw(LR, eps=1e-6), 16, mesh_shape, atol=0.1 * LR)


# (4, 2) plans MoE's 2-D ILP for 80 s on 2 cores (with the canonical tie-break solve).
@pytest.mark.parametrize("mesh_shape", LONG_RUN_MESHES)
def test_moe_adamw(mesh_shape):
    cfg = moe.CONFIGS["tiny"]
    _check(moe, cfg, optax.adamw(LR, eps=1e-6), 16, mesh_shape, atol=0.1 * LR)


@pytest.mark.parametrize("mesh_shape", LONG_RUN_MESHES)
def test_conv_sgd(mesh_shape):
    cfg = wide_resnet.CONFIGS["tiny"]
    _check(wide_resnet, cfg, optax.sgd(LR), 16, mesh_shape, atol=1e-5)


# ---- the two parts of the prediction, each against XLA ---------------------------------


def _xla_collectives(fn, args, in_specs, out_spec, mesh_shape) -> dict[str, float]:
    """Collective kind -> bytes that XLA compiles `fn` to with these specs."""
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("x", "y"))
    shardings = [NamedSharding(mesh, to_partition_spec(s)) for s in in_specs]
    compiled = jax.jit(
        fn, in_shardings=shardings, out_shardings=NamedSharding(mesh, to_partition_spec(out_spec))
    )
    text = compiled.lower(*args).compile().as_text()
    return {kind: nbytes for kind, (_, nbytes) in count_collectives(text).items()}


def _assert_predicted(collectives, measured, what):
    predicted = Counter()
    for c in collectives:
        predicted[c.kind] += c.nbytes
    allowed = set(predicted).union(*(EQUIVALENT_KINDS.get(k, set()) for k in predicted))
    assert set(measured) <= allowed, f"{what}: XLA {measured}, predicted {dict(predicted)}"
    measured_bytes, predicted_bytes = sum(measured.values()), sum(predicted.values())
    ratio = 1.0 if measured_bytes == predicted_bytes else measured_bytes / predicted_bytes
    assert 0.5 <= ratio <= 2.0, f"{what}: XLA {measured}, predicted {dict(predicted)}"


def _matrix_specs():
    """Every spec of a matrix on axes x and y: each axis on one dimension or none."""
    specs = set()
    for dims in product([None, 0, 1], repeat=2):
        per_dim = [[a for a, d in zip("xy", dims) if d == dim] for dim in (0, 1)]
        for orders in product(*(permutations(axes) for axes in per_dim)):
            specs.add(tuple(tuple(axes) for axes in orders))
    return sorted(specs)


@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((4, 2), marks=pytest.mark.extended)])
def test_reshard_matches_xla(mesh_shape):
    """Every resharding of a matrix: XLA issues no collective kind that the model does not
    predict, and moves the predicted bytes within 2x (collective-permutes included)."""
    mesh = LogicalMesh.create(mesh_shape)
    arg = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    specs = _matrix_specs()
    assert len(specs) == 11
    for src, dst in product(specs, specs):
        if src == dst:
            continue
        measured = _xla_collectives(lambda x: x, [arg], [src], dst, mesh_shape)
        predicted = reshard_collectives(arg.shape, "float32", src, dst, mesh)
        _assert_predicted(predicted, measured, f"{src} -> {dst} on {mesh_shape}")


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_reduce_scatter_strategies_match_xla(mesh_shape):
    """A weight-gradient matmul summed over the batch and left split over the summed axes:
    a reduce-scatter, or (when unused mesh axes can hold the split, as x of size 4 on
    (4, 2) for a sum over y) a sliced all-reduce plus a collective-permute."""

    def weight_grad(x, dy):  # x.T @ dy as one dot_general
        return jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))

    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in [(64, 32), (64, 16)]]
    graph = trace(weight_grad, *args, batch_argnums=())
    (node,) = graph.nodes
    ctx = CostContext(autopar.Cluster.from_profile("cpu-local"), LogicalMesh.create(mesh_shape))
    strategies = node_strategies(node, graph, node_signature(node, graph), ctx)
    scattered = [s for s in strategies if " rs:" in s.name]
    kinds = {c.kind for s in scattered for c in s.collectives}
    assert kinds == {"reduce_scatter", "all_reduce", "send_recv"}, kinds
    for strategy in scattered:
        measured = _xla_collectives(
            weight_grad, args, strategy.in_specs, strategy.out_specs[0], mesh_shape
        )
        _assert_predicted(strategy.collectives, measured, f"{strategy.name} on {mesh_shape}")
