"""Sharding rules for control flow: `scan`, `while` and `cond`, whole or split on a batch.

The tracer keeps a loop or a conditional as one node whose params hold its bodies. Its
rule offers the replicated strategy and, when the bodies allow it, a signature in which one
label, ``"batch"``, marks a dimension of some operands and results: splitting that
dimension over mesh axes runs every iteration (every branch) on a slice of the batch with
no communication, and XLA's partitioner splits the loop the same way from the shardings at
its boundary.

**The analysis.** A *tag* says that a value of a body carries the batch on one dimension
(all tagged dimensions have the same size). Tags are pushed through the body's equations
in the `eval_jaxpr` shape (an env, one loop, recursion into nested calls and control
flow). An equation that reads a tagged value is accepted only if its own sharding rule
(the `SHARDING_RULES` registry) gives every tagged operand dimension one and the same
label, that label is no reduction (no sum over the batch, no contracting dimension, no
gathered or dynamically sliced batch), it marks dimensions of the batch size only, and
every result carries it on exactly one dimension. Untagged values are replicated: each
device may take its slice of them locally, so they may meet tagged ones freely. Anything
else (a primitive without a rule, an operand used whole, a reshape that merges the batch)
rejects the split, and so does a split that leaves more than `MAX_REPLICATED_SHARE` of a
body's FLOPs on unsplit values (its cost, node FLOPs / parallelism, would be a fiction).
Loop-specific checks:

- `scan`: operands are consts, carries and xs (scanned axis leading, so the batch is a
  later dimension); a carry whose body result is tagged is tagged on entry too, until a
  fixed point; ys carry the batch one dimension later than the body's results.
- `while`: the same for body consts and carries; the condition must not read a tagged
  carry at all (the trip count would depend on the batch), and its consts are never split.
- `cond`: the index (a scalar) is never split; every branch must accept the tags, and
  branches that tag a result must agree on its dimension.

The rule tries each splittable operand dimension as a seed, grows it to a fixed point,
adds every other operand dimension that stays consistent, and keeps the choice that
splits the most elements. If none is consistent, the node is planned replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core

from autopar._memo import memo
from autopar.graph._flops import CALL_JAXPR_PARAM, eqn_flops
from autopar.intra._rules import OpInfo, Rule, primitive_signature
from autopar.intra._signature import Labels, Signature

BATCH = "batch"

# A split strategy costs node.flops / parallelism, as every strategy does, yet a body's
# work on values that carry no batch (a counter, a transform of the weights, or all of it
# when only a small accumulator is split) runs whole on every device. A split is offered
# only if such work is at most this share of the body's FLOPs, so the prediction stays
# within a few percent of what runs.
MAX_REPLICATED_SHARE = 0.05

# Analyses remembered (see `_cached_best_split`); each entry keeps its bodies alive.
SPLIT_CACHE_SIZE = 1024

Tags = tuple[int | None, ...]  # per value: the dimension carrying the batch, or None


# ---- pushing tags through a jaxpr -------------------------------------------------------


def _open(jaxpr: Any) -> core.Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


@dataclass(frozen=True)
class Propagation:
    """Where the batch goes through one jaxpr, and how much of its work is split.

    `out_tags`: per output, its tagged dimension or None. `split_flops` are the FLOPs of
    equations that read a tagged value (they run on a slice of the batch),
    `replicated_flops` those of the others (every device runs them whole).
    """

    out_tags: Tags
    split_flops: float
    replicated_flops: float

    @property
    def replicated_share(self) -> float:
        total = self.split_flops + self.replicated_flops
        return self.replicated_flops / total if total else 0.0


def propagate(jaxpr: Any, in_tags: Sequence[int | None], size: int) -> Propagation | None:
    """Push batch tags from the inputs of `jaxpr` to its outputs.

    **Arguments:**
    - `jaxpr`: a `Jaxpr` or `ClosedJaxpr` (its consts are untagged).
    - `in_tags`: per input, the dimension carrying the batch, or None.
    - `size`: the batch size; every tagged dimension must have it.

    **Returns:** a `Propagation`, or None if some equation does not treat the batch
    independently.
    """
    jaxpr = _open(jaxpr)
    env: dict[Any, int] = {}
    for var, tag in zip(jaxpr.invars, in_tags, strict=True):
        if tag is not None:
            if _shape(var)[tag] != size:
                return None
            env[var] = tag
    split_flops = replicated_flops = 0.0
    for eqn in jaxpr.eqns:
        tags = tuple(None if isinstance(a, core.Literal) else env.get(a) for a in eqn.invars)
        if all(t is None for t in tags):
            replicated_flops += eqn_flops(eqn)  # from replicated values only: replicated
            continue
        inner = _eqn_propagation(eqn, tags, size)
        if inner is None:
            return None
        split_flops += inner.split_flops
        replicated_flops += inner.replicated_flops
        for var, tag in zip(eqn.outvars, inner.out_tags):
            if tag is not None:
                env[var] = tag
    out_tags = tuple(None if isinstance(a, core.Literal) else env.get(a) for a in jaxpr.outvars)
    return Propagation(out_tags, split_flops, replicated_flops)


def _eqn_propagation(eqn: core.JaxprEqn, tags: Tags, size: int) -> Propagation | None:
    """How one equation that reads tagged values passes them on, or None to reject."""
    name = eqn.primitive.name
    if name in CALL_JAXPR_PARAM:
        return propagate(eqn.params[CALL_JAXPR_PARAM[name]], tags, size)
    if name in CONTROL_FLOW:
        # A nested loop or branch checks its own replicated share (see `_enough_split`).
        found = CONTROL_FLOW[name](eqn.params, tags, size)
        return None if found is None else Propagation(found.out_tags, eqn_flops(eqn), 0.0)
    op = OpInfo(
        primitive=name,
        params=eqn.params,
        in_shapes=tuple(_shape(a) for a in eqn.invars),
        out_shapes=tuple(_shape(v) for v in eqn.outvars),
        in_const=tuple(isinstance(a, core.Literal) for a in eqn.invars),
    )
    sig = primitive_signature(op)  # control flow was handled above
    out_tags = None if sig is None else _follow_label(sig, op, tags, size)
    return None if out_tags is None else Propagation(out_tags, eqn_flops(eqn), 0.0)


def _follow_label(sig: Signature, op: OpInfo, tags: Tags, size: int) -> Tags | None:
    """Result tags under `sig`: the one label the tagged operands share, where it lands."""
    label = None
    for labels, tag in zip(sig.inputs, tags):
        if tag is None:
            continue
        if labels is None or labels[tag] is None or label not in (None, labels[tag]):
            return None
        label = labels[tag]
    assert label is not None, f"{op.primitive}: called without a tagged operand"
    if label in sig.reductions:
        return None
    for labels, shape in zip((*sig.inputs, *sig.outputs), (*op.in_shapes, *op.out_shapes)):
        dims = [d for d, lab in enumerate(labels or ()) if lab == label]
        if len(dims) > 1 or any(shape[d] != size for d in dims):
            return None  # the label spans several dimensions or a merged / resized one
    out_tags = tuple(labels.index(label) if label in labels else None for labels in sig.outputs)
    # A result without the label would be computed from the whole batch on every device.
    return None if None in out_tags else out_tags


# ---- one control-flow equation under given operand tags ---------------------------------


def _enough_split(found: Propagation) -> bool:
    return found.replicated_share <= MAX_REPLICATED_SHARE


@dataclass(frozen=True)
class Split:
    """A consistent batch split of one control-flow equation.

    `in_tags` may tag more operands than asked (carries whose body results carry the
    batch); `out_tags` are the results' tagged dimensions.
    """

    in_tags: Tags
    out_tags: Tags


def _loop_fixed_point(
    body: Any, in_tags: list[int | None], first_carry: int, num_carry: int, size: int
) -> tuple[list[int | None], Tags] | None:
    """Propagate through a loop body until the carries' tags stop growing.

    Body inputs are ``[... consts, carries, ...]`` with the carries at `first_carry`; body
    outputs start with the carries. A carry tagged on entry but computed from replicated
    values keeps its tag (each device slices the replicated value).
    """
    in_tags = list(in_tags)
    for _ in range(num_carry + 1):
        found = propagate(body, in_tags, size)
        if found is None:
            return None
        out = found.out_tags
        changed = False
        for j in range(num_carry):
            entry, result = in_tags[first_carry + j], out[j]
            if result is None:
                continue
            if entry is None:
                in_tags[first_carry + j] = result
                changed = True
            elif entry != result:
                return None
        if not changed:
            # Judged at the fixed point only: before it, carries still to be split count
            # as replicated work.
            return (in_tags, out) if _enough_split(found) else None
    raise AssertionError("the carries' tags can only grow, once per carry")


def scan_split(params: Any, tags: Tags, size: int) -> Split | None:
    """Split of a `scan` under operand tags (xs tags count the scanned axis)."""
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    first_xs = num_consts + num_carry
    if any(t == 0 for t in tags[first_xs:]):
        return None  # the scanned axis itself
    body_tags = [t if i < first_xs or t is None else t - 1 for i, t in enumerate(tags)]
    found = _loop_fixed_point(params["jaxpr"], body_tags, num_consts, num_carry, size)
    if found is None:
        return None
    body_tags, out = found
    in_tags = tuple(t if i < first_xs or t is None else t + 1 for i, t in enumerate(body_tags))
    carries = in_tags[num_consts:first_xs]
    ys = tuple(None if t is None else t + 1 for t in out[num_carry:])
    return Split(in_tags, carries + ys)


def while_split(params: Any, tags: Tags, size: int) -> Split | None:
    """Split of a `while`: body consts and carries; the condition reads no tagged carry."""
    cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
    if any(t is not None for t in tags[:cond_nconsts]):
        return None
    num_carry = len(tags) - cond_nconsts - body_nconsts
    found = _loop_fixed_point(
        params["body_jaxpr"], list(tags[cond_nconsts:]), body_nconsts, num_carry, size
    )
    if found is None:
        return None
    body_tags, _ = found
    carries = tuple(body_tags[body_nconsts:])
    cond = _open(params["cond_jaxpr"])
    tagged = {v for v, t in zip(cond.invars[cond_nconsts:], carries) if t is not None}
    if _reads_any(cond, tagged):
        return None
    return Split(tuple(tags[:cond_nconsts]) + tuple(body_tags), carries)


def _reads_any(jaxpr: core.Jaxpr, variables: set) -> bool:
    atoms = [a for eqn in jaxpr.eqns for a in eqn.invars] + list(jaxpr.outvars)
    return any(not isinstance(a, core.Literal) and a in variables for a in atoms)


def cond_split(params: Any, tags: Tags, size: int) -> Split | None:
    """Split of a `cond`: the index stays whole, every branch accepts the same tags."""
    if tags[0] is not None:
        return None
    merged: list[int | None] = [None] * len(_open(params["branches"][0]).outvars)
    for branch in params["branches"]:
        found = propagate(branch, tags[1:], size)
        if found is None or not _enough_split(found):
            return None
        for j, tag in enumerate(found.out_tags):
            if tag is None:
                continue  # this branch returns a replicated value: sliceable
            if merged[j] not in (None, tag):
                return None
            merged[j] = tag
    return Split(tags, tuple(merged))


SplitFn = Callable[[Any, Tags, int], Split | None]
CONTROL_FLOW: dict[str, SplitFn] = {"scan": scan_split, "while": while_split, "cond": cond_split}


def _splittable_operands(op: OpInfo) -> list[int]:
    """Operands the outer rule may split (never literals, a while's condition consts or a
    cond's index)."""
    if op.primitive == "while":
        first = op.params["cond_nconsts"]
    elif op.primitive == "cond":
        first = 1
    else:
        first = 0
    return [i for i in range(first, len(op.in_shapes)) if not op.in_const[i]]


# ---- the rule ---------------------------------------------------------------------------


def best_split(op: OpInfo) -> Split | None:
    """The batch split of a control-flow node that splits the most elements, if any.

    **Arguments:**
    - `op`: a `scan`, `while` or `cond` equation as a rule sees it.

    **Returns:** a `Split`, or None when no operand dimension can carry a batch.
    """
    split_fn = CONTROL_FLOW[op.primitive]
    operands = _splittable_operands(op)
    best, best_score = None, 0
    for i in operands:
        for d, size in enumerate(op.in_shapes[i]):
            if size <= 1 or (best is not None and best.in_tags[i] == d):
                continue
            seed = [None] * len(op.in_shapes)
            seed[i] = d
            found = split_fn(op.params, tuple(seed), size)
            if found is None:
                continue
            found = _grow(op, split_fn, found, operands, size)
            score = _split_elements(op, found)
            if score > best_score:
                best, best_score = found, score
    return best


def _cached_best_split(op: OpInfo) -> Split | None:
    """`best_split`, remembered per equation: the planner asks again for every mesh shape
    and stage, and a large body takes tens of milliseconds to analyse."""
    key = (op.primitive, tuple(sorted(op.params.items())), op.in_shapes, op.out_shapes,
           op.in_const)
    try:
        hash(key)  # jaxprs hash by identity; a parameter of another kind may not hash
    except TypeError:
        return best_split(op)
    return _best_split_by_key(key)


@memo("intra.best_splits", "control-flow op key", maxsize=SPLIT_CACHE_SIZE)
def _best_split_by_key(key: tuple) -> Split | None:
    primitive, params, in_shapes, out_shapes, in_const = key
    return best_split(OpInfo(primitive, dict(params), in_shapes, out_shapes, in_const))


def _grow(op: OpInfo, split_fn: SplitFn, split: Split, operands, size: int) -> Split:
    """Add every other operand dimension of the batch size that keeps the split valid."""
    for i in operands:
        if split.in_tags[i] is not None:
            continue
        for d, dim_size in enumerate(op.in_shapes[i]):
            if dim_size != size:
                continue
            tags = list(split.in_tags)
            tags[i] = d
            found = split_fn(op.params, tuple(tags), size)
            if found is not None:
                split = found
                break
    return split


def _split_elements(op: OpInfo, split: Split) -> int:
    total = 0
    for shapes, tags in ((op.in_shapes, split.in_tags), (op.out_shapes, split.out_tags)):
        for shape, tag in zip(shapes, tags):
            if tag is not None:
                total += _num_elements(shape)
    return total


def _num_elements(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _labels(shape: Sequence[int], tag: int | None) -> Labels:
    return tuple(BATCH if d == tag else None for d in range(len(shape)))


def control_flow_rule(op: OpInfo) -> Signature:
    """Replicated, or split along the batch dimension the bodies treat independently.

    **Arguments:**
    - `op`: a `scan`, `while` or `cond` equation; its params hold the bodies.

    **Returns:** a `Signature` whose only label is ``"batch"`` on the split operands and
    results, or one without labels (replicated only) when no batch split is sound.
    """
    split = _cached_best_split(op)
    in_tags = split.in_tags if split else (None,) * len(op.in_shapes)
    out_tags = split.out_tags if split else (None,) * len(op.out_shapes)
    return Signature(
        tuple(_labels(s, t) for s, t in zip(op.in_shapes, in_tags)),
        tuple(_labels(s, t) for s, t in zip(op.out_shapes, out_tags)),
    )


# ---- the markers of an opened scan (see `_scan.py`) -------------------------------------

# A stacked operand -> its slice, an operand or initial carry -> the body, the final carry
# -> the result, the body's per-iteration result -> the stacked result.
SLICE, ENTER, EXIT, STACK = "scan_slice", "scan_enter", "scan_exit", "scan_stack"


def scan_marker_rule(op: OpInfo) -> Signature:
    """Identity on the body's dimensions; a stack's scanned (leading) dim is never split."""
    (in_shape,), (out_shape,) = op.in_shapes, op.out_shapes
    if op.primitive == SLICE:
        labels = _dim_labels(len(out_shape))
        return Signature(((None, *labels),), (labels,))
    labels = _dim_labels(len(in_shape))
    if op.primitive == STACK:
        return Signature((labels,), ((None, *labels),))
    return Signature((labels,), (labels,))


def _dim_labels(n: int) -> Labels:
    return tuple(f"d{i}" for i in range(n))


CONTROL_FLOW_RULES: dict[str, Rule] = {
    **dict.fromkeys(("scan", "while", "cond"), control_flow_rule),
    **dict.fromkeys((SLICE, ENTER, EXIT, STACK), scan_marker_rule),
}
