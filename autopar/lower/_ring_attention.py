"""Ring attention: causal attention with the sequence split over a mesh axis, K/V blocks
passed around the ring with `jax.lax.ppermute` (Liu et al. 2023), under `shard_map`.

In: Q ``[batch, S, heads, head_dim]`` and K, V ``[batch, S, kv_heads, head_dim]``
(grouped-query attention when ``heads > kv_heads``), their sequence in *zig-zag* order
(`zigzag_order`) and split over the ring's mesh axis. Out: the attention output in the
same layout. Differentiable: JAX transposes each `ppermute` into the opposite one.

Zig-zag load balancing (as Megatron-LM's CP and zhuzilin/ring-flash-attention): the
sequence is cut into ``2 * cp`` chunks and rank r holds chunks r and ``2cp - 1 - r``, so
that under a causal mask every rank does the same work. Step 0 attends the rank's own
block (the causal mask inside it); at step j > 0 the block of rank ``src = r - j`` is
either wholly earlier than the rank's first chunk, or later than the first and earlier
than the second: when ``src < r`` both local query chunks attend the block's first chunk
unmasked, when ``src > r`` the second local query chunk attends the whole block unmasked.
Either is half a block of dense work, the same on every rank, chosen with `lax.cond`.
Partial results are merged with an online softmax (running max, running sum, unnormalised
output; Milakov & Gimelshein 2018).

Plain-JAX equivalent: ``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` on the
whole sequence, in natural order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

# A finite stand-in for -inf in the running max: exp(NEG_INF - m) is exactly 0 for any
# real score m, and never nan (inf - inf) where a whole block row is masked.
NEG_INF = -1e30


def zigzag_order(seq_len: int, cp: int) -> np.ndarray:
    """Token indices in zig-zag order for a ring of `cp` ranks: ``x[:, zigzag_order(S,
    cp)]`` puts chunks r and ``2cp-1-r`` (of ``S / 2cp`` tokens) in rank r's contiguous
    shard. Raises a ValueError naming the fix when ``2 * cp`` does not divide `seq_len`."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"ring attention over {cp} devices cuts the sequence into 2 x {cp} = {2 * cp} "
            f"balanced chunks, but the sequence has {seq_len} tokens; use a sequence length "
            f"divisible by {2 * cp}, or a context-parallel degree whose double divides it"
        )
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]])
                           for r in range(cp)])


def ring_attention(q, k, v, mesh: Mesh, axis: str, batch_axes: tuple[str, ...] = ()):
    """Causal attention of zig-zag ordered `q`, `k`, `v` with the sequence split over mesh
    `axis` (module docstring); `batch_axes` split the batch besides."""
    cp = mesh.shape[axis]
    zigzag_order(q.shape[1], cp)  # checks the sequence divides into 2 * cp chunks
    spec = PartitionSpec(batch_axes or None, axis, None, None)
    kernel = functools.partial(_ring_kernel, axis=axis, cp=cp)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)


def _ring_kernel(q, k, v, *, axis: str, cp: int):
    rank = jax.lax.axis_index(axis)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # grouped-query attention: each K/V head serves `groups` query heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.astype(jnp.float32) * scale
    chunk = q.shape[1] // 2
    b, _, n, _ = q.shape
    state = (jnp.full((b, n, 2 * chunk), NEG_INF, jnp.float32),   # running max
             jnp.zeros((b, n, 2 * chunk), jnp.float32),           # running sum
             jnp.zeros(q.shape, jnp.float32))                     # unnormalised output
    # step 0: the rank's own block, causal inside (chunk order: [r, 2cp-1-r])
    pos = jnp.concatenate([jnp.arange(chunk), jnp.arange(chunk) + chunk])
    state = _merge(state, qf, k, v, pos[:, None] >= pos[None, :])
    perm = [(i, (i + 1) % cp) for i in range(cp)]
    for step in range(1, cp):
        k = jax.lax.ppermute(k, axis, perm)
        v = jax.lax.ppermute(v, axis, perm)
        src = (rank - step) % cp
        state = jax.lax.cond(src < rank, _earlier, _later, state, qf, k, v)
    m, denom, o = state
    out = o / jnp.transpose(denom, (0, 2, 1))[..., None]
    return out.astype(q.dtype)


def _earlier(state, qf, k, v):
    """A block from a lower rank: all local queries see its first chunk, unmasked."""
    chunk = k.shape[1] // 2
    return _merge(state, qf, k[:, :chunk], v[:, :chunk], None)


def _later(state, qf, k, v):
    """A block from a higher rank: the local second chunk sees all of it, unmasked."""
    chunk = qf.shape[1] // 2
    m, denom, o = state
    part = (m[..., chunk:], denom[..., chunk:], o[:, chunk:])
    m2, l2, o2 = _merge(part, qf[:, chunk:], k, v, None)
    return (jnp.concatenate([m[..., :chunk], m2], -1),
            jnp.concatenate([denom[..., :chunk], l2], -1),
            jnp.concatenate([o[:, :chunk], o2], 1))


def _merge(state, qf, k, v, mask):
    """Online-softmax update of (running max, sum, output) with one K/V block."""
    m, denom, o = state
    s = jnp.einsum("bqnd,bknd->bnqk", qf, k.astype(jnp.float32))
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    l_new = denom * correction + p.sum(-1)
    pv = jnp.einsum("bnqk,bknd->bqnd", p, v.astype(jnp.float32))
    o_new = o * jnp.transpose(correction, (0, 2, 1))[..., None] + pv
    return m_new, l_new, o_new
