"""The context-parallel and expert-parallel formulas (`cost/_context.py`, `_experts.py`)
against hand computation on the DGX H100 profile (NVLink 450 GB/s, 5 us a step; one
50 GB/s, 10 us InfiniBand rail per GPU)."""

from __future__ import annotations

import pytest

from autopar.cluster import Cluster
from autopar.cluster._mesh import LogicalMesh
from autopar.cost import (
    all_gather_kv_time,
    all_to_all_time,
    causal_attention_flops,
    causal_imbalance,
    check_load_balanced_sequence,
    check_ulysses_heads,
    context_parallel_buffer_bytes,
    context_parallel_time,
    dispatch_bytes,
    expert_flops,
    expert_weight_bytes,
    kv_block_bytes,
    moe_all_to_all_time,
    overlap_saving,
    ring_attention_time,
    ring_compute_fraction,
    routed_activation_bytes,
    ulysses_time,
    zigzag_swap_time,
)

NVLINK_BW, NVLINK_LAT = 450e9, 5e-6
RAIL_BW, RAIL_LAT = 50e9, 10e-6


def _h100(hosts: int) -> Cluster:
    return Cluster.from_profile("dgx-h100").with_shape(hosts, 8)


def _mesh(n: int) -> LogicalMesh:
    return LogicalMesh.create((n,), range(n), ("cp",))


def test_kv_block_and_causal_balance():
    # Llama 3 405B at 128k: 1 K/V head per tp-8 rank, head 128, bf16, cp 16: 4 MiB.
    assert kv_block_bytes(1, 131072, 16, 1, 128, 2) == 2 * 8192 * 128 * 2
    assert causal_imbalance(4, load_balanced=False) == pytest.approx(1.75)
    assert causal_imbalance(4) == 1.0
    assert causal_imbalance(1, load_balanced=False) == 1.0
    # 4096 tokens, 32 heads of 128, causal, one device: 4 s^2 h d / 2
    assert causal_attention_flops(1, 4096, 32, 128) == 4 * 4096**2 * 32 * 128 / 2
    # cp 4 unbalanced: the last rank does (4 - 1/2) of cp/2 mean blocks
    assert causal_attention_flops(1, 4096, 32, 128, cp=4, load_balanced=False) == (
        4 * 4096**2 * 32 * 128 / 4 / 2 * 1.75)


def test_load_balanced_sequence_rule():
    check_load_balanced_sequence(4096, 8)
    with pytest.raises(ValueError, match=r"2\*cp = 16 equal chunks.*seq_len=4104"):
        check_load_balanced_sequence(4104, 8)


def test_all_gather_kv_inside_a_host():
    block = 4 * 2**20
    forward, backward = all_gather_kv_time(block, _h100(1), _mesh(8), "cp")
    expected = 7 * NVLINK_LAT + 7 / 8 * (8 * block) / NVLINK_BW
    assert forward == pytest.approx(expected)
    assert backward == pytest.approx(expected)  # reduce-scatter of the gradients


def test_ring_attention_overlaps_compute():
    block = 4 * 2**20
    hop = NVLINK_LAT + block / NVLINK_BW  # one send/recv inside a host
    mesh, cluster = _mesh(8), _h100(1)
    # compute-bound: 8 ms of attention, 1 ms a step > one hop (9.3 us)
    forward, backward = ring_attention_time(8e-3, block, cluster, mesh, "cp")
    assert forward == pytest.approx(7 * 1e-3 + 1e-3)
    assert backward == pytest.approx(7 * 2e-3 + 2e-3 + hop)
    # communication-bound: 8 us of attention, 1 us a step < one hop
    forward, backward = ring_attention_time(8e-6, block, cluster, mesh, "cp")
    assert forward == pytest.approx(7 * hop + 1e-6)
    assert backward == pytest.approx(7 * 2 * hop + 2e-6 + hop)
    exposed = context_parallel_time(
        "ring", attention_compute=8e-6, batch=1, seq_len=8 * 8192, num_heads=16,
        num_kv_heads=1, head_dim=128, itemsize=2, cluster=cluster, mesh=mesh, axis="cp")
    assert exposed[0] == pytest.approx(7 * hop + 1e-6 - 8e-6)


def test_ring_across_hosts_takes_the_rail():
    # 16 devices on 2 hosts, one cp group: a hop crossing hosts runs over the rail
    block = 2**20
    forward, _ = ring_attention_time(0.0, block, _h100(2), _mesh(16), "cp")
    assert forward == pytest.approx(15 * (RAIL_LAT + block / RAIL_BW))


def test_ring_skips_the_masked_blocks_and_swaps_halves():
    # cp = 4, chunks of c tokens: own block 4c^2 + 3 half blocks 2c^2, of 16c^2 dense
    assert ring_compute_fraction(4) == pytest.approx((4 + 3 * 2) / 16)
    assert ring_compute_fraction(1) == 1.0
    # a 4 MiB share: its two 2 MiB halves, one send/recv each, inside a host
    share = 4 * 2**20
    assert zigzag_swap_time(share, _h100(1), _mesh(8), "cp") == pytest.approx(
        2 * (NVLINK_LAT + share / 2 / NVLINK_BW))


def test_ulysses_four_all_to_alls_and_heads_rule():
    b, s, h, kv, d, cp = 1, 8 * 4096, 16, 8, 128, 8
    per = b * s / cp * h * d * 2  # q (and the output): 16 heads; k, v: 8 heads
    total = 2 * per + 2 * per / 2
    one = 7 * NVLINK_LAT + 7 / 8 * (total / 4) / NVLINK_BW
    forward, backward = ulysses_time(b, s, h, kv, d, 2, _h100(1), _mesh(cp), "cp")
    assert forward == pytest.approx(4 * one)
    assert backward == forward
    with pytest.raises(ValueError, match=r"12 query head\(s\).*do not divide by 8"):
        check_ulysses_heads(12, 4, 8)
    check_ulysses_heads(16, 2, 8)  # 2 K/V heads replicated 4-fold


def test_buffers_by_algorithm():
    kw = dict(batch=1, seq_len=65536, cp=8, num_heads=8, num_kv_heads=1, head_dim=128,
              itemsize=2)
    block = kv_block_bytes(1, 65536, 8, 1, 128, 2)
    assert context_parallel_buffer_bytes("all_gather", **kw) == 8 * block
    assert context_parallel_buffer_bytes("ring", **kw) == 2 * block
    assert context_parallel_buffer_bytes("ulysses", **kw) == 65536 / 8 * (16 + 16) * 128 * 2
    with pytest.raises(ValueError, match="unknown context-parallel algorithm 'zigzag'"):
        context_parallel_buffer_bytes("zigzag", **kw)


def test_moe_dispatch_inside_and_across_hosts():
    nbytes = dispatch_bytes(4096, 8, 7168, 2)
    assert nbytes == 4096 * 8 * 7168 * 2
    assert dispatch_bytes(4096, 8, 7168, 2, imbalance=1.25) == nbytes * 1.25
    inside = all_to_all_time(nbytes, _h100(1), _mesh(8), "cp")
    assert inside == pytest.approx(7 * NVLINK_LAT + 7 / 8 * nbytes / NVLINK_BW)
    # ep 64 over 8 hosts: 7 blocks of 1/64 over NVLink, 56 over each GPU's rail
    across = all_to_all_time(nbytes, _h100(8), _mesh(64), "cp")
    assert across == pytest.approx(7 * NVLINK_LAT + 7 / 64 * nbytes / NVLINK_BW
                                   + 56 * RAIL_LAT + 56 / 64 * nbytes / RAIL_BW)
    forward, backward = moe_all_to_all_time(4096, 8, 7168, 2, _h100(8), _mesh(64), "cp")
    assert forward == backward == pytest.approx(2 * across)
    with pytest.raises(ValueError, match="token imbalance.*>= 1"):
        dispatch_bytes(4096, 8, 7168, 2, imbalance=0.5)


def test_expert_compute_memory_and_overlap():
    # Mixtral 8x7B, 4096 tokens, top-2, SwiGLU: 2 t k h f 3
    assert expert_flops(4096, 2, 4096, 14336) == 2 * 4096 * 2 * 4096 * 14336 * 3
    assert expert_flops(4096, 2, 4096, 14336, gated=False) == 2 * 4096 * 2 * 4096 * 14336 * 2
    assert routed_activation_bytes(1024, 2, 4096, 14336, 2) == (
        1024 * 2 * (2 * 4096 + 3 * 14336) * 2)
    assert expert_weight_bytes(8, 4096, 14336, 2, ep=4, etp=2) == 2 * 3 * 4096 * 14336 / 2 * 2
    with pytest.raises(ValueError, match=r"num_experts % ep must be 0"):
        expert_weight_bytes(8, 4096, 14336, 2, ep=3)
    assert overlap_saving(3e-3, 5e-3) == 3e-3
    assert overlap_saving(3e-3, 2e-3, efficiency=0.5) == 1e-3
    with pytest.raises(ValueError, match=r"overlap efficiency must be in \[0, 1\]"):
        overlap_saving(1.0, 1.0, efficiency=1.5)
