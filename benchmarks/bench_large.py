"""Large models on virtual clusters: autopar's plan against the best Megatron-style plan.

In: a `Row` (a GPT, MoE or Llama configuration by name, a cost profile and a number of its
hosts, the global batch) and the microbatch counts to try. Out: a `RowResult`: planning
time by phase, predicted step time and TFLOP/s per GPU of both planners, and each chosen
plan in one line. Nothing executes; every figure comes from the shared cost model.

The Megatron baseline is the full grid of `autopar.manual.megatron_grid_search`, the one
`autopar compare` and users search: dp x tp x pp x sequence parallelism x distributed
optimizer (ZeRO-1) x recompute x interleaving, pruned by Megatron's rules (tp inside a host,
tp | heads, pp·v | layers; Narayanan et al. 2021, Korthikanti et al. 2022; REFERENCES.md
"Megatron-LM plans"), with the same microbatch counts as autopar, each configuration
planned on the step traced at one microbatch, so pp = 1 plans accumulate gradients over
microbatches as Megatron does. Recompute is costed only where a configuration does not
fit without it (it only adds time).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import optax

from autopar.cluster import Cluster
from autopar.graph import trace
from autopar.manual import megatron_grid_search
from autopar.report import weights_split_across_hosts
from autopar.search import microbatch_args, plan
from examples import gpt, llama, moe

log = logging.getLogger("autopar.benchmarks")

# The profile of a row that names none (every GPT and MoE row).
PROFILE = "dgx-a100-80g"
# Model families: the example module of each. Llama runs its layers with `jax.lax.scan`
# over stacked weights with each layer checkpointed, as MaxText (`scan_layers`,
# `remat_policy: full`) writes it, so it has no layer marks.
FAMILIES = {"gpt": gpt, "moe": moe, "llama": llama}
SCANNED_FAMILIES = ("llama",)
TERA = 1e12
# Alpa's GPT and MoE benchmarks use a global batch of 1024 sequences (Zheng et al. 2022,
# benchmark/alpa/suite_*.py); the sequence length is the config's.
GLOBAL_BATCH = 1024


@dataclass(frozen=True)
class Row:
    """One benchmark row: `family` "gpt", "moe" or "llama", `model` a config name of that
    example, `num_hosts` hosts of the cost profile `profile`."""

    family: str
    model: str
    num_hosts: int
    global_batch: int = GLOBAL_BATCH
    profile: str = PROFILE
    tag: str = ""  # appended to the key: a second row of the same model and GPUs

    @property
    def key(self) -> str:
        """The row's name on the command line, e.g. ``gpt-1.3B@8``."""
        return f"{self.family}-{self.model}@{self.num_gpus}{self.tag}"

    @property
    def num_gpus(self) -> int:
        return self.num_hosts * self.cluster().devices_per_host

    def cluster(self) -> Cluster:
        """The row's virtual cluster."""
        return Cluster.from_profile(self.profile, num_hosts=self.num_hosts)

    @property
    def num_layers(self) -> int:
        """Layers of the row's model (the pipeline degrees Megatron may use)."""
        return _config(self).num_layers


@dataclass(frozen=True)
class PlannerResult:
    """One planner's best plan of a row."""

    step_time: float  # predicted seconds
    tflops_per_gpu: float
    plan_line: str
    planning_seconds: float
    schedule: str = "-"  # `schedule_label` of the plan
    phases: dict[str, float] = field(default_factory=dict)
    # Matmul weights split across hosts where the matmul reads them (tensor parallelism
    # over the slow links; `autopar.report.weights_split_across_hosts`).
    cross_host_splits: tuple[str, ...] = ()
    # What the plan recomputes, by layer (`remat_label`; issue 15 asks the table for it).
    remat: str = "-"


@dataclass(frozen=True)
class RowResult:
    """Both planners on one row."""

    row: Row
    num_gpus: int
    total_flops: float
    auto: PlannerResult | None
    megatron: PlannerResult | None
    notes: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        """autopar's predicted throughput over Megatron's (> 1: autopar is faster)."""
        if self.auto is None or self.megatron is None:
            return None
        return self.megatron.step_time / self.auto.step_time


def _config(row: Row):
    module = FAMILIES.get(row.family)
    if module is None:
        raise ValueError(
            f"unknown model family {row.family!r}; use one of {', '.join(FAMILIES)}"
        )
    if row.model not in module.CONFIGS:
        raise ValueError(
            f"unknown {row.family} config {row.model!r}; choose one of "
            f"{', '.join(module.CONFIGS)}"
        )
    return module.CONFIGS[row.model]


def model_step(row: Row, *, loop: bool = False):
    """``(train step, abstract args)`` of a row's model in bfloat16, with layer marks or
    (Llama) with its layers scanned.

    **Arguments:**
    - `row`: the `Row`.
    - `loop`: write a scanned family's layers as a Python loop with layer marks instead
      (the same computation). The Megatron baseline plans this form: Megatron-LM runs its
      layers as a loop, and `megatron_plan` places no weight whose first use is a scan.

    **Returns:** the train step and ``(abstract state, abstract batch)``.
    """
    module, cfg = FAMILIES[row.family], _config(row)
    # Realistic mixed precision (issue 14): bf16 compute, fp32 master weights and AdamW
    # moments, where the model has the option (examples/gpt.py's GPTConfig.master_dtype).
    precision = {"master_dtype": "float32"} if hasattr(cfg, "master_dtype") else {}
    layers = (
        # Each scanned layer recomputed in the backward, as MaxText's default remat_policy
        # ("full") writes it; the loop form gets Megatron's recompute from the grid.
        {"scan_layers": True, "remat_layers": True, "layer_markers": False}
        if row.family in SCANNED_FAMILIES and not loop
        else {"layer_markers": True}
    )
    cfg = dataclasses.replace(cfg, dtype="bfloat16", **layers, **precision)
    optimizer = optax.adamw(1e-4)
    step = module.make_train_step(cfg, optimizer)
    args = (module.abstract_state(cfg, optimizer), module.abstract_batch(cfg, row.global_batch))
    return step, args


def plan_line(plan) -> str:
    """A plan in one line: ``2 stages x mesh (2, 4), 64 microbatches``."""
    shapes = [tuple(stage.mesh.shape) for stage in plan.stages]
    unique = list(dict.fromkeys(shapes))
    mesh = f"mesh {unique[0]}" if len(unique) == 1 else "meshes " + " | ".join(map(str, shapes))
    return f"{plan.method}: {plan.num_stages} stage(s) x {mesh}, {plan.num_microbatches} mb"


def schedule_label(plan) -> str:
    """The pipeline schedule a plan runs: ``1f1b``, ``interleaved_1f1b (v=2)``, ...;
    ``-`` for one stage (nothing to schedule: one program, or gradient accumulation)."""
    if plan.runtime != "pipeline" or plan.num_stages == 1:
        return "-"
    v = plan.virtual_stages
    return plan.schedule + (f" (v={v})" if v > 1 else "")


def remat_label(plan) -> str:
    """What a plan recomputes in the backward, by layer: ``none``, or runs of layers such as
    ``layers 0-19 selective, 20-23 full`` (layer numbers as the stage DP counts them; a
    Megatron plan's recompute is in its plan line)."""
    kinds = [kind for stage in plan.stage_remat for kind in stage]
    if all(kind == "none" for kind in kinds):
        return "none"
    runs: list[list] = []  # [first, last, kind]
    for k, kind in enumerate(kinds):
        if runs and runs[-1][2] == kind:
            runs[-1][1] = k
        else:
            runs.append([k, k, kind])
    return "layers " + ", ".join(
        f"{a}{'' if a == b else f'-{b}'} {kind}" for a, b, kind in runs
    )


def run_auto(step, args, cluster, microbatches: Sequence[int], flops: float,
             schedule: str = "1f1b") -> PlannerResult:
    """`autopar.plan` once per microbatch count; the fastest predicted plan wins.
    `schedule`: the planner's schedule option (`run_benchmarks.py --schedule`, default
    "auto": the planner chooses by predicted step time).

    **Returns:** the `PlannerResult`; phases are summed over the microbatch counts.
    Raises the last ValueError if no count gives a plan.
    """
    best, phases, error = None, {}, None
    start = time.perf_counter()
    for m in microbatches:
        try:
            # A dry run scored by prediction: the microbatch-math check (the step compiled
            # and run on the host twice more) says nothing the table reports, and skips
            # the large rows by their size anyway.
            p = plan(step, *args, cluster=cluster, num_microbatches=m, schedule=schedule,
                     cache=False, microbatch_check="off")
        except ValueError as err:
            error = err
            log.info("auto, %d microbatches: no plan (%s)", m, str(err)[:120])
            continue
        for name, seconds in p.timings.items():
            phases[name] = phases.get(name, 0.0) + seconds
        log.info("auto, %d microbatches: %.4g s predicted", m, p.predicted_step_time)
        if best is None or p.predicted_step_time < best.predicted_step_time:
            best = p
    if best is None:
        raise error
    seconds = time.perf_counter() - start
    graph = trace(step, *microbatch_args(args, (1,), best.num_microbatches))
    return _result(best, cluster, flops, seconds, phases, graph)


def run_megatron(step, args, cluster, microbatches: Sequence[int], num_layers: int,
                 flops: float, pp_values: Sequence[int] | None = None,
                 num_heads: int | None = None) -> tuple[PlannerResult, int]:
    """The best plan of the full Megatron grid (`autopar.manual.megatron_grid_search`, the
    grid `autopar compare` and users search) with the row's microbatch counts.

    **Returns:** (result, configurations costed). Raises ValueError naming every
    configuration's reason when none works.
    """
    start = time.perf_counter()
    graphs: dict = {}
    best, grid = megatron_grid_search(
        step, *args, cluster=cluster, microbatch_counts=microbatches, pp_values=pp_values,
        num_layers=num_layers, num_heads=num_heads, traces=graphs,
    )
    seconds = time.perf_counter() - start
    costed = sum(1 for _, outcome in grid if isinstance(outcome, float))
    log.info("Megatron grid: %d configurations, %d costed, best %s: %.4g s predicted",
             len(grid), costed, best.method, best.predicted_step_time)
    phases = {"grid": seconds}
    graph = graphs[best.num_microbatches]
    return _result(best, cluster, flops, seconds, phases, graph), costed


def run_row(row: Row, microbatches: Sequence[int],
            pp_values: Sequence[int] | None = None, schedule: str = "1f1b",
            megatron_grid: bool = True) -> RowResult:
    """Plan one row with both planners.

    **Arguments:**
    - `row`: the model and cluster.
    - `microbatches`: the microbatch counts both planners may use.
    - `pp_values`: limit the Megatron grid's pipeline degrees (None: all).
    - `schedule`: autopar's schedule option (the planner's default "1f1b" here;
      `run_benchmarks.py` passes "auto", chosen by predicted step time).
    - `megatron_grid`: False skips the Megatron grid (`run_benchmarks.py --no-megatron`).

    **Returns:** the `RowResult` (a planner that finds no plan is None, with a note).
    """
    step, args = model_step(row)
    cluster = row.cluster()
    flops = trace(step, *args).total_flops
    num_layers = row.num_layers
    notes = [f"global batch {row.global_batch}"] if row.tag else []
    auto = megatron = None
    try:
        auto = run_auto(step, args, cluster, microbatches, flops, schedule)
    except ValueError as err:
        notes.append(f"autopar found no plan: {str(err)[:200]}")
    module = {"gpt": gpt, "moe": moe, "llama": llama}.get(row.family)
    num_heads = getattr(module.CONFIGS[row.model], "num_heads", None) if module else None
    if not megatron_grid:
        notes.append("Megatron grid not run (--no-megatron)")
        return RowResult(row, cluster.num_devices, flops, auto, None, tuple(notes))
    if row.family in SCANNED_FAMILIES:  # the same model, its layers a loop (`model_step`)
        step, args = model_step(row, loop=True)
        notes.append("Megatron planned on the Python-loop form of the layers")
    try:
        megatron, tried = run_megatron(
            step, args, cluster, microbatches, num_layers, flops, pp_values, num_heads
        )
        notes.append(f"{tried} Megatron configurations costed")
    except ValueError as err:
        notes.append(f"Megatron grid found no plan: {str(err)[:200]}")
    return RowResult(row, cluster.num_devices, flops, auto, megatron, tuple(notes))


def least_memory_per_device(row: Row, num_microbatches: int) -> float:
    """A lower bound on the bytes per device any plan of the row needs with
    `num_microbatches`: parameters, optimizer state, gradients and one microbatch's kept
    activations, each split over every GPU (no plan splits further). A layer keeps the
    lesser of what its backward reads from its forward and, with full recompute, the
    activations its forward reads (the layer's input)."""
    from autopar.graph import Role
    from autopar.inter.passes._layers import assign_layers
    from autopar.inter.passes._partition import partition

    step, args = model_step(row, loop=True)  # the layer marks delimit layers
    graph = trace(step, *microbatch_args(args, (1,), num_microbatches), batch_argnums=(1,))
    layers = assign_layers(graph)
    part = partition(graph, layers, [(k, k + 1) for k in range(layers.num_layers)])
    state = sum(
        graph.vars[v].nbytes for v in graph.invars
        if graph.vars[v].role in (Role.PARAM, Role.OPT_STATE)
    )
    grads = sum(graph.vars[v].nbytes for v in part.grad_vars)
    state_roles = (Role.PARAM, Role.OPT_STATE)
    kept = 0
    for k in range(layers.num_layers):
        forward, backward = part.forward[k], part.backward[k]
        stored = sum(graph.vars[v].nbytes
                     for v in set(forward.outputs) & set(backward.inputs))
        inputs = sum(graph.vars[v].nbytes for v in set(forward.inputs)
                     if graph.vars[v].role not in state_roles)
        kept += min(stored, inputs)
    return (state + grads + kept) / row.num_gpus


def _result(p, cluster, flops, seconds, phases, graph) -> PlannerResult:
    step_time_ = p.predicted_step_time
    return PlannerResult(
        step_time=step_time_,
        tflops_per_gpu=flops / (step_time_ * cluster.num_devices) / TERA,
        plan_line=plan_line(p),
        planning_seconds=seconds,
        schedule=schedule_label(p),
        phases=dict(phases),
        remat=remat_label(p),
        cross_host_splits=tuple(
            weights_split_across_hosts(p, graph, cluster.devices_per_host)
        ),
    )

