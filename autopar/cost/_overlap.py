"""Overlap: how much of a collective that runs concurrently with compute stays exposed.

Some collectives need not wait for the compute around them: the data-parallel gradient
reduction of a layer runs while the backward of the layers before it computes (PyTorch
DDP's buckets, Megatron-LM's ``--overlap-grad-reduce``, XLA's asynchronous collectives),
ZeRO-3 parameter gathers are prefetched a layer ahead, and pipeline sends run while the
next microbatch computes. The cluster's `overlap` says what fraction of such a collective
the runtime hides; the rest, and all of it beyond the compute available to hide behind,
is exposed. Every other collective (a tensor-parallel all-reduce whose result the next
operation reads) is in series. One rule, `exposed_time`, for the planner's stage costs and
the Megatron scorer; the ILP, which sums per-operation costs, charges each hideable
collective `hideable_weight` of its time (the same rule while compute is the longer).
"""

from __future__ import annotations

from collections.abc import Iterable


def exposed_time(compute: float, hideable: float | Iterable[float], overlap: float) -> float:
    """Seconds of the hideable collectives that compute does not hide.

    **Arguments:**
    - `compute`: seconds of compute the collectives can run under (a stage's backward for
      its gradient reductions, its forward and backward for prefetched gathers).
    - `hideable`: the seconds of each hideable collective (or their sum).
    - `overlap`: `Cluster.overlap`, the fraction of a collective the runtime hides, in
      [0, 1].

    **Returns:** ``H − min(overlap · H, compute)`` with ``H = sum(hideable)``: a fraction
    `overlap` is hidden, but never more than the compute that runs meanwhile.

    **Example:** 10 ms of gradient all-reduce under a 40 ms backward with overlap 0.9:
    1 ms exposed; under a 5 ms backward: 5 ms exposed.
    """
    total = hideable if isinstance(hideable, (int, float)) else sum(hideable)
    if compute < 0 or total < 0:
        raise ValueError(
            f"exposed_time needs compute >= 0 and hideable >= 0, got {compute}, {total}"
        )
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}; see Cluster.overlap")
    return total - min(overlap * total, compute)


def hideable_weight(overlap: float) -> float:
    """The share of a hideable collective's time the ILP charges: ``1 − overlap``.

    `exposed_time` with compute at least ``overlap ·`` the collectives' time, which holds
    for gradient reductions and parameter gathers of any layer worth parallelising; the
    stage cost (`exposed_time`) applies the bound exactly.
    """
    return exposed_time(float("inf"), 1.0, overlap)
