"""Fitting a `Link` (latency alpha, bandwidth beta) to measured collective times."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.cluster import Link
from autopar.cost._formulas import CollectiveKind, alpha_beta_terms


@dataclass(frozen=True)
class CollectiveSample:
    """One timed collective: `kind` over `num_devices` devices with message `nbytes`.

    `nbytes` follows the convention of `autopar.cost.collective_time`; `seconds` is the
    measured (median) time.
    """

    kind: CollectiveKind
    num_devices: int
    nbytes: float
    seconds: float

    def predicted(self, link: Link) -> float:
        """The time the alpha-beta model gives for this sample over `link`."""
        return alpha_beta_terms(self.kind, self.nbytes, self.num_devices).seconds(link)


def fit_link(samples: Sequence[CollectiveSample]) -> Link:
    """Least-squares fit of latency and bandwidth to `samples` in the alpha-beta model.

    Minimises the sum of squared *relative* errors, ``sum ((predicted - t) / t)**2``, so
    that small messages (latency-bound) and large ones (bandwidth-bound) count alike. The
    model is linear in (alpha, 1/beta); alpha is clamped at 0 if the unconstrained fit makes
    it negative.

    **Arguments:**
    - `samples`: timed collectives over at least 2 devices, with at least two different
      amounts of bytes on the wire.

    **Returns:** the fitted `Link`.
    """
    samples = [s for s in samples if s.num_devices > 1]
    if len(samples) < 2:
        raise ValueError(f"fit_link needs >= 2 samples over >= 2 devices, got {len(samples)}")
    terms = [alpha_beta_terms(s.kind, s.nbytes, s.num_devices) for s in samples]
    design = np.array([[t.latency_steps, t.wire_bytes] for t in terms], dtype=np.float64)
    seconds = np.array([s.seconds for s in samples], dtype=np.float64)
    if not np.all(seconds > 0):
        raise ValueError(f"fit_link: measured times must be > 0, got {seconds.min()}")
    weighted = design / seconds[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(weighted, np.ones_like(seconds))
    if latency < 0:
        column = weighted[:, 1]
        latency, inverse_bandwidth = 0.0, column.sum() / (column @ column)
    if not inverse_bandwidth > 0:
        raise ValueError(
            "fit_link: the measured times do not grow with the message size, so no bandwidth "
            "can be fitted; measure larger messages"
        )
    return Link(bandwidth=float(1 / inverse_bandwidth), latency=float(latency))
