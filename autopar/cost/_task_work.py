"""The CPU work a pipeline's tasks do per step, at the share of a core each device gets.

In: each stage's predicted seconds per microbatch and its devices, the microbatch count,
the host's `host_cores` and `devices_per_host`. Out: CPU seconds per step.
`autopar.app._task_overhead` subtracts it from a measured step's process CPU to find what
a task costs besides its work.
"""

from __future__ import annotations

from collections.abc import Iterable


def core_share(host_cores: int | None, devices_per_host: int) -> float:
    """The share of a CPU core each device of a host runs at while all run:
    ``host_cores / devices_per_host`` where the devices share fewer cores than they are
    (XLA:CPU's virtual devices), else 1."""
    if host_cores and host_cores < devices_per_host:
        return host_cores / devices_per_host
    return 1.0


def tasks_cpu_seconds(stages: Iterable[tuple[float, int]], num_microbatches: int,
                      share: float) -> float:
    """CPU seconds per step of a pipeline's tasks' work: for each stage's ``(seconds per
    microbatch, devices)``, the seconds times the microbatches and the devices, at `share`
    of a core per device (`core_share`)."""
    return sum(seconds * num_microbatches * devices * share for seconds, devices in stages)
