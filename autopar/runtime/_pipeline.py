"""Run a pipelined plan: per-stage jitted segments, microbatches, a schedule.

Per step: the batch is cut into microbatches; for each task of the schedule (forward,
backward, and with zero bubble the backward's weight-gradient part, see `split_backward`),
the stage's segment is dispatched on its submesh, its inputs moved there device to device
(`autopar.distributed.copy_to_devices`; across processes `transfer`) into the stage's
expected sharding; gradients are summed on the stage that computes them (data-parallel
weight gradients as unreduced per-device partial sums, reduced once per step); then the
update fragments run once, each on its stage, with the summed gradients scaled by
1/microbatches. Every task is dispatched asynchronously, in one order that keeps each
device group's schedule (`autopar.cost._schedule`), and nothing waits per task, so
stages overlap and a stage's next work is queued while its devices compute.

A one-stage plan in one process runs instead as one compiled program per step, with the
microbatches accumulated inside it by a `lax.scan` (`autopar.runtime._fused`); a recorded
step (`record`, `record_memory`) still runs its tasks.

Memory: every per-microbatch value is dropped after its last reader on each stage
(`autopar.runtime._values`, reader counts computed once here at build time), so a stage
holds the activations of the microbatches its schedule keeps in flight, not of the whole
step; each stage keeps one running sum per gradient. `record_memory` samples the live bytes
per device by part (state, gradient sums, held activations) after every task, and while
each task runs with its program's own working memory from XLA's `memory_analysis()`
(`autopar.runtime._memory`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding

from autopar.cluster._mesh import replicated, to_partition_spec
from autopar.cost._schedule import dependencies, device_orders, dispatch_order
from autopar.distributed import copy_to_devices, place, settle_transfers, transfer
from autopar.graph import OpGraph, Role
from autopar.inter.passes import Partition, Segment, split_backward, stacked_layout
from autopar.lower import jax_mesh, lower_segment
from autopar.runtime._fused import FusedStep
from autopar.runtime._memory import MemoryRecorder, MemorySample, executable_working_bytes
from autopar.runtime._values import MicrobatchValues, readers_by_stage


@dataclass(frozen=True)
class TaskRecord:
    """One executed task: `kind` is "forward", "backward" or "apply"."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class _Compiled:
    segment: Segment
    fn: Any
    fn_sum: Any  # the version that adds into running gradient sums (None if no gradients)
    in_shardings: list
    sums: tuple[int, ...]


def _task_segments(partition: Partition, schedule: str, grad_set: set) -> list:
    """[(phase, segment)] of the segments run once per microbatch, by phase (see
    `autopar.cost._schedule`): with zero bubble each backward splits into its
    input-gradient part B (phase "backward") and its weight-gradient part W ("weight")."""
    segments = [("forward", seg) for seg in partition.forward]
    for seg in partition.backward:
        if schedule == "zero_bubble":
            b, w = split_backward(seg, partition.stage_graphs[seg.stage], grad_set)
            segments += [("backward", b), ("weight", w)]
        else:
            segments.append(("backward", seg))
    return segments


class PipelineExecutable:
    """A compiled pipelined plan; call it with the step's flat arguments."""

    def __init__(
        self,
        graph: OpGraph,
        partition: Partition,
        stage_plans: Sequence,
        num_microbatches: int,
        schedule: str,
        devices: Sequence | None = None,
        output_specs: dict | None = None,
        donate_flat: Sequence[int] = (),
    ):
        self.graph = graph
        self.partition = partition
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.meshes = [jax_mesh(p.mesh, devices) for p in stage_plans]
        self.stage_plans = list(stage_plans)
        self.timeline: list[TaskRecord] | None = None
        # Gradients kept as stacks of per-device partial sums until the update (one
        # reduction per step; see autopar.inter.passes._deferred).
        self.stacked = [
            stacked_layout(partition.stage_graphs[s], plan, partition.deferrable)
            for s, plan in enumerate(self.stage_plans)
        ]
        self.handoff = self._handoffs()
        grad_set = set(partition.grad_vars)
        scale = {v: 1.0 / num_microbatches for v in partition.grad_vars}
        segments = _task_segments(partition, schedule, grad_set)
        self.tasks: dict[tuple[str, int], _Compiled] = {
            (phase, seg.stage): self._lower(seg, grad_set, None, output_specs)
            for phase, seg in segments
        }
        self.apply = [self._lower(seg, (), scale, output_specs) for seg in partition.apply]
        self.batch_vars = [v for v in graph.invars if graph.vars[v].role is Role.BATCH]
        # Values made once per microbatch (its batch rows and everything its tasks
        # produce), and how many tasks of each stage read each: a value goes once its
        # last reader has run (see `autopar.runtime._values`).
        self.per_microbatch = frozenset(
            {*self.batch_vars, *(v for _, seg in segments for v in seg.outputs)})
        self.readers = readers_by_stage((seg for _, seg in segments), self.per_microbatch)
        self.memory_samples: list[MemorySample] | None = None
        # (phase, stage, id(program)) -> (working bytes per device, compiled executable)
        self._working: dict[tuple, tuple] = {}
        self.virtual_stages = _virtual_stages(schedule, self.meshes)
        self.group_orders = device_orders(
            schedule, partition.num_stages, num_microbatches, self.virtual_stages
        )
        # Every process dispatches the tasks in this one order: JAX matches transfers
        # between processes by the order in which each process issues them.
        self.order = dispatch_order(
            schedule, partition.num_stages, num_microbatches, self.virtual_stages
        )
        # One stage in one process: the whole step as one program (`FusedStep`, reusing
        # the buffers of the flat arguments `donate_flat`, as the SPMD runtime does); the
        # tasks above still run it when a step is recorded.
        self.fused = (
            FusedStep(self, donate_flat)
            if partition.num_stages == 1 and jax.process_count() == 1 else None
        )

    def _handoffs(self) -> list[dict[int, Any]]:
        """Per stage, {stacked gradient the update of another stage reads (a shared
        weight's contribution): its reducer}; each is reduced on its own stage first, once
        per step."""
        handoff = []
        for s, stacked in enumerate(self.stacked):
            elsewhere = {
                v for seg in self.partition.apply if seg.stage != s for v in seg.inputs
            } & set(stacked)
            handoff.append({v: self._reducer(s, v) for v in elsewhere})
        return handoff

    def _reducer(self, stage: int, v: int):
        """A jitted sum of stage `stage`'s stack of partial sums of `v`, laid out as
        planned."""
        plan = self.stage_plans[stage]
        spec = plan.var_specs[v] or replicated(len(self.graph.vars[v].shape))
        sharding = NamedSharding(self.meshes[stage], to_partition_spec(spec))
        return jax.jit(lambda x: x.sum(axis=0), out_shardings=sharding)

    def _lower(self, seg: Segment, accumulate, scale, output_specs) -> _Compiled:
        sub = self.partition.stage_graphs[seg.stage]
        plan = self.stage_plans[seg.stage]
        mesh = self.meshes[seg.stage]
        overrides = dict(plan.output_overrides)
        overrides.update({v: s for v, s in (output_specs or {}).items() if v in seg.outputs})
        sums = tuple(v for v in seg.outputs if v in set(accumulate))
        stacked = self.stacked[seg.stage]
        fn, in_sh, _ = lower_segment(
            sub, plan, seg.nodes, seg.inputs, seg.outputs, mesh, scale=scale,
            output_specs=overrides, stacked=stacked,
        )
        fn_sum = None
        if sums:
            fn_sum, _, _ = lower_segment(
                sub, plan, seg.nodes, seg.inputs, seg.outputs, mesh, accumulate=sums,
                output_specs=overrides, stacked=stacked,
            )
        return _Compiled(seg, fn, fn_sum, in_sh, sums)

    # ---- running ---------------------------------------------------------------------------

    def _fetch(self, env: dict, compiled: _Compiled) -> list:
        """The arguments of a once-per-step segment (the update) from `env`."""
        args = []
        for v, sharding in zip(compiled.segment.inputs, compiled.in_shardings):
            x = _placed(env[v], sharding)
            env[v] = x  # later readers on this stage reuse the moved copy
            args.append(x)
        return args

    def _batch_sources(self, step_env: dict) -> list[dict]:
        """Per microbatch, var -> a function slicing its rows out of a batch input (called
        when a stage first reads them, so that a microbatch's rows exist only while it
        runs)."""
        m = self.num_microbatches
        for v in self.batch_vars:
            size, rows = self.graph.vars[v].shape[0], step_env[v].shape[0]
            if rows != size * m:
                raise ValueError(
                    f"batch input {self.graph.vars[v].path} has {rows} rows; with "
                    f"{m} microbatches of {size} it needs {size * m}"
                )

        def rows(x, start, stop):
            return lambda: x[start:stop]

        return [
            {
                v: rows(step_env[v], i * self.graph.vars[v].shape[0],
                        (i + 1) * self.graph.vars[v].shape[0])
                for v in self.batch_vars
            }
            for i in range(m)
        ]

    def __call__(self, flat_args: Sequence, record: bool = False,
                 record_memory: bool = False) -> list:
        """Run one step. With `record`, `self.timeline` gets every task's start and end;
        with `record_memory`, `self.memory_samples` gets the live bytes per device after
        every task (`MemorySample`; slow, for tests and debugging).

        A plain step dispatches every task asynchronously, in `self.order` (each stage's
        own order, interleaved so that a task comes after the tasks it reads from): a call
        returns as soon as the work is enqueued, and each device runs its queue as its
        inputs arrive, so stages overlap and a stage's next microbatch is queued while its
        device computes. Nothing waits per task. Recording times or memory waits for
        every task instead (see `_run_timed`). One stage in one process: one program for
        the whole step (`FusedStep`) unless recording."""
        if self.fused is not None and not record and not record_memory:
            return self.fused(flat_args)
        graph, part = self.graph, self.partition
        recorder = MemoryRecorder(flat_args) if record_memory else None
        step_env: dict[int, Any] = dict(zip(graph.invars, flat_args))
        lock = threading.Lock()
        micro = [
            MicrobatchValues(self.readers, sources, lock)
            for sources in self._batch_sources(step_env)
        ]
        step_values = _StepValues(step_env, lock)
        stage_sums: list[dict[int, Any]] = [{} for _ in range(part.num_stages)]
        records: list[TaskRecord] = []
        if recorder:
            recorder.sample(0, "start", 0)
        t0 = time.perf_counter()
        if record and jax.process_count() == 1:
            self._run_timed(micro, step_values, stage_sums, records, t0)
        else:
            self._run_in_order(step_env, micro, step_values, stage_sums, records, t0, record,
                               recorder)
        assert all(not m.copies for m in micro), (
            "values of a microbatch outlived their last reader: "
            f"{[m.held() for m in micro if m.copies]}"
        )
        micro.clear()
        step_values.copies.clear()  # parameters moved for the microbatches' tasks
        for stage, sums in enumerate(stage_sums):
            for v, reduce in self.handoff[stage].items():
                sums[v] = reduce(sums[v])
            step_env.update(sums)
        stage_sums.clear()
        self._run_updates(step_env, step_values, records, t0, record, recorder)
        settle_transfers()  # several processes: every transfer in before the next step
        if record:
            self.timeline = sorted(records, key=lambda r: (r.start, r.stage))
        if recorder:
            self.memory_samples = recorder.finish()
        return [self._result(step_env, v) for v in graph.outvars]

    def _run_in_order(self, step_env, micro, step_values, stage_sums, records, t0, record,
                      recorder) -> None:
        """Every microbatch's tasks dispatched in `self.order`; with `record` or a memory
        `recorder`, each waited for and recorded (and sampled while and after it runs)."""
        for phase, stage, i in self.order:
            start = time.perf_counter()
            running = None
            if recorder:
                running = functools.partial(
                    self._sample_running, recorder, (phase, stage, i), functools.partial(
                        self._held, step_env, step_values, stage_sums, micro),
                )
            outs = self._run_task(phase, stage, micro[i], step_values, stage_sums[stage],
                                  running)
            if record or recorder:
                jax.block_until_ready(outs)  # only this process's shards
                records.append(
                    TaskRecord(stage, phase, i, start - t0, time.perf_counter() - t0)
                )
            if recorder:
                recorder.sample(stage, phase, i,
                                self._held(step_env, step_values, stage_sums, micro))

    def _run_updates(self, step_env, step_values, records, t0, record, recorder) -> None:
        """The once-per-step segments (the update), their results into `step_env`; with
        `record` or a memory `recorder`, each waited for and recorded."""
        for compiled in self.apply:
            start = time.perf_counter()
            args = self._fetch(step_env, compiled)
            fn = compiled.fn
            if recorder:
                fn = self._sample_running(
                    recorder, ("apply", compiled.segment.stage, 0),
                    functools.partial(self._held, step_env, step_values), compiled.fn, args,
                )
            outs = fn(*args)
            del args
            for v, x in zip(compiled.segment.outputs, outs):
                step_env[v] = x
            if record or recorder:
                jax.block_until_ready(outs)
                end = time.perf_counter()
                stage = compiled.segment.stage
                records.append(TaskRecord(stage, "apply", 0, start - t0, end - t0))
                if recorder:
                    recorder.sample(stage, "apply", 0, self._held(step_env, step_values))

    def _run_timed(self, micro, step_values, stage_sums, records, t0) -> None:
        """Every task timed (one process): one thread per device group runs the group's
        tasks in its order, each after the tasks it reads from, and waits for each to finish (XLA
        releases the GIL while it computes, so stages still run at the same time)."""
        part = self.partition
        done = {task: threading.Event() for task in self.order}
        errors: list[BaseException] = []

        def run_group(group: int) -> None:
            try:
                for phase, stage, i in self.group_orders[group]:
                    for dep in dependencies((phase, stage, i), part.num_stages):
                        while not done[dep].wait(0.1):
                            if errors:
                                return
                    start = time.perf_counter()
                    outs = self._run_task(phase, stage, micro[i], step_values, stage_sums[stage])
                    jax.block_until_ready(outs)
                    end = time.perf_counter()
                    records.append(TaskRecord(stage, phase, i, start - t0, end - t0))
                    done[(phase, stage, i)].set()
            except BaseException as err:  # re-raised by the caller's thread
                errors.append(err)

        threads = [
            threading.Thread(target=run_group, args=(g,), daemon=True)
            for g in range(len(self.group_orders))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _held(self, step_env: dict, step_values: _StepValues, stage_sums=(), micro=()):
        """The step's arrays by part (`autopar.runtime._memory.PARTS`), for a sample."""
        roles = {v: self.graph.vars[v].role for v in self.graph.invars}
        state = [x for v, x in step_env.items()
                 if roles.get(v) in (Role.PARAM, Role.OPT_STATE)]
        return {
            "state": state + list(step_values.copies.values()),
            "batch": [step_env[v] for v in self.batch_vars],
            "gradients": [x for sums in stage_sums for x in sums.values()]
            + [step_env[v] for v in self.partition.grad_vars if v in step_env],
            "activations": [x for m in micro for copies in list(m.copies.values())
                            for x in copies.values()],
        }

    def _sample_running(self, recorder: MemoryRecorder, task: tuple, held, fn,
                        args: list):
        """Sample while task (phase, stage, microbatch) runs: its arguments in place
        (`held()`: the step's arrays by part), and its program's working memory
        (`executable_working_bytes`) on every device of its stage. The program is compiled
        ahead of time once per (phase, stage, program) for its memory analysis; that
        executable is returned for the dispatch, so a recorded step compiles each program
        once, not once for the analysis and again on its first call."""
        phase, stage, i = task
        key = (phase, stage, id(fn))
        if key not in self._working:
            executable = fn.lower(*args).compile()
            self._working[key] = (executable_working_bytes(executable), executable)
        working_bytes, executable = self._working[key]
        working = {d.id: working_bytes for d in self.meshes[stage].devices.flat}
        recorder.sample(stage, phase, i, held(), working)
        return executable

    def _run_task(self, phase: str, stage: int, values: MicrobatchValues,
                  step_values: _StepValues, sums: dict, running=None) -> list:
        """Dispatch one task (returns at once, its outputs still being computed).
        `running(fn, args)`, when given, is called just before the dispatch (a memory
        sample while the task runs) and returns the program to dispatch (`fn` compiled)."""
        compiled = self.tasks[(phase, stage)]
        seg = compiled.segment
        if not seg.nodes:
            return []
        args = [
            values.read(v, stage, functools.partial(_placed, sharding=sharding))
            if v in self.per_microbatch
            else step_values.read(v, stage, sharding)
            for v, sharding in zip(seg.inputs, compiled.in_shardings)
        ]
        fn = compiled.fn
        if compiled.sums and all(v in sums for v in compiled.sums):
            args += [sums[v] for v in compiled.sums]
            fn = compiled.fn_sum
        summing = fn is compiled.fn_sum
        if running is not None:
            fn = running(fn, args)
        if summing:
            for v in compiled.sums:
                del sums[v]  # donated to the program, which returns the new sum
        outs = fn(*args)
        del args
        for v, x in zip(seg.outputs, outs):
            if v in compiled.sums:
                sums[v] = x  # the stage's one running sum (the old one was donated)
            values.put(v, x, stage)
        values.done(stage, seg.inputs)
        return outs

    def _result(self, step_env: dict, v: int):
        v = self.partition.resolve(v)
        if v not in step_env:
            return self.graph.vars[v].value  # a constant result
        x = step_env[v]
        if any(v in stacked and x.ndim > len(self.graph.vars[v].shape) for stacked in self.stacked):
            x = x.sum(axis=0)  # a gradient returned as is: reduce its partial sums
        if v in set(self.partition.grad_vars) and self.num_microbatches > 1:
            return x / self.num_microbatches  # a mean over microbatches (e.g. the loss)
        return x


class _StepValues:
    """The step's inputs read by every microbatch (parameters, optimizer state), with one
    copy moved to each stage that reads them in another layout, kept for the step."""

    def __init__(self, step_env: dict, lock: threading.Lock):
        self.step_env = step_env
        self.copies: dict[tuple[int, int], Any] = {}  # (var, stage) -> array
        self.lock = lock

    def read(self, v: int, stage: int, sharding) -> Any:
        with self.lock:
            x = self.copies.get((v, stage), self.step_env[v])
            x = self.copies[(v, stage)] = _placed(x, sharding)
            return x


def _placed(x, sharding):
    """`x` laid out as `sharding`: `x` itself when it already is, else a moved copy."""
    current = getattr(x, "sharding", None)
    if current is not None and (current == sharding or current.is_equivalent_to(sharding,
                                                                                x.ndim)):
        return x
    return _move(x, sharding)


def _move(x, sharding):
    """`x` on `sharding`: in one process, device to device (`copy_to_devices`: resharded
    on the source into a layout that maps onto the target devices, then copied shard by
    shard); across processes, a transfer that every process joins (see
    `autopar.distributed.transfer`)."""
    if jax.process_count() == 1:
        if isinstance(x, jax.Array) and x.committed:
            return copy_to_devices(x, sharding)
        return jax.device_put(x, sharding)  # a host value (a constant): its first upload

    # Arrays inside a step are global arrays of the stage meshes; anything else is a value
    # every process holds in full.
    return transfer(x, sharding) if isinstance(x, jax.Array) else place(x, sharding)


def _virtual_stages(schedule: str, meshes: Sequence) -> int:
    """Stages per device group: 1, or for interleaved 1F1B v when the p·v stages' meshes
    repeat every p stages (stage s on the devices of stage s mod p)."""
    if schedule != "interleaved_1f1b":
        return 1
    devices = [tuple(d.id for d in mesh.devices.flat) for mesh in meshes]
    groups = len(dict.fromkeys(devices))
    if len(devices) % groups or any(d != devices[s % groups] for s, d in enumerate(devices)):
        raise ValueError(
            "interleaved_1f1b needs the stages' meshes to repeat in order (stage s on the "
            f"devices of stage s mod p); got device ids {devices}. Build the plan with "
            "virtual_stages (autoparallel or megatron_plan) rather than by hand"
        )
    return len(devices) // groups


def overlap_fraction(timeline: Sequence[TaskRecord]) -> float:
    """Fraction of the step (first start to last end) with at least 2 stages busy."""
    if not timeline:
        return 0.0
    events = []
    for t in timeline:
        events.append((t.start, 1, t.stage))
        events.append((t.end, -1, t.stage))
    events.sort()
    busy: dict[int, int] = {}
    overlap = 0.0
    last = events[0][0]
    for when, delta, stage in events:
        if sum(1 for n in busy.values() if n > 0) >= 2:
            overlap += when - last
        busy[stage] = busy.get(stage, 0) + delta
        last = when
    span = max(t.end for t in timeline) - min(t.start for t in timeline)
    return overlap / span if span > 0 else 0.0
