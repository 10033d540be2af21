"""XLA:CPU's cost per kernel of a step-sized program (`Cluster.kernel_overhead` on CPU).

In: the host's CPU devices. Out: seconds each kernel of a program costs besides its
roofline work, every device of the host running the program at once.

A training step of a small model is a few hundred kernels that each do next to nothing:
the tiny GPT's hand-sharded step (`benchmarks/investigations/score_vs_measured.py`) runs
476 fusions per device, half of them on 128 floats or fewer. XLA:CPU runs each as a thunk:
its launch, its buffers, and its machine code, which in a program of hundreds of distinct
kernels no longer stays in the core's caches. The cost per kernel grows with the program:
on 8 virtual devices of the 2-core VM, 4 KiB per device per kernel, about 3.6 us per kernel
in a program of 96 kernels and 12-15 us in one of 384-480 (per kernel over the cores, CPU
clock). So the probe times a program of a step's size, `KERNEL_PROBE_CHAIN` dependent
``x - mean(x)`` pairs (three kernels each), against one pair: what each extra kernel adds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from autopar.profile._measure import AXIS, ProfileOptions, _filled, _median_seconds

# Dependent ``x - mean(x)`` pairs of the step-sized program: 160 pairs compile to 480
# kernels, a small model's training step (the tiny GPT's: 476).
KERNEL_PROBE_CHAIN = 160
# Floats per device each kernel reads and writes (4 KiB: a small model's activations and
# weights per device, between the tiny GPT's 128-float median and its 4096-float largest).
KERNEL_PROBE_WIDTH = 1024
# HLO instructions of the entry computation that launch no kernel.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple"}


def entry_kernels(hlo_text: str) -> int:
    """Instructions of a compiled program's entry computation that XLA runs as kernels
    (every one but parameters, constants, tuples and bitcasts)."""
    entry = hlo_text[hlo_text.index("ENTRY"):]
    ops = re.findall(r"= \S+ ([a-z][a-z\-]*)\(", entry)
    return sum(1 for op in ops if op not in _NO_KERNEL)


def measure_cpu_kernel_overhead(
    devices: Sequence, options: ProfileOptions, log: Callable[[str], None]
) -> float:
    """Seconds per kernel (module docstring) on all `devices` at once, by `options.clock`
    (with ``"cpu-per-core"``: the process's CPU seconds over the cores, the per-device
    share the profile's other figures are): ``(t(chain) - t(1)) / (kernels(chain) -
    kernels(1))``, at least 0."""
    mesh = Mesh(np.array(devices), (AXIS,))
    x = _filled((len(devices), KERNEL_PROBE_WIDTH), jnp.float32, mesh)
    spec = PartitionSpec(AXIS)

    def chain(length: int):
        def body(x):
            for i in range(length):
                x = x - x.mean(axis=-1, keepdims=True) * (1.0 + i * 1e-3)
            return x
        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                             check_vma=False)

    seconds, kernels = [], []
    for length in (1, KERNEL_PROBE_CHAIN):
        fn = chain(length)
        kernels.append(entry_kernels(jax.jit(fn).lower(x).compile().as_text()))
        seconds.append(_median_seconds(fn, (x,), options))
    per_kernel = max(0.0, (seconds[1] - seconds[0]) / max(1, kernels[1] - kernels[0]))
    log(f"kernel overhead: {per_kernel * 1e6:.2f} us per kernel "
        f"({kernels[1]} kernels: {seconds[1] * 1e3:.2f} ms, {kernels[0]}: "
        f"{seconds[0] * 1e3:.2f} ms)")
    return per_kernel
