"""What `autopar profile` measures on one accelerator beside peak rates and GEMMs by shape:
memory bandwidth by size, fused elementwise and reduction throughput, and the time of the
smallest kernels.

These are the figures the GPU cost model needs to predict a step on one device (issue 14,
item 8): its activations of a few MiB live partly in
the L2 cache, its layer norms and softmaxes are reduction fusions, and a step launches
thousands of kernels. Each function times programs on the first of `devices` alone (a GPU
computes on its own: no device shares it) and returns JSON-ready data for the profile's
``measured`` section; `measure_profile` makes `Cluster.kernel_overhead` of one.

All timings go through `autopar.profile._measure._median_seconds` (compiled once, warmed
up, median of repeats with ``block_until_ready``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from autopar.profile._measure import (
    AXIS,
    MiB,
    ProfileOptions,
    _filled,
    _median_seconds,
    _size_str,
)

# Bytes of the programs of `measure_bandwidth_by_size`: from inside a GPU's L2 cache
# (50-60 MB on a H100/H200) to far beyond it.
BANDWIDTH_SIZES = tuple(2**k * MiB for k in (2, 4, 6, 8, 10))
# Rows x hidden of the fused-throughput probes (bf16), a microbatch of 8 x 1024 tokens.
FUSED_ROWS, FUSED_HIDDEN = 8192, 4096
# Dependent small kernels per program of `measure_kernel_floor`.
KERNEL_CHAIN = 256


def measure_bandwidth_by_size(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> list[list[float]]:
    """Bytes per second (read + written) of ``x * 2 + 1`` on one device, float32, by the
    bytes of `x`: ``[[bytes, bytes_per_s], ...]`` over `BANDWIDTH_SIZES`. Small sizes run
    out of the L2 cache: each call reads what the last one wrote."""
    mesh = Mesh(np.array(devices[:1]), (AXIS,))
    rows = []
    for nbytes in BANDWIDTH_SIZES:
        x = _filled((nbytes // 4,), jnp.float32, mesh)
        seconds = _median_seconds(lambda x: x * 2 + 1, (x,), options, num_devices=1,
                                  donate=True)
        rows.append([float(nbytes), round(2 * nbytes / seconds, 1)])
        del x
    log("memory bandwidth by size: " + ", ".join(
        f"{_size_str(b)} {r / 1e9:.0f} GB/s" for b, r in rows))
    return rows


def measure_fused_throughput(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> dict[str, dict[str, float]]:
    """Seconds and achieved bytes per second of three fusions a transformer layer runs, on
    one device, bf16 ``[FUSED_ROWS, FUSED_HIDDEN]``: a GELU (tanh form; one elementwise
    fusion), a layer norm (a row reduction and its elementwise use) and a row softmax (two
    reductions). Bytes are the input read once and the output written once."""
    mesh = Mesh(np.array(devices[:1]), (AXIS,))
    shape = (FUSED_ROWS, FUSED_HIDDEN)
    nbytes = 2 * math.prod(shape) * jnp.dtype(jnp.bfloat16).itemsize

    def gelu(x):
        y = x.astype(jnp.float32)
        y = 0.5 * y * (1.0 + jnp.tanh(0.7978845608 * (y + 0.044715 * y**3)))
        return y.astype(x.dtype)

    def layer_norm(x):
        y = x.astype(jnp.float32)
        mean = y.mean(-1, keepdims=True)
        var = jnp.square(y - mean).mean(-1, keepdims=True)
        return ((y - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)

    def softmax(x):
        return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)

    results = {}
    for name, fn in (("gelu", gelu), ("layer_norm", layer_norm), ("softmax", softmax)):
        x = _filled(shape, jnp.bfloat16, mesh)
        seconds = _median_seconds(fn, (x,), options, num_devices=1)
        results[name] = {"seconds": seconds, "bytes_per_s": round(nbytes / seconds, 1)}
        del x
    log(f"fused throughput (bf16 {shape[0]}x{shape[1]}): " + ", ".join(
        f"{k} {v['bytes_per_s'] / 1e9:.0f} GB/s" for k, v in results.items()))
    return results


def measure_kernel_floor(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> dict[str, float]:
    """Seconds per kernel of programs made of `KERNEL_CHAIN` dependent tiny kernels on one
    device: ``"matmul"``, a chain of 64 x 64 bf16 matmuls (one GEMM kernel each), and
    ``"reduction"``, a chain of ``x - mean(x)`` over 4096 floats (a reduction and the
    elementwise op fused into the next one). Each kernel does next to nothing, so this is
    what any kernel of a step costs at least: its launch and the gap before the next one."""
    mesh = Mesh(np.array(devices[:1]), (AXIS,))

    def matmuls(x, w):
        for _ in range(KERNEL_CHAIN):
            x = x @ w
        return x

    def reductions(x):
        for i in range(KERNEL_CHAIN):
            x = x - x.mean() * (1.0 + i * 1e-3)
        return x

    w = _filled((64, 64), jnp.bfloat16, mesh)
    results = {
        "matmul": _median_seconds(matmuls, (_filled((64, 64), jnp.bfloat16, mesh), w),
                                  options, num_devices=1) / KERNEL_CHAIN,
        "reduction": _median_seconds(reductions, (_filled((4096,), jnp.float32, mesh),),
                                     options, num_devices=1) / KERNEL_CHAIN,
    }
    log("smallest kernels: " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in results.items()))
    return results
