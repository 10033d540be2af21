"""The `Backend` interface: what one XLA backend's runtime does that the general cost model
does not, as named methods (`autopar.cost.backends` docstring)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.choices import Schedule


@dataclass(frozen=True)
class LayoutCopy:
    """Operand `operand` of a node is copied into another memory order; the loop that
    copies it reads `fan_in` bytes per byte of the operand (1: the operand alone; more
    when the copy runs inside the elementwise fusion that makes the operand), and
    `fused` says whether it does. `strided=False`: a straight copy in the same order
    (a loop's ``dynamic-slice`` of a stacked operand, every iteration), whose bytes
    move at `hbm_bandwidth`."""

    operand: int
    fan_in: float = 1.0
    fused: bool = False
    strided: bool = True


def cluster_field(cluster, name: str) -> Any:
    """A `Cluster`'s field, or the same key of its JSON (what a `Plan` keeps)."""
    if isinstance(cluster, dict):
        return cluster.get(name)
    return getattr(cluster, name, None)


class Backend(abc.ABC):
    """What one backend's runtime adds to the general cost model (roofline, alpha-beta
    collectives, Alpa's pipeline latency). Every method takes the cluster, so a backend
    charges a behaviour only where its profile measured it; on another backend the
    answer is "no such cost" (0, None, or the general formula's own value).

    `cluster` is a `Cluster`, or where noted its JSON dict (what a `Plan` keeps).
    """

    name: str

    @abc.abstractmethod
    def layout_copies(self, graph, node) -> tuple[LayoutCopy, ...]:
        """The operands of `node` (of `graph`, an `OpGraph`) that the backend copies
        into another memory order before its kernel reads them; () for none."""

    @abc.abstractmethod
    def prices_layout_copies(self, cluster) -> bool:
        """Whether `layout_copy_seconds` can be more than 0 on `cluster` (callers skip
        walking the graph for copies otherwise)."""

    @abc.abstractmethod
    def layout_copy_seconds(self, cluster, nbytes: float, fan_in: float = 1.0,
                            fused: bool = False, strided: bool = True) -> float:
        """Seconds one `LayoutCopy` of `nbytes` per device adds on `cluster`."""

    @abc.abstractmethod
    def returned_gradient_seconds(self, cluster, nbytes: float) -> float:
        """Seconds a pipeline's backward task pays, per microbatch, to return `nbytes`
        per device of weight gradients from its program (`cluster` may be JSON)."""

    @abc.abstractmethod
    def shared_cores_step_time(self, cluster, forward: Sequence[float],
                               backward: Sequence[float], num_microbatches: int,
                               group_devices: Sequence[int] | None, schedule: Schedule,
                               num_device_groups: int) -> float | None:
        """Seconds per step of a pipeline whose stages take `forward` and `backward`
        seconds per microbatch (dispatch not included), when its devices share the
        host's CPU cores; None where they do not (the general formula holds). `cluster`
        may be JSON."""

    @abc.abstractmethod
    def collective_latency(self, cluster, group_size: int) -> float | None:
        """Seconds one collective over `group_size` devices of a host adds inside a
        program, in place of the ring's latency steps; None: the ring's alpha-beta
        latency holds."""

    @abc.abstractmethod
    def merged_latency_share(self, cluster, nbytes: float, threshold: float) -> float:
        """The share of its latency a collective of `nbytes` pays once XLA's combiner
        merged it into buckets of `threshold` bytes (`combined_collective_time`)."""

    @abc.abstractmethod
    def collective_concurrency(self, cluster) -> float:
        """The share, in [0, 1], of a collective's time that runs beside independent
        compute of the same device (`autopar.cost.chunked_exchange_time`: one chunk's
        all-to-all beside another chunk's grouped GEMM). `cluster` may be JSON."""
