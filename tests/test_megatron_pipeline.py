"""Megatron plans with pipeline stages (tp=2, pp=2, dp=2), with and without sequence
parallelism, run and match one device."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax
import numpy as np
import optax
from helpers import assert_trees_close, run_steps
from test_megatron import activation_collectives

import autopar
from autopar.lower import count_collectives
from examples import gpt

CFG = dataclasses.replace(gpt.CONFIGS["tiny"], hidden=64, num_layers=2, layer_markers=True)
# Stage-local device ids of the "model" groups of a (dp=2, tp=2) stage mesh (TP innermost).
MODEL_GROUPS = {(0, 1), (2, 3)}


def _model_axis_all_reduces(hlo: str, tp: int) -> int:
    """Tensors all-reduced within groups of `tp` devices (the "model" axis)."""
    count = 0
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        groups = re.search(r"replica_groups=\{(\{[0-9,]+\}(?:,\{[0-9,]+\})*)\}", line)
        if groups:
            sizes = {len(g.split(",")) for g in re.findall(r"\{([0-9,]+)\}", groups.group(1))}
        else:
            iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
            sizes = {int(iota.group(2))} if iota else set()
        if sizes == {tp}:
            shape = line.split("=", 1)[1].split(" all-reduce", 1)[0]
            count += max(1, shape.count("["))
    return count


def _run_and_compare(sequence_parallel: bool, num_microbatches: int = 2):
    """Plan, run 3 steps against one device; **Returns:** (plan, [(phase, HLO text)],
    the pipeline executable)."""
    opt = optax.adamw(1e-2, eps=1e-6)
    state = gpt.init_state(CFG, opt, jax.random.key(0))
    batch = gpt.make_batch(CFG, 8, jax.random.key(1))
    step = gpt.make_train_step(CFG, opt)
    plan = autopar.megatron_plan(
        step, state, batch, cluster="cpu-local", dp=2, tp=2, pp=2,
        num_microbatches=num_microbatches, sequence_parallel=sequence_parallel,
    )
    assert plan.num_stages == 2 and plan.runtime == "pipeline"
    assert [len(s.mesh.device_ids) for s in plan.stages] == [4, 4]
    ref_losses, ref_state = run_steps(jax.jit(step), state, batch)
    par = autopar.autoparallel(step, plan=plan, donate_argnums=())
    losses, par_state = run_steps(par, state, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(par_state, ref_state, 1e-3)

    pipeline = par.pipeline
    hlos = []
    for (phase, stage), task in pipeline.tasks.items():
        if not task.segment.nodes:
            continue
        sub = pipeline.partition.stage_graphs[stage]
        args = [
            jax.ShapeDtypeStruct(sub.vars[v].shape, sub.vars[v].dtype, sharding=sh)
            for v, sh in zip(task.segment.inputs, task.in_shardings)
        ]
        hlos.append((phase, task.fn.lower(*args).compile().as_text()))
    return plan, hlos, pipeline


def test_megatron_tp2_pp2_dp2_matches_one_device_and_all_reduces_per_layer():
    _, hlos, _ = _run_and_compare(sequence_parallel=False)
    # Megatron TP: two all-reduces forward (attention output, MLP output) and two backward
    # (the column-parallel inputs' gradients) per transformer layer, on the model axis.
    total = 0
    for phase, hlo in hlos:
        assert "all_reduce" in count_collectives(hlo) or phase == "forward"
        total += _model_axis_all_reduces(hlo, 2)
    print(f"model-axis all-reduces over both stages: {total} for {CFG.num_layers} layers")
    assert total >= 4 * CFG.num_layers


def test_megatron_sequence_parallel_pipeline_reduce_scatters_instead():
    """With sequence parallelism each stage's layers reduce-scatter onto the sequence and
    all-gather it back (two of each per layer forward, two of each backward); no
    activation is all-reduced over "model"."""
    plan, hlos, pipeline = _run_and_compare(sequence_parallel=True, num_microbatches=4)
    assert plan.method == "megatron(dp=2,tp=2,pp=2,sp,mb=4)"
    # Gradients wait for the update as partial sums over "data" (Megatron's gradient
    # buffers) and, over "model", only the vectors (layer norms, biases): a matrix's
    # weight gradient is complete per model rank, never a stack of the whole matrix.
    for s, stacked in enumerate(pipeline.stacked):
        sub = pipeline.partition.stage_graphs[s]
        for v, axes in stacked.items():
            if "model" in axes:
                assert sum(d > 1 for d in sub.vars[v].shape) < 2, (sub.vars[v], axes)
    total = Counter()
    for _, hlo in hlos:
        total += activation_collectives(hlo, MODEL_GROUPS, 2)
    print(f"sequence-parallel collectives on 'model' over both stages: {total} for "
          f"{CFG.num_layers} layers")
    assert total["all_reduce"] == 0
    assert total["reduce_scatter"] >= 4 * CFG.num_layers
    assert total["all_gather"] >= 4 * CFG.num_layers
