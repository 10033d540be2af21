"""The Megatron grid prices a CP algorithm's attention core as autopar's planner prices
the same algorithm: the share of the dense core each algorithm computes under causal load
balancing (by hand and by counting blocks), `context_terms` against hand computation for
each algorithm, and the grid's core (its local trace scaled, `local_attention_core`)
against autopar's ring twins on the whole sequence for the same ring."""

from __future__ import annotations

import dataclasses
import math

import optax
import pytest

from autopar.cluster import Cluster, LogicalMesh
from autopar.cost import (
    all_gather_compute_fraction,
    context_compute_fraction,
    context_core_time,
    context_parallel_time,
    ring_compute_fraction,
)
from autopar.graph import trace
from autopar.intra._attention_roles import attention_components
from autopar.intra._ring_strategies import ring_core_seconds
from autopar.manual import AttentionShape, MegatronConfig, context_args
from autopar.manual._context_experts import (
    LocalCore,
    context_terms,
    layer_graphs,
    local_attention_core,
    stage_cp_mesh,
)
from examples import llama


def _blocks_computed(cp: int, algorithm: str) -> int:
    """c x c blocks one zig-zag rank computes of its 2 x 2cp dense share, counted: rank i
    holds query chunks i and 2cp-1-i. All-gather: each chunk against the keys up to its
    end. Ring: at its own step the 2 x 2 block of its own chunks whole, at each other
    step the blocks of the held K/V chunks not wholly masked (a query chunk q sees a key
    chunk k unless k > q)."""
    counts = set()
    for rank in range(cp):
        mine = (rank, 2 * cp - 1 - rank)
        if algorithm == "all_gather":
            counts.add(sum(q + 1 for q in mine))
            continue
        n = 4
        for other in range(cp):
            if other != rank:
                keys = (other, 2 * cp - 1 - other)
                n += sum(1 for q in mine for k in keys if k <= q)
        counts.add(n)
    assert len(counts) == 1  # load balanced: every rank the same
    return counts.pop()


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_fractions_count_the_blocks_each_algorithm_computes(cp):
    dense = 2 * 2 * cp
    assert ring_compute_fraction(cp) == pytest.approx(_blocks_computed(cp, "ring") / dense)
    assert all_gather_compute_fraction(cp) == pytest.approx(
        _blocks_computed(cp, "all_gather") / dense)
    assert context_compute_fraction("ring", cp) == ring_compute_fraction(cp)
    assert context_compute_fraction("all_gather", cp) == all_gather_compute_fraction(cp)
    assert context_compute_fraction("ulysses", cp) == 1.0


def test_core_time_by_hand():
    # a 10 ms local piece, cp = 4: ring 4 x 5/8, all-gather 4 x 9/16, Ulysses 4 x 1
    assert context_core_time(10e-3, "ring", 4) == pytest.approx(25e-3)
    assert context_core_time(10e-3, "all_gather", 4) == pytest.approx(22.5e-3)
    assert context_core_time(10e-3, "ulysses", 4) == pytest.approx(40e-3)
    assert context_core_time(10e-3, "all_gather", 1) == 10e-3
    with pytest.raises(ValueError, match="unknown context-parallel algorithm 'zigzag'"):
        context_core_time(1.0, "zigzag", 2)
    with pytest.raises(ValueError, match="local_core must be >= 0"):
        context_core_time(-1.0, "ring", 2)


ATTENTION = AttentionShape(num_heads=8, num_kv_heads=8, head_dim=128, num_layers=4)


@pytest.mark.parametrize("algorithm,factor", [("ring", 2.5), ("all_gather", 2.25),
                                              ("ulysses", 4.0)])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_context_terms_charge_the_algorithms_core(algorithm, factor, recompute):
    cluster = Cluster.from_profile("dgx-h100").with_shape(1, 8)
    config = MegatronConfig(dp=1, tp=2, cp=4, cp_algorithm=algorithm, recompute=recompute,
                            num_microbatches=2)
    # one layer's local core: forward dots 1 ms, forward scale/mask/softmax 0.5 ms,
    # backward 3 ms; factor = cp x the algorithm's fraction (4 x 5/8, 4 x 9/16, 4 x 1)
    core = LocalCore(1e-3, 0.5e-3, 3e-3)
    terms = context_terms(config, cluster, ATTENTION, 2, 8192, 3, 0, core)
    passes = 1.5e-3 * (2 if recompute == "selective" else 1) + 3e-3
    assert terms.compute == pytest.approx(3 * (factor - 1) * passes)
    # the ring overlaps its hops with the forward's dots at the ring's price, 2.5 ms
    fwd, bwd = context_parallel_time(
        algorithm, attention_compute=factor * 1e-3, batch=2, seq_len=8192, num_heads=4,
        num_kv_heads=4, head_dim=128, itemsize=2, cluster=cluster,
        mesh=stage_cp_mesh(config, 0), axis="context")
    recomputed = fwd if recompute == "selective" else 0.0
    assert terms.communication == pytest.approx(3 * (fwd + bwd + recomputed))


# A Llama whose CP-local sequence (512 / 4 = 128) is a fused attention's smallest and no
# other dimension: hidden 256, 8 heads of 32, 2 K/V heads.
CFG = llama.LlamaConfig(512, 512, 256, 1, 8, 2, 352, dtype="bfloat16")


def _flat(cluster: Cluster) -> Cluster:
    """`cluster` with a linear roofline: every node FLOP-bound (unbounded memory
    bandwidth), one GEMM efficiency, no kernel launches. The grid prices a CP rank's
    core from its local piece scaled by cp, autopar's ring twins price the rank's share
    itself; on such a cluster the two are the same arithmetic, so they agree exactly
    (on a real profile they differ by GEMM efficiency at the two shapes and launches)."""
    return dataclasses.replace(cluster, hbm_bandwidth=1e30, gemm_efficiency=None,
                               gemm_shapes=None, kernel_overhead=0.0)


@pytest.mark.parametrize("per_layer", [False, True])
def test_grid_core_matches_autopar_ring_on_the_same_ring(per_layer):
    # per_layer: layer marks, each attention priced on its layer's sub-graph (as the
    # layer-wise planners, the grid's pipeline path and autopar's, price it)
    cfg = dataclasses.replace(CFG, layer_markers=per_layer)
    cp, tp, batch = 4, 2, 2
    cluster = _flat(Cluster.from_profile("dgx-h100").with_shape(1, 8))
    opt = optax.adamw(1e-3)
    step = llama.make_train_step(cfg, opt)
    args = (llama.abstract_state(cfg, opt), llama.abstract_batch(cfg, batch))
    # the grid: the step at one CP rank's shapes on its (dp·cp, tp) mesh
    local = trace(step, *context_args(args, (1,), cp), batch_argnums=(1,))
    grid_mesh = LogicalMesh.create((cp, tp), range(8), ("data", "model"))
    core = local_attention_core(local, cluster, grid_mesh, cfg.seq_len // cp, per_layer)
    assert core.forward_dots > 0 and core.forward_other > 0 and core.backward > 0
    grid = context_core_time(core.forward + core.backward, "ring", cp)
    # autopar: the whole sequence, queries over a context axis of cp, heads over tp
    full = trace(step, *args, batch_argnums=(1,))
    if per_layer:
        full = next(g for g in layer_graphs(full) if attention_components(g, cfg.seq_len))
    mesh = LogicalMesh.create((cp, tp), range(8), ("context", "model"))
    ring = ring_core_seconds(full, cluster, mesh, cfg.seq_len, "context")
    assert grid == pytest.approx(ring, rel=1e-6)
    # the element-wise part is a real share of it (what the grid once left at 1/cp)
    assert core.forward_other / core.forward > 0.05
    assert math.isclose(cp * ring_compute_fraction(cp), 2.5)
