"""Every strategy the generator lists is one the rest of autopar can use.

For each node of the example models (the Llama example as a loop of layers and scanned,
the flax NNX Llama with `nnx.scan`) and of tiny Hugging Face decoders (Llama with
grouped-query attention, Mistral, Gemma), on logical meshes (8,), (2, 4) and (4, 2):
every spec names real mesh axes, each at most once per tensor, and divides the dimensions
it splits; every collective a strategy lists is costed by `autopar.cost.collective_time`
without raising; and a partial-result reduction runs only over axes that split some
operand (a split of a constant alone splits nothing). Issue 16: a rotary table gathered
by position ids got a reduce-scatter over ('x', 'x').
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import optax
import pytest

import autopar
from autopar.app._examples import named_model
from autopar.cluster import LogicalMesh
from autopar.cost import collective_time
from autopar.graph import Role, trace
from autopar.intra._scan import expand_scans
from autopar.intra._strategies import (
    CostContext,
    follow_strategies,
    follower_candidates,
    input_strategies,
    node_signature,
    node_strategies,
    replicated_signature,
)

MESHES = [(8,), (2, 4), (4, 2)]
EXAMPLES = ["gpt", "moe", "wide_resnet", "mlp", "llama_example", "llama_scan", "nnx_llama"]
HF_MODELS = ["llama", "mistral", "gemma"]
REDUCTIONS = {"all_reduce", "reduce_scatter"}


@functools.cache
def _graph(model: str):
    """The graph the sharding planner enumerates: a scan over layers opened into one copy
    of its body (`expand_scans`), as `build_problem` plans it."""
    graph = _traced(model)
    expansion = expand_scans(graph)
    return graph if expansion is None else expansion.graph


def _traced(model: str):
    if model in HF_MODELS:
        pytest.importorskip("transformers")
        from hf_models import make_model

        step, state, batch = make_model(model, optax.sgd(0.1))
        return trace(step, state, batch)
    if model == "nnx_llama":
        from examples import nnx_llama

        cfg = dataclasses.replace(nnx_llama.CONFIGS["tiny"], scan_layers=True)
        graphdefs, state = nnx_llama.abstract_state(cfg, optax.sgd(0.1))
        batch = jax.eval_shape(lambda k: nnx_llama.make_batch(cfg, 16, k), jax.random.key(1))
        return trace(nnx_llama.make_train_step(graphdefs), state, batch)
    if model == "llama_scan":
        from examples import llama

        cfg = dataclasses.replace(llama.CONFIGS["tiny"], scan_layers=True)
        optimizer = optax.sgd(0.1)
        return trace(llama.make_train_step(cfg, optimizer), llama.abstract_state(cfg, optimizer),
                     llama.abstract_batch(cfg, 16))
    named = named_model(f"{model.removesuffix('_example')}-tiny", batch_size=16)
    return trace(named.train_step, named.abstract_state, named.abstract_batch)


@functools.cache  # about a million strategies share a few thousand specs
def _spec_problems(spec, shape, mesh: LogicalMesh) -> tuple[str, ...]:
    if spec is None:
        return ()
    if len(spec) != len(shape):
        return (f"spec {spec} has {len(spec)} dims for shape {shape}",)
    problems = []
    axes = [a for dim in spec for a in dim]
    if len(set(axes)) != len(axes):
        problems.append(f"spec {spec} repeats a mesh axis")
    unknown = set(axes) - set(mesh.axis_names)
    if unknown:
        problems.append(f"spec {spec} names axes {sorted(unknown)} not in the mesh")
        return tuple(problems)
    for size, dim in zip(shape, spec):
        if dim and size % math.prod(mesh.axis_size(a) for a in dim):
            problems.append(f"spec {spec} does not divide shape {shape}")
    return tuple(problems)


def _collective_problems(c, cluster, mesh: LogicalMesh) -> tuple[str, ...]:
    try:
        seconds = collective_time(c.kind, c.nbytes, cluster, mesh, c.axes)
    except Exception as err:  # noqa: BLE001  (any failure is the finding)
        return (f"{c} cannot be costed: {err}",)
    if not (seconds >= 0 and math.isfinite(seconds)):
        return (f"{c} costs {seconds} s",)
    return ()


def _tensors(variables) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """(shape, is constant) of each tensor: all `_problems` needs of them."""
    return tuple((tuple(v.shape), v.role is Role.CONST) for v in variables)


def _problems(in_specs, out_specs, collectives, ins, outs, cluster, mesh) -> tuple[str, ...]:
    problems = []
    if len(in_specs) != len(ins) or len(out_specs) != len(outs):
        problems.append("spec count differs from the operand or result count")
    for (shape, const), spec in [*zip(ins, in_specs), *zip(outs, out_specs)]:
        if spec is None and not const:
            problems.append(f"no spec for a non-constant {shape} tensor")
        problems += _spec_problems(spec, shape, mesh)
    operand_axes = {a for spec in in_specs if spec is not None for dim in spec for a in dim}
    for c in collectives:
        problems += _collective_problems(c, cluster, mesh)
        if c.kind in REDUCTIONS and not set(c.axes) <= operand_axes:
            problems.append(f"{c} reduces over axes that split no operand")
    return tuple(problems)


def _extended(model: str, mesh_shape) -> bool:
    # The loop form's operators are the scanned body's (llama_scan checks them), 3x over.
    # The GPT on (4, 2): the same rules as on (2, 4), and its plans on (4, 2) run and are
    # checked against XLA's collectives in test_intra_correctness.py.
    return model == "llama_example" or (model, mesh_shape) == ("gpt", (4, 2))


@pytest.mark.parametrize("model,mesh_shape", [
    pytest.param(m, s, marks=[pytest.mark.extended] if _extended(m, s) else [], id=f"{m}-{s}")
    for m in EXAMPLES + HF_MODELS for s in MESHES
])
def test_strategies_are_valid(model, mesh_shape):
    graph = _graph(model)
    ctx = CostContext(autopar.Cluster.from_profile("cpu-local"), LogicalMesh.create(mesh_shape))
    found: list[str] = []
    seen: dict[tuple, tuple[str, ...]] = {}  # many nodes share shapes and specs
    out_specs: dict[int, list] = {}  # var -> the specs its producer's strategies give it

    def check(where, strategies, in_vars, out_vars):
        assert strategies, f"{where}: no strategy"
        ins, outs = _tensors(in_vars), _tensors(out_vars)
        for s in strategies:
            key = (s.in_specs, s.out_specs, s.collectives, ins, outs)
            problems = seen.get(key)
            if problems is None:
                problems = seen[key] = _problems(*key, ctx.cluster, ctx.mesh)
            if not math.isfinite(s.cost):
                problems += (f"cost {s.cost}",)
            found.extend(f"{where} {s.name}: {p}" for p in problems)

    for v in graph.invars:
        var = graph.vars[v]
        if var.role is Role.CONST:
            continue
        strategies = input_strategies(var, ctx)
        check(f"input {var.path}", strategies, [], [var])
        out_specs[v] = [s.out_specs[0] for s in strategies]
    for node in graph.nodes:
        in_vars = [graph.vars[v] for v in node.inputs]
        out_vars = [graph.vars[v] for v in node.outputs]
        sig = node_signature(node, graph) or replicated_signature(node, graph)
        where = f"{node.primitive} #{node.id} {[v.shape for v in in_vars]}"
        strategies = node_strategies(node, graph, sig, ctx)
        check(where, strategies, in_vars, out_vars)
        for k, v in enumerate(node.outputs):
            out_specs[v] = [s.out_specs[k] for s in strategies]
        for i in follower_candidates(node, graph, sig):
            leader = out_specs.get(node.inputs[i])
            if leader is None:
                continue
            followed = follow_strategies(node, graph, sig, i, leader, ctx)
            if followed is not None:
                check(f"{where} following operand {i}", followed, in_vars, out_vars)
    assert not found, f"{len(found)} invalid strategies, e.g.:\n" + "\n".join(found[:20])


def test_no_phantom_split_of_a_constant():
    """The rotary pattern alone: a constant table gathered by position ids. Its rows are
    never split (the table is used whole), so no strategy reduces partial results."""
    import jax.numpy as jnp

    table = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 1, 16)

    def lookup(positions):
        return table[positions]

    graph = trace(lookup, jax.ShapeDtypeStruct((8, 16), jnp.int32), batch_argnums=(0,))
    (node,) = [n for n in graph.nodes if n.primitive == "gather"]
    for mesh_shape in MESHES:
        ctx = CostContext(autopar.Cluster.from_profile("cpu-local"),
                          LogicalMesh.create(mesh_shape))
        sig = node_signature(node, graph)
        strategies = node_strategies(node, graph, sig, ctx)
        assert all(not s.collectives for s in strategies), [s.name for s in strategies]
        assert any(s.out_specs[0][0] for s in strategies)  # the batch still splits
