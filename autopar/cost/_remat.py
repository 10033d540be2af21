"""Rematerialization formulas: what recomputing part of a layer's forward costs and saves.

In: a layer's `LayerCost` without recompute, the predicted seconds of the forward work its
backward reruns, and the bytes per device it stops (and starts) keeping. Out: the layer's
`LayerCost` with that recompute, which the stage DP adds up like any other
(`stage_memory`, `pipeline_latency`).

Per microbatch in flight a layer keeps its `activation_memory`; with recompute it keeps
less, and during its own backward the dropped values exist again (one layer at a time:
`transient_memory`). The rerun adds its forward seconds to the layer's latency.
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", sections 4-5; REFERENCES.md.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from autopar.cost._compute import compute_time
from autopar.cost._layer_cost import LayerCost


def recompute_seconds(work: Iterable[tuple[float, float, str]], cluster) -> float:
    """Predicted seconds to rerun forward nodes, each given as (FLOPs per device, bytes
    accessed per device, dtype): the sum of their roofline times (`compute_time`)."""
    return sum(compute_time(flops, nbytes, cluster, dtype) for flops, nbytes, dtype in work)


def scan_rerun_seconds(body_work: Iterable[tuple[float, float, str]], length: int,
                       held_bytes: Iterable[float], whole_bytes: Iterable[float],
                       cluster) -> float:
    """Predicted seconds to rerun a scan's forward: its body's nodes, each given as (FLOPs,
    bytes crossing its fusion's boundary, dtype) of one iteration, `length` times, at the
    share of the work one device does, taken as the share of the scan's results a device
    holds (`held_bytes` per device over `whole_bytes`, the results' whole sizes; 1 when
    they have none), each node's roofline time (`recompute_seconds`). A rerun body's
    tensor-parallel collectives are not counted.

    **Example:** a body of one 1 GFLOP node run 12 times, its results split 4 ways: the
    roofline time of 12 * 1e9 / 4 FLOPs (and bytes likewise).
    """
    whole = math.fsum(whole_bytes)
    share = math.fsum(held_bytes) / whole if whole > 0 else 1.0
    scale = length * share
    return recompute_seconds(
        [(flops * scale, hbm * scale, dtype) for flops, hbm, dtype in body_work], cluster
    )


def planned_rerun_seconds(node_terms: Iterable[tuple[float, Iterable[float]]]) -> float:
    """Predicted seconds to rerun forward nodes exactly as their plan runs them, each node
    given as (its chosen strategy's seconds: compute and its own collectives, the seconds
    of each operand resharding the plan does before it): their sum, in that order. A
    recompute reruns the forward as planned (Megatron-LM reissues the tensor-parallel
    collectives too; Korthikanti et al. 2022, section 5)."""
    seconds = 0.0
    for strategy_seconds, reshard_seconds in node_terms:
        seconds += strategy_seconds
        for reshard in reshard_seconds:
            seconds += reshard
    return seconds


def stage_recompute_seconds(layers: Iterable[tuple[float, float, float]]) -> float:
    """Seconds per microbatch a stage's recompute adds, each layer given as (its latency
    with its remat choice, its latency without, the seconds of the fused rerun its
    backward does whatever the choice): the sum of (with - without + fused).

    **Example:** layers of 10 ms becoming 13 ms with full recompute, each with a 0.1 ms
    fused rerun: 3.1 ms per layer.
    """
    return math.fsum(with_remat - without + fused for with_remat, without, fused in layers)


def fused_rerun_seconds(work: Iterable[tuple[float, str]], cluster) -> float:
    """Predicted seconds of the forward values a backward makes again inside its own
    fusions (`with_remat`'s fused recompute: GELU's tanh and powers, a layer norm's
    centred input), each node given as (FLOPs per device, dtype).

    Such a value was made inside a forward fusion and is no longer kept: the backward's
    fusion that reads it reruns the elementwise nodes from the stored value they are made
    of, reading that value in place of the kept one, so the rerun moves no bytes of its
    own; it costs its FLOPs, at the rate of its dtype (`compute_time` with no bytes).

    **Example:** a tanh over 4M float32 elements per device (4e6 FLOPs) on a device of
    19.5 TFLOP/s float32 and `matmul_efficiency` e adds 4e6 / (19.5e12 * e) seconds.
    """
    return sum(compute_time(flops, 0.0, cluster, dtype) for flops, dtype in work)


def recomputed_layer_cost(
    base: LayerCost, extra_seconds: float, dropped_bytes: float, added_bytes: float = 0.0
) -> LayerCost:
    """`base` with a recompute that reruns `extra_seconds` of forward work, drops
    `dropped_bytes` of kept activations and keeps `added_bytes` it did not keep before.

    Kept per microbatch in flight: ``activation - dropped + added``; during the layer's
    backward the dropped values are live again, so its transient memory grows by
    `dropped_bytes` and its peak by `added_bytes` only.
    """
    if extra_seconds < 0 or dropped_bytes < 0 or added_bytes < 0:
        raise ValueError(
            f"recompute needs non-negative seconds and bytes, got {extra_seconds}, "
            f"{dropped_bytes}, {added_bytes}"
        )
    dropped = min(dropped_bytes, base.activation_memory)
    return replace(
        base,
        latency=base.latency + extra_seconds,
        memory=base.memory + added_bytes,
        activation_memory=base.activation_memory - dropped + added_bytes,
    )


def full_recompute_cost(base: LayerCost, forward_seconds: float, input_bytes: float) -> LayerCost:
    """Full recompute (Megatron-LM's "full"): the layer keeps only its input
    (`input_bytes` per device) and its backward reruns its whole forward (`forward_seconds`
    more per microbatch); every activation it kept is live again during its backward.

    **Example:** a layer of 10 ms (3 ms of it forward) keeping 100 MB, with an 8 MB input,
    becomes 13 ms keeping 8 MB, with 100 MB more transient memory.
    """
    return recomputed_layer_cost(base, forward_seconds, base.activation_memory, input_bytes)


def selective_recompute_cost(
    base: LayerCost, core_seconds: float, core_bytes: float, added_bytes: float = 0.0
) -> LayerCost:
    """Selective recompute (Korthikanti et al. 2022): the layer stops keeping its attention
    core's sequence x sequence tensors (`core_bytes` per device: scores, softmax, dropout
    mask) and its backward reruns the nodes that make them (`core_seconds`)."""
    return recomputed_layer_cost(base, core_seconds, core_bytes, added_bytes)
