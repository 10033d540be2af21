"""Megatron-style plans: layout from the dataflow, correctness on 8 devices, the TP
all-reduces in the compiled HLO, the grid search, and the errors users see."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, compiled_hlo, run_steps

import autopar
from autopar.graph import trace
from autopar.intra._ilp import solve
from autopar.intra._options import ShardOptions
from autopar.intra._problem import build_problem
from autopar.manual import (
    Kind,
    MegatronConfig,
    classify_parameters,
    kept_activation_bytes,
    megatron_candidates,
    megatron_configs,
    megatron_grid_search,
    megatron_plan,
    megatron_plan_for_graph,
    megatron_specs,
    pin_activations,
    residual_specs,
    residual_stream,
    stage_mesh,
)
from autopar.manual._sequence import forward_nodes
from examples import gpt, moe

LR = 1e-2
BATCH = 8
DATA, MODEL = ("data",), ("model",)


def _gpt(hidden=64, num_layers=2, seq_len=16):
    cfg = dataclasses.replace(
        gpt.CONFIGS["tiny"], hidden=hidden, num_layers=num_layers, seq_len=seq_len
    )
    optimizer = optax.adamw(LR, eps=1e-6)
    step = gpt.make_train_step(cfg, optimizer)
    args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, BATCH))
    return cfg, optimizer, step, args


def _cpu():
    return autopar.Cluster.from_profile("cpu-local")


def compiled_hlo_matching_one_device(cfg, optimizer, step, plan) -> str:
    """Run `plan` of the GPT train step on the 8 devices, assert its losses and parameters
    equal one device's over a few steps, and return its compiled HLO text."""
    state = gpt.init_state(cfg, optimizer, jax.random.key(0))
    batch = gpt.make_batch(cfg, BATCH, jax.random.key(1))
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, plan=plan, donate_argnums=())
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state.params, ref_state.params, atol=1e-3)
    return compiled_hlo(par, state, batch)


# ---- the compiled HLO's all-reduces ---------------------------------------------------

_ALL_REDUCE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+all-reduce(?:-start)?\("
)
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)+)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,?\s*device_ids=\(\[([0-9,]+)\]"
    r"(?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}"
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def replica_groups(line: str) -> set[tuple[int, ...]]:
    """The device groups of one collective, from any of XLA's three spellings."""
    if m := _EXPLICIT.search(line):
        return {tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))}
    if m := _IOTA.search(line):
        ids = np.arange(np.prod(_ints(m.group(3)))).reshape(_ints(m.group(3)))
        if m.group(4):
            ids = ids.transpose(_ints(m.group(4)))
        return {tuple(int(d) for d in row) for row in ids.reshape(int(m.group(1)), -1)}
    if m := _MESH.search(line):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = np.arange(np.prod(sizes))
        if m.group(2):
            ids = ids.reshape(_ints(m.group(2)))
            if m.group(3):
                ids = ids.transpose(_ints(m.group(3)))
        ids = ids.reshape(sizes)
        chosen = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        ids = np.moveaxis(ids, chosen, list(range(len(sizes) - len(chosen), len(sizes))))
        size = int(np.prod([sizes[i] for i in chosen]))
        return {tuple(int(d) for d in row) for row in ids.reshape(-1, size)}
    raise AssertionError(f"cannot read the replica groups of: {line[:200]}")


def all_reduced_tensors(hlo: str, groups: set[tuple[int, ...]]) -> int:
    """Tensors all-reduced within exactly `groups` (a tuple all-reduce counts each)."""
    count = 0
    for line in hlo.splitlines():
        m = _ALL_REDUCE.search(line)
        if m and replica_groups(line) == groups:
            count += len(re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", m.group("shape")))
    return count


# One HLO instruction: name, result shape (a tuple in parentheses or one array), opcode.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?(?P<name>%[\w.-]+)\s*=\s*(?P<shape>\(.*?\)|\w+\[[0-9,]*\])"
    r"(?:\{[^}]*\})?\s+(?P<op>[\w-]+)\((?P<rest>.*)$"
)


def _computations(hlo: str) -> dict[str, list[re.Match]]:
    """Computation name -> its instructions (to look inside fusions)."""
    bodies: dict[str, list[re.Match]] = {}
    current = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?(%[\w.-]+)\s*\(.*\{\s*$", line)
        if header:
            current = bodies.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append(m)
    return bodies


def _dims(shape: str) -> tuple[int, ...]:
    return tuple(_ints(re.search(r"\[([0-9,]*)\]", shape).group(1)))


def activation_collectives(hlo: str, groups: set[tuple[int, ...]], tp: int) -> Counter:
    """Collectives within exactly `groups` on rank-3 (batch, sequence, hidden) tensors.

    "all_gather": gathered along dim 1, the sequence. "reduce_scatter": all-reduced, then
    every user keeps a 1/`tp` slice of one dimension: XLA:CPU has no reduce-scatter and
    its SPMD partitioner writes one as an all-reduce and a dynamic-slice (fused or not).
    A fused user whose result has another shape (it goes on to reduce the slice, e.g. a
    gradient summed over the batch) keeps a slice when, inside the fusion, it reads the
    tensor only through such dynamic-slices.
    "all_reduce": any other all-reduced rank-3 tensor (each element of a tuple counts).
    """
    found = [m for m in map(_INSTRUCTION.match, hlo.splitlines()) if m]
    users: dict[str, list[re.Match]] = {}
    for m in found:
        for ref in set(re.findall(r"%[\w.-]+", m.group("rest").split("metadata=")[0])):
            users.setdefault(ref, []).append(m)
    computations = _computations(hlo)

    def one_slice_of(dims: tuple[int, ...], out: tuple[int, ...]) -> bool:
        one_slice = sorted([1.0] * (len(dims) - 1) + [float(tp)])
        return len(out) == len(dims) and sorted(b / a for a, b in zip(out, dims)) == one_slice

    def slices_inside(user: re.Match, name: str, dims: tuple[int, ...]) -> bool:
        called = re.search(r"calls=(%[\w.-]+)", user.group("rest"))
        if user.group("op") != "fusion" or not called or called.group(1) not in computations:
            return False
        operands = re.findall(r"%[\w.-]+", user.group("rest").split(")", 1)[0])
        positions = {str(i) for i, o in enumerate(operands) if o == name}
        body = computations[called.group(1)]
        params = {
            m.group("name") for m in body
            if m.group("op") == "parameter" and m.group("rest").split(")", 1)[0] in positions
        }
        reads = [
            m for m in body
            if params & set(re.findall(r"%[\w.-]+", m.group("rest").split("metadata=")[0]))
        ]
        return bool(reads) and all(
            m.group("op") == "dynamic-slice" and one_slice_of(dims, _dims(m.group("shape")))
            for m in reads
        )

    def sliced(name: str, dims: tuple[int, ...]) -> bool:
        found_users = users.get(name, [])
        return bool(found_users) and all(
            one_slice_of(dims, _dims(u.group("shape"))) or slices_inside(u, name, dims)
            for u in found_users
        )

    counts = Counter()
    for m in found:
        op = m.group("op")
        if op not in ("all-gather", "all-reduce") or replica_groups(m.group(0)) != groups:
            continue
        if op == "all-gather":
            if len(_dims(m.group("shape"))) == 3 and "dimensions={1}" in m.group("rest"):
                counts["all_gather"] += 1
            continue
        tensors = [(m.group("name"), m.group("shape"))]
        if m.group("shape").startswith("("):  # a tuple: its elements' get-tuple-elements
            tensors = [(u.group("name"), u.group("shape")) for u in users.get(m.group("name"), [])
                       if u.group("op") == "get-tuple-element"]
        for name, shape in tensors:
            if len(_dims(shape)) == 3:
                counts["reduce_scatter" if sliced(name, _dims(shape)) else "all_reduce"] += 1
    return counts


def test_replica_group_spellings():
    assert replica_groups("replica_groups={{0,1},{2,3}}, x") == {(0, 1), (2, 3)}
    assert replica_groups("replica_groups=[4,2]<=[8], x") == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x") == {(0, 2, 4, 6), (1, 3, 5, 7)}
    assert replica_groups("replica_groups=mesh['a'=4,'b'=2] {'b'}, x") == {
        (0, 1), (2, 3), (4, 5), (6, 7)
    }


# ---- a dp=4 x tp=2 plan runs and matches one device -----------------------------------


# Extended (CI time): test_megatron_pipeline checks the same tensor-parallel layout's
# parity and its all-reduces per layer on a pipeline of dp2 tp2 stages.
@pytest.mark.extended
def test_gpt_dp4_tp2_matches_single_device_and_has_megatron_all_reduces():
    """Per layer Megatron TP all-reduces four activations over "model": the attention and
    MLP outputs forward, the inputs of QKV and of the MLP first linear backward. We count
    tensors all-reduced within exactly the "model" groups {0,1},{2,3},{4,5},{6,7} of the
    compiled step (TP innermost). XLA may merge all-reduces into one tuple all-reduce, so
    each tensor of a tuple counts; XLA:CPU lowers a reduce-scatter as an all-reduce plus a
    slice, so it counts too. The vocabulary-parallel embedding adds more; a plan without
    tensor parallelism has none, so at least 4 per layer is a real check. Without sequence
    parallelism the residual stream stays whole on "model", so the activations are
    all-reduced, never reduce-scattered (the contrast with the SP test below)."""
    cfg, optimizer, step, args = _gpt()
    plan = megatron_plan(step, *args, cluster=_cpu(), dp=4, tp=2)
    assert plan.method == "megatron(dp=4,tp=2,pp=1)"
    mesh = plan.stages[0].mesh
    assert mesh.axis_names == ("data", "model") and mesh.shape == (4, 2)
    assert mesh.groups("model") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    specs = plan.specs_by_path()
    for layer in range(cfg.num_layers):
        prefix = f"params/layers/{layer}"
        assert specs[f"{prefix}/attn/wqkv"] == ((), MODEL)  # column-parallel
        assert specs[f"{prefix}/attn/bqkv"] == (MODEL,)
        assert specs[f"{prefix}/attn/wo"] == (MODEL, ())  # row-parallel
        assert specs[f"{prefix}/attn/bo"] == ((),)
        assert specs[f"{prefix}/mlp/w1"] == ((), MODEL)
        assert specs[f"{prefix}/mlp/w2"] == (MODEL, ())
        assert specs[f"{prefix}/ln1/scale"] == ((),)
    assert specs["params/wte"] == (MODEL, ())  # vocabulary-parallel (tied logits too)
    assert specs["params/wpe"] == ((), ())
    assert specs["batch/tokens"] == (DATA, ())
    assert specs["opt_state/0/mu/layers/1/attn/wqkv"] == ((), MODEL)
    assert specs["opt_state/0/nu/layers/0/mlp/w2"] == (MODEL, ())

    hlo = compiled_hlo_matching_one_device(cfg, optimizer, step, plan)
    model_groups = set(mesh.groups("model"))
    found = all_reduced_tensors(hlo, model_groups)
    assert found >= 4 * cfg.num_layers, (
        f"{found} tensors all-reduced over 'model', expected >= {4 * cfg.num_layers}"
    )
    activations = activation_collectives(hlo, model_groups, 2)
    assert activations["all_reduce"] >= 4 * cfg.num_layers, activations
    assert "all_reduce" in plan.stages[0].sharding.cost.collectives
    graph = trace(step, *args)
    stream = residual_stream(graph).vars
    assert {plan.stages[0].sharding.var_specs[v] for v in stream} == {(DATA, (), ())}


# Extended (CI time): test_megatron_pipeline checks sequence parallelism's parity and its
# reduce-scatters on a pipeline of dp2 tp2 stages.
@pytest.mark.extended
def test_gpt_sequence_parallel_matches_single_device_and_reduce_scatters():
    """Sequence parallelism (Korthikanti et al. 2022): the residual stream is split on the
    sequence over "model", each TP block's all-reduce becomes a reduce-scatter onto the
    sequence and its input is all-gathered. Per layer, forward: 2 reduce-scatters
    (attention and MLP outputs) and 2 all-gathers (the layer-norm outputs into QKV and the
    MLP); backward: their transposes, 2 all-gathers and 2 reduce-scatters. In the compiled
    HLO no activation is all-reduced over "model" any more."""
    cfg, optimizer, step, args = _gpt()
    plan = megatron_plan(step, *args, cluster=_cpu(), dp=4, tp=2, sequence_parallel=True)
    assert plan.method == "megatron(dp=4,tp=2,pp=1,sp)"
    graph = trace(step, *args)
    stream = residual_stream(graph)
    assert (stream.batch, stream.sequence, stream.hidden) == (BATCH, 16, {cfg.hidden})
    sharding = plan.stages[0].sharding
    assert {sharding.var_specs[v] for v in stream.vars} == {(DATA, MODEL, ())}
    assert plan.specs_by_path()["params/layers/0/attn/wqkv"] == ((), MODEL)  # TP as before
    assert "reduce_scatter" in sharding.cost.collectives

    hlo = compiled_hlo_matching_one_device(cfg, optimizer, step, plan)
    found = activation_collectives(hlo, set(plan.stages[0].mesh.groups("model")), 2)
    print(f"sequence-parallel collectives on 'model' for {cfg.num_layers} layers: {found}")
    assert found["all_reduce"] == 0, found
    assert found["reduce_scatter"] >= 4 * cfg.num_layers, found
    assert found["all_gather"] >= 4 * cfg.num_layers, found


# ---- the layout from the dataflow ---------------------------------------------------


def test_moe_layout_experts_on_data_router_replicated():
    cfg = moe.CONFIGS["tiny"]
    optimizer = optax.adamw(LR)
    graph = trace(moe.make_train_step(cfg, optimizer), moe.abstract_state(cfg, optimizer),
                  moe.abstract_batch(cfg, 16))
    kinds = {graph.vars[v].path: p.kind for v, p in classify_parameters(graph).items()}
    assert kinds["params/layers/0/attn/wq"] is Kind.COLUMN
    assert kinds["params/layers/0/attn/wk"] is Kind.COLUMN
    assert kinds["params/layers/0/attn/bv"] is Kind.BIAS
    assert kinds["params/layers/0/attn/wo"] is Kind.ROW
    assert kinds["params/layers/1/moe/router"] is Kind.REPLICATED
    assert kinds["params/wte"] is Kind.VOCAB
    specs = {graph.vars[v].path: s
             for v, s in megatron_specs(graph, MegatronConfig(dp=4, tp=2)).items()}
    assert specs["params/layers/1/moe/w1"] == (DATA, (), MODEL)  # experts x column
    assert specs["params/layers/1/moe/w2"] == (DATA, MODEL, ())  # experts x row
    assert specs["params/layers/1/moe/router"] == ((), ())
    assert specs["opt_state/0/mu/layers/1/moe/w1"] == (DATA, (), MODEL)


def test_distributed_optimizer_splits_state_over_data():
    _, _, step, args = _gpt(hidden=32)
    graph = trace(step, *args)
    config = MegatronConfig(dp=4, tp=2, distributed_optimizer=True)
    specs = {graph.vars[v].path: s for v, s in megatron_specs(graph, config).items()}
    assert specs["params/layers/0/attn/wqkv"] == ((), MODEL)  # parameters as without
    assert specs["opt_state/0/mu/layers/0/attn/wqkv"] == (DATA, MODEL)
    assert specs["opt_state/0/nu/layers/0/attn/wo"] == (MODEL, DATA)
    assert specs["opt_state/0/mu/layers/0/ln1/scale"] == (DATA,)
    assert specs["opt_state/0/count"] == ()  # a scalar stays whole


def test_overrides_take_precedence():
    _, _, step, args = _gpt(hidden=32)
    graph = trace(step, *args)
    config = MegatronConfig(dp=4, tp=2)
    overrides = {"params/wpe": jax.sharding.PartitionSpec(None, "model")}
    specs = {graph.vars[v].path: s for v, s in megatron_specs(graph, config, overrides).items()}
    assert specs["params/wpe"] == ((), MODEL)
    assert specs["opt_state/0/mu/wpe"] == ((), MODEL)  # state follows the override
    with pytest.raises(ValueError, match="'params/nope', which is not an input"):
        megatron_specs(graph, config, {"params/nope": (None,)})
    with pytest.raises(ValueError, match=r"uses mesh axes \['x'\]"):
        megatron_specs(graph, config, {"params/wpe": ("x", None)})


# ---- errors -----------------------------------------------------------------------------


def test_device_count_mismatch():
    _, _, step, args = _gpt(hidden=32)
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 2\*2\*1 = 4 devices.*has 8"):
        megatron_plan(step, *args, cluster=_cpu(), dp=2, tp=2)


def _conv_step(params, batch):
    def loss(p, b):
        y = jax.lax.conv_general_dilated(b["x"], p["my_kernel"], (1, 1), "SAME")
        return jnp.mean((y.reshape(y.shape[0], -1) @ p["head"]) ** 2)

    value, grads = autopar.value_and_grad(loss)(params, batch)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), {"loss": value}


def test_weight_that_cannot_be_placed_names_path_and_fix():
    params = {"my_kernel": jnp.zeros((4, 2, 3, 3)), "head": jnp.zeros((4 * 8 * 8, 8))}
    batch = {"x": jnp.zeros((8, 2, 8, 8))}
    with pytest.raises(ValueError, match=r"cannot place parameter params/my_kernel of shape "
                       r"\(4, 2, 3, 3\): its first use is 'conv_general_dilated'.*"
                       r"overrides=\{'params/my_kernel': spec\}"):
        megatron_plan(_conv_step, params, batch, cluster=_cpu(), dp=4, tp=2)
    plan = megatron_plan(_conv_step, params, batch, cluster=_cpu(), dp=4, tp=2,
                         overrides={"params/my_kernel": (None, None, None, None)})
    assert plan.specs_by_path()["params/my_kernel"] == ((), (), (), ())


def test_split_that_does_not_divide_names_path_and_fix():
    def step(params, batch):
        def loss(p, b):
            return jnp.mean(jnp.tanh(b @ p["w_in"]) @ p["w_out"])

        value, grads = autopar.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), {"loss": value}

    params = {"w_in": jnp.zeros((16, 6)), "w_out": jnp.zeros((6, 16))}
    with pytest.raises(ValueError, match=r"cannot place parameter params/w_in of shape "
                       r"\(16, 6\): as a column-parallel weight its dim 1 \(6\).*tp=4.*"
                       r"overrides="):
        megatron_plan(step, params, jnp.zeros((8, 16)), cluster=_cpu(), dp=2, tp=4)


def test_unmarked_pipeline_and_bad_options_are_refused():
    _, _, step, args = _gpt(hidden=32)
    # pp > 1 needs layers: this GPT has no layer_boundary marks
    with pytest.raises(ValueError, match="layer_boundary"):
        megatron_plan(step, *args, cluster=_cpu(), dp=2, tp=2, pp=2, num_microbatches=4)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        megatron_plan(step, *args, cluster=_cpu(), dp=8, tp=1, schedule="zigzag")
    with pytest.raises(ValueError, match="splits the sequence over the tensor-parallel "
                       "devices, but tp=1; use tp > 1 or sequence_parallel=False"):
        megatron_plan(step, *args, cluster=_cpu(), dp=8, tp=1, sequence_parallel=True)
    _, _, step12, args12 = _gpt(hidden=32, seq_len=12)
    with pytest.raises(ValueError, match=r"splits the sequence \(12 positions\) over tp=8"):
        megatron_plan(step12, *args12, cluster=_cpu(), dp=1, tp=8, sequence_parallel=True)


def test_sequence_parallel_needs_transformer_blocks():
    """A model without row-parallel weights has no residual stream to split; without SP
    its activations are left to the ILP as before."""
    params = {"my_kernel": jnp.zeros((4, 2, 3, 3)), "head": jnp.zeros((4 * 8 * 8, 8))}
    batch = {"x": jnp.zeros((8, 2, 8, 8))}
    overrides = {"params/my_kernel": (None, None, None, None)}
    with pytest.raises(ValueError, match="needs tensor-parallel blocks"):
        megatron_plan(_conv_step, params, batch, cluster=_cpu(), dp=4, tp=2,
                      sequence_parallel=True, overrides=overrides)
    assert residual_specs(trace(_conv_step, params, batch), MegatronConfig(dp=4, tp=2)) == {}


# ---- sequence parallelism: the residual stream and its pins ------------------------------


def test_residual_stream_is_what_tp_leaves_whole():
    """Found from the dataflow: the inputs of the column-parallel dots (layer-norm outputs),
    the outputs of the row-parallel dots; not the head-split attention context."""
    cfg, _, step, args = _gpt(hidden=32)
    graph = trace(step, *args)
    stream = set(residual_stream(graph).vars)
    kinds = classify_parameters(graph)
    column_inputs, row_outputs, row_inputs = [], [], []
    for node in graph.nodes:
        weights = [kinds[v].kind for v in node.inputs if v in kinds]
        if node.primitive != "dot_general" or not weights:
            continue
        activation = next(v for v in node.inputs if v not in kinds)
        if weights[0] is Kind.COLUMN and activation not in column_inputs:
            column_inputs.append(activation)
        if weights[0] is Kind.ROW and graph.vars[node.outputs[0]].shape == (BATCH, 16, 32):
            row_outputs.append(node.outputs[0])
            row_inputs.append(activation)
    assert len(column_inputs) >= 2 * cfg.num_layers  # forward (and backward) uses of QKV, w1
    assert set(column_inputs[: 2 * cfg.num_layers]) <= stream
    assert set(row_outputs[: 2 * cfg.num_layers]) <= stream
    assert not set(row_inputs) & stream
    assert all(graph.vars[v].shape == (BATCH, 16, 32) for v in stream)


def test_pin_activations_restricts_the_leader_of_a_follower():
    _, _, step, args = _gpt(hidden=32, num_layers=1)
    graph = trace(step, *args)
    config = MegatronConfig(dp=4, tp=2)
    cluster = _cpu()
    mesh = stage_mesh(cluster, config, 0)
    built = build_problem(graph, mesh, cluster, ShardOptions(), (),
                          megatron_specs(graph, config))
    # An elementwise op of the residual stream follows its producer's choice.
    v = next(v for v in residual_stream(graph).vars
             if built.source_of[v][0] in built.problem.followers)
    index, k = built.source_of[v]
    leader = built.problem.followers[index][0]
    spec = (MODEL, (), ())  # the batch split on "model": not Megatron's, just a pin to honour
    pinned = pin_activations(built, graph, {v: spec})
    assert pinned.problem.num_strategies[leader] < built.problem.num_strategies[leader]
    assert pinned.problem.num_strategies[index] == built.problem.num_strategies[index]
    choice = solve(pinned.problem).choices[index]
    assert pinned.ilp_nodes[index].strategies[choice].out_specs[k] == spec
    # (batch, sequence, 1): a layer norm's mean cannot be split on its size-1 dimension
    mean = next(v.id for v in graph.vars if v.shape == (BATCH, 16, 1) and v.id in built.source_of)
    with pytest.raises(ValueError, match=rf"cannot give activation {mean} of shape "
                       r"\(8, 16, 1\) the spec P\(None, None, 'model'\)"):
        pin_activations(built, graph, {mean: ((), (), MODEL)})
    lenient = pin_activations(built, graph, {mean: ((), (), MODEL)}, where_possible=True)
    assert lenient.problem.num_strategies == built.problem.num_strategies
    assert "activations left unpinned" in lenient.warnings[-1]


def test_sequence_parallel_lowers_predicted_activation_memory():
    """On DGX A100s the SP plan keeps a tp-th of the residual stream's activations per
    device (Korthikanti et al. 2022: 34/t instead of 10 + 24/t of the 34·sbh bytes)."""
    _, _, step, args = _gpt(hidden=64, num_layers=1)
    graph = trace(step, *args)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    kept, peak = {}, {}
    for sp in (False, True):
        plan = megatron_plan_for_graph(
            graph, cluster, MegatronConfig(dp=2, tp=4, sequence_parallel=sp)
        )
        kept[sp] = kept_activation_bytes(graph, plan)
        peak[sp] = plan.stages[0].sharding.cost.memory_per_device
    # The residual-stream values the backward pass reads, per device with dp=2, shrink to
    # a quarter (tp=4); nothing else is kept in a larger layout.
    forward = forward_nodes(graph)
    read_later = {v for n in graph.nodes if n.id not in forward for v in n.inputs}
    stream_kept = sum(graph.vars[v].nbytes for v in residual_stream(graph).vars
                      if v in read_later) / 2
    print(f"kept activations per device: {kept[False]:.0f} -> {kept[True]:.0f} bytes "
          f"(residual stream {stream_kept:.0f}); peak {peak[False]:.0f} -> {peak[True]:.0f}")
    assert kept[False] - kept[True] >= (1 - 1 / 4) * stream_kept > 0
    assert peak[True] < peak[False]


# ---- grid search ------------------------------------------------------------------------


def test_megatron_configs_enumeration():
    configs = megatron_configs(16, 8, 32, pp_values=(1, 2, 3), microbatch_sizes=(1, 2, 64),
                               sequence_parallel=(False, True), num_layers=4)
    degrees = {(c.dp, c.tp, c.pp) for c in configs}
    assert all(c.num_devices == 16 for c in configs)
    assert all(c.tp <= 8 for c in configs)  # TP stays inside a host
    assert (1, 16, 1) not in degrees and (2, 8, 1) in degrees and (1, 8, 2) in degrees
    assert not any(c.pp == 3 for c in configs)  # 3 does not divide 16
    assert not any(c.sequence_parallel and c.tp == 1 for c in configs)
    # pp=2, dp=4: 32 examples in microbatches of 1 and 2 per rank -> 8 and 4 microbatches
    # (one microbatch, the whole batch, is fewer than the stages)
    assert sorted({c.num_microbatches for c in configs if (c.dp, c.pp) == (4, 2)}) == [4, 8]
    # pp=1 accumulates gradients: the whole batch, or 4 or 8 microbatches
    assert {c.num_microbatches for c in configs if (c.dp, c.pp) == (4, 1)} == {1, 4, 8}

    # Counts instead of sizes (what the benchmark gives both planners): each count that
    # splits the batch into whole examples per data-parallel rank, one microbatch only if
    # listed; pp=2 still needs at least 2.
    counted = megatron_configs(16, 8, 32, pp_values=(1, 2), microbatch_counts=(1, 2, 16),
                               num_layers=4)
    assert {c.num_microbatches for c in counted if (c.dp, c.pp) == (4, 1)} == {1, 2}
    assert {c.num_microbatches for c in counted if (c.dp, c.pp) == (2, 2)} == {2, 16}
    with pytest.raises(ValueError, match="microbatch_counts must be a non-empty"):
        megatron_grid_search(lambda s, b: s, {}, {}, cluster="dgx-a100-80g",
                             microbatch_counts=())

    both = megatron_configs(16, 8, 32, distributed_optimizer=(False, True))
    assert len(both) == 2 * len(megatron_configs(16, 8, 32))
    assert {c.distributed_optimizer for c in both} == {False, True}


def test_grid_rules_prune_with_reasons():
    """Megatron's rules, each reported on the configuration it prunes."""
    found = megatron_candidates(
        16, 8, 64, num_layers=6, num_heads=4, microbatch_sizes=(2,),
        sequence_parallel=(False, True), distributed_optimizer=(False, True),
        virtual_stages=(1, 2, 3),
    )
    reason = {c.name: r for c, r in found}
    assert "devices per host" in reason["megatron(dp=1,tp=16,pp=1)"]
    assert "does not divide the 4 attention heads" in reason["megatron(dp=2,tp=8,pp=1)"]
    assert "pp=4 does not divide the 6 layers" in reason["megatron(dp=4,tp=1,pp=4)"]
    # pp=2, v=2: 4 chunks do not divide 6 layers; v=3: 6 chunks do
    assert "model chunks do not divide the 6 layers" in reason["megatron(dp=8,tp=1,pp=2,v=2)"]
    assert reason["megatron(dp=8,tp=1,pp=2,mb=4,v=3)"] == ""
    # one microbatch for two stages; an odd count for the interleaved schedule
    assert "for 2 pipeline stages" in reason["megatron(dp=8,tp=1,pp=2)"]
    assert reason["megatron(dp=2,tp=4,pp=2,sp,zero1,mb=16)"] == ""
    valid = [c for c, r in found if not r]
    assert all(c.num_microbatches % c.pp == 0 for c in valid if c.virtual_stages > 1)
    assert not any(c.virtual_stages > 1 and c.pp == 1 for c, _ in found)
    assert not any(c.sequence_parallel and c.tp == 1 for c, _ in found)
    assert {c.distributed_optimizer for c in valid} == {False, True}
    interleaved = megatron_candidates(4, 4, 12, num_layers=4, pp_values=(2,),
                                      microbatch_sizes=(4,), virtual_stages=(2,))
    assert [(c.name, r) for c, r in interleaved if c.num_microbatches == 3] == [
        ("megatron(dp=1,tp=2,pp=2,mb=3,v=2)",
         "pruned: the interleaved schedule needs microbatches a multiple of pp=2, got 3")
    ]


def test_megatron_config_options_are_validated():
    with pytest.raises(ValueError, match="unknown recompute 'some'"):
        MegatronConfig(dp=1, tp=1, recompute="some")
    with pytest.raises(ValueError, match="virtual_stages=2 .* but pp=1"):
        MegatronConfig(dp=1, tp=1, virtual_stages=2)
    config = MegatronConfig(dp=1, tp=1, pp=2, num_microbatches=3, virtual_stages=2,
                            recompute="selective", schedule="interleaved_1f1b")
    assert config.name == "megatron(dp=1,tp=1,pp=2,mb=3,recompute=selective,v=2)"
    with pytest.raises(ValueError, match="needs a number of microbatches that pp=2 divides"):
        config.check_microbatches()


def test_grid_search_on_dgx_returns_best_and_reasons():
    _, _, step, args = _gpt(hidden=32, num_layers=1)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    # With dp=8 every device holds all weights, their Adam moments and an eighth of the
    # activations: at least 0.34 MB per device (the ILP's least memory). tp=8 needs
    # 0.33 MB with the residual stream whole on every device, and fits in 0.16 MB with it
    # split on the sequence (sequence parallelism); dp=2 x tp=4 needs 0.26 MB.
    budget = 3e5
    best, results = megatron_grid_search(
        step, *args, cluster=cluster, pp_values=(1, 2), sequence_parallel=(False, True),
        memory_budget=budget, distributed_optimizer=(False,), microbatch_sizes=(),
        recompute=("none", "selective"),
    )
    outcome = {c.name: o for c, o in results}
    assert "MemoryBudgetError" in outcome["megatron(dp=8,tp=1,pp=1)"]
    # recompute is tried where memory needs it, and only there; it runs per layer, and
    # this step has no layer marks
    assert "layer_boundary marks" in outcome["megatron(dp=8,tp=1,pp=1,recompute=selective)"]
    assert outcome["megatron(dp=4,tp=2,pp=1,sp,recompute=selective)"].startswith("not needed")
    assert "layer_boundary" in outcome["megatron(dp=2,tp=2,pp=2)"]  # no layer marks
    assert outcome["megatron(dp=2,tp=2,pp=2)"].startswith("pruned")
    assert "MemoryBudgetError" in outcome["megatron(dp=1,tp=8,pp=1)"]
    times = {name: o for name, o in outcome.items() if isinstance(o, float)}
    assert {"megatron(dp=1,tp=8,pp=1,sp)", "megatron(dp=4,tp=2,pp=1,sp)"} <= set(times)
    assert not any("NotImplementedError" in str(o) for o in outcome.values())
    assert best.method == min(times, key=times.get)
    assert best.predicted_step_time == min(times.values())
    assert best.stages[0].sharding.cost.memory_per_device <= budget
    assert best.stages[0].mesh.num_devices == 8


def test_grid_costs_each_configuration_at_its_microbatch_size():
    """A grid row is exactly `megatron_plan` of the step traced at that microbatch size."""
    cfg, _, step, args = _gpt(hidden=32, num_layers=4)
    cfg = dataclasses.replace(cfg, layer_markers=True)
    optimizer = optax.adamw(1e-2)
    step = gpt.make_train_step(cfg, optimizer)
    args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 8))
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1, devices_per_host=4)
    _, results = megatron_grid_search(
        step, *args, cluster=cluster, pp_values=(2,), sequence_parallel=(False,),
        distributed_optimizer=(False,), recompute=("none",), virtual_stages=(1, 2),
        microbatch_sizes=(2,), num_heads=cfg.num_heads,
    )
    times = {c.name: o for c, o in results if isinstance(o, float)}
    # 4 marked layers: pp=2 with 2 virtual stages each (4 chunks) is valid
    assert set(times) == {"megatron(dp=2,tp=1,pp=2,mb=2)", "megatron(dp=1,tp=2,pp=2,mb=4)",
                          "megatron(dp=2,tp=1,pp=2,mb=2,v=2)",
                          "megatron(dp=1,tp=2,pp=2,mb=4,v=2)"}
    plan = autopar.megatron_plan(step, *args, cluster=cluster, dp=1, tp=2, pp=2,
                                 num_microbatches=4)
    assert times["megatron(dp=1,tp=2,pp=2,mb=4)"] == plan.predicted_step_time
