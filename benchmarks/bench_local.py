"""Local plans: predicted against measured step time on the virtual CPU devices.

In: a small GPT, a batch size and the cost profile the predictions use. Out: one
`LocalResult` per plan (predicted and measured seconds) and the Spearman rank correlation
between the two columns. The process must see 8 devices (set
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing jax).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_large import plan_line, schedule_label

from autopar.app._autoparallel import autoparallel
from autopar.cluster import Cluster
from autopar.manual import megatron_plan
from autopar.profile._measure import usable_cores
from autopar.search import plan
from examples import gpt

log = logging.getLogger("autopar.benchmarks")

LOCAL_PROFILE = "cpu-local"
LOCAL_DEVICES = 8


@dataclass(frozen=True)
class LocalResult:
    """One plan run locally: predicted and measured seconds per step."""

    name: str
    plan_line: str
    predicted: float
    measured: float
    runtime: str  # "spmd" (one jitted program) or "pipeline" (per-stage programs)
    schedule: str = "-"  # `schedule_label` of the plan


def spearman(x, y) -> float:
    """Spearman's rank correlation of two equally long sequences (ties get mean ranks).

    **Arguments:**
    - `x`, `y`: numbers, at least two each.

    **Returns:** the Pearson correlation of the ranks, in [-1, 1]; 0 when one sequence is
    constant.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(
            f"spearman needs two 1-D sequences of the same length >= 2, got shapes "
            f"{x.shape} and {y.shape}"
        )
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = np.sqrt((rx**2).sum() * (ry**2).sum())
    return float((rx * ry).sum() / denominator) if denominator > 0 else 0.0


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of their ranks."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def local_plans(step, args, cluster) -> dict[str, Callable[[], object]]:
    """Named makers of the plans to compare: one function each, so a failure stays local."""
    makers: dict[str, Callable[[], object]] = {}
    for method in ("shard", "data", "zero2", "zero3"):
        for shape in ((8,), (2, 4), (4, 2)):
            if method != "shard" and shape != (8,):
                continue  # data / ZeRO only use the devices as one data axis
            makers[f"{method} {shape}"] = (
                lambda method=method, shape=shape: plan(
                    step, *args, cluster=cluster, method=method, mesh_shape=shape, cache=False
                )
            )
    for dp, tp, pp, m in ((8, 1, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (2, 2, 2, 4)):
        makers[f"megatron dp{dp} tp{tp} pp{pp}"] = (
            lambda dp=dp, tp=tp, pp=pp, m=m: megatron_plan(
                step, *args, cluster=cluster, dp=dp, tp=tp, pp=pp, num_microbatches=m
            )
        )
    for stages in (2, 4):
        makers[f"auto {stages} stages"] = (
            lambda stages=stages: plan(
                step, *args, cluster=cluster, num_stages=stages, num_microbatches=4,
                cache=False, microbatch_check="off",  # a mean loss; timed, not checked
            )
        )
    return makers


class _Timer:
    """A plan compiled and warmed up (one step), ready to time more steps."""

    def __init__(self, step, state, batch, p, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.run = autoparallel(step, plan=p, cache=False, donate=True)
        self.state = jax.tree.map(jnp.copy, state)  # the step donates its state
        self.batch = batch
        self.times: list[float] = []
        self._step()  # compiles

    def _step(self) -> float:
        start = self.clock()
        self.state, metrics = self.run(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        return self.clock() - start

    def time_steps(self, n: int) -> float:
        """Time `n` steps; returns their median and keeps every time."""
        times = [self._step() for _ in range(n)]
        self.times += times
        return statistics.median(times)


def run_local(config: str = "small-test", batch_size: int = 16, num_steps: int = 10,
              profile: str = LOCAL_PROFILE, only: int | None = None,
              rounds: int = 3, clock: str = "wall",
              ) -> tuple[list[LocalResult], list[list[float]]]:
    """Plan, run and time a small GPT under each local plan.

    Every plan is compiled first; then `rounds` rounds each time `num_steps` steps of
    every plan in turn, so that a slow spell of the shared machine falls on all plans
    rather than on the few that happened to run then.

    **Arguments:**
    - `config`: a GPT config name (`examples.gpt.CONFIGS`), layer marks added.
    - `batch_size`, `num_steps`: the batch and the steps timed per plan per round.
    - `profile`: the cost profile the predictions use (a name or a path).
    - `only`: run just the first `only` plans (for a smoke test).
    - `rounds`: timing rounds.
    - `clock`: "wall" (`time.perf_counter`), "process" (`time.process_time`: the CPU
      seconds of this process's threads, which other processes on a shared machine do
      not inflate; on a machine with c cores a step that keeps them all busy measures up
      to c times its wall time) or "cpu-per-core" (those CPU seconds over the c cores the
      process may use: the wall time with the machine to itself of a step that keeps
      every core busy, the clock `autopar profile --clock cpu-per-core` measures with).

    **Returns:** a `LocalResult` per plan that planned and ran (measured = median of all
    its timed steps), and per round the median step time of each of those plans.
    """
    if rounds < 1 or num_steps < 1:
        raise ValueError(f"rounds and num_steps must be at least 1, got {rounds}, {num_steps}")
    clocks = {"wall": time.perf_counter, "process": time.process_time,
              "cpu-per-core": _cpu_per_core}
    if clock not in clocks:
        raise ValueError(f"clock must be one of {sorted(clocks)}, got {clock!r}")
    step, state, batch = _gpt_arrays(config, batch_size)
    cluster = _cluster(profile)
    timers = {}
    for name, make in list(local_plans(step, (state, batch), cluster).items())[:only]:
        try:
            p = make()
            timers[name] = (p, _Timer(step, state, batch, p, clocks[clock]))
        except (ValueError, NotImplementedError) as err:
            log.warning("local plan %s skipped: %s", name, str(err)[:200])
    per_round = []
    for r in range(rounds):
        per_round.append([t.time_steps(num_steps) for _, t in timers.values()])
        log.info("timing round %d/%d done", r + 1, rounds)
    results = []
    for name, (p, t) in timers.items():
        seconds = statistics.median(t.times)
        log.info("%s: predicted %.4g s, measured %.4g s", name, p.predicted_step_time, seconds)
        results.append(LocalResult(name, plan_line(p), p.predicted_step_time, seconds, p.runtime,
                                   schedule_label(p)))
    return results, per_round


def _cpu_per_core() -> float:
    """This process's CPU seconds over the cores it may use (the "cpu-per-core" clock)."""
    return time.process_time() / usable_cores()


def _gpt_arrays(config: str, batch_size: int):
    cfg = dataclasses.replace(gpt.CONFIGS[config], layer_markers=True)
    optimizer = optax.adamw(1e-3)
    step = gpt.make_train_step(cfg, optimizer)
    state = jax.jit(lambda key: gpt.init_state(cfg, optimizer, key))(jax.random.key(0))
    batch = jax.jit(lambda key: gpt.make_batch(cfg, batch_size, key))(jax.random.key(1))
    return step, state, batch


def _cluster(profile: str) -> Cluster:
    cluster = Cluster.from_profile(profile)
    if cluster.num_devices != len(jax.devices()):
        raise ValueError(
            f"profile {profile!r} describes {cluster.num_devices} devices but this process "
            f"sees {len(jax.devices())}; set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{cluster.num_devices} before importing jax"
        )
    return cluster
