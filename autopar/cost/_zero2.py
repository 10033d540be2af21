"""ZeRO-2: gradients kept sharded over the data-parallel ranks, reduce-scattered as made.

ZeRO stage 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", sec. 5.2) and FSDP's gradient sharding keep each data-parallel
rank's 1/d of every gradient only. A gradient sum cannot be accumulated over the
microbatches in that form without reducing first, so each microbatch's backward
reduce-scatters its fresh gradients over the d ranks (bucket by bucket, as they are made)
and adds its shard to the running one. Llama 3 405B trained this way: its FSDP "shards
the optimizer states and gradients" (Dubey et al. 2024, "The Llama 3 Herd of Models",
sec. 3.3.2), reduce-scattering in FP32 (sec. 3.3.4).

What it costs against ZeRO-1 (Megatron's distributed optimizer, which keeps a whole fp32
gradient buffer and reduce-scatters it once per step):
- memory: the running sums are 1/d, plus the bucket in flight (the largest gradient
  tensor, whole, before its reduce-scatter): `zero2_gradient_bytes`;
- time: a reduce-scatter of the stage's gradients per microbatch instead of one per step,
  run on its own stream while the device computes (PyTorch FSDP and Megatron's
  ``--overlap-grad-reduce`` issue each bucket as soon as the backward has made it), so
  only what the runtime does not hide is exposed: `zero2_exposed_reduction`
  (`exposed_time`). The compute it can hide under is what the device runs from one
  microbatch's reduce-scatter of a stage to the next one's: the rest of that backward and,
  in a pipeline's steady state (1F1B, interleaved or not, and plain gradient
  accumulation alike), the next forward and backward of the stage, i.e. one microbatch's
  forward, backward and recompute.
"""

from __future__ import annotations

from autopar.cost._overlap import exposed_time


def zero2_gradient_bytes(gradient_bytes: float, largest_gradient_bytes: float,
                         shards: int) -> tuple[float, float]:
    """(kept, transient) bytes per device of a stage's gradients under ZeRO-2.

    **Arguments:**
    - `gradient_bytes`: the stage's gradient sums per device as ZeRO-1 keeps them (whole
      over the data-parallel ranks, at their accumulation dtype).
    - `largest_gradient_bytes`: the largest single gradient among them (the bucket made
      whole by the backward before its reduce-scatter).
    - `shards`: the data-parallel ranks the gradients are split over (dp·cp).

    **Returns:** ``(gradient_bytes / shards, largest_gradient_bytes)``: the running sums
    kept for the whole step, and the working bytes of the one bucket in flight.

    **Example:** 1.49 GiB of fp32 gradients per device over 64 ranks, the largest 0.41 GiB:
    23.8 MiB kept and 0.41 GiB in flight.
    """
    if shards < 1:
        raise ValueError(f"zero2_gradient_bytes needs shards >= 1, got {shards}")
    if gradient_bytes < 0 or largest_gradient_bytes < 0:
        raise ValueError(
            "zero2_gradient_bytes needs gradient_bytes >= 0 and largest_gradient_bytes >= 0, "
            f"got {gradient_bytes}, {largest_gradient_bytes}"
        )
    if shards == 1:
        return float(gradient_bytes), 0.0
    return gradient_bytes / shards, float(min(largest_gradient_bytes, gradient_bytes))


def zero2_exposed_reduction(reduce_scatter_seconds: float, compute_seconds: float,
                            overlap: float) -> float:
    """Seconds per microbatch ZeRO-2's gradient reduce-scatter adds to a stage.

    **Arguments:**
    - `reduce_scatter_seconds`: one reduce-scatter of the stage's gradients over the
      data-parallel ranks (`collective_time("reduce_scatter", ...)`).
    - `compute_seconds`: the stage's compute per microbatch (forward, backward and
      recompute), what the device runs between one microbatch's reduce-scatter and the
      next (module docstring).
    - `overlap`: `Cluster.overlap`, the share of a hideable collective the runtime hides.

    **Returns:** `exposed_time(compute_seconds, reduce_scatter_seconds, overlap)`.

    **Example:** a 250 ms reduce-scatter under 336 ms of compute at overlap 0.8: 50 ms;
    under 100 ms: 150 ms.
    """
    return exposed_time(compute_seconds, reduce_scatter_seconds, overlap)
