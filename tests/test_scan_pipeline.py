"""Pipeline stages over a scanned layer stack (issue 16, item 2).

A GPT whose blocks run under `jax.lax.scan` over stacked parameters gets its layers from
the scan's iterations (no `layer_boundary` marks): the stage DP may cut the stack, each
stage runs one sub-scan over its slice ``w[a:b]`` of every stacked leaf, holds only that
slice (parameters, optimizer state, gradients), and the caller gets each stacked leaf back
as one array laid out over the stages. It trains like one device.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, run_steps

import autopar
from autopar.app._autoparallel import check_arguments_fit
from autopar.graph import abstract_args, split_stacked, tied_state, trace
from autopar.inter import LayerCostTable, assign_layers, layer_scan, scan_layers
from autopar.inter.passes import per_iteration
from autopar.inter.passes._scan_layers import check_ranges
from autopar.intra import ShardOptions
from autopar.search import PlanOptions, graph_for_plan
from autopar.search._stack import even_shares as _even_shares
from autopar.search._stack import stack_ranges
from examples import gpt, llama

CPU = autopar.Cluster.from_profile("cpu-local")
SCANNED = dataclasses.replace(gpt.CONFIGS["tiny"], num_layers=8, scan_layers=True)
SMALL = dataclasses.replace(SCANNED, num_layers=4, hidden=16)
BATCH = 8
LR = 1e-2
STATE_ATOL = 1e-5
# Fixed so that the test plans few meshes: two stages of four devices, a (2, 2) mesh each.
PIPELINE = dict(num_stages=2, num_microbatches=2, submeshes=[(1, 4)], logical_shapes=[(2, 2)])


def _step(cfg):
    optimizer = optax.adamw(LR)
    return gpt.make_train_step(cfg, optimizer), optimizer


# Mixed precision: the loss casts the fp32 stacked master weights to bfloat16 before the
# scan; the stack is still found through the cast and cut into the ranges.
MIXED = dataclasses.replace(SMALL, dtype="bfloat16", master_dtype="float32")


# The Llama example as MaxText writes it (fp32 master weights cast to bf16 before the scan,
# each layer checkpointed), cut one range per iteration as the stage DP sees it: before the
# split's grouping was fixed, AdamW's update joined the master weights to their cast only
# through a chain the union-find lost, so every iteration read the whole cast stack.
LLAMA_MIXED = dataclasses.replace(
    llama.CONFIGS["tiny"], num_layers=6, dtype="bfloat16", master_dtype="float32",
    scan_layers=True, remat_layers=True,
)


@pytest.mark.parametrize(
    "module, cfg, ranges",
    # CI time: the mixed-precision step runs the same split with a cast on top; the
    # per-iteration split of a Llama is planned and run by test_llama's scan tests.
    [pytest.param(gpt, SMALL, ((0, 1), (1, 4)), marks=pytest.mark.extended),
     (gpt, MIXED, ((0, 1), (1, 4))),
     pytest.param(llama, LLAMA_MIXED, per_iteration(LLAMA_MIXED.num_layers),
                  marks=pytest.mark.extended)],
    ids=["float32", "mixed_precision", "llama_mixed_per_iteration"],
)
def test_split_graph_computes_the_step_and_holds_no_whole_stack(module, cfg, ranges):
    optimizer = optax.adamw(LR)
    step = module.make_train_step(cfg, optimizer)
    state = module.init_state(cfg, optimizer, jax.random.key(0))
    batch = module.make_batch(cfg, 2, jax.random.key(1))
    with scan_layers(ranges):
        graph = trace(step, state, batch)
    split = split_stacked(graph, ranges)
    # Embeddings, one layer per range, the head.
    assert assign_layers(split).num_layers == len(ranges) + 2
    stacked = split.stacked
    paths = {split.vars[v].path for v in split.invars}
    a, b = ranges[-1]
    leaf = "attn/wqkv" if module is gpt else "attn/wq"
    assert f"params/layers/{leaf}[0:1]" in paths and f"params/layers/{leaf}[{a}:{b}]" in paths
    assert f"opt_state/0/mu/layers/{leaf}[{a}:{b}]" in paths
    whole = [
        (n.primitive, split.vars[v].shape)
        for n in split.nodes
        for v in (*n.inputs, *n.outputs)
        if split.vars[v].shape[:1] == (cfg.num_layers,)
    ]
    assert not whole, f"equations hold a whole stacked array: {whole[:5]}"
    leaves = jax.tree.leaves((state, batch))
    flat = stacked.graph_leaves(leaves, lambda x, where: [x[a:b] for a, b in ranges])
    # One program computes both (one compilation).
    got, want = jax.jit(lambda a, b: (split.evaluate(a), graph.evaluate(b)))(flat, leaves)
    got = stacked.caller_outputs(got, lambda pieces, where: np.concatenate(pieces))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layers_come_from_the_scan_iterations():
    step, optimizer = _step(SCANNED)
    abstract = gpt.abstract_state(SCANNED, optimizer), gpt.abstract_batch(SCANNED, 4)
    assert layer_scan(trace(step, *abstract)).params["length"] == SCANNED.num_layers
    ranges = per_iteration(SCANNED.num_layers)
    with scan_layers(ranges):
        graph = split_stacked(trace(step, *abstract), ranges)
    layers = assign_layers(graph)
    assert layers.num_layers == SCANNED.num_layers + 2
    # Every iteration is the same layer: the stage DP solves its ILP once per mesh.
    table = LayerCostTable(graph, layers, CPU, ShardOptions(), tied_state(graph, (0,)))
    assert len(set(table.fingerprints[1:-1])) == 1
    assert len(set(table.fingerprints)) == 3  # embeddings, an iteration, the head


@pytest.mark.extended  # minutes on a loaded 2-core machine; the plan test below is default
def test_scanned_gpt_on_two_stages_holds_slices_and_trains_like_one_device(tmp_path):
    _train_on_two_stages(SCANNED, tmp_path, num_steps=3)


@pytest.mark.extended  # compiling the stages' programs dominates; the plan test is default
def test_small_scanned_gpt_on_two_stages_holds_slices_and_trains_like_one_device(tmp_path):
    _train_on_two_stages(SMALL, tmp_path, num_steps=2)


def test_scanned_gpt_plan_on_two_stages_gives_each_stage_its_slice():
    """The default-tier twin of the training tests: the plan alone."""
    step, optimizer = _step(SMALL)
    plan = autopar.plan(
        step, gpt.abstract_state(SMALL, optimizer), gpt.abstract_batch(SMALL, BATCH),
        cluster=CPU, cache=False, **PIPELINE,
    )
    assert plan.num_stages == 2 and plan.scan_ranges == ((0, 2), (2, 4))
    assert plan.scan_remat == ("none", "none")  # it fits: nothing recomputed
    split = plan.split_inputs()
    assert "params/layers/mlp/w1" in split and "opt_state/0/nu/layers/mlp/w1" in split
    for path, pieces in split.items():
        assert [(i.shape[0], i.stage) for i in pieces] == [(2, 0), (2, 1)], path
        assert all(not i.spec[0] for i in pieces), f"{path}: a piece's layer dim is split"
    # Whole leaves for the caller: one sharding over both stages' devices.
    by_path = plan.shardings_by_path()
    w1 = by_path["params/layers/mlp/w1"]
    assert w1.mesh.axis_names[0] == "stage" and w1.mesh.devices.size == 8
    assert w1.spec[0] == "stage"
    whole = {i.path: i.shape for i in plan.caller_inputs()}
    assert whole["params/layers/mlp/w1"][0] == SMALL.num_layers
    again = autopar.Plan.from_json(plan.to_json())
    assert again == plan and again.split_inputs().keys() == split.keys()
    # Reused (plan=..., or a cache hit): the step is traced and cut again as the plan says,
    # and the caller's arguments, whole, fit it.
    abstract = (gpt.abstract_state(SMALL, optimizer), gpt.abstract_batch(SMALL, BATCH))
    check_arguments_fit(again, *abstract_args(step, abstract))
    graph = graph_for_plan(step, abstract, again, PlanOptions(**PIPELINE))
    assert graph.stacked.ranges == plan.scan_ranges


def _train_on_two_stages(cfg, tmp_path, num_steps):
    step, optimizer = _step(cfg)
    state = gpt.init_state(cfg, optimizer, jax.random.key(0))
    batch = gpt.make_batch(cfg, BATCH, jax.random.key(1))
    want_losses, want_state = run_steps(jax.jit(step), state, batch, num_steps)
    par = autopar.autoparallel(step, cluster=CPU, donate_argnums=(), cache=False, **PIPELINE)
    losses, got_state = run_steps(par, state, batch, num_steps)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    # As in test_scan_layers: the optimizer state checks the gradients closely.
    assert_trees_close(got_state.opt_state, want_state.opt_state, atol=STATE_ATOL)

    plan = par.plan
    half = cfg.num_layers // 2
    assert plan.num_stages == 2 and plan.scan_ranges == ((0, half), (half, cfg.num_layers))
    split = plan.split_inputs()
    stacked_paths = [
        p for p, _ in jax.tree_util.tree_flatten_with_path(state.params["layers"])[0]
    ]
    assert len(split) == 3 * len(stacked_paths)  # parameters, adam's mu and nu
    for path, pieces in split.items():
        assert [(i.shape[0], i.stage) for i in pieces] == [(half, 0), (half, 1)], path
    # On the devices: each stage's devices hold its four layers of every stacked leaf, and
    # no device holds more.
    stage_devices = [set(d.id for d in m.devices.flat) for m in par.pipeline.meshes]
    for w in jax.tree.leaves(got_state.params["layers"]):
        assert w.shape[0] == cfg.num_layers
        for shard in w.addressable_shards:
            stage = next(s for s, ids in enumerate(stage_devices) if shard.device.id in ids)
            assert shard.index[0] == slice(half * stage, half * (stage + 1)), (shard.index, stage)
    # The caller's shardings: the whole leaf over both stages, the layer dim split by stage,
    # and the updated state comes back laid out so (passing it back moves nothing).
    sharding = par.shardings()[0].params["layers"]["mlp"]["w1"]
    assert sharding.mesh.axis_names[0] == "stage" and sharding.spec[0] == "stage"
    for got, want in zip(jax.tree.leaves(got_state.params["layers"]),
                         jax.tree.leaves(par.shardings()[0].params["layers"])):
        assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)

    # A checkpoint of the trained state restores onto this plan and training goes on.
    autopar.checkpoint.save(tmp_path / "ckpt", got_state)
    restored = autopar.checkpoint.restore(tmp_path / "ckpt", like=par)
    assert_trees_close(restored, got_state, 0.0)
    _, again = par(restored, batch)
    _, want = jax.jit(step)(want_state, batch)
    np.testing.assert_allclose(again["loss"], want["loss"], rtol=1e-5)


def test_a_stack_that_does_not_divide_stays_on_one_stage():
    cfg = dataclasses.replace(SCANNED, num_layers=3)
    step, optimizer = _step(cfg)
    plan = autopar.plan(
        step, gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, BATCH),
        cluster=CPU, cache=False, **PIPELINE,
    )
    # 3 layers on 2 stages: no even cut, so one stage holds the whole stack (the other the
    # embeddings or the head), and no leaf is held in pieces.
    assert plan.num_stages == 2 and plan.scan_ranges == ((0, 3),)
    assert not plan.split_inputs()
    wqkv = next(i for i in plan.inputs if i.path == "params/layers/attn/wqkv")
    assert wqkv.shape[0] == 3


def test_even_shares_and_ranges():
    allowed = _even_shares(6, 4)  # layer 0: embeddings, 1..6: iterations, 7: head
    assert allowed(0, 1) and allowed(0, 3) and allowed(1, 4) and allowed(4, 8)
    assert not allowed(0, 2)  # one iteration: 6 / 1 iterations cannot be shared evenly
    assert not allowed(1, 6)  # five
    with pytest.raises(ValueError, match="do not cover the layer scan's 8 iterations"):
        check_ranges(((0, 4), (5, 8)), 8)


@dataclasses.dataclass
class _FakeChoice:
    stage_layers: tuple
    logical_shapes: tuple
    timings: dict
    name: str = ""


def _cut(name, lengths, shapes, first=1):
    """A fake stage DP choice: stages holding `lengths` iterations each on `shapes`."""
    layers, start = [], first
    for n in lengths:
        layers.append((start, start + n))
        start += n
    return _FakeChoice(tuple(layers), tuple(shapes), {"layer ILPs solved": 1}, name)


def test_a_cut_mixing_piece_lengths_is_redone_with_one_length():
    """The DP allows each stage's share of the stack on its own, so it may mix lengths
    (llama-70B on 32 H100s: 10/10/20/20/20 of 80 iterations); the search re-runs it with
    each of those lengths as the only share and keeps the fastest that plans."""
    from autopar.search import _stack

    assert _even_shares(80, 8, share=20)(1, 21) and not _even_shares(80, 8, share=20)(1, 11)
    mixed = _FakeChoice(((0, 11), (11, 21), (21, 41), (41, 61), (61, 82)), ((8,),) * 5,
                        {"layer ILPs solved": 5})
    assert _stack.piece_lengths(mixed, 80) == {10, 20}
    tens = _cut("tens", [10] * 8, [(4,)] * 8)
    twenties = _cut("twenties", [20] * 4, [(8,)] * 4)
    latency = {"tens": 2.0, "twenties": 3.0}
    latency_of = lambda choice: latency[choice.name]  # noqa: E731
    asked = []

    def rerun(*, allowed, range_shapes):
        assert range_shapes is None
        share = 10 if allowed(1, 11) else 20
        asked.append(share)
        return tens if share == 10 else twenties

    kept = _stack.one_layout(mixed, 80, 32, 4, rerun, latency_of)
    assert kept.name == "tens" and asked == [10, 20]
    assert kept.timings["layer ILPs solved"] == 5 + 1 + 1  # every run's search counted
    latency["tens"] = 4.0
    assert _stack.one_layout(mixed, 80, 32, 4, rerun, latency_of).name == "twenties"
    # A uniform cut is kept as it is.
    assert _stack.one_layout(tens, 80, 32, 4, rerun, latency_of) is tens


def test_a_cut_mixing_mesh_shapes_is_redone_with_one_shape():
    """llama-70B on 32 H100s: four stages of 20 iterations on logical meshes (2, 4) and
    (4, 2); a stacked leaf held in pieces needs one shape, so the DP is re-run with each
    as the only shape of the stages holding the stack (the others keep any shape)."""
    from autopar.search import _stack

    mixed = _cut("mixed", [20] * 4, [(2, 4), (4, 2), (2, 4), (4, 2)])
    fixed = {(2, 4): _cut("24", [20] * 4, [(2, 4)] * 4),
             (4, 2): _cut("42", [20] * 4, [(4, 2)] * 4)}
    latency = {"24": 5.0, "42": 4.0}
    latency_of = lambda choice: latency[choice.name]  # noqa: E731
    asked = []

    def rerun(*, allowed, range_shapes):
        assert allowed(1, 21) and not allowed(1, 11)
        (shape,) = range_shapes(15, 30)
        assert range_shapes(0, 1) is None and range_shapes(81, 82) is None
        assert range_shapes(0, 2) == [shape]
        asked.append(shape)
        return fixed[shape]

    assert _stack.one_layout(mixed, 80, 32, 4, rerun, latency_of).name == "42"
    assert asked == [(2, 4), (4, 2)]

    def nothing_fits(*, allowed, range_shapes):
        raise ValueError("no stage fits")

    with pytest.raises(ValueError, match="no stage fits"):
        _stack.one_layout(mixed, 80, 32, 4, nothing_fits, latency_of)


def test_pieces_of_different_lengths_are_refused_with_the_fix():
    # Should the DP mix shares (2 + 4 of 6 layers), the search says what to pass instead.
    choice = SimpleNamespace(stage_layers=((0, 3), (3, 8)), logical_shapes=((2, 2), (2, 2)))
    with pytest.raises(ValueError, match="pass num_stages= a divisor of 6"):
        stack_ranges(choice, 6)


@pytest.mark.extended  # minutes of ILPs; the fixed two-stage plan test is default
def test_auto_pipelines_a_scanned_gpt_across_slow_hosts():
    # Two V100 hosts (p3.16xlarge: a slow link between hosts): with the stages not fixed,
    # the search (method "auto") picks one stage per host and cuts the stack in halves.
    cfg = dataclasses.replace(gpt.GPTConfig(gpt.PADDED_VOCAB, 1024, 2048, 8, 16),
                              scan_layers=True)
    step, optimizer = _step(cfg)
    plan = autopar.plan(
        step, gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, 32),
        cluster=autopar.Cluster.from_profile("p3.16xlarge-v100", num_hosts=2),
        num_microbatches=4, cache=False,
    )
    assert plan.num_stages == 2 and plan.scan_ranges == ((0, 4), (4, 8))
    for path, pieces in plan.split_inputs().items():
        assert [(i.shape[0], i.stage) for i in pieces] == [(4, 0), (4, 1)], path


def test_scanned_stack_cut_into_stages_under_the_auto_schedule():
    """schedule="auto" (the benchmarks' default) over a scanned stack: the stages are
    re-planned on the stack cut into slices with the memory of the schedule it picked (it
    was passed "auto" itself, and failed: "unknown schedule 'auto'")."""
    step, optimizer = _step(SMALL)
    plan = autopar.plan(
        step, gpt.abstract_state(SMALL, optimizer), gpt.abstract_batch(SMALL, BATCH),
        cluster=CPU, cache=False, **{**PIPELINE, "schedule": "auto"},
    )
    assert plan.num_stages == 2 and plan.scan_ranges == ((0, 2), (2, 4))
    assert plan.schedule in ("1f1b", "zero_bubble")
