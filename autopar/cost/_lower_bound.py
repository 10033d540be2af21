"""The least memory per device any plan can reach: the bound the feasibility check uses.

Every byte of the training state must live on some device, and no plan holds less of a
part per device than that part split evenly over every device that may split it: all of
them for a part a plan may shard (ZeRO-3 or full sharding), one for a part the method
keeps whole on every device (data parallelism). So ``sum(part / num_holders)`` is a lower
bound on the fullest device's memory, optimistic by construction (a plan needs at least
this, usually more: working memory, activations kept for the backward, replicas).
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def least_memory_per_device(part_bytes: Mapping[str, float],
                            devices_splitting: Mapping[str, int]) -> float:
    """Bytes the fullest device holds at least: each part over the devices that may split
    it (`devices_splitting[part]`, 1 for a part held whole on every device)."""
    return float(sum(b / max(1, devices_splitting[part]) for part, b in part_bytes.items()))


def least_devices(total_bytes: float, budget: float) -> int:
    """The fewest devices of `budget` bytes each that could hold `total_bytes` split evenly
    over all of them."""
    return max(1, math.ceil(total_bytes / budget))
