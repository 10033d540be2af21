"""`@autopar.autoparallel`: plan on the first call, then run the compiled plan."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar.graph import OpGraph, Role, abstract_args, tied_state
from autopar.inter import assign_layers, partition, with_remat
from autopar.lower import join_pieces, lower_sharding_plan, pieces_of
from autopar.plan import Plan
from autopar.runtime import PipelineExecutable
from autopar.search import (
    PlanOptions,
    graph_for_plan,
    options_from,
    resolve_cluster,
    search,
    takes_plan_options,
)

log = logging.getLogger("autopar")


@dataclass
class _Compiled:
    graph: OpGraph
    plan: Plan
    fn: Callable
    in_shardings: list
    out_shardings: list


class AutoParallel:
    """A train step wrapped by `autopar.autoparallel`; call it like the original."""

    def __init__(
        self, fn: Callable, options: PlanOptions, cluster: Any, plan: Any, cache: Any = None
    ):
        if not callable(fn):
            raise TypeError(
                f"autoparallel expects a function, got {type(fn).__name__}; decorate the "
                "train step: @autopar.autoparallel def train_step(state, batch): ..."
            )
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._options = options
        self._cluster_arg = cluster
        self._fixed_plan = Plan.load(plan) if isinstance(plan, str) else plan
        self._cache = cache
        self._compiled: dict[Any, _Compiled] = {}
        self._donated_leaves: dict[Any, list[int]] = {}  # by argument tree: donated leaves
        self._last: _Compiled | None = None
        self._abstract_args: Any = None  # the last compiled call's arguments, abstract
        self._alternatives: dict[int, list] = {}  # by id of the plan they were made for
        self.num_traces = 0  # how many times the step was traced and planned

    @property
    def plan(self) -> Plan:
        """The `Plan` used by the last call."""
        if self._last is None:
            raise ValueError("no plan yet: call the function once (or use autopar.plan)")
        return self._last.plan

    @property
    def graph(self) -> OpGraph:
        """The traced step as the caller sees it (for a plan that holds a scanned stack in
        pieces, the step before its stacked leaves were cut: `OpGraph.stacked`)."""
        if self._last is None:
            raise ValueError("not traced yet: call the function once")
        graph = self._last.graph
        return graph if graph.stacked is None else graph.stacked.original

    def _key(self, leaves, treedef) -> Any:
        """The compiled plan's key: the argument tree and each leaf's shape and dtype; None
        when a leaf has neither (a Python scalar, or no array: `abstract_args` says which).
        Read on every call, so it reads nothing else (`abstract_args`, which names every
        leaf's path, runs only when the key is new)."""
        try:
            return treedef, tuple([(x.shape, x.dtype) for x in leaves])
        except AttributeError:
            return None

    def _agree(self, compiled: _Compiled, args) -> _Compiled:
        """With several processes: every process runs process 0's plan."""
        from autopar.distributed import agree_on_plan

        plan = agree_on_plan(compiled.plan)
        return compiled if plan is compiled.plan else self._compile(args, plan)

    def explain(self, detail: int = 1, alternatives: bool = True) -> str:
        """`plan.explain()` of the last call's plan with what it is chosen against: data
        parallel, data parallel with ZeRO-1 and the best Megatron-LM configuration of a
        small grid, each with its predicted time and memory (`autopar.report.alternatives`,
        costed once per plan, a few seconds for a small model), and what reads each batch
        input. `alternatives=False` leaves them out."""
        from autopar.report import alternatives as plans_by_hand
        from autopar.report import explain

        plan = self.plan
        alts = None
        if alternatives:
            alts = self._alternatives.get(id(plan))
            if alts is None:
                alts = self._alternatives[id(plan)] = plans_by_hand(
                    self._fn, self._abstract_args, plan.cluster, plan,
                    memory_budget=self._options.memory_budget,
                    donate_argnums=self._options.donate_argnums,
                    batch_argnums=self._options.batch_argnums,
                )
        return explain(plan, detail, alternatives=alts, graph=self.graph)

    def _compile(self, args, fixed_plan: Plan | None = None) -> _Compiled:
        self.num_traces += 1
        leaves, treedef = jax.tree.flatten(args)
        self._abstract_args = jax.tree.unflatten(treedef, abstract_args(self._fn, args)[0])
        options = self._options
        fixed_plan = fixed_plan or self._fixed_plan
        if fixed_plan is not None:
            plan = fixed_plan
            check_arguments_fit(plan, *abstract_args(self._fn, args))
            graph = graph_for_plan(self._fn, args, plan, options)
        else:
            cluster = _cluster(self._cluster_arg)
            plan, graph = search(self._fn, args, cluster, options, self._cache)
        donate = _flat_indices(graph.in_tree, options.donate_argnums)
        if plan.runtime == "spmd":
            fn, in_sh, out_sh = lower_sharding_plan(graph, plan.stages[0].sharding, None, donate)
            return _Compiled(graph, plan, fn, in_sh, out_sh)
        return self._compile_pipeline(graph, plan, donate)

    def _compile_pipeline(self, graph: OpGraph, plan: Plan,
                          donate: Sequence[int] = ()) -> _Compiled:
        layers = assign_layers(graph)
        stage_layers = [stage.layers for stage in plan.stages]
        if stage_layers[-1][1] != layers.num_layers:
            raise ValueError(
                f"the plan's stages cover {stage_layers[-1][1]} layers but the traced step "
                f"has {layers.num_layers}; plan again for this model"
            )
        part = with_remat(graph, partition(graph, layers, stage_layers), layers,
                          plan.stage_remat)
        stage_plans = [stage.sharding for stage in plan.stages]
        for sp, sub in zip(stage_plans, part.stage_graphs):
            sp.check_graph(sub)
        executable = PipelineExecutable(
            graph, part, stage_plans, plan.num_microbatches, plan.schedule, donate_flat=donate
        )
        self.pipeline = executable
        # Inputs go to the stage that holds them, in that stage's sharding.
        in_shardings = []
        for v in graph.invars:
            stage = part.home.get(v, 0)
            sp = stage_plans[stage]
            mesh = executable.meshes[stage]
            spec = sp.var_specs[v] if v < len(sp.var_specs) else None
            in_shardings.append(_named(mesh, spec, graph.vars[v]))
        return _Compiled(graph, plan, executable, in_shardings, None)

    def shardings(self, devices=None) -> tuple:
        """`plan.shardings` shaped like the arguments of the last call: one pytree of
        `NamedSharding` per positional argument, for `jax.jit(in_shardings=...)`,
        `jax.device_put` or a checkpoint restore target."""
        graph = self.graph
        like = jax.tree.unflatten(graph.in_tree, [
            jax.ShapeDtypeStruct(graph.vars[v].shape, graph.vars[v].dtype) for v in graph.invars
        ])
        return self.plan.shardings(like=like, devices=devices)

    def record_timeline(self, *args: Any):
        """Run one step recording every pipeline task's start and end (seconds).

        Returns `(outputs, timeline)`; `timeline` is a list of `TaskRecord`s.
        """
        out = self(*args, _record=True)
        return out, getattr(self, "pipeline", None) and self.pipeline.timeline

    def _check_not_donated_before(self, args, leaves, treedef) -> None:
        """Raise a ValueError naming the option when a leaf of a donated argument was
        already donated to an earlier call (its buffer deleted), before anything runs:
        JAX's own error ("Array has been deleted") never says why."""
        where = self._donated_leaves.get(treedef)
        if where is None:
            sizes = [child.num_leaves for child in treedef.children()]
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            where = self._donated_leaves[treedef] = [
                starts[a] + i for a in self._options.donate_argnums if a < len(sizes)
                for i in range(sizes[a])
            ]
        deleted = [i for i in where if _is_deleted(leaves[i])]
        if not deleted:
            return
        paths = [jax.tree_util.keystr(path) for path, _ in
                 jax.tree_util.tree_flatten_with_path(args)[0]]
        shown = ", ".join(f"args{paths[i]}" for i in deleted[:3])
        more = f" and {len(deleted) - 3} more" if len(deleted) > 3 else ""
        raise ValueError(
            f"{getattr(self._fn, '__name__', 'the step')} was called with arrays an earlier "
            f"call already consumed: {shown}{more} were donated (autoparallel(..., "
            f"donate=True) or donate_argnums={self._options.donate_argnums}) and their "
            "buffers reused. Pass the state the step returned (state, metrics = "
            "train_step(state, batch)), or leave out donate=True / donate_argnums to keep "
            "the arguments alive (costs one more copy of the state in memory)"
        )

    def __call__(self, *args: Any, _record: bool = False) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        if self._options.donate_argnums:
            self._check_not_donated_before(args, leaves, treedef)
        key = self._key(leaves, treedef)
        compiled = None if key is None else self._compiled.get(key)
        if compiled is None:
            # Every leaf an array or a Python scalar: a TypeError naming it, else the key
            # of its abstract value.
            abstract, _ = abstract_args(self._fn, args)
            key = self._key(abstract, treedef)
            compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(args)
            if jax.process_count() > 1:
                compiled = self._agree(compiled, args)
            self._compiled[key] = compiled
            from autopar.report._why import batch_warnings

            for warning in batch_warnings(compiled.plan):
                log.warning(warning)
        self._last = compiled
        if compiled.plan.runtime == "pipeline":
            batch = {
                i for i, v in enumerate(compiled.graph.invars)
                if compiled.graph.vars[v].role is Role.BATCH
            }
            if jax.process_count() > 1:
                batch = set()  # every input becomes a global array on its stage's devices
            stacked = compiled.graph.stacked
            if stacked is not None:  # a stacked leaf held in pieces: one per stage
                leaves = stacked.graph_leaves(leaves, lambda x, where: pieces_of(
                    x, stacked.ranges, [compiled.in_shardings[w] for w in where]
                ))
            placed = [
                x if i in batch or _has_sharding(x, s) else _put(x, s)
                for i, (x, s) in enumerate(zip(leaves, compiled.in_shardings))
            ]
            out = compiled.fn(placed, record=_record)
            if stacked is not None:
                out = stacked.caller_outputs(out, _joiner(compiled, self._options))
                return jax.tree.unflatten(stacked.original.out_tree, out)
        else:
            placed = [
                x if _has_sharding(x, s) else _put(x, s)
                for x, s in zip(leaves, compiled.in_shardings)
            ]
            out = compiled.fn(*placed)
        return jax.tree.unflatten(compiled.graph.out_tree, out)


def check_arguments_fit(plan: Plan, leaves, paths) -> None:
    """Raise a ValueError naming the leaves whose path, shape or dtype differ from what
    `plan` was made for, before anything is traced, compiled or donated. Batch leaves are
    compared without their leading (batch) dimension: a pipelined plan records them at one
    microbatch."""
    given = {p: x for p, x in zip(paths, leaves)}
    planned = {i.path: i for i in plan.caller_inputs()}
    problems = [f"'{p}' is not an input of the plan" for p in given if p not in planned]
    for path, info in planned.items():
        x = given.get(path)
        if x is None:
            problems.append(f"'{path}' is missing (the plan has it)")
            continue
        shape, want = tuple(x.shape), tuple(info.shape)
        if info.role == "batch":
            shape, want = shape[1:], want[1:]
        if shape != want or str(x.dtype) != info.dtype:
            problems.append(
                f"'{path}' is {x.dtype}{list(x.shape)}, the plan has {info.dtype}{list(info.shape)}"
            )
    if problems:
        shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        raise ValueError(
            f"the arguments differ from those the plan was made for (a different program): "
            f"{shown}. Plan again for these arguments (drop plan=...), or pass the arguments "
            "the plan was saved for"
        )


def _joiner(compiled: _Compiled, options: PlanOptions) -> Callable:
    """`join(pieces)`: a stacked leaf's pieces (one per stage) as one array over those
    stages, laid out as the step takes the leaf when it is updated state (so that passing
    it back moves nothing), else as the pieces come."""
    stacked = compiled.graph.stacked
    original = stacked.original
    in_position = {v: i for i, v in enumerate(original.invars)}
    out_position = {v: i for i, v in enumerate(original.outvars)}
    taken = {}
    for out_var, in_var in tied_state(original, options.donate_argnums):
        i, j = out_position[out_var], in_position[in_var]
        if i in stacked.split_outputs and j in stacked.split_inputs:
            taken[tuple(stacked.outputs[i])] = [compiled.in_shardings[w] for w in stacked.inputs[j]]

    def join(pieces: list, where: tuple | None = None):
        shardings = taken.get(where) or [p.sharding for p in pieces]
        return join_pieces(pieces, shardings)

    return lambda pieces, where: join(pieces, tuple(where))


def _named(mesh, spec, var):
    from jax.sharding import NamedSharding

    from autopar.cluster import replicated, to_partition_spec

    return NamedSharding(mesh, to_partition_spec(spec or replicated(len(var.shape))))


def _cluster(cluster: Any):
    """The cluster to plan on; the devices of every process when `cluster` is None."""
    return resolve_cluster(cluster)


def _put(x: Any, sharding):
    """`jax.device_put` in one process; with several, a global array on `sharding` built from
    each process's copy, or moved there (`autopar.distributed.place`)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    from autopar.distributed import place

    return place(x, sharding)


def _is_deleted(x: Any) -> bool:
    is_deleted = getattr(x, "is_deleted", None)
    return is_deleted is not None and is_deleted()


def _has_sharding(x: Any, sharding) -> bool:
    current = getattr(x, "sharding", None)
    if current is None:
        return False
    # Equality first: it is cheap, and every leaf is checked on every call.
    return current == sharding or current.is_equivalent_to(sharding, x.ndim)


def _flat_indices(in_tree, argnums: Sequence[int]) -> list[int]:
    """Flat leaf indices belonging to the positional arguments `argnums`."""
    args = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
    return sorted(i for a in argnums if a < len(args) for i in jax.tree.leaves(args[a]))


@takes_plan_options
def autoparallel(
    fn: Callable | None = None,
    *,
    cluster: Any = None,
    plan: Plan | str | None = None,
    cache: Any = None,
    donate: bool = False,
    **options: Any,
) -> Any:
    """Parallelise a single-device train step over the devices it is given.

    **Arguments:**
    - `cluster`: a `Cluster`, a profile name or path; None uses the local devices.
    - `plan`: a `Plan` or a path to a saved one: reuse it, no search.
    - `cache`: a `PlanCache`, False for none, None for the default on-disk plan cache.
    - `donate`: let the step reuse the buffers of its first argument (the state) for the
      new state, as `jax.jit(donate_argnums=0)` does: one copy of the state less in
      memory, and the arrays passed in are deleted by the call (passing them again raises
      an error naming this option). Off by default; `donate_argnums=(0, ...)` names the
      donated arguments instead.
    - `**options`: the `PlanOptions`, as `autopar.plan` takes them: `method` ("auto",
      "shard", "data", "zero2", "zero3"), `num_microbatches`, `schedule`,
      `memory_budget`, `donate_argnums` (default here: none, or (0,) with
      `donate=True`), `batch_argnums`, `mesh_shape`, `num_stages`,
      `submeshes`, `logical_shapes`, `remat` ("auto": recompute per layer only where a
      stage would not fit otherwise; "none", "selective", "full"), ...

    **Example:**

    ```python
    @autopar.autoparallel(donate=True)
    def train_step(state, batch):
        loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
        ...
    state, metrics = train_step(state, batch)
    print(train_step.plan.explain())
    ```
    """
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be True or False, got {donate!r}")
    if "donate_argnums" not in options:
        options = {**options, "donate_argnums": (0,) if donate else ()}
    elif donate and not options["donate_argnums"]:
        raise ValueError(
            f"donate=True but donate_argnums={options['donate_argnums']!r} donates nothing; "
            "pass one of them: donate=True (the state, argument 0) or donate_argnums=(i, ...)"
        )
    resolved = options_from("autoparallel", options)

    def wrap(f: Callable) -> AutoParallel:
        return AutoParallel(f, resolved, cluster, plan, cache)

    return wrap if fn is None else wrap(fn)


# `autoparallel` donates nothing unless asked: show its own default for donate_argnums.
autoparallel.__signature__ = autoparallel.__signature__.replace(parameters=[
    p.replace(default=()) if p.name == "donate_argnums" else p
    for p in autoparallel.__signature__.parameters.values()
])
