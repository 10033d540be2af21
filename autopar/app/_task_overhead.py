"""The host's cost of one pipeline task, measured through the pipeline runtime.

In: a measured `Cluster` (`autopar profile`'s) and this process's devices. Out: seconds
of the host thread per task (`Cluster.dispatch_overhead`), from a small two-stage
pipelined step run by `autoparallel`: what the runtime does per task (its argument
lookups and placement checks, the moves between the stages' devices, the jitted calls'
dispatch) on this machine. A trivial jitted call alone takes a fraction of it (on 8
virtual CPU devices of a 2-core AMD EPYC: about 0.2 ms against 1.2-1.6 ms of host time per
task of the local GPT's pipelines).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from autopar.cost import tasks_per_step

# The probe's shape: layers of transformer-like parameter counts (12 leaves each: six
# dense sublayers' weights and biases), split into two stages of two layers, with an
# Adam-like state (two moments per parameter), so that its tasks take about as many
# arguments as a small transformer's stage tasks (the local GPT's: 26-53).
PROBE_LAYERS = 4
PROBE_SUBLAYERS = 6
PROBE_WIDTH = 32
PROBE_MICROBATCHES = 4
PROBE_STEPS = 6


def measure_task_overhead(cluster, log: Callable[[str], None]) -> float | None:
    """Seconds of host thread time (`time.thread_time`) per pipeline task on `cluster`'s
    devices: the median over `PROBE_STEPS` steps of a two-stage pipeline (1F1B,
    `PROBE_MICROBATCHES` microbatches, `tasks_per_step` tasks per stage), each step's
    host time over its tasks. None with fewer than 2 devices or several processes (each
    process would dispatch only its own stage's tasks)."""
    from autopar.app._autoparallel import autoparallel
    from autopar.graph import layer_boundary, value_and_grad
    from autopar.manual import megatron_plan

    devices = cluster.num_devices
    if devices < 2 or devices % 2 or jax.process_count() > 1:
        log(f"pipeline task on the host: not measured ({devices} device(s), "
            f"{jax.process_count()} process(es); it needs an even number >= 2 in one "
            "process); dispatch_overhead stays the trivial call's launch time")
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
    per_task = []
    for _ in range(PROBE_STEPS):
        start = time.thread_time()
        state, metrics = run(state, batch)
        jax.block_until_ready((state, metrics))
        per_task.append((time.thread_time() - start) / tasks)
    seconds = sorted(per_task)[len(per_task) // 2]
    log(f"pipeline task on the host: {seconds * 1e6:.0f} us of host thread time per task "
        f"(two stages of {devices // 2} devices each; {tasks} tasks per step)")
    return seconds
