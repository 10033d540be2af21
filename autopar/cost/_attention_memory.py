"""Device memory of a value inside a fused attention kernel.

A fused attention kernel (FlashAttention; Dao et al. 2022, Algorithm 1-2 and section 3.1)
streams Q, K and V through on-chip memory in tiles: the (..., s, s) scores, mask,
probabilities and, backward, their gradients never reach device memory. What it does keep
per attention is O(s): the softmax statistics of each query row (the log-sum-exp, fp32),
written by the forward and read by the backward, and, backward, one more fp32 value per
query row (rowsum(dO * O)). The memory models (`autopar.intra._liveness`, the sharding
ILP's live groups, a layer's kept activations) count each value of
`autopar.graph.attention_core` as those row statistics: `fused_attention_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.cost._compute import bytes_per_device

# The softmax statistics' dtype: FlashAttention keeps the log-sum-exp in fp32 whatever the
# inputs' dtype (Dao et al. 2022, Algorithm 2, line 13: L_i = m_i + log(l_i)).
STATISTICS_DTYPE = np.dtype(np.float32)


def fused_attention_bytes(shape: Sequence[int], spec, mesh) -> float:
    """Bytes per device that a fused attention kernel holds for a (..., s_q, s_k) value
    it keeps on chip: one fp32 statistic per query row, shape (..., s_q), split as the
    value's `spec` splits its leading dimensions (None: whole).

    **Example:** the (2, 4, 1024, 1024) bf16 scores of a batch of 2 with 4 heads: 8 MiB
    unfused; fused, 2 * 4 * 1024 * 4 bytes = 32 KiB; split over a 2-device axis on the
    heads, 16 KiB per device.
    """
    rows = tuple(shape[:-1])
    if spec is None:
        return float(int(np.prod(rows, dtype=np.int64)) * STATISTICS_DTYPE.itemsize)
    return bytes_per_device(rows, STATISTICS_DTYPE, tuple(spec[:-1]), mesh)
