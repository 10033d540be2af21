"""`megatron_grid_search`: the best Megatron-style plan over Megatron's whole space.

In: a train step, abstract arguments, a cluster and the values to try. Out: the plan with
the least predicted step time, and every configuration considered with its predicted time
or the reason it was left out.

The grid is dp × tp × pp × sequence parallelism × distributed optimizer (ZeRO-1) ×
recompute × interleaving (virtual stages) × microbatch counts. Megatron's rules prune it
before anything is costed (Narayanan et al. 2021, Korthikanti et al. 2022; REFERENCES.md
"Megatron-LM plans"), each pruned configuration reported with the rule it breaks:

- dp·tp·pp is the number of devices; tp stays inside a host (tp <= devices per host);
- tp divides the number of attention heads (when known);
- pp·virtual_stages divides the number of layers (pipelines need `layer_boundary` marks);
- the batch splits into whole microbatches per data-parallel rank; a pipeline has at least
  as many microbatches as stages, and the interleaved schedule a multiple of pp;
- sequence parallelism only with tp > 1, interleaving only with pp > 1;
- context parallelism: cp splits the sequence into 2·cp balanced chunks
  (seq % (2·cp) == 0), dp·cp·tp·pp devices (tried with the model's `attention` shape);
- expert parallelism (with a `moe` shape): ep divides the routed experts and ep·etp the
  tp·cp·dp devices of a stage (Megatron-Core MoE; etp = tp or 1).

Every remaining configuration is planned on the step traced at ITS microbatch size (one
trace per size, cached), so a configuration costs what `megatron_plan` says it costs.
Recompute only adds time, so it is costed in the order given ("none" first) and a later
value only where the earlier ones do not fit in memory; likewise gradient accumulation
without pipelining (pp = 1): more microbatches only where fewer do not fit. The others are
reported as not needed. A configuration that does not fit reports the memory error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from autopar._memo import search_scoped
from autopar.graph import OpGraph, Role, trace
from autopar.intra import MemoryBudgetError
from autopar.manual._context_experts import AttentionShape, MoEShape, context_args
from autopar.manual._layout import MegatronConfig
from autopar.manual._megatron import megatron_plan_for_graph
from autopar.plan import Plan
from autopar.search import microbatch_args, resolve_cluster

log = logging.getLogger("autopar")

GridResult = tuple[MegatronConfig, float | str]  # predicted seconds, or why it was left out

# Prefixes of the reasons a configuration was not costed (the rest are planning errors).
PRUNED = "pruned"
NOT_NEEDED = "not needed"


@search_scoped
def megatron_grid_search(
    step_fn: Callable,
    *abstract_args: Any,
    cluster: Any,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    sequence_parallel: Sequence[bool] = (False, True),
    pp_values: Sequence[int] | None = None,
    distributed_optimizer: Sequence[bool] = (False, True),
    recompute: Sequence[str] = ("none", "selective", "full"),
    zero2: Sequence[bool] = (False,),
    virtual_stages: Sequence[int] = (1, 2),
    num_heads: int | None = None,
    num_layers: int | None = None,
    donate_argnums: Sequence[int] = (0,),
    batch_argnums: Sequence[int] = (1,),
    memory_budget: float | None = None,
    traces: dict[int, OpGraph] | None = None,
    microbatch_counts: Sequence[int] | None = None,
    attention: AttentionShape | None = None,
    cp_values: Sequence[int] | None = None,
    moe: MoEShape | None = None,
    ep_values: Sequence[int] | None = None,
    etp_values: Sequence[int | None] | None = None,
    tp_values: Sequence[int] | None = None,
    plans: dict[MegatronConfig, Plan] | None = None,
    uneven_stages: bool = False,
) -> tuple[Plan, list[GridResult]]:
    """Try every valid Megatron configuration; return the fastest predicted plan.

    **Arguments:**
    - `step_fn`, `abstract_args`, `cluster`: as for `megatron_plan`.
    - `microbatch_sizes`: examples per microbatch per data-parallel rank; each that
      divides the batch gives a microbatch count (pp = 1 included: gradient
      accumulation). One microbatch (the whole batch) is always tried; ``()``: only it.
    - `microbatch_counts`: numbers of microbatches to try instead of `microbatch_sizes`
      (each that splits the batch into whole examples per data-parallel rank; one
      microbatch only if listed), e.g. to give the grid the counts autopar searches.
    - `sequence_parallel`, `pp_values` (None: every divisor of the device count),
      `distributed_optimizer`, `recompute`, `virtual_stages`: the values to try.
    - `zero2`: with the distributed optimizer, also keep the gradients sharded
      (`MegatronConfig.zero2`): ``(False, True)`` tries both, so the grid takes ZeRO-2
      where only it fits or it is faster; default ZeRO-1 only.
    - `num_heads`: attention heads, for the rule tp | heads (None: not checked; a weight
      tp cannot split still fails when planned).
    - `num_layers`: layers, for the rule pp·v | layers (None: the forward pass's
      `layer_boundary` marks; unmarked steps are not pipelined).
    - `donate_argnums`, `batch_argnums`, `memory_budget`: as for `megatron_plan`.
    - `traces`: ``{number of microbatches: the step traced at that microbatch size}``
      (``{(microbatches, cp): ...}`` for cp > 1), read and filled (pass a dict to reuse
      the traces afterwards, e.g. to explain the best plan).
    - `attention`: the model's `AttentionShape`; with it the grid tries context
      parallelism, `cp_values` (None: every divisor of the devices whose 2·cp chunks
      divide the sequence; without `attention`: cp = 1 only).
    - `tp_values`: the tensor-parallel degrees to try (None: every divisor).
    - `moe`: the MoE's `MoEShape` when the step is its dense proxy; with it the grid
      tries `ep_values` (None: every divisor of the experts that divides tp·cp·dp) and
      `etp_values` (None: ``(None, 1)``, i.e. etp = tp or 1).
    - `plans`: a dict filled with the plan of every configuration costed (by its config,
      as `results` names it), for callers that want more than the time (`autopar.space`).
    - `uneven_stages`: also try a pp (without interleaving) that does not divide the
      layers, its stages split as evenly as the marks allow: Megatron-LM's
      ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``,
      which a model with a prime layer count needs to pipeline at all (DeepSeek-V3's 61).

    **Returns:** ``(best plan, results)``; `results` lists every configuration
    considered, in order, with its predicted step time in seconds or a string saying why
    it was not costed (``pruned: <rule>``, ``not needed: ...``) or could not be planned
    (``MemoryBudgetError: ...``). Raises ValueError naming every reason if no
    configuration works. Progress goes to the ``autopar`` logger at INFO.

    **Example:**

    ```python
    best, results = megatron_grid_search(step, state, batch, cluster="dgx-a100-80g")
    for config, outcome in results:
        print(config.name, outcome)
    ```
    """
    cluster = resolve_cluster(cluster)
    batch_argnums = tuple(batch_argnums)
    _check_values(microbatch_sizes, pp_values, virtual_stages, recompute, microbatch_counts)
    graphs = _Traces(step_fn, abstract_args, batch_argnums,
                     {} if traces is None else traces)
    graph = graphs(1)
    seq_len = _sequence_length(graph)
    if cp_values is None:
        cp_values = _divisors(cluster.num_devices) if attention is not None else (1,)
    candidates = megatron_candidates(
        cluster.num_devices,
        cluster.devices_per_host,
        _batch_size(graph),
        num_layers=_num_layers(graph) if num_layers is None else num_layers,
        num_heads=num_heads,
        microbatch_sizes=microbatch_sizes,
        sequence_parallel=sequence_parallel,
        pp_values=pp_values,
        distributed_optimizer=distributed_optimizer,
        zero2=zero2,
        virtual_stages=virtual_stages,
        microbatch_counts=microbatch_counts,
        cp_values=cp_values,
        seq_len=seq_len,
        num_experts=moe.num_experts if moe is not None else None,
        ep_values=ep_values,
        etp_values=etp_values,
        tp_values=tp_values,
        uneven_stages=uneven_stages,
    )
    results: list[GridResult] = [(c, reason) for c, reason in candidates if reason]
    to_cost = [c for c, reason in candidates if not reason]
    coster = _Coster(graphs, cluster, recompute, donate_argnums, memory_budget,
                     marked=any(n.primitive == "layer_boundary" for n in graph.nodes),
                     results=results, attention=attention, moe=moe, plans=plans)
    return _fastest(coster, to_cost, cluster), results


def _fastest(coster: _Coster, to_cost: Sequence[MegatronConfig], cluster) -> Plan:
    """The plan of least predicted step time among `to_cost`, costed in order by `coster`
    (which records every outcome); ValueError naming every outcome when none works."""
    best: Plan | None = None
    for index, config in enumerate(to_cost):
        plan = coster.cost(config, f"grid {index + 1}/{len(to_cost)}")
        if plan is not None and (best is None
                                 or plan.predicted_step_time < best.predicted_step_time):
            best = plan
    if best is None:
        reasons = "\n".join(f"  {c.name}: {outcome}" for c, outcome in coster.results)
        raise ValueError(
            f"no Megatron configuration of this step works on {cluster.num_devices} devices "
            f"of {cluster.name!r}:\n{reasons or '  (no valid configuration)'}\n"
            "Use more devices or memory, or other pp_values / microbatch_sizes."
        )
    return best


class _Traces:
    """The step traced at each microbatch count's microbatch size, once per count (read
    from and filled into `graphs`)."""

    def __init__(self, step_fn, abstract_args, batch_argnums, graphs: dict[int, OpGraph]):
        self.step_fn, self.abstract_args, self.batch_argnums = (
            step_fn, abstract_args, batch_argnums)
        self.graphs = graphs

    def __call__(self, num_microbatches: int, cp: int = 1) -> OpGraph:
        key = num_microbatches if cp == 1 else (num_microbatches, cp)
        if key not in self.graphs:
            args = context_args(self.abstract_args, self.batch_argnums, cp)
            if num_microbatches > 1:
                args = microbatch_args(args, self.batch_argnums, num_microbatches)
            self.graphs[key] = trace(self.step_fn, *args, batch_argnums=self.batch_argnums)
        return self.graphs[key]


class _Coster:
    """Costs the grid's configurations one at a time, each with the recompute values in
    order until one fits, appending every outcome to `results`; remembers which pp = 1
    configurations fit with how many microbatches (more only add time)."""

    def __init__(self, graphs: _Traces, cluster, recompute, donate_argnums, memory_budget,
                 *, marked: bool, results: list[GridResult], attention=None, moe=None,
                 plans: dict | None = None):
        self.attention, self.moe = attention, moe
        self.plans = plans  # config -> plan of every configuration costed, when asked
        self.graphs, self.cluster, self.recompute = graphs, cluster, recompute
        self.donate_argnums, self.memory_budget = donate_argnums, memory_budget
        self.marked, self.results = marked, results
        self.solve_cache: dict = {}  # layer ILPs shared by configurations with one problem
        self.fits_with: dict[MegatronConfig, int] = {}  # pp = 1 configuration -> microbatches
        self.start = time.perf_counter()

    def cost(self, config: MegatronConfig, progress: str) -> Plan | None:
        """The plan of `config` with the first recompute value that fits, or None."""
        accumulation = replace(config, num_microbatches=1)
        if config.pp == 1 and accumulation in self.fits_with:
            self.results.append((config, f"{NOT_NEEDED}: fits with "
                                         f"{self.fits_with[accumulation]} microbatch(es) "
                                         "(accumulation only adds time)"))
            return None
        for r, remat in enumerate(self.recompute):
            candidate = replace(config, recompute=remat)
            if remat != "none" and not self.marked:
                self.results.append((candidate, f"{PRUNED}: recompute runs per layer and the "
                                                "step has no autopar.layer_boundary marks"))
                continue
            try:
                plan = megatron_plan_for_graph(
                    self.graphs(candidate.num_microbatches, candidate.cp), self.cluster,
                    candidate, donate_argnums=self.donate_argnums,
                    memory_budget=self.memory_budget, solve_cache=self.solve_cache,
                    attention=self.attention, moe=self.moe,
                )
            except ValueError as err:  # MemoryBudgetError is a ValueError
                self.results.append((candidate, f"{type(err).__name__}: {err}"))
                log.info("%s %s: %s (%.0f s)", progress, candidate.name, type(err).__name__,
                         time.perf_counter() - self.start)
                if _out_of_memory(err):
                    continue
                return None
            self.results.append((candidate, plan.predicted_step_time))
            if self.plans is not None:
                self.plans[candidate] = plan
            log.info("%s %s: predicted %.4g s (%.0f s)", progress, candidate.name,
                     plan.predicted_step_time, time.perf_counter() - self.start)
            if config.pp == 1 and remat == "none":
                # more microbatches only add time to a plan that recomputes nothing; one
                # that fits only with recompute may run faster accumulating without it
                self.fits_with[accumulation] = config.num_microbatches
            for later in self.recompute[r + 1:]:
                self.results.append((replace(config, recompute=later),
                                     f"{NOT_NEEDED}: fits with recompute={remat} "
                                     "(recompute only adds time)"))
            return plan
        return None


def megatron_candidates(
    num_devices: int,
    devices_per_host: int,
    batch_size: int | None,
    *,
    num_layers: int | None = None,
    num_heads: int | None = None,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    sequence_parallel: Sequence[bool] = (False,),
    pp_values: Sequence[int] | None = None,
    distributed_optimizer: Sequence[bool] = (False,),
    virtual_stages: Sequence[int] = (1,),
    microbatch_counts: Sequence[int] | None = None,
    cp_values: Sequence[int] = (1,),
    zero2: Sequence[bool] = (False,),
    seq_len: int | None = None,
    num_experts: int | None = None,
    ep_values: Sequence[int] | None = None,
    etp_values: Sequence[int | None] | None = None,
    tp_values: Sequence[int] | None = None,
    uneven_stages: bool = False,
) -> list[tuple[MegatronConfig, str]]:
    """Every configuration of the grid with the rule it breaks ("" when valid).

    A rule on the degrees (tp across hosts, tp ∤ heads, pp·v ∤ layers) is reported once,
    on the configuration without options; a rule on the microbatches once per count.
    Sequence parallelism is only enumerated with tp > 1, interleaving only with pp > 1.

    **Arguments:** the cluster's `num_devices` and `devices_per_host`, the global
    `batch_size` (None: no microbatching), `num_layers` (None or 1: no pipelining; the
    number of `layer_boundary`-marked layers), `num_heads` (None: unchecked), and the
    values to try, as `megatron_grid_search` takes them; `cp_values` with the sequence
    length `seq_len` (None: unchecked), and with `num_experts` (None: no MoE) the
    `ep_values` / `etp_values` (None: every ep dividing the experts and tp·cp·dp; etp = tp
    or 1); `uneven_stages`: pp need not divide the layers (pp <= layers).

    **Returns:** ``[(config, reason)]`` in enumeration order, recompute left "none".
    """
    pps = _divisors(num_devices) if pp_values is None else list(dict.fromkeys(pp_values))
    out: list[tuple[MegatronConfig, str]] = []
    for pp in pps:
        if pp < 1 or num_devices % pp:
            continue
        for tp, cp in _tp_cp(num_devices // pp, cp_values, tp_values):
            dp = num_devices // (pp * tp * cp)
            base = MegatronConfig(dp=dp, tp=tp, pp=pp, cp=cp)
            reason = (_degree_rule(base, devices_per_host, num_layers, num_heads,
                                   uneven_stages)
                      or _context_rule(cp, seq_len))
            if reason:
                out.append((base, f"{PRUNED}: {reason}"))
                continue
            for expert_base in _expert_configs(base, num_experts, ep_values, etp_values):
                out += _with_virtual(expert_base, num_layers, batch_size, microbatch_sizes,
                                     microbatch_counts, sequence_parallel,
                                     distributed_optimizer, virtual_stages, zero2)
    return out


def _with_virtual(base, num_layers, batch_size, microbatch_sizes, microbatch_counts,
                  sequence_parallel, distributed_optimizer, virtual_stages, zero2=(False,)):
    """`base` with every interleaving and microbatch count, each with its options."""
    out: list[tuple[MegatronConfig, str]] = []
    pp, dp = base.pp, base.dp
    for v in dict.fromkeys(virtual_stages):
        if v > 1 and pp == 1:
            continue
        if v > 1 and num_layers and num_layers % (pp * v):
            out.append((replace(base, virtual_stages=v, schedule="interleaved_1f1b"),
                        f"{PRUNED}: pp*v = {pp * v} model chunks do not divide the "
                        f"{num_layers} layers"))
            continue
        for m in _microbatch_counts(dp, batch_size, microbatch_sizes,
                                    microbatch_counts):
            out += _with_options(base, v, m, sequence_parallel,
                                 distributed_optimizer, zero2)
    return out


def _with_options(base: MegatronConfig, v: int, m: int, sequence_parallel,
                  distributed_optimizer, zero2=(False,)) -> list[tuple[MegatronConfig, str]]:
    """`base` with v virtual stages and m microbatches, once per sequence-parallel and
    distributed-optimizer choice, each with the rule it breaks (a broken microbatch rule
    reported once, on the first)."""
    reason = _microbatch_rule(base.pp, v, m)
    out = []
    for sp in dict.fromkeys(sequence_parallel):
        if sp and base.tp == 1:
            continue
        for zero1, grads in ((z, g) for z in dict.fromkeys(distributed_optimizer)
                             for g in dict.fromkeys(zero2) if z or not g):
            config = replace(
                base, sequence_parallel=sp, distributed_optimizer=zero1, zero2=grads,
                num_microbatches=m, virtual_stages=v,
                schedule="interleaved_1f1b" if v > 1 else base.schedule,
            )
            out.append((config, f"{PRUNED}: {reason}" if reason else ""))
            if reason:
                return out
    return out


def megatron_configs(
    num_devices: int,
    devices_per_host: int,
    batch_size: int | None,
    *,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    sequence_parallel: Sequence[bool] = (False,),
    pp_values: Sequence[int] = (1,),
    distributed_optimizer: Sequence[bool] = (False,),
    num_layers: int | None = None,
    num_heads: int | None = None,
    virtual_stages: Sequence[int] = (1,),
    microbatch_counts: Sequence[int] | None = None,
) -> list[MegatronConfig]:
    """The valid configurations of `megatron_candidates` (those no rule prunes)."""
    return [
        c for c, reason in megatron_candidates(
            num_devices, devices_per_host, batch_size, num_layers=num_layers,
            num_heads=num_heads, microbatch_sizes=microbatch_sizes,
            sequence_parallel=sequence_parallel, pp_values=pp_values,
            distributed_optimizer=distributed_optimizer, virtual_stages=virtual_stages,
            microbatch_counts=microbatch_counts,
        ) if not reason
    ]


def _tp_cp(devices: int, cp_values, tp_values=None) -> list[tuple[int, int]]:
    """(tp, cp) pairs whose product divides `devices`, tp first as before (those of
    `tp_values` only, when given), each cp of `cp_values` (in order) that divides what tp
    leaves."""
    tps = [tp for tp in _divisors(devices) if tp_values is None or tp in tp_values]
    return [(tp, cp) for tp in tps for cp in dict.fromkeys(cp_values)
            if cp >= 1 and (devices // tp) % cp == 0]


def _context_rule(cp: int, seq_len: int | None) -> str:
    """Why Megatron would not split this sequence over cp devices, or ""."""
    if cp > 1 and seq_len is not None and seq_len % (2 * cp):
        return (f"cp={cp} needs the sequence ({seq_len}) in 2*cp = {2 * cp} equal chunks "
                "(Megatron's load-balanced context parallelism)")
    return ""


def _expert_configs(base: MegatronConfig, num_experts, ep_values, etp_values):
    """`base` with each valid (ep, etp) when the model has `num_experts` routed experts
    (ep dividing them, ep·etp dividing tp·cp·dp; etp None means tp); `base` alone
    without experts."""
    if num_experts is None:
        return [base]
    group = base.tp * base.cp * base.dp
    eps = _divisors(group) if ep_values is None else list(dict.fromkeys(ep_values))
    etps = (None, 1) if etp_values is None else tuple(dict.fromkeys(etp_values))
    out = []
    for ep in eps:
        if num_experts % ep:
            continue
        for etp in etps:
            if etp == 1 and base.tp == 1:
                continue  # the same as etp = tp
            if group % (ep * (etp or base.tp)):
                continue
            out.append(replace(base, ep=ep, etp=etp))
    return out


def _degree_rule(config: MegatronConfig, devices_per_host: int, num_layers, num_heads,
                 uneven_stages: bool = False) -> str:
    """Why Megatron would not use these degrees, or ""."""
    if config.tp > devices_per_host:
        return (f"tp={config.tp} > {devices_per_host} devices per host (tensor parallelism "
                "stays inside a host)")
    if num_heads is not None and num_heads % config.tp:
        return f"tp={config.tp} does not divide the {num_heads} attention heads"
    if config.pp > 1 and (num_layers or 1) <= 1:
        return (f"pp={config.pp} needs layers marked with autopar.layer_boundary (for the "
                "GPT example: GPTConfig(layer_markers=True))")
    if config.pp > 1 and uneven_stages and config.pp > num_layers:
        return f"pp={config.pp} stages for {num_layers} layers"
    if config.pp > 1 and num_layers % config.pp and not uneven_stages:
        return (f"pp={config.pp} does not divide the {num_layers} layers (uneven_stages="
                "True splits them as evenly as they allow)")
    return ""


def _microbatch_rule(pp: int, v: int, m: int) -> str:
    if pp > 1 and m < pp:
        return f"{m} microbatch(es) for {pp} pipeline stages (at least one per stage)"
    if v > 1 and m % pp:
        return f"the interleaved schedule needs microbatches a multiple of pp={pp}, got {m}"
    return ""


def _out_of_memory(err: ValueError) -> bool:
    return isinstance(err, MemoryBudgetError) or "does not fit" in str(err)


def _check_values(microbatch_sizes, pp_values, virtual_stages, recompute,
                  microbatch_counts=None) -> None:
    from autopar.choices import REMATS, check_choice

    for name, values in (("microbatch_sizes", microbatch_sizes), ("pp_values", pp_values),
                         ("virtual_stages", virtual_stages),
                         ("microbatch_counts", microbatch_counts)):
        if values is None:
            continue
        bad = [x for x in values if not isinstance(x, int) or isinstance(x, bool) or x < 1]
        if bad or (not list(values) and name != "microbatch_sizes"):
            raise ValueError(f"{name} must be a non-empty sequence of positive integers, "
                             f"got {values!r}")
    if isinstance(recompute, str) or not list(recompute):
        raise ValueError(f"recompute must be a sequence such as ('none', 'selective'), got "
                         f"{recompute!r}")
    for value in recompute:
        check_choice("recompute", value, REMATS)


def _microbatch_counts(dp, batch_size, microbatch_sizes, microbatch_counts=None) -> list[int]:
    """Microbatch counts, largest microbatch first: the whole batch per data-parallel rank
    (one microbatch), then one per size that splits the batch; or, given
    `microbatch_counts`, those that split it into whole examples per data-parallel rank."""
    if batch_size is None:
        return [1]
    if microbatch_counts is not None:
        return [m for m in sorted(set(microbatch_counts)) if batch_size % (dp * m) == 0]
    counts = [1] + [
        batch_size // (dp * size)
        for size in sorted(set(microbatch_sizes), reverse=True)
        if batch_size % (dp * size) == 0
    ]
    return list(dict.fromkeys(counts))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sequence_length(graph: OpGraph) -> int | None:
    """The sequence length of the (batch, sequence) batch inputs, or None."""
    sizes = [graph.vars[v].shape[1] for v in graph.invars
             if graph.vars[v].role is Role.BATCH and len(graph.vars[v].shape) >= 2]
    return max(sizes) if sizes else None


def _batch_size(graph: OpGraph) -> int | None:
    sizes = [graph.vars[v].shape[0] for v in graph.invars
             if graph.vars[v].role is Role.BATCH and graph.vars[v].shape]
    return max(sizes) if sizes else None


def _num_layers(graph: OpGraph) -> int:
    """Layers as Megatron counts them: the `layer_boundary` marks of the forward pass (a
    GPT marks each transformer block's output; the embedding and the head ride with the
    first and last stage). 1 when unmarked: no pipelining."""
    if not any(n.primitive == "layer_boundary" for n in graph.nodes):
        return 1
    from autopar.inter import assign_layers

    try:
        return max(assign_layers(graph).num_layers - 1, 1)
    except ValueError:
        return 1
