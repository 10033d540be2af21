"""Bytes as people write them: `format_gib` for messages, `parse_bytes` for options.

Every memory figure autopar prints is in GiB (2**30 bytes), also when it is small, so two
figures in one message compare at a glance; `parse_bytes` reads what a user types on the
command line ("40GiB", "512MiB", "80GB", a plain number of bytes).
"""

from __future__ import annotations

import math
import re

# Binary (IEC) and decimal (SI) units, case-insensitive; "B" alone is bytes.
BYTE_UNITS = {
    "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def format_gib(num_bytes: float) -> str:
    """``"74.5 GiB"``; below 1 MiB also the bytes (``"9.31e-07 GiB (1000 B)"``); a figure
    that is not finite reads ``"unknown"`` (a message never prints "inf")."""
    if not math.isfinite(num_bytes):
        return "unknown"
    gib = num_bytes / 2**30
    text = f"{gib:,.1f} GiB" if abs(gib) >= 10 else f"{gib:.3g} GiB"
    if abs(num_bytes) < 2**20:
        text += f" ({num_bytes:.0f} B)"
    return text


def parse_bytes(text: str) -> float:
    """``"40GiB"`` -> ``42949672960.0``; ``"512 MiB"``, ``"80GB"``, ``"1e9"`` (bytes).

    Raises a ValueError naming the accepted units."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and (match.group(2).lower() or "b")
    if not match or unit not in BYTE_UNITS:
        raise ValueError(
            f"{text!r} is not an amount of memory; write a number and a unit, e.g. 40GiB, "
            "512MiB or 80GB (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; "
            "a plain number is bytes)"
        )
    value = float(match.group(1)) * BYTE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"{text!r}: the memory must be more than zero")
    return value
