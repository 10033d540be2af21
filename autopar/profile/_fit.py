"""From measured figures to a profile: the alpha-beta fits and the `Cluster` record.

In: what `autopar.profile._measure` timed (`RawFigures`: matmul rates, bandwidths,
latencies, collective samples). Out: the fitted links (`fit_links`), the `Cluster` of a
measured profile (`fitted_cluster`) and its ``measured`` section (`measured_json`). Plain
numbers only: nothing here runs on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.cluster import Cluster, Link
from autopar.cluster._profiles import builtin_profile_for
from autopar.cost import COLLECTIVE_KINDS, CollectiveSample, fit_link


@dataclass(frozen=True)
class RawFigures:
    """What `measure_profile` measured, before any fit: matmul FLOP/s by dtype and size,
    GEMM rates by shape (in `gemm_dtype`), memory bandwidths, dispatch, merged and grouped
    collective latencies, transposing copies, collective samples within and across hosts,
    and an accelerator's extra figures (`_accelerator_figures`; {} on CPU)."""

    flops: dict
    gemm_dtype: str
    shapes: dict
    hbm: float
    inplace: float
    dispatch: float
    combined: float
    transpose: Any
    latency: Any
    intra: list
    inter: list
    extra: dict


@dataclass(frozen=True)
class FittedLinks:
    """The links `measure_profile` fitted: within and across hosts, by group size, and
    each collective kind's bandwidth scale; `base` is the built-in profile they come from
    when one device alone had nothing to measure (None otherwise)."""

    base: Cluster | None
    intra: Link
    inter: Link
    by_group: tuple[tuple[int, Link], ...] | None
    by_kind: tuple[tuple[str, float], ...] | None


def fit_links(raw: RawFigures, device_kind: str, alone: bool, log) -> FittedLinks:
    """The alpha-beta links of the collective samples (`fit_link`); one device alone: the
    links of the built-in profile of its kind."""
    if alone:  # nothing to communicate with: the links of the built-in profile of its kind
        base = builtin_profile_for(device_kind)
        intra_link, inter_link, by_group = base.intra_host, base.inter_host, None
        log(f"one device: links taken from the built-in profile {base.name!r}, not measured")
    else:
        base = None
        intra_link = fit_link(raw.intra or raw.inter)
        inter_link = fit_link(raw.inter) if raw.inter else intra_link
        by_group = fit_by_group(raw.intra)
    by_kind = kind_scales(raw.intra, intra_link) if raw.intra else None
    return FittedLinks(base, intra_link, inter_link, by_group, by_kind)


def fitted_cluster(raw: RawFigures, links: FittedLinks, num_hosts: int, devices_per_host: int,
                   device_kind: str, device_memory: float, host_cores: int | None) -> Cluster:
    """The `Cluster` record of the measured figures and fitted links."""
    flops = raw.flops
    return Cluster(
        name="local-measured",
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        device_kind=device_kind,
        device_memory=device_memory,
        peak_flops={dtype: max(by_size.values()) for dtype, by_size in flops.items()},
        matmul_efficiency=1.0,
        gemm_efficiency=gemm_table(flops),
        gemm_shapes=shape_table(raw.shapes, max(flops[raw.gemm_dtype].values())),
        collective_bandwidth_by_kind=links.by_kind,
        hbm_bandwidth=raw.hbm,
        inplace_bandwidth=raw.inplace,
        intra_host=links.intra,
        inter_host=links.inter,
        dispatch_overhead=raw.dispatch,
        intra_host_by_group=links.by_group,
        combined_operand_latency=raw.combined,
        transpose_bandwidth=raw.transpose,
        collective_latency_by_group=raw.latency,
        host_cores=host_cores,
        nics_per_host=links.base.nics_per_host if links.base else None,
        kernel_overhead=raw.extra.get("kernel_overhead", 0.0),
    )


def measured_json(raw: RawFigures, links: FittedLinks, seconds: float) -> dict:
    """The profile's ``measured`` section: the time it took, matmul rates, GEMM shapes,
    the collective samples with their fits, and an accelerator's extra figures."""
    measured = {"seconds": round(seconds, 2),
                "matmul_flops_per_device": raw.flops, **raw.extra.get("measured", {})}
    if raw.shapes:
        measured[f"gemm_shapes_{raw.gemm_dtype}"] = [
            [*shape, rate] for shape, rate in raw.shapes.items()]
    for level, samples, link in (("intra_host", raw.intra, links.intra),
                                 ("inter_host", raw.inter, links.inter)):
        if samples:
            measured[level] = samples_json(samples, link)
    return measured


def fit_by_group(samples: Sequence[CollectiveSample]) -> tuple[tuple[int, Link], ...] | None:
    """One `Link` per measured group size (`Cluster.intra_host_by_group`); a size whose
    samples do not fit (too noisy) is left out; None without at least one fit."""
    fits = []
    for n in sorted({s.num_devices for s in samples}):
        try:
            fits.append((n, fit_link([s for s in samples if s.num_devices == n])))
        except ValueError:
            continue
    return tuple(fits) or None


def kind_scales(samples: Sequence[CollectiveSample], link: Link
                 ) -> tuple[tuple[str, float], ...] | None:
    """`Cluster.collective_bandwidth_by_kind`: per collective kind, the bandwidth of the
    alpha-beta fit of its samples alone over `link`'s (the fit of all of them); a kind
    too noisy to fit is left out; None without one fit."""
    scales = []
    for kind in COLLECTIVE_KINDS:
        try:
            fit = fit_link([s for s in samples if s.kind == kind])
        except ValueError:
            continue
        scales.append((kind, round(fit.bandwidth / link.bandwidth, 3)))
    return tuple(scales) or None


def gemm_table(flops: dict[str, dict[int, float]]) -> tuple[tuple[float, float], ...] | None:
    """The measured fraction of the best rate by matmul size, averaged over dtypes: the
    profile's `gemm_efficiency` (None with fewer than two sizes)."""
    sizes = sorted(set.intersection(*(set(by_size) for by_size in flops.values())))
    if len(sizes) < 2:
        return None
    fractions = [
        sum(by_size[n] / max(by_size.values()) for by_size in flops.values()) / len(flops)
        for n in sizes
    ]
    return tuple((float(n), round(f, 3)) for n, f in zip(sizes, fractions))


def shape_table(rates: dict[tuple[int, int, int], float], peak: float):
    """The profile's `gemm_shapes`, ``((M, N, K, fraction of peak), ...)``, from measured
    rates by shape (fractions capped at 1: a shape may beat the best square); None when
    nothing was measured."""
    if not rates:
        return None
    return tuple((float(m), float(n), float(k), round(min(1.0, rate / peak), 4))
                 for (m, n, k), rate in sorted(rates.items()))


def profile_note(num_hosts: int, measured_inter: bool) -> str:
    base = (
        "Measured by `autopar profile`. peak_flops are the fastest measured matmuls with all "
        "devices busy, so matmul_efficiency is 1. "
    )
    if measured_inter:
        return base + f"inter_host was measured with one device on each of {num_hosts} hosts."
    return base + (
        "One process: only the intra-host level could be measured, so inter_host is a copy "
        "of intra_host."
    )


def note_alone(base: Cluster) -> str:
    return (
        "Measured by `autopar profile` on one device. peak_flops are the fastest measured "
        "matmuls, so matmul_efficiency is 1. With nothing to communicate with, intra_host, "
        f"inter_host and nics_per_host are the built-in profile {base.name!r}'s, not measured."
    )


def samples_json(samples: Sequence[CollectiveSample], link: Link) -> dict:
    ratios = [s.predicted(link) / s.seconds for s in samples]
    per_kind = {}
    for kind in COLLECTIVE_KINDS:
        of_kind = [s for s in samples if s.kind == kind]
        try:
            per_kind[kind] = fit_link(of_kind).to_json()
        except ValueError as e:  # diagnostics only: a kind too noisy to fit on its own
            per_kind[kind] = {"error": str(e)}
    return {
        "fit_predicted_over_measured": {"min": min(ratios), "max": max(ratios)},
        "fit_per_kind": per_kind,
        "samples": [[s.kind, s.num_devices, s.nbytes, s.seconds] for s in samples],
    }
