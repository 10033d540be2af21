"""The stage DP's pass for one bound t_max on every stage (`autopar.inter._stage_dp`):
the least total latency of stages slicing the layers onto all devices, by a table over
(stages from a layer to the end, layer, device units). Numbers only.
"""

from __future__ import annotations

import math

import numpy as np


def _bounded_dp(latency, device_counts, num_devices, t_max, buckets, live):
    """The DP for one t_max: least total latency with every stage <= t_max.

    **Arguments:**
    - `latency`: ``[start, end, group, position - 1]`` stage latencies (inf = infeasible).
    - `device_counts`: devices of each group.
    - `num_devices`: devices the plan must use in total.
    - `t_max`: the bound on every stage.
    - `buckets`: what the stage counts index (`autopar.inter._stage_dp._Buckets`); a
      stage in bucket b (itself and the stages after it) is at position min(b, P),
      P = ``latency.shape[3]``.
    - `live`: the groups with a finite latency somewhere; the others are skipped.

    The device axis counts in units of the gcd of the live groups' device counts (whole
    hosts, when no host-local stage is feasible), and each group adds only the layer
    ranges it has a finite stage for: the work follows the stages that can be, not
    ``groups x layers^2 x devices``. Of the states (stages, layer, devices) it computes
    only those a plan can reach: the device counts the layers before can leave
    (`_prefix_reach`) and the stage counts with a finite plan from there on (`alive`);
    the others are never read on the way to the answer (`_bounded_dp_states`).

    **Returns:**
    ``[(start, end, group), ...]`` of the best plan, or None if there is none.
    """
    unit = math.gcd(num_devices, *(int(device_counts[g]) for g in live))
    if not live or num_devices % unit:
        return None
    total, choice, from_top = _bounded_dp_states(latency, device_counts, num_devices, t_max,
                                                 buckets, live, unit)
    final = buckets.final_range
    last = total.shape[2] - 1
    bucket = final.start + int(np.argmin(total[final.start : final.stop, 0, last]))
    if not np.isfinite(total[bucket, 0, last]):
        return None
    return _reconstruct(choice, from_top, device_counts, bucket, unit)


def _prefix_reach(latency, device_counts, t_max, live, unit: int, columns: int,
                  fits=None):
    """``reach[k, u]``: whether layers [0, k) slice into stages of latency <= t_max (at
    some position) on groups of `live` using u device units in all. `fits`: ``latency <=
    t_max`` at some position, ``[start, end, group]``, when the caller has it."""
    num_layers = latency.shape[0]
    if fits is None:
        fits = (latency <= t_max).any(axis=3)  # [start, end, group]
    reach = np.zeros((num_layers + 1, columns), dtype=bool)
    reach[0, 0] = True
    for start in range(num_layers):
        if not reach[start].any():
            continue
        for g in live:
            step = int(device_counts[g]) // unit
            if step >= columns:
                continue
            ends = start + 1 + np.flatnonzero(fits[start, start + 1 :, g])
            if ends.size:
                reach[ends, step:] |= reach[start, : columns - step]
    return reach


def _bounded_dp_states(latency, device_counts, num_devices, t_max, buckets, live,
                       unit: int):
    """`_bounded_dp`'s tables ``(total, choice, from_top)``, each ``[bucket, layer,
    device units]``: the least total latency from a layer to the end, the choice that
    gives it and, for the saturating bucket, whether it came from itself.

    A state (bucket, layer k, d units) is computed only where the layers before k can use
    the other units (`_prefix_reach`: every state a plan from (bucket, 0, all units)
    reaches is one) and from end layers where some bucket read has a finite plan
    (`alive`); the others stay at inf with no choice. A state computed reads only states
    so reachable, which hold what the full DP would give them, and the ends and buckets
    left out hold inf in the full DP too: its least, and its first least end, are the
    full DP's. A group with no stage from a layer within t_max at any position
    (`from_start`) finds no end there and is skipped before its arrays are sliced (the
    others keep their order, so ties go as before)."""
    num_layers, num_positions = latency.shape[0], latency.shape[3]
    top, saturating = buckets.top, buckets.saturating
    columns = num_devices // unit + 1
    fits = (latency <= t_max).any(axis=3)  # [start, end, group]
    reach = _prefix_reach(latency, device_counts, t_max, live, unit, columns, fits)
    # [start][group]: whether some stage from `start` on the group is within t_max
    from_start = fits.any(axis=1).tolist()
    total = np.full((top + 1, num_layers + 1, columns), np.inf)
    total[0, num_layers, 0] = 0.0
    alive = np.zeros((top + 1, num_layers + 1), dtype=bool)  # some finite state there
    alive[0, num_layers] = True
    choice = np.full(total.shape, -1, dtype=np.int64)
    # Where the "top or more" bucket came from the top bucket itself (not from top - 1).
    from_top = np.zeros(total.shape, dtype=bool)
    sources = np.arange(top + 1) if saturating else np.arange(top)
    targets = np.minimum(sources + 1, top)
    positions = np.minimum(np.maximum(targets, 1), num_positions) - 1
    for start in range(num_layers - 1, -1, -1):
        left = np.flatnonzero(reach[start])  # units the layers before may use
        if not left.size:
            continue
        # The device units from here to the end worth computing: [low, high].
        low, high = columns - 1 - int(left[-1]), columns - 1 - int(left[0])
        num_ends = num_layers - start
        value = np.full((len(sources), columns), np.inf)
        best = np.full(value.shape, -1, dtype=np.int64)  # group * num_ends + end - start - 1
        for g in live:
            if not from_start[start][g]:
                continue  # no end below: `ends` would be empty
            step = int(device_counts[g]) // unit
            if step >= columns or step > high:
                continue
            stage = latency[start, start + 1 :, g][:, positions]  # [end, source bucket]
            stage = np.where(stage <= t_max, stage, np.inf)
            ends = np.flatnonzero(np.isfinite(stage).any(axis=1))
            if not ends.size:
                continue
            usable = np.isfinite(stage[ends]) & alive[: len(sources), start + 1 + ends].T
            rows = np.flatnonzero(usable.any(axis=0))  # source buckets with a finite one
            if not rows.size:
                continue
            ends = ends[usable.any(axis=1)]
            first = max(low, step)
            source = total[rows[:, None], (start + 1 + ends)[None, :],
                           first - step : high - step + 1]  # [src, end, d]
            candidates = stage[ends][:, rows].T[:, :, None] + source
            pick = candidates.argmin(axis=1)  # the first least end, as the flat argmin
            found = np.take_along_axis(candidates, pick[:, None, :], axis=1)[:, 0, :]
            held = value[rows, first : high + 1]
            better = found < held  # strict: an earlier group keeps a tie
            value[rows, first : high + 1] = np.where(better, found, held)
            best[rows, first : high + 1] = np.where(better, g * num_ends + ends[pick],
                                                    best[rows, first : high + 1])
        if not saturating:
            total[1:, start], choice[1:, start] = value, best
        elif top == 0:
            total[0, start], choice[0, start], from_top[0, start] = value[0], best[0], True
        else:
            total[1:top, start], choice[1:top, start] = value[: top - 1], best[: top - 1]
            stays = value[top] < value[top - 1]
            total[top, start] = np.where(stays, value[top], value[top - 1])
            choice[top, start] = np.where(stays, best[top], best[top - 1])
            from_top[top, start] = stays
        alive[:, start] = np.isfinite(total[:, start]).any(axis=1)
    return total, choice, from_top


def _reconstruct(choice, from_top, device_counts, bucket, unit=1) -> list[tuple[int, int, int]]:
    num_layers = choice.shape[1] - 1
    devices = choice.shape[2] - 1
    stages, start = [], 0
    while start < num_layers:
        code = int(choice[bucket, start, devices])
        assert code >= 0, f"DP state (stages={bucket}, layer={start}) has no recorded choice"
        came_from_top = bool(from_top[bucket, start, devices])
        group, offset = divmod(code, num_layers - start)
        end = start + 1 + offset
        stages.append((start, end, group))
        devices -= int(device_counts[group]) // unit
        start = end
        bucket -= 0 if came_from_top else 1
    assert devices == 0, f"DP plan leaves {devices * unit} devices unused"
    return stages
