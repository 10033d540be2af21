"""``autopar demo``: plan and train a small GPT on the local devices, next to one device.

Plans the GPT of ``examples/gpt.py`` (`DEMO_GPT`) with ``@autopar.autoparallel`` on
`Cluster.local()` (8 virtual CPU devices when run by the CLI on a machine without an
accelerator), prints the plan, trains a few steps beside the same step jitted on one
device, and writes ``plan.json``, ``plan_explain.txt`` (the printed plan) and
``plan_layout.png`` (and ``schedule.png`` for a pipelined plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autopar.app._examples import LEARNING_RATE, load_example

# The demo model: small enough to plan and train in well under a minute on 2 CPU cores,
# large enough that splitting its matrices across 8 devices is a real choice.
# The blocks are marked with autopar.layer_boundary: the pipeline search then solves the
# ILP of each distinct layer (embedding+block, block, head) once per mesh.
DEMO_GPT = dict(
    vocab_size=256, seq_len=32, hidden=64, num_layers=4, num_heads=4, layer_markers=True
)
DEMO_BATCH_SIZE = 16
# Searching one microbatch count keeps the demo's planning to well under a minute on two
# CPU cores; num_microbatches="auto" tries several (each a full layer-cost pass).
DEMO_MICROBATCHES = 2
DEFAULT_STEPS = 5
# The largest loss difference to one device the demo accepts: float32 sums in another
# order differ by ~1e-6 relative per step; Adam can grow that over a few steps.
LOSS_TOLERANCE = 1e-3


@dataclass(frozen=True)
class DemoResult:
    """What `run_demo` did: the plan, both loss curves, the files written."""

    plan: object
    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    files: tuple[Path, ...]
    seconds: dict = field(default_factory=dict)

    @property
    def max_difference(self) -> float:
        return max_difference(self.losses, self.reference_losses)


def max_difference(losses, reference_losses) -> float:
    """The largest absolute difference between two loss curves, step by step."""
    return max(abs(a - b) for a, b in zip(losses, reference_losses))


def run_demo(
    out_dir: str | Path = ".",
    num_steps: int = DEFAULT_STEPS,
    method: str = "auto",
    mesh_shape: tuple[int, ...] | None = None,
    pictures: bool = True,
    echo: Callable[[str], None] = print,
    model: Mapping[str, int] = DEMO_GPT,
) -> DemoResult:
    """Plan, train and compare the demo GPT; write the plan and its pictures.

    **Arguments:**
    - `out_dir`: where ``plan.json``, ``plan_explain.txt`` and the pictures go (created
      if missing).
    - `num_steps`: training steps.
    - `method`: the `autopar.autoparallel` method.
    - `mesh_shape`: fix the logical mesh shape (default: the planner tries every shape).
    - `pictures`: draw ``plan_layout.png`` (needs matplotlib; skipped with a note if absent).
    - `echo`: where the report lines go.
    - `model`: `GPTConfig` fields of the model (default `DEMO_GPT`).

    **Returns:** a `DemoResult`.
    """
    if num_steps < 1:
        raise ValueError(f"the demo needs at least one step, got {num_steps}")
    import jax
    import optax

    from autopar.cluster import Cluster

    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(**model)
    optimizer = optax.adamw(LEARNING_RATE)
    train_step = gpt.make_train_step(cfg, optimizer)
    cluster = Cluster.local()
    echo(
        f"autopar demo: GPT with {cfg.num_params:,} parameters (hidden {cfg.hidden}, "
        f"{cfg.num_layers} layers, sequence {cfg.seq_len}, batch {DEMO_BATCH_SIZE}), "
        f"{num_steps} AdamW steps on {cluster.num_devices} {cluster.device_kind} device(s)"
    )
    init = jax.jit(lambda key: gpt.init_state(cfg, optimizer, key))
    batch = jax.jit(lambda key: gpt.make_batch(cfg, DEMO_BATCH_SIZE, key))(jax.random.key(1))
    step, losses, seconds = _train_planned(train_step, cluster, method, mesh_shape, init,
                                           batch, num_steps)
    echo("")
    explained = step.explain()  # beside the plans a user would write by hand
    echo(explained)
    echo("")

    reference_losses = _one_device_losses(train_step, init, batch, num_steps)
    _print_losses(losses, reference_losses, echo)
    echo(", ".join(f"{name}: {value:.2f} s" for name, value in seconds.items()))
    if num_steps > 1:
        from autopar.report import step_time_comparison

        measured = seconds["later steps"] / (num_steps - 1)
        echo(step_time_comparison(step.plan.predicted_step_time, measured,
                                  step.plan.cluster.get("name")))
    timeline = _timeline(step, init, batch) if pictures else None
    files = _write_files(step.plan, Path(out_dir), pictures, echo, timeline, explained)
    return DemoResult(step.plan, tuple(losses), tuple(reference_losses), files, seconds)


def _train_planned(train_step, cluster, method, mesh_shape, init, batch, num_steps: int):
    """The step under `autoparallel` trained `num_steps` steps. **Returns:** (the
    decorated step, its losses, {phase: seconds})."""
    import jax

    from autopar.app._autoparallel import autoparallel

    seconds = {}
    step = autoparallel(
        train_step, cluster=cluster, method=method, mesh_shape=mesh_shape,
        num_microbatches=DEMO_MICROBATCHES,
        donate=True,  # the new state reuses the old one's buffers: one state less in memory
    )
    start = time.perf_counter()
    losses = _train(step, init(jax.random.key(0)), batch, num_steps, seconds)
    seconds["autopar, all steps"] = time.perf_counter() - start
    return step, losses, seconds


def _one_device_losses(train_step, init, batch, num_steps: int) -> list[float]:
    """The losses of the same steps under plain `jax.jit` on the first device."""
    import jax

    one_device = jax.devices()[0]
    reference = jax.jit(train_step)
    state = jax.device_put(init(jax.random.key(0)), one_device)
    return _train(reference, state, jax.device_put(batch, one_device), num_steps, {})


def _timeline(step, init, batch):
    """A pipelined plan's recorded task timeline for the schedule picture; None for a
    plan that runs as one program. Two more steps, recording when each stage's tasks ran:
    the first recorded step compiles the per-task programs (the runtime runs a pipelined
    step as one program otherwise), so the picture shows the second."""
    import jax

    if step.plan.runtime != "pipeline":
        return None
    timeline = None
    state = init(jax.random.key(0))
    for _ in range(2):
        (state, _), timeline = step.record_timeline(state, batch)
    return timeline


def _train(step, state, batch, num_steps: int, seconds: dict) -> list[float]:
    """Losses of `num_steps` steps; the first step's time (plan + compile) into `seconds`."""
    losses = []
    for i in range(num_steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        key = "first step (trace, plan, compile)" if i == 0 else "later steps"
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
    return losses


def _print_losses(losses, reference_losses, echo: Callable[[str], None]) -> None:
    echo(f"{'step':>4}  {'autopar loss':>12}  {'1-device loss':>13}  {'|difference|':>12}")
    for i, (a, b) in enumerate(zip(losses, reference_losses)):
        echo(f"{i:>4}  {a:>12.6f}  {b:>13.6f}  {abs(a - b):>12.2e}")
    worst = max_difference(losses, reference_losses)
    verdict = "ok" if worst <= LOSS_TOLERANCE else "TOO LARGE"
    echo(f"max |difference| {worst:.2e} (tolerance {LOSS_TOLERANCE:g}): {verdict}")


def _write_files(plan, out_dir: Path, pictures: bool, echo, timeline=None,
                 explained: str | None = None) -> tuple[Path, ...]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / "plan.json"
    plan.save(plan_path)
    explain_path = out_dir / "plan_explain.txt"
    explain_path.write_text((explained or plan.explain()) + "\n")
    files = [plan_path, explain_path]
    if pictures:
        try:
            files += _draw(plan, out_dir, timeline)
        except ImportError as err:
            echo(f"pictures skipped: {err}")
    echo("wrote " + ", ".join(str(f) for f in files))
    return tuple(files)


def _draw(plan, out_dir: Path, timeline=None) -> list[Path]:
    from autopar.report import gantt, gantt_compare, plan_schedule, plot_layout

    files = [plot_layout(plan, out_dir / "plan_layout.png")]
    if plan.runtime == "pipeline" or plan.num_stages > 1:
        path = out_dir / "schedule.png"
        if timeline:  # predicted above, measured below, each on its own time axis
            files.append(gantt_compare(plan_schedule(plan), timeline, path,
                                       profile=plan.cluster.get("name")))
        else:
            title = f"{plan.schedule}, {plan.num_microbatches} microbatches, predicted"
            files.append(gantt(plan_schedule(plan), path, title=title))
    return files
