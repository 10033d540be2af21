"""Megatron-style plans: layout from the dataflow, correctness on 8 devices, the TP
all-reduces in the compiled HLO, the grid search, and the errors users see."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, compiled_hlo, run_steps

import autopar
from autopar.graph import trace
from autopar.manual import (
    Kind,
    MegatronConfig,
    classify_parameters,
    megatron_configs,
    megatron_grid_search,
    megatron_plan,
    megatron_specs,
)
from examples import gpt, moe

LR = 1e-2
BATCH = 8
DATA, MODEL = ("data",), ("model",)


def _gpt(hidden=64, num_layers=2):
    cfg = dataclasses.replace(
        gpt.CONFIGS["tiny"], hidden=hidden, num_layers=num_layers, seq_len=16
    )
    optimizer = optax.adamw(LR, eps=1e-6)
    step = gpt.make_train_step(cfg, optimizer)
    args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, BATCH))
    return cfg, optimizer, step, args


def _cpu():
    return autopar.Cluster.from_profile("cpu-local")


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


def test_replica_group_spellings():
    assert replica_groups("replica_groups={{0,1},{2,3}}, x") == {(0, 1), (2, 3)}
    assert replica_groups("replica_groups=[4,2]<=[8], x") == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x") == {(0, 2, 4, 6), (1, 3, 5, 7)}
    assert replica_groups("replica_groups=mesh['a'=4,'b'=2] {'b'}, x") == {
        (0, 1), (2, 3), (4, 5), (6, 7)
    }


# ---- a dp=4 x tp=2 plan runs and matches one device -----------------------------------


def test_gpt_dp4_tp2_matches_single_device_and_has_megatron_all_reduces():
    """Per layer Megatron TP all-reduces four activations over "model": the attention and
    MLP outputs forward, the inputs of QKV and of the MLP first linear backward. We count
    tensors all-reduced within exactly the "model" groups {0,1},{2,3},{4,5},{6,7} of the
    compiled step (TP innermost). XLA may merge all-reduces into one tuple all-reduce, so
    each tensor of a tuple counts; XLA:CPU lowers a reduce-scatter (which the ILP may pick
    for a row-parallel output, sequence-parallel style) as an all-reduce plus a slice, so it
    counts too. The vocabulary-parallel embedding adds more; a plan without tensor
    parallelism has none, so at least 4 per layer is a real check."""
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

    state = gpt.init_state(cfg, optimizer, jax.random.key(0))
    batch = gpt.make_batch(cfg, BATCH, jax.random.key(1))
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, plan=plan, donate_argnums=())
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state.params, ref_state.params, atol=1e-3)

    hlo = compiled_hlo(par, state, batch)
    model_groups = set(mesh.groups("model"))
    found = all_reduced_tensors(hlo, model_groups)
    assert found >= 4 * cfg.num_layers, (
        f"{found} tensors all-reduced over 'model', expected >= {4 * cfg.num_layers}"
    )
    assert "all_reduce" in plan.stages[0].sharding.cost.collectives


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


def test_unmarked_pipeline_and_sequence_parallel_are_refused():
    _, _, step, args = _gpt(hidden=32)
    # pp > 1 needs layers: this GPT has no layer_boundary marks
    with pytest.raises(ValueError, match="layer_boundary"):
        megatron_plan(step, *args, cluster=_cpu(), dp=2, tp=2, pp=2, num_microbatches=4)
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        megatron_plan(step, *args, cluster=_cpu(), dp=4, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        megatron_plan(step, *args, cluster=_cpu(), dp=8, tp=1, schedule="zigzag")


# ---- grid search ------------------------------------------------------------------------


def test_megatron_configs_enumeration():
    configs = megatron_configs(16, 8, 32, pp_values=(1, 2, 3), microbatch_sizes=(1, 2, 64),
                               sequence_parallel=(False, True))
    degrees = {(c.dp, c.tp, c.pp) for c in configs}
    assert all(c.num_devices == 16 for c in configs)
    assert all(c.tp <= 8 for c in configs)  # TP stays inside a host
    assert (1, 16, 1) not in degrees and (2, 8, 1) in degrees and (1, 8, 2) in degrees
    assert not any(c.pp == 3 for c in configs)  # 3 does not divide 16
    assert not any(c.sequence_parallel and c.tp == 1 for c in configs)
    # pp=2, dp=4: 32 examples in microbatches of 1 and 2 per rank -> 8 and 4 microbatches
    assert sorted({c.num_microbatches for c in configs if (c.dp, c.pp) == (4, 2)}) == [4, 8]
    assert {c.num_microbatches for c in configs if c.pp == 1} == {1}


def test_grid_search_on_dgx_returns_best_and_reasons():
    _, _, step, args = _gpt(hidden=32)
    cluster = autopar.Cluster.from_profile("dgx-a100-80g", num_hosts=1)
    # With dp=8 every device holds all weights, their Adam moments and an eighth of the
    # activations: at least 0.57 MB per device (the ILP's least memory); tp=8 fits in
    # about 0.41 MB.
    budget = 5e5
    best, results = megatron_grid_search(
        step, *args, cluster=cluster, pp_values=(1, 2), sequence_parallel=(False, True),
        memory_budget=budget,
    )
    outcome = {c.name: o for c, o in results}
    assert "MemoryBudgetError" in outcome["megatron(dp=8,tp=1,pp=1)"]
    assert "layer_boundary" in outcome["megatron(dp=2,tp=2,pp=2,mb=4)"]  # no layer marks
    assert "sequence_parallel" in outcome["megatron(dp=4,tp=2,pp=1,sp)"]
    times = {name: o for name, o in outcome.items() if isinstance(o, float)}
    assert "megatron(dp=1,tp=8,pp=1)" in times
    assert best.method == min(times, key=times.get)
    assert best.predicted_step_time == min(times.values())
    assert best.stages[0].sharding.cost.memory_per_device <= budget
    assert best.stages[0].mesh.num_devices == 8
