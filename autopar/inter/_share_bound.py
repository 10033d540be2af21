"""A known plan for a stage DP whose layer ranges are restricted (a scanned stack's even
shares): even plans with the end layers riding on the end stages.

In: the stage DP's `_StageCosts` and the stage cost function it asks (with its `allowed`
restriction), the layer count, the cluster and submeshes. Out: `inner.bound` lowered to
the DP objective of the best such plan that fits.

Why. `_bound_by_even_plans` cuts S stages at ``round(i * L / S)``: on a stack of n
iterations traced between an embedding layer and a head (L = n + 2), those cuts give the
stages n / S iterations only where the rounding happens to put the end layers on the end
stages, so the DP restricted to even shares of the stack (`search._stack.even_shares`)
often has no even plan (`one_layout`'s re-runs with one share: bound inf) and costs every
stage in full. Here S stages of n / S iterations each, layer 0 on the first and layer
L - 1 on the last (``[0, 1 + s), [1 + s, 1 + 2s), ..., [1 + (S - 1) s, L)``), on S copies
of one submesh that fill the cluster, are plans the restricted DP may choose.

Why it is exact. The bound is the DP objective of a plan the DP can choose, costed by the
DP's own stage cost function, so the DP's answer is at most the bound, and
`_StageCosts.latency_cutoff` only cuts stages that cannot be part of a plan as fast
(`BOUND_MARGIN` above it). The DP's answer is the same with any such bound; only the
leaner levels solved on the way differ (`tests/test_share_bound.py`).
"""

from __future__ import annotations

from autopar.inter._stage_costs import _bound_by_even_plans

# Off: only `_bound_by_even_plans` bounds a restricted DP (to compare; the same plans).
SHARE_PLANS = True


def share_cuts(num_layers: int, count: int) -> list[int] | None:
    """Cuts of `count` stages over `num_layers` layers, the first and last layers riding
    on the end stages and the layers between in equal shares; None where they do not
    divide."""
    inner = num_layers - 2
    if count < 1 or inner < count or inner % count:
        return None
    share = inner // count
    return [0, *(1 + i * share for i in range(1, count)), num_layers]


def bound_by_share_plans(inner, stage_cost, allowed, num_layers: int, num_hosts: int,
                         devices_per_host: int, submeshes, num_stages: int | None) -> None:
    """Lower `inner.bound` to the best `share_cuts` plan's DP objective (`sum t + (B - 1)
    max t`) whose ranges `allowed` takes, on copies of one submesh that fill the cluster
    and pack; tried by their lower bound, each costed under the bound the ones before
    left (`_bound_by_even_plans` with these cuts)."""
    if not SHARE_PLANS or allowed is None:
        return

    def cuts_of(count: int) -> list[int] | None:
        cuts = share_cuts(num_layers, count)
        if cuts is None or not all(allowed(cuts[i], cuts[i + 1]) for i in range(count)):
            return None
        return cuts

    _bound_by_even_plans(inner, stage_cost, num_layers, num_hosts, devices_per_host,
                         submeshes, num_stages, cuts_of=cuts_of)
