"""Layer construction: group a program's forward equations into L contiguous layers.

In: FLOPs per equation in program order and the dataflow edges ``(producer, consumer,
bytes)``. Out: L ranges ``[start, end)`` covering all equations. Numbers only, no JAX.

Alpa (REFERENCES.md, "Layer clustering") groups equations into layers of roughly equal
FLOPs while keeping the bytes that cross layer edges small. Here:

- Balance: every layer has at most ``(1 + delta) * total / L`` FLOPs. If no slicing meets
  that (one equation alone is too big), delta is doubled until one does.
- Objective, lexicographic: (1) the largest number of bytes crossing any cut, because the
  worst cut bounds the pipeline's slowest transfer; then (2) the total bytes over all cuts;
  then (3) the distance of each cut from its ideal balanced position (sum over cuts r of
  ``|flops before the cut - r * total / L|``), so equally cheap cuts are spread evenly.
- Bytes crossing the cut before equation p: every producer u < p with an edge to some
  consumer v >= p adds the largest such edge's bytes once. Several edges from one producer
  are taken to be one value read many times, so a value used by several later layers is
  counted once per cut it crosses.

The cut bytes depend on the cut position only (not on the other cuts), which makes the
problem fast to solve exactly for N ~ 20,000 equations:

1. Objective (1) by bisection over the distinct cut-byte values: with only cuts of at most
   T bytes allowed, a greedy that always cuts as late as the FLOPs cap allows finds the
   fewest layers; L layers fit iff that is <= L <= (allowed cuts + 1), since adding a cut to
   a valid slicing keeps it valid. Each test is O(L log N).
2. Objectives (2) and (3) by a DP over the allowed positions, D[r][p] = cost(r, p) +
   min{D[r - 1][q] : q < p, flops(q, p) <= cap}. The admissible q form a window that slides
   right with p, answered for all p at once by a sparse table (range-minimum query) in
   numpy: O(L N log N) element operations, a few hundred vector operations in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Relative slack on the FLOPs cap so that rounding in prefix sums does not reject a
# slicing that meets the cap exactly.
FLOPS_TOLERANCE = 1e-9
# Slack used when the caller's delta is 0 and must be relaxed: first try 1/16 over the mean.
FIRST_RELAXED_DELTA = 1 / 16


@dataclass(frozen=True)
class LayerClustering:
    """The layers chosen by `cluster_layers_detailed`.

    **Arguments:**
    - `boundaries`: ``(start, end)`` equation ranges, contiguous, covering all equations.
    - `delta`: the balance slack used (larger than asked if that was infeasible).
    - `max_cut_bytes`, `total_cut_bytes`: bytes crossing the L - 1 cuts, largest and sum.
    - `layer_flops`: FLOPs per layer.
    """

    boundaries: tuple[tuple[int, int], ...]
    delta: float
    max_cut_bytes: float
    total_cut_bytes: float
    layer_flops: tuple[float, ...]


def cut_bytes(num_equations: int, edges: Sequence[tuple[int, int, float]]) -> np.ndarray:
    """Bytes crossing the cut before each equation.

    **Arguments:**
    - `num_equations`: N.
    - `edges`: ``(producer, consumer, bytes)`` with ``0 <= producer < consumer < N``.

    **Returns:**
    ``cross[p]`` for p = 0..N: for every producer u < p, the largest of its edges to a
    consumer v >= p (see the module docstring); ``cross[0] = cross[N] = 0``.
    """
    diff = np.zeros(num_equations + 2)
    if len(edges) == 0:
        return diff[: num_equations + 1]
    producer, consumer, size = _edge_arrays(num_equations, edges)
    order = np.lexsort((-consumer, producer))  # by producer, latest consumer first
    producer, consumer, size = producer[order], consumer[order], size[order]
    running = _grouped_running_max(producer, size)
    # Edge i covers cuts (next consumer of its producer, consumer_i] with the running max.
    same_next = np.append(producer[1:] == producer[:-1], False)
    lower = np.where(same_next, np.append(consumer[1:], 0), producer)
    np.add.at(diff, lower + 1, running)
    np.add.at(diff, consumer + 1, -running)
    return np.cumsum(diff)[: num_equations + 1]


def _edge_arrays(num_equations, edges):
    array = np.asarray(edges, dtype=np.float64).reshape(-1, 3)
    producer, consumer, size = array[:, 0], array[:, 1], array[:, 2]
    bad = (producer < 0) | (consumer >= num_equations) | (producer >= consumer)
    bad |= (producer != np.floor(producer)) | (consumer != np.floor(consumer))
    if bad.any():
        u, v, _ = array[np.argmax(bad)]
        raise ValueError(
            f"edge ({u:g}, {v:g}) is not a forward dataflow edge of {num_equations} equations; "
            "edges must be (producer, consumer, bytes) with 0 <= producer < consumer < N "
            "in program order"
        )
    if not np.all(np.isfinite(size) & (size >= 0)):
        raise ValueError("edge bytes must be finite and >= 0")
    return producer.astype(np.int64), consumer.astype(np.int64), size


def _grouped_running_max(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Running max of `values` restarting where the (sorted) `group` changes."""
    distinct, rank = np.unique(values, return_inverse=True)
    group_rank = np.cumsum(np.append(0, group[1:] != group[:-1]))
    stride = len(distinct)  # exact in int64: rank < stride, so groups never mix
    keyed = np.maximum.accumulate(group_rank * stride + rank)
    return distinct[keyed - group_rank * stride]


def _min_layers(prefix, allowed_positions, cap, tolerance, stop_after) -> int:
    """Fewest layers with cuts only at `allowed_positions` (sorted, ending at N) and at
    most `cap` FLOPs each; `stop_after` + 1 once more than `stop_after` are needed."""
    allowed_prefix = prefix[allowed_positions]
    position, count = 0, 0
    while position < len(prefix) - 1:
        reach = np.searchsorted(allowed_prefix, prefix[position] + cap + tolerance, "right")
        following = allowed_positions[reach - 1] if reach > 0 else -1
        if following <= position or count >= stop_after:
            return stop_after + 1
        position, count = int(following), count + 1
    return count


def _fits(prefix, cross, threshold, num_layers, cap, tolerance) -> bool:
    num_equations = len(prefix) - 1
    cuts = np.flatnonzero(cross[1:num_equations] <= threshold) + 1
    if len(cuts) + 1 < num_layers:
        return False
    allowed = np.append(cuts, num_equations)
    return _min_layers(prefix, allowed, cap, tolerance, num_layers) <= num_layers


def _lexmin(first, second, primary, secondary):
    """Element-wise the index (from `first` or `second`) with the smaller
    (primary, secondary) pair."""
    p1, p2 = primary[first], primary[second]
    take_second = (p2 < p1) | ((p2 == p1) & (secondary[second] < secondary[first]))
    return np.where(take_second, second, first)


def _window_argmin(primary, secondary, lo, hi):
    """For each query i, the index in [lo[i], hi[i]] with the least (primary, secondary);
    a sparse table answers every query with two lookups. Queries need lo <= hi."""
    table = [np.arange(len(primary))]
    span = 1
    while 2 * span <= len(primary):
        last = table[-1]
        table.append(_lexmin(last[:-span], last[span:], primary, secondary))
        span *= 2
    level = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
    stacked = np.full((len(table), len(primary)), -1, dtype=np.int64)
    for k, row in enumerate(table):
        stacked[k, : len(row)] = row
    left = stacked[level, lo]
    right = stacked[level, hi - (1 << level) + 1]
    return _lexmin(left, right, primary, secondary)


def _min_total_cuts(prefix, cross, threshold, num_layers, cap, tolerance):
    """Objectives (2) and (3) with cuts of at most `threshold` bytes; returns the cuts."""
    num_equations = len(prefix) - 1
    cuts = np.flatnonzero(cross[1:num_equations] <= threshold) + 1
    positions = np.concatenate(([0], cuts, [num_equations]))
    position_prefix = prefix[positions]
    total = prefix[-1]
    lo = np.searchsorted(position_prefix, position_prefix - cap - tolerance, "left")
    hi = np.arange(len(positions)) - 1  # q < p
    last = len(positions) - 1  # position N, where the last layer ends
    inner = np.flatnonzero(lo[1:last] <= hi[1:last]) + 1  # cuts with some admissible q
    assert lo[last] <= hi[last], "the threshold passed the feasibility test but N is unreachable"
    primary = np.full(len(positions), np.inf)  # D[r - 1][q]: total cut bytes
    primary[0] = 0.0
    secondary = np.zeros(len(positions))  # its total distance from balanced cuts
    back = np.zeros((num_layers + 1, len(positions)), dtype=np.int64)
    for layer in range(1, num_layers + 1):
        is_last = layer == num_layers
        queries = np.array([last]) if is_last else inner
        best = _window_argmin(primary, secondary, lo[queries], hi[queries])
        if is_last:
            step_bytes, step_balance = 0.0, 0.0
        else:
            step_bytes = cross[positions[queries]]
            step_balance = np.abs(position_prefix[queries] - layer * total / num_layers)
        primary_next = np.full(len(positions), np.inf)
        secondary_next = np.zeros(len(positions))
        primary_next[queries] = primary[best] + step_bytes
        secondary_next[queries] = secondary[best] + step_balance
        back[layer, queries] = best
        primary, secondary = primary_next, secondary_next
    assert np.isfinite(primary[-1]), "the threshold passed the feasibility test but the DP failed"
    chosen, index = [], len(positions) - 1
    for layer in range(num_layers, 0, -1):
        index = int(back[layer, index])
        chosen.append(int(positions[index]))
    assert chosen[-1] == 0, f"the DP's first layer starts at {chosen[-1]}, not 0"
    return sorted(chosen[:-1])


def _check_inputs(flops, num_layers) -> np.ndarray:
    flops = np.asarray(flops, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(flops) & (flops >= 0)):
        raise ValueError("flops must be finite and >= 0 for every equation")
    if not isinstance(num_layers, (int, np.integer)) or isinstance(num_layers, bool):
        raise TypeError(f"num_layers must be an int, got {type(num_layers).__name__}")
    if not 1 <= num_layers <= len(flops):
        raise ValueError(
            f"cannot group {len(flops)} equations into {num_layers} layers: every layer "
            f"needs at least one equation; ask for 1 <= num_layers <= {len(flops)}"
        )
    return flops


def cluster_layers_detailed(
    flops: Sequence[float],
    edges: Sequence[tuple[int, int, float]],
    num_layers: int,
    delta: float = 0.5,
) -> LayerClustering:
    """Group equations into `num_layers` contiguous layers (see the module docstring).

    **Arguments:**
    - `flops`: FLOPs of each forward equation, in program order.
    - `edges`: dataflow ``(producer, consumer, bytes)``, producer < consumer.
    - `num_layers`: L, between 1 and the number of equations.
    - `delta`: each layer has at most ``(1 + delta) * total / L`` FLOPs; relaxed (doubled)
      if no slicing meets it.

    **Returns:**
    A `LayerClustering` with the boundaries and what they cost.
    """
    flops = _check_inputs(flops, num_layers)
    if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    prefix = np.concatenate(([0.0], np.cumsum(flops)))
    total = float(prefix[-1])
    tolerance = FLOPS_TOLERANCE * total
    cross = cut_bytes(len(flops), edges)
    while not _fits(prefix, cross, np.inf, num_layers, (1 + delta) * total / num_layers, tolerance):
        delta = max(2 * delta, FIRST_RELAXED_DELTA)
    cap = (1 + delta) * total / num_layers
    levels = np.unique(cross[1 : len(flops)]) if len(flops) > 1 else np.zeros(1)
    low, high = 0, len(levels) - 1  # bisection: the smallest level that fits
    while low < high:
        middle = (low + high) // 2
        if _fits(prefix, cross, levels[middle], num_layers, cap, tolerance):
            high = middle
        else:
            low = middle + 1
    cuts = _min_total_cuts(prefix, cross, levels[low], num_layers, cap, tolerance)
    bounds = [0, *cuts, len(flops)]
    cut_values = cross[cuts] if cuts else np.zeros(0)
    return LayerClustering(
        boundaries=tuple(zip(bounds[:-1], bounds[1:])),
        delta=float(delta),
        max_cut_bytes=float(cut_values.max()) if cuts else 0.0,
        total_cut_bytes=float(cut_values.sum()),
        layer_flops=tuple(float(prefix[e] - prefix[s]) for s, e in zip(bounds, bounds[1:])),
    )


def cluster_layers(
    flops: Sequence[float],
    edges: Sequence[tuple[int, int, float]],
    num_layers: int,
    delta: float = 0.5,
) -> list[tuple[int, int]]:
    """The layer boundaries of `cluster_layers_detailed`, as a list of ``(start, end)``.

    **Arguments:** as `cluster_layers_detailed`.

    **Returns:**
    `num_layers` contiguous equation ranges covering ``range(len(flops))``.
    """
    return list(cluster_layers_detailed(flops, edges, num_layers, delta).boundaries)
