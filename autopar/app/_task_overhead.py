"""What one pipeline task costs besides its work, measured through the pipeline runtime.

In: a measured `Cluster` (`autopar profile`'s) and this process's devices. Out: a
`TaskOverhead` from a small two-stage pipelined step run by `autoparallel`:

- `host`: seconds of the host thread per task (`Cluster.dispatch_overhead`): what the
  runtime does per task (its argument lookups and placement checks, the moves between the
  stages' devices, the jitted calls' dispatch) on this machine. A trivial jitted call
  alone takes a fraction of it (on 8 virtual CPU devices of a 2-core AMD EPYC: about
  0.2 ms against 1.2-1.6 ms of host time per task of the local GPT's pipelines).
- `device`: CPU seconds per task and device spent outside the host thread and outside
  the tasks' work (`Cluster.task_device_overhead`): the process's CPU per step less the
  host thread's and less the work the cost model predicts for the tasks, over the step's
  tasks times their devices. On XLA:CPU that is the launch on each device's thread, its
  buffers' allocation and release, and the thread pool's search for work once a task is
  done (in a `perf` profile of the local GPT's 4-stage pipeline pinned to one core,
  Eigen's `GlobalSteal`/`PopBack` and `malloc` take about 25 ms more per step than in the
  one-program data-parallel step's; session 23, docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from autopar.cost import core_share, tasks_cpu_seconds, tasks_per_step

# The probe's shape: layers of transformer-like parameter counts (12 leaves each: six
# dense sublayers' weights and biases), split into two stages of two layers, with an
# Adam-like state (two moments per parameter), so that its tasks take about as many
# arguments as a small transformer's stage tasks (the local GPT's: 26-53).
PROBE_LAYERS = 4
PROBE_SUBLAYERS = 6
PROBE_WIDTH = 32
PROBE_MICROBATCHES = 4
PROBE_STEPS = 6


@dataclass(frozen=True)
class TaskOverhead:
    """Seconds per pipeline task besides its work: of the host thread (`host`), and of
    CPU on each of the task's devices' threads (`device`)."""

    host: float
    device: float


def measure_task_overhead(cluster, log: Callable[[str], None]) -> TaskOverhead | None:
    """A pipeline task's overhead on `cluster`'s devices, over `PROBE_STEPS` steps of a
    two-stage pipeline (1F1B, `PROBE_MICROBATCHES` microbatches, `tasks_per_step` tasks
    per stage): the median of each step's host thread time (`time.thread_time`) over its
    tasks, and the median of each step's process CPU (`time.process_time`) less that host
    time and less the tasks' predicted work (`predicted_work`), over its tasks times
    their devices (at least 0). None with fewer than 2 devices or several processes (each
    process would dispatch only its own stage's tasks)."""
    from autopar.app._autoparallel import autoparallel
    from autopar.graph import layer_boundary, value_and_grad
    from autopar.manual import megatron_plan

    devices = cluster.num_devices
    if devices < 2 or devices % 2 or jax.process_count() > 1:
        log(f"pipeline task on the host: not measured ({devices} device(s), "
            f"{jax.process_count()} process(es); it needs an even number >= 2 in one "
            "process); dispatch_overhead stays the trivial call's launch time and "
            "task_device_overhead 0")
        return None

    def loss(params, batch):
        x = batch["x"]
        for layer in params:
            for w, b in layer:
                x = jnp.tanh(x @ w + b)
            x = layer_boundary(x)
        return jnp.mean((x - batch["y"]) ** 2)

    def step(state, batch):
        params, m, v = state
        value, grads = value_and_grad(loss)(params, batch)
        m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = jax.tree.map(lambda a, g: 0.99 * a + 0.01 * g * g, v, grads)
        params = jax.tree.map(lambda p, a, b: p - 1e-3 * a / (jnp.sqrt(b) + 1e-8), params, m, v)
        return (params, m, v), {"loss": value}

    width = PROBE_WIDTH
    params = [[(jnp.full((width, width), 0.01), jnp.zeros((width,)))
               for _ in range(PROBE_SUBLAYERS)] for _ in range(PROBE_LAYERS)]
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = (params, zeros, jax.tree.map(jnp.zeros_like, params))
    rows = PROBE_MICROBATCHES * devices
    batch = {"x": jnp.ones((rows, width)), "y": jnp.zeros((rows, width))}
    plan = megatron_plan(step, state, batch, cluster=cluster, dp=devices // 2, tp=1, pp=2,
                         num_microbatches=PROBE_MICROBATCHES)
    run = autoparallel(step, plan=plan, cache=False)
    tasks = 2 * tasks_per_step(2, PROBE_MICROBATCHES)
    for _ in range(2):  # compiles, then warms up
        state, metrics = run(state, batch)
        jax.block_until_ready((state, metrics))
    work = predicted_work(plan, cluster)
    host, device = [], []
    for _ in range(PROBE_STEPS):
        thread, process = time.thread_time(), time.process_time()
        state, metrics = run(state, batch)
        jax.block_until_ready((state, metrics))
        thread, process = time.thread_time() - thread, time.process_time() - process
        host.append(thread / tasks)
        device.append(max(0.0, process - thread - work) / (tasks * (devices // 2)))
    result = TaskOverhead(sorted(host)[len(host) // 2], sorted(device)[len(device) // 2])
    log(f"pipeline task on the host: {result.host * 1e6:.0f} us of host thread time per task "
        f"(two stages of {devices // 2} devices each; {tasks} tasks per step); on each "
        f"device's thread besides its work: {result.device * 1e6:.0f} us of CPU")
    return result


def predicted_work(plan, cluster) -> float:
    """CPU seconds per step the cost model predicts for `plan`'s tasks' work
    (`autopar.cost.tasks_cpu_seconds`): each stage's seconds per microbatch
    (`PredictedCost.total` and its recompute, once-per-step parts included) times the
    microbatches and its devices, at the share of a core each device gets while all run
    (`autopar.cost.core_share`, the rate the profile's figures were measured at)."""
    share = core_share(cluster.host_cores, cluster.devices_per_host)
    stages = [(stage.sharding.cost.total + stage.recompute_time, stage.mesh.num_devices)
              for stage in plan.stages]
    return tasks_cpu_seconds(stages, plan.num_microbatches, share)
