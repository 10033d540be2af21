"""Large models on virtual clusters: autopar's plan against the best Megatron-style plan.

In: a `Row` (a GPT, MoE or Llama configuration by name, a cost profile and a number of its
hosts, the global batch) and the microbatch counts to try. Out: a `RowResult`: planning
time by phase, predicted step time and TFLOP/s per GPU of both planners, and each chosen
plan in one line. Nothing executes; every figure comes from the shared cost model.

The Megatron baseline is a grid over dp x tp x pp (tp inside a host, Narayanan et al. 2021;
REFERENCES.md "Megatron-LM plans"), sequence parallelism on and off (Korthikanti et al.
2022) and the same microbatch counts, each configuration
planned on the step traced at one microbatch (`megatron_plan_for_graph`), so pp = 1 plans
accumulate gradients over microbatches as Megatron does. The distributed optimizer (ZeRO-1)
is tried only when a configuration does not fit without it (it changes memory, not time).
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
from autopar.manual import MegatronConfig, megatron_plan_for_graph
from autopar.report import weights_split_across_hosts
from autopar.search import microbatch_args, plan
from examples import gpt, llama, moe

log = logging.getLogger("autopar.benchmarks")

# The profile of a row that names none (every GPT and MoE row).
PROFILE = "dgx-a100-80g"
# Model families: the example module of each. Llama runs its layers with `jax.lax.scan`
# over stacked weights, as MaxText (`scan_layers`) writes it, so it has no layer marks.
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

    @property
    def key(self) -> str:
        """The row's name on the command line, e.g. ``gpt-1.3B@8``."""
        return f"{self.family}-{self.model}@{self.num_gpus}"

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
    phases: dict[str, float] = field(default_factory=dict)
    # Matmul weights split across hosts where the matmul reads them (tensor parallelism
    # over the slow links; `autopar.report.weights_split_across_hosts`).
    cross_host_splits: tuple[str, ...] = ()


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
        {"scan_layers": True, "layer_markers": False}
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


def run_auto(step, args, cluster, microbatches: Sequence[int], flops: float) -> PlannerResult:
    """`autopar.plan` once per microbatch count; the fastest predicted plan wins.

    **Returns:** the `PlannerResult`; phases are summed over the microbatch counts.
    Raises the last ValueError if no count gives a plan.
    """
    best, phases, error = None, {}, None
    start = time.perf_counter()
    for m in microbatches:
        try:
            p = plan(step, *args, cluster=cluster, num_microbatches=m, cache=False)
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


def megatron_configs(num_gpus: int, gpus_per_host: int, num_layers: int, batch: int,
                     microbatches: Sequence[int],
                     pp_values: Sequence[int] | None = None) -> list[MegatronConfig]:
    """Every dp x tp x pp x microbatch count x sequence parallelism (with tp > 1) with
    tp <= gpus per host, pp <= layers and a whole number of examples per microbatch per
    data-parallel rank; `pp_values`, if given, limits pp to those values."""
    configs = []
    for pp in _divisors(num_gpus):
        if pp > num_layers or (pp_values is not None and pp not in pp_values):
            continue
        for tp in _divisors(num_gpus // pp):
            dp = num_gpus // (pp * tp)
            if tp > gpus_per_host:
                continue
            for m in microbatches:
                if batch % (m * dp) == 0:
                    for sp in (False, True) if tp > 1 else (False,):
                        configs.append(MegatronConfig(
                            dp=dp, tp=tp, pp=pp, num_microbatches=m, sequence_parallel=sp,
                        ))
    return configs


def run_megatron(step, args, cluster, microbatches: Sequence[int], num_layers: int,
                 flops: float, pp_values: Sequence[int] | None = None
                 ) -> tuple[PlannerResult, int]:
    """The best Megatron plan of the grid. **Returns:** (result, configurations planned)."""
    start = time.perf_counter()
    phases = {"trace": 0.0, "intra_op_ilp": 0.0}
    graphs = {}
    best, tried, failures = None, 0, []
    batch = args[1]["tokens"].shape[0]
    for config in megatron_configs(cluster.num_devices, cluster.devices_per_host, num_layers,
                                   batch, microbatches, pp_values):
        m = config.num_microbatches
        if m not in graphs:
            t = time.perf_counter()
            graphs[m] = trace(step, *microbatch_args(args, (1,), m))
            phases["trace"] += time.perf_counter() - t
        t = time.perf_counter()
        p = _megatron_plan(graphs[m], cluster, config)
        phases["intra_op_ilp"] += time.perf_counter() - t
        tried += 1
        if isinstance(p, str):
            failures.append(f"{config.name}: {p}")
            continue
        log.info("%s: %.4g s predicted", config.name, p.predicted_step_time)
        if best is None or p.predicted_step_time < best.predicted_step_time:
            best = p
    if best is None:
        raise ValueError("no Megatron configuration fits:\n" + "\n".join(failures))
    seconds = time.perf_counter() - start
    graph = graphs[best.num_microbatches]
    return _result(best, cluster, flops, seconds, phases, graph), tried


def _megatron_plan(graph, cluster, config):
    """A plan, retried with the distributed optimizer if it does not fit; else why not."""
    try:
        return megatron_plan_for_graph(graph, cluster, config)
    except (ValueError, NotImplementedError) as err:
        first = f"{type(err).__name__}: {str(err)[:160]}"
    try:
        return megatron_plan_for_graph(
            graph, cluster, dataclasses.replace(config, distributed_optimizer=True)
        )
    except (ValueError, NotImplementedError):
        return first


def run_row(row: Row, microbatches: Sequence[int],
            pp_values: Sequence[int] | None = None) -> RowResult:
    """Plan one row with both planners.

    **Arguments:**
    - `row`: the model and cluster.
    - `microbatches`: the microbatch counts both planners may use.
    - `pp_values`: limit the Megatron grid's pipeline degrees (None: all).

    **Returns:** the `RowResult` (a planner that finds no plan is None, with a note).
    """
    step, args = model_step(row)
    cluster = row.cluster()
    flops = trace(step, *args).total_flops
    num_layers = row.num_layers
    notes = []
    auto = megatron = None
    try:
        auto = run_auto(step, args, cluster, microbatches, flops)
    except ValueError as err:
        notes.append(f"autopar found no plan: {str(err)[:200]}")
    if row.family in SCANNED_FAMILIES:  # the same model, its layers a loop (`model_step`)
        step, args = model_step(row, loop=True)
        notes.append("Megatron planned on the Python-loop form of the layers")
    try:
        megatron, tried = run_megatron(
            step, args, cluster, microbatches, num_layers, flops, pp_values
        )
        notes.append(f"{tried} Megatron configurations planned")
    except ValueError as err:
        notes.append(f"Megatron grid found no plan: {str(err)[:200]}")
    return RowResult(row, cluster.num_devices, flops, auto, megatron, tuple(notes))


def least_memory_per_device(row: Row, num_microbatches: int) -> float:
    """A lower bound on the bytes per device any plan of the row needs with
    `num_microbatches`: parameters, optimizer state, gradients and one microbatch's kept
    activations, each split over every GPU (no plan splits further; none keeps less
    without rematerialisation)."""
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
    kept = sum(
        graph.vars[v].nbytes
        for k in range(layers.num_layers)
        for v in set(part.forward[k].outputs) & set(part.backward[k].inputs)
    )
    return (state + grads + kept) / row.num_gpus


def _result(p, cluster, flops, seconds, phases, graph) -> PlannerResult:
    step_time_ = p.predicted_step_time
    return PlannerResult(
        step_time=step_time_,
        tflops_per_gpu=flops / (step_time_ * cluster.num_devices) / TERA,
        plan_line=plan_line(p),
        planning_seconds=seconds,
        phases=dict(phases),
        cross_host_splits=tuple(
            weights_split_across_hosts(p, graph, cluster.devices_per_host)
        ),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
