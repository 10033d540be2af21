"""Does microbatching change the step's math? A numerical check of the gradient boundary.

A plan of m > 1 microbatches runs the step up to its gradient boundary
(`autopar.value_and_grad`) once per microbatch and takes the mean of the m values and
gradients (`autopar.runtime`). That equals the full batch's value and gradient exactly when
the loss is a mean over examples. A loss with batch statistics (BatchNorm in training
mode), a mixture-of-experts load-balancing term or a contrastive loss is not: its
microbatch mean differs from the full-batch value.

`microbatch_change` first tries a static proof (`autopar.search._batch_linearity`): over the
step traced at the full batch and at one microbatch, every value reaching the gradient
boundary is shown to be a mean over the batch's examples (or batch-free), so the
microbatches' mean equals it for any data; nothing is compiled or run. Where the proof
fails for any reason (a loss that is not such a mean, or a primitive the proof has no rule
for), it evaluates the traced step on one set of arguments (the caller's
arrays, or, for abstract arguments, random ones: floats from a normal of scale 0.1,
integers 0 or 1, so that indices stay in range) at the full batch and at each of the m
microbatches, and compares what reaches the gradient boundary (the loss first, then each
gradient) between the full batch and the mean of the microbatches. A difference above
`RELATIVE_TOLERANCE` names the value. Skipped when the arguments hold more than
`MAX_CHECK_BYTES`, or when one evaluation of the full-batch step would hold more than
`MAX_CHECK_LIVE_BYTES` at once on one device (`autopar.intra.peak_live_bytes` of the traced
graph, unsplit): the check evaluates the step once more on the default device, and a
long-sequence step's attention alone can need hundreds of GB there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopar.cluster import LogicalMesh
from autopar.graph import OpGraph, trace
from autopar.graph._trace import GRAD_BOUNDARY
from autopar.intra import peak_live_bytes
from autopar.search._batch_linearity import Proof, prove_microbatch_mean
from autopar.search._microbatch import microbatch_args

log = logging.getLogger("autopar")

# float32 sums in another order move a mean by a few ulps (~1e-7 relative); a loss that
# is not a mean over examples moves by far more on random data (BatchNorm statistics over
# 2 rows against 16: order 1). 1e-5 keeps rounding out and flags any real change.
RELATIVE_TOLERANCE = 1e-5
MAX_CHECK_BYTES = 256 * 2**20
# The check's own evaluation, at full batch on one device: a bound on what planning may
# allocate beside the caller's arrays.
MAX_CHECK_LIVE_BYTES = 2 * 2**30
# XLA options the check's programs are compiled with: its results are compared to 1e-5,
# which XLA's LLVM optimisation passes do not move, and the passes are most of a compile.
CHECK_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def microbatch_change(fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
                      num_microbatches: int, traced: Sequence[OpGraph] = ()) -> str | None:
    """A sentence naming the value that the mean over `num_microbatches` microbatches
    moves from its full-batch value (and by how much); None when nothing moves, or when
    the check was skipped (too large, or no gradient boundary). `traced`: graphs of `fn`
    the caller has traced already (the search's); one whose inputs have the full batch's
    or a microbatch's shapes is evaluated instead of tracing `fn` again."""
    leaves = jax.tree.leaves(args)
    nbytes = sum(int(np.prod(getattr(x, "shape", ()))) * np.dtype(x.dtype).itemsize
                 for x in leaves)
    small = nbytes <= MAX_CHECK_BYTES
    proof, traced = _static_proof(fn, args, batch_argnums, num_microbatches, traced,
                                  may_trace=small)
    if proof.proven:
        log.info("microbatch math: %d microbatches keep the step's math, proven statically "
                 "(%s); nothing compiled", num_microbatches, proof.reason)
        return None
    if not small:
        log.info("microbatch math not checked: the arguments hold %d bytes", nbytes)
        return None
    log.info("microbatch math: no static proof (%s); checking numerically", proof.reason)
    return numeric_change(fn, args, batch_argnums, num_microbatches, traced)


def numeric_change(fn: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
                   num_microbatches: int, traced: Sequence[OpGraph] = ()) -> str | None:
    """The numerical check alone (`microbatch_change` without the static proof and the
    argument-size guard): the step evaluated at the full batch and at each microbatch."""
    concrete = _concrete(args)
    run_full = _boundary_runner(fn, concrete, batch_argnums, traced)
    if run_full is None:
        return None
    full = run_full(concrete)
    pieces = [_microbatch(concrete, batch_argnums, num_microbatches, i)
              for i in range(num_microbatches)]
    run_piece = _boundary_runner(fn, pieces[0], batch_argnums, traced)
    parts = [run_piece(piece) for piece in pieces]
    for index, value in enumerate(full):
        if not jnp.issubdtype(value.dtype, jnp.floating):
            continue
        mean = sum(np.asarray(p[index], np.float64) for p in parts) / num_microbatches
        value = np.asarray(value, np.float64)
        scale = max(float(np.max(np.abs(value), initial=0.0)), 1e-30)
        moved = float(np.max(np.abs(mean - value), initial=0.0)) / scale
        if moved > RELATIVE_TOLERANCE:
            what = "the loss" if index == 0 else (
                f"output {index} of value_and_grad (a gradient or aux value of shape "
                f"{tuple(value.shape)})")
            return (f"{num_microbatches} microbatches change the step's math: {what} "
                    f"averaged over microbatches differs from its full-batch value by "
                    f"{moved:.2g} relative (checked on "
                    f"{'random' if _abstract(args) else 'the given'} arguments); the loss is "
                    "not a mean over examples (batch statistics, a load-balancing or "
                    "contrastive term?). Pass num_microbatches=1 to keep the one-device math")
    return None


def _static_proof(fn, args, batch_argnums, num_microbatches: int, traced: Sequence[OpGraph],
                  may_trace: bool) -> tuple[Proof, tuple[OpGraph, ...]]:
    """The static proof over the step at the full batch and at one microbatch (graphs of
    `traced` where their input shapes match, else traced here when `may_trace`; traced
    again here where the search's graphs are a different program, e.g. with its layer
    scan cut into ranges), and `traced` with the graphs traced here added."""
    try:
        micro_args = microbatch_args(args, batch_argnums, num_microbatches)
    except ValueError as err:
        return Proof(False, str(err)), tuple(traced)
    traced = tuple(traced)
    full, micro = _matching(traced, args), _matching(traced, micro_args)
    if (full is None or micro is None) and not may_trace:
        return Proof(False, "the step was not traced at both sizes"), traced
    reused = full is not None or micro is not None
    fresh: list[OpGraph] = []

    def traced_here(at):
        fresh.append(trace(fn, *at, batch_argnums=batch_argnums))
        return fresh[-1]

    full = full or traced_here(args)
    micro = micro or traced_here(micro_args)
    proof = _proof(full, micro, num_microbatches)
    if not proof.aligned and reused and may_trace:
        # the search's graph is another program (its layer scan cut into ranges, say)
        full = full if any(full is g for g in fresh) else traced_here(args)
        micro = micro if any(micro is g for g in fresh) else traced_here(micro_args)
        proof = _proof(full, micro, num_microbatches)
    return proof, (*traced, *fresh)


def _proof(full: OpGraph, micro: OpGraph, num_microbatches: int) -> Proof:
    """`prove_microbatch_mean`, and no proof where it fails on something it did not
    expect (the numeric check then decides, as without it)."""
    try:
        return prove_microbatch_mean(full, micro, num_microbatches)
    except Exception as err:  # noqa: BLE001 - any failure of the proof means no proof
        return Proof(False, f"the static proof failed: {type(err).__name__}: {err}")


def _matching(graphs: Sequence[OpGraph], args) -> OpGraph | None:
    """The first of `graphs` whose inputs have `args`'s shapes and dtypes."""
    want = [(tuple(np.shape(x)), _dtype_name(x.dtype)) for x in jax.tree.leaves(args)]
    return next((g for g in graphs
                 if [(tuple(g.vars[v].shape), _dtype_name(g.vars[v].dtype)) for v in g.invars]
                 == want), None)


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # a typed PRNG key: "key<fry>"
        return str(dtype)


def evaluation_bytes(graph: OpGraph) -> float:
    """Peak bytes live at once when `graph` runs whole on one device (every value
    unsplit; `autopar.intra.peak_live_bytes`)."""
    return peak_live_bytes(graph, [None] * len(graph.vars), LogicalMesh.create((1,)))


def _abstract(args) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(args))


def _concrete(args):
    """The arguments as arrays: the caller's, or random ones for abstract leaves (drawn
    with NumPy on the host: no program compiled per shape)."""
    rng = np.random.default_rng(0)

    def leaf(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return np.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
        if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            return rng.integers(0, 2, x.shape).astype(x.dtype)
        return np.zeros(x.shape, x.dtype)

    return jax.tree.map(leaf, tuple(args))


def _microbatch(args, batch_argnums, m: int, i: int):
    """Microbatch `i` of `m`: rows of each batch leaf, sliced on the host (NumPy; a slice
    of a device array would compile a program per shape) where this process holds the
    whole leaf, on the devices otherwise (an array across processes)."""
    def rows(x):
        if not np.shape(x):
            return x
        size = x.shape[0] // m
        if getattr(x, "is_fully_addressable", True):
            x = np.asarray(x)
        return x[i * size:(i + 1) * size]

    out = list(args)
    for a in batch_argnums:
        if a < len(out):
            out[a] = jax.tree.map(rows, out[a])
    return tuple(out)


def _boundary_runner(fn, args, batch_argnums, traced: Sequence[OpGraph] = ()
                     ) -> Callable | None:
    """A jitted function of arguments shaped like `args` returning what reaches the step's
    gradient boundary; None when the step has none. A graph of `traced` whose inputs have
    `args`'s shapes and dtypes is used as is; otherwise `fn` is traced."""
    want = [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in jax.tree.leaves(args)]
    graph = next((g for g in traced
                  if [(tuple(g.vars[v].shape), np.dtype(g.vars[v].dtype)) for v in g.invars]
                  == want), None)
    if graph is None:
        graph = trace(fn, *args, batch_argnums=batch_argnums)
    if not any(n.primitive == GRAD_BOUNDARY for n in graph.nodes):
        return None
    live = evaluation_bytes(graph)
    if live > MAX_CHECK_LIVE_BYTES:
        log.info("microbatch math not checked: one evaluation of the step would hold %d "
                 "bytes on one device", int(live))
        return None

    def run(flat):
        captured = []

        def on_output(node, outs):
            if node.primitive == GRAD_BOUNDARY:
                captured.extend(outs)
            return outs

        graph.evaluate(flat, on_output)
        return captured

    jitted = jax.jit(run)
    compiled = {}

    def call(a):
        # Compiled once per argument shapes, at XLA's lowest backend optimisation level:
        # the check runs the step once or twice, so the compile is most of its time
        # (the demo: 10.5 CPU s at the default level, 7.3 at level 0, trace included).
        leaves = jax.tree.leaves(a)
        key = tuple((np.shape(x), np.dtype(x.dtype)) for x in leaves)
        if key not in compiled:
            compiled[key] = jitted.lower(leaves).compile(CHECK_COMPILER_OPTIONS)
        return compiled[key](leaves)

    return call
