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

A group spanning k hosts with g > 1 devices on each uses the two-level (hierarchical,
rail-parallel) algorithms NCCL runs on clusters with one NIC per GPU (REFERENCES.md,
"Communication on real clusters"): every level is a ring with its own alpha and bandwidth
(steps, wire bytes; RS, AG, AR: reduce-scatter, all-gather, all-reduce):

| kind | inside each host (g devices) | across hosts (k), on every rail |
|---|---|---|
| all_reduce | RS + AG of S: 2(g−1), 2(g−1)/g · S | AR of S/g: 2(k−1), 2(k−1)/k · S/g |
| all_gather | AG of S: g−1, (g−1)/g · S | AG of S/g: k−1, (k−1)/k · S/g |
| reduce_scatter | RS of S: g−1, (g−1)/g · S | RS of S/g: k−1, (k−1)/k · S/g |
| all_to_all | local blocks: g−1, (g−1)/n · S | remote blocks: n−g, (n−g)/n · S |

(`hierarchical_terms`). With g = 8 NVLink devices per host the cross-host level moves 1/8
of the data per GPU, each GPU over its own rail, so the network time falls 8-fold against
one ring through one NIC.

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


@dataclass(frozen=True)
class TwoLevelTerms:
    """A hierarchical collective: `intra` over the intra-host link, then `inter` over the
    network, in series (each level's ring waits for the previous one)."""

    intra: AlphaBetaTerms
    inter: AlphaBetaTerms

    def seconds(self, intra_link, inter_link) -> float:
        return self.intra.seconds(intra_link) + self.inter.seconds(inter_link)


def hierarchical_all_reduce(nbytes: float, per_host: int, num_hosts: int) -> TwoLevelTerms:
    """Reduce-scatter inside each host, all-reduce of 1/`per_host` of the data across hosts
    over every rail at once, all-gather inside each host (module docstring's table)."""
    g, k = per_host, num_hosts
    inside = 2 * (g - 1), 2 * (g - 1) / g * nbytes
    across = 2 * (k - 1), 2 * (k - 1) / k * nbytes / g
    return TwoLevelTerms(AlphaBetaTerms(*inside), AlphaBetaTerms(*across))


def hierarchical_all_gather(nbytes: float, per_host: int, num_hosts: int) -> TwoLevelTerms:
    """All-gather of each host's 1/`per_host` share across hosts (one ring per rail), then
    all-gather inside each host. `nbytes` is the full gathered tensor."""
    g, k = per_host, num_hosts
    inside = g - 1, (g - 1) / g * nbytes
    across = k - 1, (k - 1) / k * nbytes / g
    return TwoLevelTerms(AlphaBetaTerms(*inside), AlphaBetaTerms(*across))


def hierarchical_reduce_scatter(nbytes: float, per_host: int, num_hosts: int) -> TwoLevelTerms:
    """Reduce-scatter inside each host, then of each device's 1/`per_host` across hosts:
    the mirror image of `hierarchical_all_gather`, with the same terms."""
    return hierarchical_all_gather(nbytes, per_host, num_hosts)


def hierarchical_all_to_all(nbytes: float, per_host: int, num_hosts: int) -> TwoLevelTerms:
    """Each device sends S/n to every other: the g − 1 blocks for its own host over the
    intra-host link, the n − g for other hosts over its rail, one message step each."""
    g, n = per_host, per_host * num_hosts
    inside = g - 1, (g - 1) / n * nbytes
    across = n - g, (n - g) / n * nbytes
    return TwoLevelTerms(AlphaBetaTerms(*inside), AlphaBetaTerms(*across))


HIERARCHICAL_FORMULAS = {
    "all_reduce": hierarchical_all_reduce,
    "all_gather": hierarchical_all_gather,
    "reduce_scatter": hierarchical_reduce_scatter,
    "all_to_all": hierarchical_all_to_all,
}


def hierarchical_terms(
    kind: CollectiveKind, nbytes: float, per_host: int, num_hosts: int
) -> TwoLevelTerms:
    """The two-level terms of `kind` over `num_hosts` hosts with `per_host` devices each.

    **Arguments:**
    - `kind`: one of `COLLECTIVE_KINDS`; ``send_recv`` has no hierarchy (one hop over the
      network) and gets ``(0, 0)`` inside plus ``(1, S)`` across.
    - `nbytes`: S as in `alpha_beta_terms`.
    - `per_host`, `num_hosts`: g >= 1 and k >= 1.

    **Example:** all-reduce of 1 GiB over 2 DGX A100 hosts: inside ``2·7/8·2**30`` bytes
    in 14 steps over NVLink, across ``2·1/2·2**30/8`` bytes in 2 steps over each rail.
    """
    check_kind(kind)
    if nbytes < 0:
        raise ValueError(f"{kind}: nbytes must be >= 0, got {nbytes}")
    if per_host < 1 or num_hosts < 1:
        raise ValueError(
            f"{kind}: needs >= 1 host and >= 1 device per host, got {num_hosts}, {per_host}"
        )
    if kind == "send_recv":
        return TwoLevelTerms(AlphaBetaTerms(0.0, 0.0), AlphaBetaTerms(1, nbytes))
    return HIERARCHICAL_FORMULAS[kind](nbytes, per_host, num_hosts)


def check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; use one of {', '.join(COLLECTIVE_KINDS)}"
        )
