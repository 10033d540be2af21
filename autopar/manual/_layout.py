"""The Megatron layout of a step's inputs on one (dp, tp) stage mesh, as specs.

In: a traced `OpGraph` and a `MegatronConfig`. Out: ``{input var id: spec}`` with mesh
axes "data" and "model": parameters as their dataflow role says (`_dataflow.py`, resolved
against the mesh size here), the batch split on "data", optimizer state like its parameter
(optax's ``mu``/``nu`` trees repeat the parameter paths) and, with the distributed
optimizer (ZeRO-1), also split over "data"; user overrides first. Axes of size 1 are left
out, so dp = 1 or tp = 1 needs no special case downstream.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.choices import REMATS, SCHEDULES, Remat, Schedule, check_choice
from autopar.cluster import Spec, replicated, spec_str
from autopar.cost import CP_ALGORITHMS, CPAlgorithm
from autopar.graph import OpGraph, Role
from autopar.manual._dataflow import Kind, Placement, classify_parameters

# Path components under which a state tree keeps its parameters (see autopar.graph.trace).
PARAM_TREE_KEY = "params"


class MeshAxis(str, enum.Enum):
    """Mesh axis names of a Megatron stage mesh, major to minor."""

    DATA = "data"
    MODEL = "model"


AXIS_NAMES = (MeshAxis.DATA.value, MeshAxis.MODEL.value)


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """The degrees and options of one Megatron-style plan.

    **Arguments:**
    - `dp`, `tp`, `pp`: data-, tensor- and pipeline-parallel degrees; dp·tp·pp devices.
    - `sequence_parallel`: split the layer-norm regions (the residual stream) on the
      sequence over the tp devices (Korthikanti et al. 2022); needs tp > 1.
    - `distributed_optimizer`: shard optimizer state over "data" (ZeRO-1).
    - `zero2`: also keep the gradients sharded over "data" (ZeRO-2; FSDP's gradient
      sharding, as Llama 3 trained, Dubey et al. 2024 sec. 3.3.2): 1/(dp·cp) of the
      gradient sums per device, a reduce-scatter per microbatch under the backward
      (`autopar.cost.zero2_gradient_bytes`, `zero2_exposed_reduction`). Needs
      `distributed_optimizer`; priced by the scorer (the pipeline runtime keeps the
      gradient sums of ZeRO-1).
    - `num_microbatches`, `schedule`: the pipeline schedule (a `Schedule`).
    - `virtual_stages`: layer chunks per pipeline device group under
      `schedule="interleaved_1f1b"` (Megatron-LM's interleaved schedule): pp·v stages,
      stage s on the devices of stage s mod pp.
    - `even_chunks`: Megatron-LM's rule that pp·v divides the marked layers (every chunk
      the same number of layers). False splits the layers over the pp·v chunks as evenly
      as the marks allow, some chunks a layer short, as Llama 3 ran its interleaved
      schedule (Dubey et al. 2024, sec. 3.3.2: one layer fewer on the first and the last
      stage).
    - `recompute`: activation recomputation of every layer, Megatron-LM's
      ``--recompute-granularity``: "none", "selective" (the attention core; Korthikanti et
      al. 2022) or "full" (all but the layer input); costed by `autopar.cost`'s recompute
      formulas and run by the pipeline runtime (needs layer marks).
    - `cp`: context-parallel degree (Megatron-LM's ``--context-parallel-size``): every
      sequence split into 2·cp load-balanced chunks over cp devices; dp·cp·tp·pp devices,
      rank order TP, CP, DP, PP from the innermost. Priced, not run: the step is traced
      at one CP rank's shapes (`context_args`) and attention's extra work, K/V traffic
      and buffers are added (`_context_experts.py`).
    - `cp_algorithm`: how K/V reach every CP rank: "ring" (Megatron's default
      ``--cp-comm-type p2p``), "all_gather" (``allgather``, Llama 3) or "ulysses" (``a2a``).
    - `ep`, `etp`: Megatron-Core MoE's expert-model-parallel and expert-tensor-parallel
      sizes. The expert grid etp × ep × expert-dp covers each stage's tp·cp·dp devices
      (Megatron-Core's "parallel folding"), so ep·etp must divide tp·cp·dp; with
      etp = tp (the default) that is Megatron's classic rule, EP carved from DP × CP.
      None (ep): a traced MoE's experts split over the whole data axis where it divides
      them (GShard's layout); with `MoEShape` (a dense proxy) one device holds all.
    """

    dp: int
    tp: int
    pp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    num_microbatches: int = 1
    schedule: Schedule = "1f1b"
    recompute: Remat = "none"
    virtual_stages: int = 1
    even_chunks: bool = True
    cp: int = 1
    cp_algorithm: CPAlgorithm = "ring"
    ep: int | None = None
    etp: int | None = None
    zero2: bool = False

    def __post_init__(self):
        if self.zero2 and not self.distributed_optimizer:
            raise ValueError(
                "zero2=True shards the gradients as well as the optimizer state, but "
                "distributed_optimizer=False; pass distributed_optimizer=True with zero2=True"
            )
        for name in ("dp", "tp", "pp", "num_microbatches", "virtual_stages", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=True splits the sequence over the tensor-parallel devices, "
                "but tp=1; use tp > 1 or sequence_parallel=False"
            )
        for name in ("ep", "etp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {value!r}")
        group = self.tp * self.cp * self.dp
        experts = self.expert_parallel * self.expert_tensor_parallel
        if group % experts:
            raise ValueError(
                f"ep*etp = {self.expert_parallel}*{self.expert_tensor_parallel} = {experts} "
                f"must divide tp*cp*dp = {self.tp}*{self.cp}*{self.dp} = {group} (Megatron-Core "
                "MoE: the expert grid etp x ep x expert-dp is carved from each pipeline "
                "stage's tensor x context x data-parallel devices); choose ep and etp whose "
                f"product divides {group}"
            )
        check_choice("cp_algorithm", self.cp_algorithm, CP_ALGORITHMS)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("recompute", self.recompute, REMATS)
        if self.virtual_stages > 1:
            if self.pp == 1:
                raise ValueError(
                    f"virtual_stages={self.virtual_stages} interleaves model chunks over "
                    "pipeline stages, but pp=1; use pp > 1 or virtual_stages=1"
                )
            if self.schedule != "interleaved_1f1b":
                raise ValueError(
                    f"virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b', "
                    f"not {self.schedule!r}"
                )

    def check_microbatches(self) -> None:
        """Raise ValueError unless pp divides the microbatches of an interleaved schedule
        (Megatron's rule; checked when planning, so that the grid can report it)."""
        if self.virtual_stages > 1 and self.num_microbatches % self.pp:
            raise ValueError(
                f"the interleaved schedule (virtual_stages={self.virtual_stages}) needs a "
                f"number of microbatches that pp={self.pp} divides, got "
                f"num_microbatches={self.num_microbatches}; use a multiple of {self.pp}"
            )

    @property
    def num_devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def expert_parallel(self) -> int:
        """The EP degree: `ep`, or 1 when unset."""
        return self.ep or 1

    @property
    def expert_tensor_parallel(self) -> int:
        """The expert-TP degree: `etp`, or tp when unset (experts split like the MLP)."""
        return self.etp or self.tp

    def data_config(self) -> MegatronConfig:
        """The (dp·cp, tp) configuration the step is planned with: CP ranks are data
        ranks of the locally traced step (`_context_experts.context_args`)."""
        if self.cp == 1:
            return self
        return replace(self, dp=self.dp * self.cp, cp=1)

    @property
    def name(self) -> str:
        """The plan's method string, e.g. ``megatron(dp=4,tp=2,pp=1)``."""
        extras = "".join(
            flag
            for flag, on in (
                (",sp", self.sequence_parallel),
                (",zero1", self.distributed_optimizer and not self.zero2),
                (",zero2", self.zero2),
                (f",mb={self.num_microbatches}", self.num_microbatches > 1),
                (f",recompute={self.recompute}", self.recompute != "none"),
                (f",v={self.virtual_stages}", self.virtual_stages > 1),
                (",uneven", self.virtual_stages > 1 and not self.even_chunks),
                (f",ep={self.ep}", self.ep is not None),
                (f",etp={self.etp}", self.etp is not None),
            )
            if on
        )
        context = ""
        if self.cp > 1:
            context = f",cp={self.cp}" + (
                f"({self.cp_algorithm})" if self.cp_algorithm != "ring" else "")
        return f"megatron(dp={self.dp},tp={self.tp},pp={self.pp}{context}{extras})"


def megatron_specs(
    graph: OpGraph, config: MegatronConfig, overrides: Mapping[str, Any] | None = None
) -> dict[int, Spec]:
    """The spec of every non-constant input of `graph` on a (dp, tp) stage mesh.

    **Arguments:**
    - `graph`: the traced step.
    - `config`: supplies dp, tp and `distributed_optimizer`.
    - `overrides`: ``{input path: spec}``, taking precedence.

    **Returns:** ``{input var id: spec}`` (axes of size 1 left out).
    """
    by_path = _check_overrides(graph, overrides or {})
    placements = classify_parameters(graph)
    specs: dict[int, Spec] = {}
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is Role.CONST:
            continue
        if var.path in by_path:
            specs[v] = by_path[var.path]
        elif var.role is Role.PARAM:
            specs[v] = param_spec(var.path or f"input {v}", var.shape, placements[v], config)
        elif var.role is Role.BATCH:
            specs[v] = _batch_spec(var, config)
        else:
            specs[v] = replicated(len(var.shape))
    _state_specs(graph, specs, set(by_path), config)
    return {v: _drop_unit_axes(spec, config) for v, spec in specs.items()}


def param_spec(path: str, shape: tuple[int, ...], placement: Placement, config) -> Spec:
    """Resolve a mesh-independent `Placement` to a spec on a (dp, tp) mesh.

    **Arguments:** the parameter's `path` and `shape` (for messages and divisibility), its
    `placement` (`classify_parameters`) and the `config` (dp, tp).

    **Returns:** the spec, with "data" on an expert dimension dp divides and "model" on
    the split dimension. Raises ValueError naming the path and the `overrides` fix when tp
    does not divide that dimension or the parameter is unplaced and tp > 1.
    """
    spec: list[tuple[str, ...]] = [()] * len(shape)
    if placement.kind is Kind.UNPLACED:
        if config.tp > 1:
            raise ValueError(_cannot_place(path, shape, placement.reason))
        return tuple(spec)
    if placement.expert_dim is not None and shape[placement.expert_dim] % config.dp == 0:
        spec[placement.expert_dim] = (MeshAxis.DATA.value,)
    if placement.model_dim is not None and config.tp > 1:
        dim = placement.model_dim
        if shape[dim] % config.tp:
            raise ValueError(
                _cannot_place(
                    path, shape,
                    f"as a {placement.kind.value} weight its dim {dim} ({shape[dim]}) would be "
                    f"split over tp={config.tp} devices, which does not divide it",
                )
            )
        spec[dim] = (MeshAxis.MODEL.value,)
    return tuple(spec)


def _cannot_place(path: str, shape, why: str) -> str:
    return (
        f"cannot place parameter {path} of shape {tuple(shape)}: {why}. Pass "
        f"overrides={{{path!r}: spec}} (e.g. P(None, 'model') or P() for replicated), "
        "or choose a tp that divides it"
    )


def _batch_spec(var, config: MegatronConfig) -> Spec:
    if not var.shape or config.dp == 1:
        return replicated(len(var.shape))
    if var.shape[0] % config.dp:
        raise ValueError(
            f"batch input {var.path} has {var.shape[0]} examples on dim 0, which dp="
            f"{config.dp} does not divide; choose a batch size that is a multiple of dp"
        )
    return ((MeshAxis.DATA.value,),) + replicated(len(var.shape) - 1)


def _state_specs(graph: OpGraph, specs: dict[int, Spec], overridden: set, config) -> None:
    """Optimizer state takes its parameter's spec (matched by path suffix and shape);
    with the distributed optimizer it is also split over "data"."""
    params = {
        _param_key(graph.vars[v].path): v
        for v in graph.invars
        if graph.vars[v].role is Role.PARAM and graph.vars[v].path
    }
    lengths = sorted({len(k) for k in params}, reverse=True)
    for v in graph.invars:
        var = graph.vars[v]
        if var.role is not Role.OPT_STATE or var.path in overridden:
            continue
        parts = tuple(var.path.split("/")) if var.path else ()
        match = next(
            (params[parts[-n:]] for n in lengths
             if n <= len(parts) and parts[-n:] in params
             and graph.vars[params[parts[-n:]]].shape == var.shape),
            None,
        )
        spec = specs[match] if match is not None else replicated(len(var.shape))
        if config.distributed_optimizer:
            spec = _zero1(spec, var.shape, config)
        specs[v] = spec


def _param_key(path: str) -> tuple[str, ...]:
    """``params/layers/0/w`` -> ``("layers", "0", "w")``: the part optax trees repeat."""
    parts = path.split("/")
    if PARAM_TREE_KEY in parts:
        parts = parts[len(parts) - parts[::-1].index(PARAM_TREE_KEY):]
    return tuple(parts)


def _zero1(spec: Spec, shape, config: MegatronConfig) -> Spec:
    """Also split over "data": the first unsplit dim it divides, else a "model" dim."""
    data = MeshAxis.DATA.value
    if config.dp == 1 or any(data in axes for axes in spec):
        return spec
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if not axes and size % config.dp == 0:
            return spec[:dim] + ((data,),) + spec[dim + 1:]
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes == (MeshAxis.MODEL.value,) and size % (config.dp * config.tp) == 0:
            return spec[:dim] + ((data, MeshAxis.MODEL.value),) + spec[dim + 1:]
    return spec


def _drop_unit_axes(spec: Spec, config: MegatronConfig) -> Spec:
    sizes = {MeshAxis.DATA.value: config.dp, MeshAxis.MODEL.value: config.tp}
    return tuple(tuple(a for a in axes if sizes[a] > 1) for axes in spec)


def _check_overrides(graph: OpGraph, overrides: Mapping[str, Any]) -> dict[str, Spec]:
    """Overrides as specs, checked against the inputs' paths, ranks and axis names."""
    shapes = {graph.vars[v].path: graph.vars[v].shape for v in graph.invars}
    result = {}
    for path, value in overrides.items():
        if path not in shapes:
            known = ", ".join(sorted(p for p in shapes if p)[:8])
            raise ValueError(
                f"overrides names {path!r}, which is not an input of the step; use an "
                f"input path such as: {known}, ..."
            )
        spec = normalize_spec(value, len(shapes[path]), path)
        result[path] = spec
    return result


def normalize_spec(value: Any, ndim: int, path: str = "input") -> Spec:
    """A spec from a `PartitionSpec` or a tuple of None / axis name / tuple of names.

    Trailing dimensions not mentioned are replicated, as in `PartitionSpec`.
    """
    entries = list(value)
    if len(entries) > ndim:
        raise ValueError(
            f"override for {path} has {len(entries)} entries but the input has {ndim} "
            "dimensions; give one entry (None or mesh axes) per dimension"
        )
    spec = []
    for entry in entries + [None] * (ndim - len(entries)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in axes if a not in AXIS_NAMES]
        if unknown:
            raise ValueError(
                f"override for {path} uses mesh axes {unknown}; a Megatron mesh has axes "
                f"{AXIS_NAMES}"
            )
        spec.append(axes)
    return tuple(spec)


@dataclass(frozen=True)
class LayoutRow:
    """One parameter's Megatron role and spec, for reports (`describe_layout`)."""

    path: str
    shape: tuple[int, ...]
    kind: str
    spec: str
    reason: str = field(default="", compare=False)


def describe_layout(graph: OpGraph, config: MegatronConfig) -> list[LayoutRow]:
    """Each parameter's role, spec on the (dp, tp) mesh and the reason, in input order."""
    placements = classify_parameters(graph)
    rows = []
    for v, placement in placements.items():
        var = graph.vars[v]
        path = var.path or f"input {v}"
        try:
            spec = spec_str(_drop_unit_axes(param_spec(path, var.shape, placement, config),
                                            config))
        except ValueError:
            spec = "(cannot place)"
        rows.append(LayoutRow(path, var.shape, placement.kind.value, spec, placement.reason))
    return rows
