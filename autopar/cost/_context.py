"""Context parallelism (CP): what splitting attention's sequence over cp devices costs.

In: plain numbers (micro-batch sequences, sequence length, heads, head size, bytes per
element, the CP degree) and, for seconds, the `Cluster` plus a `LogicalMesh` axis that is
the CP group (the collectives of `_collective.py` price it: NVLink inside a host, each
device's rail across hosts). Out: bytes and seconds per layer, per microbatch, per device.

Three algorithms, each of which keeps the queries of 1/cp of the sequence per device and
must bring every device the keys and values of the whole sequence (REFERENCES.md,
"Context parallelism"):

| algorithm | forward communication | backward communication | K/V buffer |
|---|---|---|---|
| all-gather (Llama 3) | all-gather K, V | reduce-scatter dK, dV | whole sequence's K, V |
| ring | cp − 1 send/recv of a K/V block, overlapped | cp − 1 of K/V + dK/dV blocks | 2 blocks |
| Ulysses | 4 all-to-all (q, k, v in; output out) | 4 all-to-all | heads/cp of everything |

Causal attention does half the work of full attention; split contiguously, rank i of cp
holds the (i + 1)-th triangle row and works (i + ½) blocks, so the last rank waits longest;
zig-zag load balancing (2·cp chunks, rank i holding chunks i and 2·cp − 1 − i, as
Megatron-LM's CP and Llama 3 do) evens it (`causal_imbalance`).

Sources: Megatron-Core's context parallel guide (docs.nvidia.com/megatron-core, "context
parallelism": ring P2P exchange of K/V overlapped with attention, 2·cp chunks for causal
load balance, activation memory / cp); Liu et al. 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context" (sec. 3: cp − 1 rotations, each overlapped with
one block's attention; a host holds two K/V blocks, the one it computes on and the one
it receives); Jacobs et al. 2023, "DeepSpeed Ulysses" (sec. 3: all-to-all on q, k, v before
attention and one on the output after it, heads divisible by the sequence-parallel
degree); Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.2 (all-gather of K and
V in the forward, reduce-scatter of their gradients in the backward, 2·cp chunks).
"""

from __future__ import annotations

from typing import Literal, get_args

from autopar.cluster._cluster import Cluster
from autopar.cluster._mesh import LogicalMesh
from autopar.cost._collective import collective_time

CPAlgorithm = Literal["all_gather", "ring", "ulysses"]
CP_ALGORITHMS: tuple[str, ...] = get_args(CPAlgorithm)

# K and V: two tensors in every K/V block.
KV_TENSORS = 2
# Ulysses' all-to-alls per attention pass: q, k and v from sequence- to head-split before
# attention, the output back after it (Jacobs et al. 2023, sec. 3.1, Fig. 2).
ULYSSES_ALL_TO_ALLS = 4


def kv_block_bytes(batch: int, seq_len: int, cp: int, kv_heads: int, head_dim: int,
                   itemsize: float) -> float:
    """Bytes of one device's K and V block: ``2 · batch · seq_len/cp · kv_heads · head_dim
    · itemsize``.

    **Arguments:** `batch` sequences per device, the full `seq_len`, the CP degree `cp`,
    the K/V heads on this device (after tensor parallelism: ``num_kv_heads / tp``, at
    least one), `head_dim` and bytes per element `itemsize`.

    **Example:** Llama 3 405B at 131,072 tokens, cp = 16, 8 K/V heads over tp = 8 (1 per
    device), head 128, bf16: ``2 · 8192 · 1 · 128 · 2`` = 4 MiB.
    """
    _check_positive(batch=batch, seq_len=seq_len, cp=cp, kv_heads=kv_heads,
                    head_dim=head_dim, itemsize=itemsize)
    _check_divides("seq_len", seq_len, cp)
    return KV_TENSORS * batch * seq_len / cp * kv_heads * head_dim * itemsize


def check_load_balanced_sequence(seq_len: int, cp: int) -> None:
    """Raise ValueError unless `seq_len` splits into 2·cp equal chunks (zig-zag load
    balancing: rank i holds chunks i and 2·cp − 1 − i; Megatron-LM asserts the same)."""
    _check_positive(seq_len=seq_len, cp=cp)
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism cp={cp} with load balancing splits the sequence into "
            f"2*cp = {2 * cp} equal chunks, but seq_len={seq_len} is not divisible by "
            f"{2 * cp}; choose a cp with seq_len % (2*cp) == 0 or pad the sequence"
        )


def causal_imbalance(cp: int, load_balanced: bool = True) -> float:
    """The slowest CP rank's causal attention work over the mean rank's.

    Split into cp contiguous chunks, rank i computes i full blocks and half a diagonal one
    (i + ½ of them), the mean is cp/2, so the factor is ``(cp − ½) / (cp/2) = 2 − 1/cp``.
    With 2·cp chunks, rank i holding chunks i and 2·cp − 1 − i (zig-zag), every rank
    computes ``(i + ½) + (2·cp − 1 − i + ½) = 2·cp`` half-size block units: 1.

    **Example:** ``causal_imbalance(4, False) == 1.75``; ``causal_imbalance(4) == 1.0``.
    """
    _check_positive(cp=cp)
    return 1.0 if load_balanced or cp == 1 else 2.0 - 1.0 / cp


def causal_attention_flops(batch: int, seq_len: int, num_heads: int, head_dim: int,
                           cp: int = 1, causal: bool = True, load_balanced: bool = True
                           ) -> float:
    """Forward FLOPs of the attention core (``q·kᵀ`` and ``p·v``) on the slowest CP rank.

    ``4 · batch · seq_len² · num_heads · head_dim / cp`` for full attention (two GEMMs of
    2·s·s·d each per head), half of it with a causal mask, times `causal_imbalance` on the
    slowest rank. `num_heads` are the query heads on this device (after tensor
    parallelism). The backward does twice the forward's (dq, dk, dv: three products of the
    same size, plus the recomputed scores flash attention needs are left to the caller).

    **Example:** one sequence of 4096 tokens, 32 heads of 128, causal, one device:
    ``4 · 4096² · 32 · 128 / 2`` = 137.4 GFLOP.
    """
    _check_positive(batch=batch, seq_len=seq_len, num_heads=num_heads, head_dim=head_dim,
                    cp=cp)
    full = 4.0 * batch * seq_len * seq_len * num_heads * head_dim / cp
    if not causal:
        return full
    return full / 2 * causal_imbalance(cp, load_balanced)


def all_gather_kv_time(kv_block: float, cluster: Cluster, mesh: LogicalMesh,
                       axis: str | tuple[str, ...]) -> tuple[float, float]:
    """Seconds of the all-gather CP algorithm's communication in one layer's attention:
    (forward, backward).

    The forward all-gathers K and V over the CP group (the gathered tensor is cp blocks
    of `kv_block` bytes, `kv_block_bytes`); the backward reduce-scatters their gradients,
    the same bytes (Dubey et al. 2024, sec. 3.3.2). Not overlapped: attention waits for
    the whole K/V (Llama 3 accepts it because with GQA the K/V are small against the
    queries).

    **Arguments:** `kv_block` bytes per device; `cluster`, `mesh` and the CP `axis` as in
    `collective_time`.
    """
    cp = mesh.axis_size(axis if isinstance(axis, str) else tuple(axis))
    gathered = kv_block * cp
    return (collective_time("all_gather", gathered, cluster, mesh, axis),
            collective_time("reduce_scatter", gathered, cluster, mesh, axis))


def all_gather_kv_buffer_bytes(kv_block: float, cp: int) -> float:
    """Bytes the all-gather algorithm holds per device during one layer's attention: the
    whole sequence's K and V, ``cp · kv_block`` (and as much for their gradients in the
    backward)."""
    _check_positive(cp=cp)
    return kv_block * cp


def ring_step_time(compute_step: float, comm_step: float) -> float:
    """One overlapped ring step: a block's attention while the next block travels,
    ``max(compute_step, comm_step)``."""
    if compute_step < 0 or comm_step < 0:
        raise ValueError(
            f"ring_step_time needs seconds >= 0, got {compute_step} and {comm_step}"
        )
    return max(compute_step, comm_step)


def ring_attention_time(attention_compute: float, kv_block: float, cluster: Cluster,
                        mesh: LogicalMesh, axis: str | tuple[str, ...]
                        ) -> tuple[float, float]:
    """Seconds of one layer's ring attention on one device: (forward, backward), compute
    and communication together.

    The attention core's per-device time `attention_compute` (forward; load balanced, so
    every rank and every step does 1/cp of it) runs in cp steps; during each of the first
    cp − 1 the next K/V block (`kv_block` bytes) moves one hop round the ring
    (``collective_time("send_recv", kv_block)``), so the forward is
    ``(cp − 1) · max(c, t) + c`` with c = attention_compute / cp: the last step's compute
    is not overlapped (Liu et al. 2023, sec. 3; Megatron-Core's P2P CP). The backward
    computes twice the forward per step and passes K/V and their partial gradients
    (twice the bytes) each step, plus the final dK/dV hop home, which nothing overlaps:
    ``(cp − 1) · max(2c, 2t) + 2c + t``. Returns the forward and backward attention time
    including the compute: subtract `attention_compute` (and twice it) for the
    communication left exposed.

    **Example:** cp = 4, c = 1 ms per step, t = 0.4 ms per hop: forward
    ``3 · 1 + 1`` = 4 ms, all communication hidden.
    """
    if attention_compute < 0:
        raise ValueError(f"ring_attention_time: attention_compute must be >= 0, got "
                         f"{attention_compute}")
    cp = mesh.axis_size(axis if isinstance(axis, str) else tuple(axis))
    if cp == 1:
        return attention_compute, 2 * attention_compute
    compute_step = attention_compute / cp
    hop = collective_time("send_recv", kv_block, cluster, mesh, axis)
    forward = (cp - 1) * ring_step_time(compute_step, hop) + compute_step
    backward = (cp - 1) * ring_step_time(2 * compute_step, 2 * hop) + 2 * compute_step + hop
    return forward, backward


def ring_compute_fraction(cp: int) -> float:
    """The share of the dense score matmuls a zig-zag ring computes under a causal mask:
    ``(cp + 1) / (2 · cp)``.

    With 2·cp chunks of c tokens, a rank's dense share is its 2c query rows by all
    2·cp·c keys, ``4·cp·c²``; the ring computes its own block whole (``4c²``, masked
    inside) and half a block at each of the other cp − 1 steps (``2c²``), so
    ``(4 + 2(cp − 1)) / (4 cp)``. **Example:** cp = 4: 5/8."""
    _check_positive(cp=cp)
    return (cp + 1) / (2 * cp)


def all_gather_compute_fraction(cp: int) -> float:
    """The share of the dense score work the all-gather algorithm computes under a causal
    mask: ``(2·cp + 1) / (4·cp)``.

    With 2·cp chunks of c tokens, rank i holds query chunks i and j = 2·cp − 1 − i; its
    dense share is those 2c rows against all 2·cp·c gathered keys, ``4·cp·c²``. Each
    chunk attends to the keys up to its own end, its diagonal block whole and masked
    inside (Llama 3's all-gather CP, Dubey et al. 2024, sec. 3.3.2; TransformerEngine's
    ``AttnFuncWithCPAndKVAllGather`` runs each chunk against ``K[:(chunk + 1)·c]``):
    chunk i computes ``(i + 1)·c²``, chunk j ``(2·cp − i)·c²``, together
    ``(2·cp + 1)·c²`` whatever i, so every rank does the same. Against the ring
    (`ring_compute_fraction`, ``(2·cp + 2)/(4·cp)``) it skips one more c² block: the ring
    computes its own chunks' block whole, chunk i's queries against chunk j's keys
    (wholly masked) included. **Example:** cp = 4: 9/16."""
    _check_positive(cp=cp)
    return (2 * cp + 1) / (4 * cp)


def context_compute_fraction(algorithm: CPAlgorithm, cp: int) -> float:
    """The share of a CP rank's dense attention core (its s/cp queries against all s
    keys, every score element) that `algorithm` computes under causal load balancing:
    the ring `ring_compute_fraction`, all-gather `all_gather_compute_fraction`, Ulysses
    1 (the rank runs the local kernel on the whole sequence for heads/cp, and the traced
    kernel, an einsum with a mask, computes the whole square); 1 at cp = 1."""
    check_algorithm(algorithm)
    _check_positive(cp=cp)
    if cp == 1 or algorithm == "ulysses":
        return 1.0
    if algorithm == "all_gather":
        return all_gather_compute_fraction(cp)
    return ring_compute_fraction(cp)


def context_core_time(local_core: float, algorithm: CPAlgorithm, cp: int) -> float:
    """Seconds of a CP rank's attention core (dots and the score-sized element-wise work:
    scale, mask, softmax and their gradients) from those of the piece one CP rank's
    local trace holds, `local_core` (its s/cp queries against its own s/cp keys, priced
    node by node as the planner prices them): ``local_core · cp ·
    context_compute_fraction(algorithm, cp)``.

    The rank's dense share is cp times the local piece (s/cp × s against s/cp × s/cp
    score elements per head; every dot's FLOPs and every element-wise node's bytes and
    FLOPs scale with the keys), of which `algorithm` computes its fraction. The local
    piece's per-kernel launch overheads and GEMM efficiency are scaled with it (they are
    a small part of a core this size). **Example:** ring, cp = 4, a 10 ms local core:
    ``10 · 4 · 5/8`` = 25 ms."""
    if local_core < 0:
        raise ValueError(f"context_core_time: local_core must be >= 0, got {local_core}")
    return local_core * cp * context_compute_fraction(algorithm, cp)


def zigzag_swap_time(tensor_bytes: float, cluster: Cluster, mesh: LogicalMesh,
                     axis: str | tuple[str, ...]) -> float:
    """Seconds to swap one device's contiguous share of a tensor (`tensor_bytes`) into
    zig-zag order or back: its two halves each go to their rank in one send/recv
    (``2 · collective_time("send_recv", tensor_bytes / 2)``), as the lowering does
    (`autopar.lower._ring_lowering.to_zigzag`) when the rest of the model keeps the
    natural order."""
    if tensor_bytes < 0:
        raise ValueError(f"zigzag_swap_time: tensor_bytes must be >= 0, got {tensor_bytes}")
    return 2 * collective_time("send_recv", tensor_bytes / 2, cluster, mesh, axis)


def ring_kv_buffer_bytes(kv_block: float) -> float:
    """Bytes of K/V a ring holds per device: the block it computes on and the one it
    receives, ``2 · kv_block`` (Liu et al. 2023, sec. 3); the backward adds as much for
    the travelling dK/dV."""
    return 2 * kv_block


def zigzag_swap_buffer_bytes(tensor_bytes: float) -> float:
    """Bytes a zig-zag swap holds per device beside the tensor it swaps: the two halves it
    receives, concatenated into the zig-zag share, one more copy of the device's share
    (``tensor_bytes``; `autopar.lower._ring_lowering.to_zigzag`, `from_zigzag`)."""
    if tensor_bytes < 0:
        raise ValueError(
            f"zigzag_swap_buffer_bytes: tensor_bytes must be >= 0, got {tensor_bytes}")
    return float(tensor_bytes)


def ring_attention_buffer_bytes(kv_block: float, swap_bytes: float,
                                backward: bool = False) -> float:
    """Bytes one layer's ring attention holds per device beyond its own inputs, in one
    direction: the K/V blocks in flight (`ring_kv_buffer_bytes`: the block computed on
    and the block received; the backward passes dK/dV blocks beside them, twice the
    bytes) plus the zig-zag swap's copy of the largest swapped tensor, `swap_bytes` (Q in
    the forward, dO in the backward: `zigzag_swap_buffer_bytes`; the swapped K and V are
    the ring's first block).

    ``kv_ring · 2 · kv_block + swap_bytes``, kv_ring = 2 backward, 1 forward.

    **Example:** K/V block 4 MiB, Q share 32 MiB: forward ``2 · 4 + 32`` = 40 MiB,
    backward ``2 · 2 · 4 + 32`` = 48 MiB.
    """
    if kv_block < 0:
        raise ValueError(f"ring_attention_buffer_bytes: kv_block must be >= 0, got "
                         f"{kv_block}")
    travelling = 2 if backward else 1  # K/V, and in the backward their gradients
    return travelling * ring_kv_buffer_bytes(kv_block) + zigzag_swap_buffer_bytes(swap_bytes)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """Raise ValueError unless Ulysses can split the (per tensor-parallel rank) heads over
    cp: ``num_heads % cp == 0``; K/V heads fewer than cp are replicated (as DeepSpeed
    Ulysses does for GQA), so they need ``num_kv_heads % cp == 0`` or
    ``cp % num_kv_heads == 0``."""
    _check_positive(num_heads=num_heads, num_kv_heads=num_kv_heads, cp=cp)
    if num_heads % cp:
        raise ValueError(
            f"Ulysses context parallelism moves attention heads over cp={cp} devices, but "
            f"{num_heads} query head(s) per tensor-parallel rank do not divide by {cp}; "
            "choose cp dividing the heads, a smaller tp, or the ring / all-gather algorithm"
        )
    if num_kv_heads % cp and cp % num_kv_heads:
        raise ValueError(
            f"Ulysses with cp={cp} cannot split or replicate {num_kv_heads} K/V head(s) "
            "evenly; choose cp dividing the K/V heads (or a multiple of them)"
        )


def ulysses_bytes(batch: int, seq_len: int, cp: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, itemsize: float) -> float:
    """Bytes per device that one attention pass's 4 Ulysses all-to-alls hold: q and the
    output (``num_heads`` each) and k, v (``num_kv_heads`` each, at least cp of them as
    replicated for the exchange), each ``batch · seq_len/cp · heads · head_dim · itemsize``
    before the exchange (Jacobs et al. 2023, sec. 3.1)."""
    check_ulysses_heads(num_heads, num_kv_heads, cp)
    _check_divides("seq_len", seq_len, cp)
    kv = max(num_kv_heads, cp)
    return batch * seq_len / cp * (2 * num_heads + 2 * kv) * head_dim * itemsize


def ulysses_time(batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, itemsize: float, cluster: Cluster, mesh: LogicalMesh,
                 axis: str | tuple[str, ...]) -> tuple[float, float]:
    """Seconds of one layer's Ulysses all-to-alls: (forward, backward).

    Forward: q, k and v go from sequence-split to head-split, the output back
    (`ULYSSES_ALL_TO_ALLS` = 4 all-to-alls of `ulysses_bytes` in all, per participant);
    the backward moves their gradients the same way. Not overlapped with the attention,
    which needs all of them. Heads per tensor-parallel rank must divide by cp
    (`check_ulysses_heads`).
    """
    cp = mesh.axis_size(axis if isinstance(axis, str) else tuple(axis))
    nbytes = ulysses_bytes(batch, seq_len, cp, num_heads, num_kv_heads, head_dim, itemsize)
    # The four exchanges are separate collectives: each pays its latency.
    share = nbytes / ULYSSES_ALL_TO_ALLS
    seconds = ULYSSES_ALL_TO_ALLS * collective_time("all_to_all", share, cluster, mesh, axis)
    return seconds, seconds


def ulysses_buffer_bytes(batch: int, seq_len: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, itemsize: float, cp: int) -> float:
    """Bytes per device of the head-split q, k, v and output during Ulysses' attention:
    the whole sequence for heads/cp, the same as `ulysses_bytes` (all-to-all keeps the
    size)."""
    return ulysses_bytes(batch, seq_len, cp, num_heads, num_kv_heads, head_dim, itemsize)


def context_parallel_time(algorithm: CPAlgorithm, *, attention_compute: float, batch: int,
                          seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                          itemsize: float, cluster: Cluster, mesh: LogicalMesh,
                          axis: str | tuple[str, ...]) -> tuple[float, float]:
    """Exposed communication seconds of one layer's CP attention: (forward, backward).

    `attention_compute` is the forward attention core's seconds per device (the backward
    does twice it); heads are per tensor-parallel rank. The ring hides what fits under
    each step's compute (`ring_attention_time` less the compute); all-gather and Ulysses
    expose all of theirs (`all_gather_kv_time`, `ulysses_time`).
    """
    check_algorithm(algorithm)
    cp = mesh.axis_size(axis if isinstance(axis, str) else tuple(axis))
    if cp == 1:
        return 0.0, 0.0
    if algorithm == "ulysses":
        return ulysses_time(batch, seq_len, num_heads, num_kv_heads, head_dim, itemsize,
                            cluster, mesh, axis)
    block = kv_block_bytes(batch, seq_len, cp, num_kv_heads, head_dim, itemsize)
    if algorithm == "all_gather":
        return all_gather_kv_time(block, cluster, mesh, axis)
    forward, backward = ring_attention_time(attention_compute, block, cluster, mesh, axis)
    return forward - attention_compute, backward - 2 * attention_compute


def context_parallel_buffer_bytes(algorithm: CPAlgorithm, *, batch: int, seq_len: int,
                                  cp: int, num_heads: int, num_kv_heads: int,
                                  head_dim: int, itemsize: float) -> float:
    """Bytes of K/V (or head-split tensors) the algorithm holds per device beyond a
    device's own sequence chunk during one layer's attention (forward)."""
    check_algorithm(algorithm)
    if cp == 1:
        return 0.0
    if algorithm == "ulysses":
        return ulysses_buffer_bytes(batch, seq_len, num_heads, num_kv_heads, head_dim,
                                    itemsize, cp)
    block = kv_block_bytes(batch, seq_len, cp, num_kv_heads, head_dim, itemsize)
    if algorithm == "all_gather":
        return all_gather_kv_buffer_bytes(block, cp)
    return ring_kv_buffer_bytes(block)


def check_algorithm(algorithm: str) -> None:
    if algorithm not in CP_ALGORITHMS:
        raise ValueError(
            f"unknown context-parallel algorithm {algorithm!r}; use one of "
            f"{', '.join(CP_ALGORITHMS)}"
        )


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _check_divides(name: str, value: int, cp: int) -> None:
    if value % cp:
        raise ValueError(
            f"{name}={value} does not split over cp={cp} devices; choose a cp dividing it"
        )
