"""The stage DP's pass for one t_max (`_bounded_dp`), which computes only the states a
plan can reach, against the plain pass over every state on made-up latency tables."""

import math
import random

import numpy as np

from autopar.inter._stage_dp import _Buckets
from autopar.inter._stage_dp_bounded import _bounded_dp, _prefix_reach, _reconstruct


def plain_bounded_dp(latency, device_counts, num_devices, t_max, buckets, live):
    """`_bounded_dp` before it skipped unreachable states: every (bucket, layer, device
    units) state computed."""
    num_layers, num_positions = latency.shape[0], latency.shape[3]
    top, saturating = buckets.top, buckets.saturating
    unit = math.gcd(num_devices, *(int(device_counts[g]) for g in live))
    if not live or num_devices % unit:
        return None
    columns = num_devices // unit + 1
    total = np.full((top + 1, num_layers + 1, columns), np.inf)
    total[0, num_layers, 0] = 0.0
    choice = np.full(total.shape, -1, dtype=np.int64)
    from_top = np.zeros(total.shape, dtype=bool)
    sources = np.arange(top + 1) if saturating else np.arange(top)
    targets = np.minimum(sources + 1, top)
    positions = np.minimum(np.maximum(targets, 1), num_positions) - 1
    for start in range(num_layers - 1, -1, -1):
        num_ends = num_layers - start
        value = np.full((len(sources), columns), np.inf)
        best = np.full(value.shape, -1, dtype=np.int64)
        for g in live:
            step = int(device_counts[g]) // unit
            if step >= columns:
                continue
            stage = latency[start, start + 1 :, g][:, positions]
            stage = np.where(stage <= t_max, stage, np.inf)
            ends = np.flatnonzero(np.isfinite(stage).any(axis=1))
            if not ends.size:
                continue
            source = total[: len(sources), start + 1 + ends, : columns - step]
            candidates = stage[ends].T[:, :, None] + source
            pick = candidates.argmin(axis=1)
            found = np.take_along_axis(candidates, pick[:, None, :], axis=1)[:, 0, :]
            better = found < value[:, step:]
            value[:, step:] = np.where(better, found, value[:, step:])
            best[:, step:] = np.where(better, g * num_ends + ends[pick], best[:, step:])
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
    final = buckets.final_range
    last = columns - 1
    bucket = final.start + int(np.argmin(total[final.start : final.stop, 0, last]))
    if not np.isfinite(total[bucket, 0, last]):
        return None
    return _reconstruct(choice, from_top, device_counts, bucket, unit)


def made_up_latency(rng, num_layers, device_counts, num_positions):
    """Sparse stage latencies ``[start, end, group, position]``, rounded so that ties occur,
    never faster further from the last stage (as 1F1B's memory makes them)."""
    latency = np.full((num_layers, num_layers + 1, len(device_counts), num_positions), np.inf)
    for start in range(num_layers):
        for end in range(start + 1, num_layers + 1):
            for g, devices in enumerate(device_counts):
                if rng.random() < 0.35:
                    continue
                t = round((end - start) * rng.uniform(0.5, 1.5) / devices ** 0.8, 2)
                for p in range(num_positions):
                    if rng.random() < 0.15:
                        break  # does not fit from this position on
                    latency[start, end, g, p] = t
                    t = round(t * rng.choice([1.0, 1.0, 1.2]), 2)
    return latency


def test_reachable_states_give_the_plain_plan():
    with_plan = 0
    for seed in range(24):
        with_plan += compare_on_made_up_table(seed)
    assert with_plan >= 12, "the made-up tables should mostly hold a plan"


def compare_on_made_up_table(seed) -> bool:
    """Both passes at every candidate t_max of one made-up table; whether some has a plan."""
    rng = random.Random(seed)
    num_layers = rng.randint(2, 9)
    device_counts = np.asarray(sorted(rng.sample([1, 2, 3, 4, 6, 8], rng.randint(1, 4))))
    num_devices = int(device_counts[-1]) * rng.randint(1, 3)
    num_positions = rng.randint(1, 4)
    latency = made_up_latency(rng, num_layers, device_counts, num_positions)
    most = min(num_layers, num_devices)
    if seed % 3 == 0:  # counted exactly (num_stages / max_stages)
        fewest = rng.randint(1, most)
        buckets = _Buckets(rng.randint(fewest, most), False, fewest)
    else:  # saturating at the positions told apart (0: not counted)
        buckets = _Buckets(num_positions if num_positions > 1 else 0, True)
    live = [g for g in range(len(device_counts)) if np.isfinite(latency[:, :, g]).any()]
    found = False
    for t_max in np.unique(latency[np.isfinite(latency)]):
        want = plain_bounded_dp(latency, device_counts, num_devices, t_max, buckets, live)
        got = _bounded_dp(latency, device_counts, num_devices, t_max, buckets, live)
        assert got == want, (seed, t_max, got, want)
        found = found or want is not None
    return found


def test_prefix_reach_counts_units_of_stages_that_fit():
    """Two layers; group 0 has 1 device, group 1 has 2. Layer 0 alone fits on either,
    layers 0-1 only on 2 devices, layer 1 alone only on 1 device (t_max 1.0)."""
    latency = np.full((2, 3, 2, 1), np.inf)
    latency[0, 1, 0], latency[0, 1, 1] = 0.5, 0.3
    latency[0, 2, 1] = 0.9
    latency[0, 2, 0] = 2.0  # over t_max
    latency[1, 2, 0] = 0.4
    reach = _prefix_reach(latency, np.asarray([1, 2]), 1.0, [0, 1], 1, 4)
    assert reach[0].tolist() == [True, False, False, False]
    assert reach[1].tolist() == [False, True, True, False]  # 1 or 2 units before layer 1
    assert reach[2].tolist() == [False, False, True, True]  # 2 (one stage) or 1+1 / 2+1


def test_groups_without_a_stage_from_a_layer_are_skipped_alike():
    """Where a live group has no stage from some layer within t_max (skipped there before
    its arrays are sliced), the pass still gives the plain pass's plan: the made-up
    tables' t_max leave such (layer, group) pairs in every table with a plan."""
    skipped = 0
    for seed in range(24):
        rng = random.Random(seed)
        num_layers = rng.randint(2, 9)
        device_counts = np.asarray(sorted(rng.sample([1, 2, 3, 4, 6, 8], rng.randint(1, 4))))
        latency = made_up_latency(rng, num_layers, device_counts, 2)
        live = [g for g in range(len(device_counts)) if np.isfinite(latency[:, :, g]).any()]
        num_devices = int(device_counts[-1])
        for t_max in np.unique(latency[np.isfinite(latency)]):
            from_start = (latency <= t_max).any(axis=(1, 3))
            skipped += int((~from_start[:, live]).sum())
            buckets = _Buckets(2, True)
            assert (_bounded_dp(latency, device_counts, num_devices, t_max, buckets, live)
                    == plain_bounded_dp(latency, device_counts, num_devices, t_max, buckets,
                                        live)), (seed, t_max)
    assert skipped > 100
