"""A one-stage pipelined plan as one compiled program per step.

With one stage there is nothing to overlap, and running the step as a forward, a backward
and an update program per microbatch (the task runtime, `autopar.runtime._pipeline`) only
adds what a single `jax.jit` does not pay: one dispatch per task, the activations written
out between the forward and the backward program, fusions cut at program edges. This
module composes the same segments (`autopar.lower.segment_body`, each input and result
pinned to the sharding its own program would give it) into one traced function:

    first microbatch: forward, backward (its gradients start the running sums)
    lax.scan over the other microbatches: forward, backward, gradients added to the sums
    update: each apply segment, reading the sums scaled by 1/microbatches

which is the task runtime's arithmetic in the task runtime's order (the first microbatch
starts the sums, each later one adds to them), so the two agree to rounding.

Layouts: inside each segment the plan's constraints hold (`plan.constrained`, its operand
specs: the layouts the ILP chose); the values between the forward and backward segments
are not pinned, since in one program they cross no program edge (pinning them, as the
task runtime's program edges do, added 8 all-gathers to the 185 of the benchmark's GPT
step, `benchmarks/investigations/fused_layouts.py`); the update segments pin their inputs
and results, so the new state comes back in the plan's layout for the next step.

In: a `PipelineExecutable` of one stage and the flat arguments whose buffers the step may
reuse (the caller's `donate_argnums`, as the SPMD runtime's `jax.jit` takes them). Out:
`FusedStep`, called with the step's flat arguments, returning its flat results as the task
runtime does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from autopar.cluster import replicated, to_partition_spec
from autopar.lower import segment_body


class FusedStep:
    """The whole step of a one-stage plan as one `jax.jit` (see the module docstring)."""

    def __init__(self, pipeline, donate_flat: Sequence[int] = ()) -> None:
        part = pipeline.partition
        assert part.num_stages == 1, f"a fused step needs one stage, got {part.num_stages}"
        graph = pipeline.graph
        self.graph = graph
        self.num_microbatches = pipeline.num_microbatches
        mesh = pipeline.meshes[0]
        plan = pipeline.stage_plans[0]
        sub = part.stage_graphs[0]
        stacked = pipeline.stacked[0]
        grad_set = set(part.grad_vars)
        overrides = dict(plan.output_overrides)

        def body(seg, constrain: bool, **kw):
            return segment_body(sub, plan, seg.nodes, seg.inputs, seg.outputs, mesh,
                                output_specs=overrides, stacked=stacked, constrain=constrain,
                                **kw)

        self.micro = []  # (segment, first run, later runs adding to the sums, sums)
        for seg in (*part.forward, *part.backward):
            if not seg.nodes:
                continue
            sums = tuple(v for v in seg.outputs if v in grad_set)
            first = body(seg, False)[0]
            later = body(seg, False, accumulate=sums)[0] if sums else first
            self.micro.append((seg, first, later, sums))
        scale = {v: 1.0 / self.num_microbatches for v in part.grad_vars}
        self.apply = [(seg, body(seg, True, scale=scale)[0]) for seg in part.apply]
        self.batch_vars = [v for v in graph.invars if v in set(pipeline.batch_vars)]
        self.in_shardings = [
            NamedSharding(mesh, to_partition_spec(
                plan.var_specs[v] if v < len(plan.var_specs) and plan.var_specs[v] is not None
                else replicated(len(graph.vars[v].shape))
            ))
            for v in graph.invars
        ]
        self.stacked = stacked
        self.grad_set = frozenset(grad_set)
        self.resolve = part.resolve
        self.fn = jax.jit(self._step, in_shardings=self.in_shardings,
                          donate_argnums=tuple(donate_flat))

    def __call__(self, flat_args: Sequence) -> list:
        m = self.num_microbatches
        for v, x in zip(self.graph.invars, flat_args):
            if v in self.batch_vars:
                size, rows = self.graph.vars[v].shape[0], x.shape[0]
                if rows != size * m:
                    raise ValueError(
                        f"batch input {self.graph.vars[v].path} has {rows} rows; with "
                        f"{m} microbatches of {size} it needs {size * m}"
                    )
        args = [
            x if _has_sharding(x, sh) else jax.device_put(x, sh)
            for x, sh in zip(flat_args, self.in_shardings)
        ]
        return self.fn(*args)

    def _step(self, *flat_args) -> list:
        graph, m = self.graph, self.num_microbatches
        step_env = dict(zip(graph.invars, flat_args))
        # Batch inputs as (microbatches, rows, ...): microbatch i is rows [i*size, (i+1)*size).
        batches = {
            v: step_env[v].reshape(m, graph.vars[v].shape[0], *graph.vars[v].shape[1:])
            for v in self.batch_vars
        }

        def run_micro(batch: dict, sums: dict | None) -> dict:
            env = {**step_env, **batch}
            new_sums = {}
            for seg, first, later, seg_sums in self.micro:
                if sums is None or not seg_sums:
                    outs = first(*(env[v] for v in seg.inputs))
                else:
                    outs = later(*(env[v] for v in seg.inputs), *(sums[v] for v in seg_sums))
                env.update(zip(seg.outputs, outs))
                new_sums.update((v, env[v]) for v in seg_sums)
            return new_sums

        sums = run_micro({v: x[0] for v, x in batches.items()}, None)
        if m > 1:
            def scan_body(carry, batch):
                return run_micro(batch, carry), None

            sums, _ = jax.lax.scan(scan_body, sums, {v: x[1:] for v, x in batches.items()})
        step_env.update(sums)
        for seg, fn in self.apply:
            outs = fn(*(step_env[v] for v in seg.inputs))
            step_env.update(zip(seg.outputs, outs))
        return [self._result(step_env, v) for v in graph.outvars]

    def _result(self, step_env: dict, v: int) -> Any:
        """As `PipelineExecutable._result`: partial sums reduced, accumulated values (e.g.
        the loss) averaged over the microbatches."""
        v = self.resolve(v)
        if v not in step_env:
            return self.graph.vars[v].value  # a constant result
        x = step_env[v]
        if v in self.stacked and x.ndim > len(self.graph.vars[v].shape):
            x = x.sum(axis=0)
        if v in self.grad_set and self.num_microbatches > 1:
            return x / self.num_microbatches
        return x


def _has_sharding(x: Any, sharding) -> bool:
    current = getattr(x, "sharding", None)
    if current is None:
        return False
    # Equality first: it is cheap, and every argument is checked on every step.
    return current == sharding or current.is_equivalent_to(sharding, x.ndim)
