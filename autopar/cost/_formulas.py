"""The alpha-beta formulas of ring collectives, as (latency, bytes) coefficients.

For n participants, link bandwidth b and latency a, every collective costs
``latency_steps · a + wire_bytes / b`` (REFERENCES.md, "Collective costs"):

| kind | latency_steps | wire_bytes | `nbytes` means |
|---|---|---|---|
| all_reduce | 2(n−1) | 2(n−1)/n · S | S per participant (the reduced tensor) |
| all_gather | n−1 | (n−1)/n · S | S = the full gathered tensor |
| reduce_scatter | n−1 | (n−1)/n · S | S = the full tensor before scattering |
| all_to_all | n−1 | (n−1)/n · S | S per participant |
| send_recv | 1 | S | S sent by each device |

Kept apart from `Cluster` so that both the cost functions and the profile fit use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
COLLECTIVE_KINDS: tuple[str, ...] = get_args(CollectiveKind)


@dataclass(frozen=True)
class AlphaBetaTerms:
    """The cost of one collective is ``latency_steps · alpha + wire_bytes / bandwidth``."""

    latency_steps: float
    wire_bytes: float

    def seconds(self, link) -> float:
        """The time over `link` (anything with `latency` and `bandwidth`, e.g. a `Link`)."""
        return self.latency_steps * link.latency + self.wire_bytes / link.bandwidth


def alpha_beta_terms(kind: CollectiveKind, nbytes: float, num_devices: int) -> AlphaBetaTerms:
    """The ring alpha-beta terms of collective `kind` (table in the module docstring).

    **Arguments:**
    - `kind`: one of `COLLECTIVE_KINDS`.
    - `nbytes`: message size S in bytes, as the table defines it per kind.
    - `num_devices`: participants n; n == 1 costs nothing.

    **Returns:** `AlphaBetaTerms`.
    """
    check_kind(kind)
    if nbytes < 0:
        raise ValueError(f"{kind}: nbytes must be >= 0, got {nbytes}")
    if num_devices < 1:
        raise ValueError(f"{kind}: needs >= 1 participant, got {num_devices}")
    n = num_devices
    if n == 1:
        return AlphaBetaTerms(0.0, 0.0)
    if kind == "all_reduce":
        return AlphaBetaTerms(2 * (n - 1), 2 * (n - 1) / n * nbytes)
    if kind == "send_recv":
        return AlphaBetaTerms(1, nbytes)
    return AlphaBetaTerms(n - 1, (n - 1) / n * nbytes)


def check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; use one of {', '.join(COLLECTIVE_KINDS)}"
        )
