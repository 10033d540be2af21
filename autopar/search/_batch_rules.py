"""The rules of `autopar.search._batch_linearity`'s proof, one per primitive.

`rule(analysis, full node, micro node, input kinds) -> output kinds`: the kinds
(`autopar.search._batch_kinds`) of a node's outputs in the full-batch trace, from its
inputs' and from both traces' parameters and shapes. Every input kind is known (a node with
an unknown input has unknown outputs without a rule being called). A primitive without a
rule is `_generic`: batch-free when all its inputs are ``F(0)`` and its parameters equal in
both traces, else unknown.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from autopar.search._batch_kinds import (
    ZERO,
    Kind,
    _is_float,
    _join,
    free,
    per_example,
    reduced,
)

MAX_FIXPOINT_ROUNDS = 6  # of a scan's carry kinds


Rule = Callable[[Any, Any, Any, list], list]  # (the `_Analysis`, full node, micro node, kinds)
RULES: dict[str, Rule] = {}


def rule(*names: str):
    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn
    return register


def _params_equal(nf, nm, skip: Sequence[str] = ()) -> bool:
    if set(nf.params) != set(nm.params):
        return False
    for key, a in nf.params.items():
        if key in skip:
            continue
        b = nm.params[key]
        if hasattr(a, "jaxpr") or hasattr(a, "eqns"):
            # a sub-jaxpr: its text (shapes and literals) and its closed-over constants
            if str(a) != str(b) or not all(
                    _same(np.asarray(x), np.asarray(y))
                    for x, y in zip(getattr(a, "consts", ()), getattr(b, "consts", ()))):
                return False
            continue
        if not _same(a, b):
            return False
    return True


def _same(a: Any, b: Any) -> bool:
    """Equal parameters (nan equal to nan: a gather's fill value)."""
    try:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.array_equal(a, b)
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return bool(a == b)
    except Exception:  # incomparable parameters: not shown equal
        return False


def _all_free0(kinds) -> bool:
    return all(k == ZERO or k == free(0) for k in kinds)


def _generic(an, nf, nm, ins: list) -> list:
    """Batch-free in, same parameters, same output shapes: batch-free out."""
    if _all_free0(ins) and _params_equal(nf, nm) and all(
            an.changing(a, b) == [] for a, b in zip(nf.outputs, nm.outputs)):
        return [free(0)] * len(nf.outputs)
    return [None] * len(nf.outputs)


def _across(an, nf, position: int, d: int) -> bool:
    """Whether operand `position` of an elementwise node is broadcast along dim d (a
    scalar, or size 1 there): the same for every example."""
    shape = an.full.vars[nf.inputs[position]].shape
    return shape == () or (len(shape) > d and shape[d] == 1)


def _unify(an, nf, ins: list, exponent_free: bool = False) -> Kind:
    """The kind of an elementwise linear combination of `ins` (add, select, concatenate):
    like kinds with one exponent; a batch-free operand broadcast along the batch dim joins
    per-example ones.
    `exponent_free`: ``F(i)`` and ``R(i)`` also join (their linear combination)."""
    kinds = [(k, p) for p, k in enumerate(ins) if k != ZERO]
    if not kinds:
        return ZERO
    examples = [k for k, _ in kinds if k[0] == "P"]
    if examples:
        d, e = examples[0][1], examples[0][2]
        for k, p in kinds:
            if k[0] == "P":
                if k != per_example(d, e):
                    return None
            elif not (k == free(e) and _across(an, nf, p, d)):
                return None
        return per_example(d, e)
    exps = {k[1] for k, _ in kinds}
    if len(exps) != 1:
        return None
    (i,) = exps
    return reduced(i) if any(k[0] == "R" for k, _ in kinds) else free(i)


@rule("add", "sub", "add_any")
def _add(an, nf, nm, ins):
    return [_unify(an, nf, ins)]


@rule("neg", "copy", "copy_p", "reduce_precision", "real", "imag", "conj", "stop_gradient")
def _linear_unary(an, nf, nm, ins):
    return [ins[0]] if _params_equal(nf, nm) else [None]


IDENTITIES = frozenset({"grad_boundary", "optimization_barrier", "sharding_constraint",
                        "reshard", "mesh_cast", "pvary", "layer_boundary"})


def _identity(an, nf, nm, ins):
    return list(ins) if _params_equal(nf, nm, skip=("sharding", "dst_sharding")) \
        else [None] * len(ins)


NONLINEAR_UNARY = (
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt",
    "cbrt", "floor", "ceil", "round", "is_finite", "erf", "erfc", "erf_inv", "lgamma",
    "digamma", "not", "population_count", "clz", "sign", "abs",
)


def _nonlinear(kinds: list) -> Kind:
    """Elementwise nonlinear: per-example rows stay per-example (unscaled), batch-free
    stays batch-free; anything scaled by B or reduced over the batch is unknown."""
    examples = {k for k in kinds if k[0] == "P"}
    if any(k[0] == "R" or (k[0] == "F" and k[1]) for k in kinds):
        return None
    if not examples:
        return free(0)
    if len(examples) != 1:
        return None
    (k,) = examples
    return per_example(k[1], 0) if k[2] == 0 else None


@rule(*NONLINEAR_UNARY)
def _unary(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm):
        return [None]
    if nf.primitive == "abs" and k[0] == "P":
        return [k]  # |m^e x| = m^e |x|
    if nf.primitive == "sign" and k[0] == "P":
        return [per_example(k[1], 0)]
    return [_nonlinear([k])]


@rule("integer_pow", "square")
def _power(an, nf, nm, ins):
    (k,) = ins
    y = 2 if nf.primitive == "square" else nf.params["y"]
    if not _params_equal(nf, nm):
        return [None]
    if y == 1:
        return [k]
    if k == ZERO:
        return [ZERO if y > 0 else None]
    if k[0] == "P":
        return [per_example(k[1], y * k[2])]
    if k[0] == "F":
        return [free(y * k[1])]
    return [None]


@rule("mul")
def _mul(an, nf, nm, ins):
    a, b = ins
    if a == ZERO or b == ZERO:
        return [ZERO]
    return [_product(an, nf, a, b, +1)]


@rule("div")
def _div(an, nf, nm, ins):
    a, b = ins
    if b == ZERO:
        return [None]
    if a == ZERO:
        return [ZERO]
    if not _is_float(an.full.vars[nf.outputs[0]].dtype):
        # integer division rounds: (m x) // y is not m (x // y) in general
        return _nonlinear_nary(an, nf, nm, ins)
    return [_product(an, nf, a, b, -1)]


def _product(an, nf, a: Kind, b: Kind, sign: int) -> Kind:
    """a * b (sign +1) or a / b (sign -1)."""
    if a[0] == "P" and b[0] == "P":
        return per_example(a[1], a[2] + sign * b[2]) if a[1] == b[1] else None
    if a[0] == "P" and b[0] == "F" and _across(an, nf, 1, a[1]):
        return per_example(a[1], a[2] + sign * b[1])
    if b[0] == "P" and a[0] == "F" and _across(an, nf, 0, b[1]):
        return per_example(b[1], a[1] + sign * b[2])
    if a[0] == "F" and b[0] == "F":
        return free(a[1] + sign * b[1])
    if a[0] == "R" and b[0] == "F":
        return reduced(a[1] + sign * b[1])
    if a[0] == "F" and b[0] == "R" and sign > 0:
        return reduced(a[1] + b[1])
    return None


@rule("max", "min")
def _max(an, nf, nm, ins):
    """max(m^e a, m^e b) = m^e max(a, b): like kinds stay."""
    kind = _unify(an, nf, ins)
    if kind is None or kind[0] == "R":
        return [None]  # a max of microbatch statistics is not their mean
    return [kind]


@rule("eq", "ne", "lt", "le", "gt", "ge")
def _compare(an, nf, nm, ins):
    """Comparisons are unchanged when both sides scale by the same positive factor."""
    kind = _unify(an, nf, ins)
    if kind is None or kind[0] == "R":
        return [None]
    return [per_example(kind[1], 0) if kind[0] == "P" else free(0)]


@rule("and", "or", "xor", "pow", "atan2", "rem", "nextafter", "clamp", "shift_left",
      "shift_right_logical", "shift_right_arithmetic")
def _nonlinear_nary(an, nf, nm, ins):
    """Elementwise nonlinear of several operands: unscaled per-example rows of one dim
    with batch-free scalars, or batch-free operands only."""
    kinds = [free(0) if k == ZERO else k for k in ins]
    if not _params_equal(nf, nm) or any(k[0] == "R" or (k[0] == "F" and k[1]) for k in kinds):
        return [None]
    examples = {k for k in kinds if k[0] == "P"}
    if not examples:
        return [free(0)]
    if len(examples) != 1 or next(iter(examples))[2] != 0:
        return [None]
    d = next(iter(examples))[1]
    if not all(k[0] == "P" or _across(an, nf, p, d) for p, k in enumerate(kinds)):
        return [None]
    return [next(iter(examples))]


@rule("select_n")
def _select(an, nf, nm, ins):
    predicate, *cases = ins
    predicate = free(0) if predicate == ZERO else predicate
    kind = _unify(an, nf, [ZERO, *cases])
    if kind is None:
        return [None]
    if predicate == free(0):
        return [kind]
    if predicate[0] == "P" and predicate[2] == 0:
        if kind == ZERO:
            return [ZERO]
        if kind[0] == "P" and kind[1] == predicate[1]:
            return [kind]
        if kind[0] == "F" and all(_across(an, nf, p, predicate[1])
                                  for p in range(1, len(ins))):
            return [per_example(predicate[1], kind[1])]
    return [None]


@rule("convert_element_type")
def _convert(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm, skip=("sharding",)):
        return [None]
    old, new = an.full.vars[nf.inputs[0]].dtype, an.full.vars[nf.outputs[0]].dtype
    if _is_float(old) and _is_float(new):
        return [k]  # linear, up to rounding
    if _is_float(new) and k[0] == "F":
        return [k]  # an integer constant as a float: B stays B
    if k == ZERO or k == free(0) or (k[0] == "P" and k[2] == 0):
        return [k]
    return [None]


# reductions ---------------------------------------------------------------------------

def _drop_dims(d: int, dims: Sequence[int]) -> int:
    return d - sum(1 for a in dims if a < d)


@rule("reduce_sum")
def _reduce_sum(an, nf, nm, ins):
    (k,) = ins
    axes = tuple(nf.params["axes"])
    if not _params_equal(nf, nm, skip=("out_sharding",)):
        return [None]
    if k[0] == "P":
        return [reduced(k[2] + 1) if k[1] in axes else per_example(_drop_dims(k[1], axes), k[2])]
    return [k]


@rule("reduce_max", "reduce_min", "argmax", "argmin", "reduce_prod", "reduce_and",
      "reduce_or", "reduce_xor")
def _reduce_other(an, nf, nm, ins):
    (k,) = ins
    axes = tuple(nf.params["axes"])
    if not _params_equal(nf, nm, skip=("out_sharding",)):
        return [None]
    homogeneous = nf.primitive in ("reduce_max", "reduce_min")
    if k[0] == "P":
        if k[1] in axes:
            return [None]
        e = k[2] if homogeneous else (0 if nf.primitive in ("argmax", "argmin") else None)
        if e is None:
            return [per_example(_drop_dims(k[1], axes), 0) if k[2] == 0 else None]
        return [per_example(_drop_dims(k[1], axes), e)]
    if k == ZERO:
        return [ZERO if homogeneous else free(0)]
    if k[0] == "F" and (homogeneous or k[1] == 0):
        return [free(k[1]) if homogeneous else free(0)]
    return [None]


@rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm):
        return [None]
    if k[0] == "P":
        if k[1] == nf.params["axis"]:
            return [None]  # a running total across examples
        if nf.primitive in ("cumsum", "cummax", "cummin") or k[2] == 0:
            return [k]
        return [None]
    if nf.primitive == "cumsum" or k == ZERO or k == free(0):
        return [k if nf.primitive == "cumsum" or k == ZERO else free(0)]
    return [None]


# shapes -------------------------------------------------------------------------------

@rule("broadcast_in_dim")
def _broadcast(an, nf, nm, ins):
    if len(ins) != 1 or not _params_equal(nf, nm, skip=("shape", "sharding")):
        return [None]
    (k,) = ins
    dims = tuple(nf.params["broadcast_dimensions"])
    out = an.changing(nf.outputs[0], nm.outputs[0])
    if out is None:
        return [None]
    if k == ZERO:
        return [ZERO]
    if k[0] == "P":
        return [per_example(dims[k[1]], k[2])]
    if not out:
        return [k]
    if k[0] == "F" and len(out) == 1:
        return [per_example(out[0], k[1])]  # the same rows for every example
    return [None]


@rule("reshape")
def _reshape(an, nf, nm, ins):
    (k,) = ins[:1]
    if len(ins) != 1 or nf.params.get("dimensions") is not None:
        return [None]
    if not _params_equal(nf, nm, skip=("new_sizes", "sharding")):
        return [None]
    if k[0] != "P":
        return [k]
    out = an.changing(nf.outputs[0], nm.outputs[0])
    if not out or len(out) != 1:
        return [None]
    shape_in = an.full.vars[nf.inputs[0]].shape
    shape_out = an.full.vars[nf.outputs[0]].shape
    # The batch dim stays the major part of its group: the same number of elements before.
    if math.prod(shape_in[:k[1]]) != math.prod(shape_out[:out[0]]):
        return [None]
    return [per_example(out[0], k[2])]


@rule("transpose")
def _transpose(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm):
        return [None]
    if k[0] == "P":
        return [per_example(tuple(nf.params["permutation"]).index(k[1]), k[2])]
    return [k]


@rule("squeeze")
def _squeeze(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm):
        return [None]
    if k[0] == "P":
        dims = tuple(nf.params["dimensions"])
        return [None if k[1] in dims else per_example(_drop_dims(k[1], dims), k[2])]
    return [k]


@rule("rev")
def _rev(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm):
        return [None]
    if k[0] == "P" and k[1] in nf.params["dimensions"]:
        return [None]
    return [k]


@rule("slice")
def _slice(an, nf, nm, ins):
    (k,) = ins
    if k[0] != "P":
        return [k] if _params_equal(nf, nm) else [None]
    d = k[1]
    if not _params_equal(nf, nm, skip=("limit_indices",)):
        return [None]
    shape_f, shape_m = an.shapes(nf.inputs[0], nm.inputs[0])
    lim_f, lim_m = list(nf.params["limit_indices"]), list(nm.params["limit_indices"])
    strides = nf.params.get("strides")
    if (nf.params["start_indices"][d] != 0 or lim_f[d] != shape_f[d] or lim_m[d] != shape_m[d]
            or (strides is not None and strides[d] != 1)):
        return [None]  # some examples only
    lim_f[d] = lim_m[d] = 0
    return [k] if lim_f == lim_m else [None]


@rule("dynamic_slice")
def _dynamic_slice(an, nf, nm, ins):
    k, *index = ins
    if not _all_free0(index) or not _params_equal(nf, nm, skip=("slice_sizes",)):
        return [None]
    sizes_f, sizes_m = list(nf.params["slice_sizes"]), list(nm.params["slice_sizes"])
    if k[0] == "P":
        shape_f, shape_m = an.shapes(nf.inputs[0], nm.inputs[0])
        d = k[1]
        if sizes_f[d] != shape_f[d] or sizes_m[d] != shape_m[d]:
            return [None]
        sizes_f[d] = sizes_m[d] = 0
    return [k] if sizes_f == sizes_m else [None]


@rule("dynamic_update_slice")
def _dynamic_update_slice(an, nf, nm, ins):
    operand, update, *index = ins
    if not _all_free0(index) or not _params_equal(nf, nm):
        return [None]
    kind = _unify(an, nf, [operand, update])
    if kind is not None and kind[0] == "P":
        # the update must cover the batch dim whole: rows of every example, in place
        d = kind[1]
        (op_f, op_m), (up_f, up_m) = (an.shapes(nf.inputs[0], nm.inputs[0]),
                                      an.shapes(nf.inputs[1], nm.inputs[1]))
        if op_f[d] != up_f[d] or op_m[d] != up_m[d]:
            return [None]
    return [kind]


@rule("concatenate")
def _concatenate(an, nf, nm, ins):
    if not _params_equal(nf, nm):
        return [None]
    kind = _unify(an, nf, ins)
    if kind is not None and kind[0] == "P" and kind[1] == nf.params["dimension"]:
        return [None]  # examples of one operand after another's
    return [kind]


@rule("pad")
def _pad(an, nf, nm, ins):
    operand, value = ins
    if not _params_equal(nf, nm):
        return [None]
    kind = _unify(an, nf, [operand, value])
    if kind is not None and kind[0] == "P" and tuple(nf.params["padding_config"][kind[1]]) \
            != (0, 0, 0):
        return [None]
    return [kind]


@rule("split")
def _split(an, nf, nm, ins):
    (k,) = ins
    if not _params_equal(nf, nm) or (k[0] == "P" and k[1] == nf.params["axis"]):
        return [None] * len(nf.outputs)
    return [k] * len(nf.outputs)


@rule("iota")
def _iota(an, nf, nm, ins):
    if not _params_equal(nf, nm, skip=("shape", "sharding")):
        return [None]
    out = an.changing(nf.outputs[0], nm.outputs[0])
    if out == []:
        return [free(0)]
    if out and len(out) == 1 and out[0] != nf.params["dimension"]:
        return [per_example(out[0], 0)]  # the same rows for every example
    return [None]  # numbers the examples


@rule("sort")
def _sort(an, nf, nm, ins):
    if not _params_equal(nf, nm):
        return [None] * len(ins)
    if any(k[0] == "R" for k in ins):
        return [None] * len(ins)
    dims = {k[1] for k in ins if k[0] == "P"}
    if not dims:
        return _generic(an, nf, nm, ins)
    if len(dims) != 1 or nf.params["dimension"] in dims:
        return [None] * len(ins)
    return [k if k[0] == "P" else None for k in ins]


# contractions and indexing -------------------------------------------------------------

@rule("dot_general")
def _dot(an, nf, nm, ins):
    a, b = ins
    if not _params_equal(nf, nm, skip=("out_sharding",)):
        return [None]
    if a == ZERO or b == ZERO:
        return [ZERO]
    (lc, rc), (lb, rb) = nf.params["dimension_numbers"]
    lhs_rank = len(an.full.vars[nf.inputs[0]].shape)
    rhs_rank = len(an.full.vars[nf.inputs[1]].shape)
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    if a[0] == "P" and b[0] == "P":
        if a[1] in lc and rc[list(lc).index(a[1])] == b[1]:
            return [reduced(a[2] + b[2] + 1)]  # a sum over the examples
        if a[1] in lb and rb[list(lb).index(a[1])] == b[1]:
            return [per_example(list(lb).index(a[1]), a[2] + b[2])]
        return [None]  # pairs of examples
    if a[0] == "P" and b[0] == "F" and a[1] in lhs_free:
        return [per_example(len(lb) + lhs_free.index(a[1]), a[2] + b[1])]
    if b[0] == "P" and a[0] == "F" and b[1] in rhs_free:
        return [per_example(len(lb) + len(lhs_free) + rhs_free.index(b[1]), a[1] + b[2])]
    if a[0] in "FR" and b[0] in "FR" and "F" in (a[0], b[0]):
        return [(reduced if "R" in (a[0], b[0]) else free)(a[1] + b[1])]
    return [None]


@rule("conv_general_dilated")
def _conv(an, nf, nm, ins):
    """A convolution of per-example images with batch-free kernels is per-example; one
    whose input features are the examples of both operands (the kernel's gradient) sums
    over them."""
    a, b = ins
    if not _params_equal(nf, nm, skip=("out_sharding",)):
        return [None]
    if a == ZERO or b == ZERO:
        return [ZERO]
    lhs_spec, rhs_spec, out_spec = nf.params["dimension_numbers"]
    single = nf.params["batch_group_count"] == 1
    if a[0] == "P" and b[0] == "F" and a[1] == lhs_spec[0] and single:
        return [per_example(out_spec[0], a[2] + b[1])]
    if (a[0] == "P" and b[0] == "P" and a[1] == lhs_spec[1] and b[1] == rhs_spec[1]
            and single and nf.params["feature_group_count"] == 1):
        return [reduced(a[2] + b[2] + 1)]
    if a[0] in "FR" and b[0] in "FR" and "F" in (a[0], b[0]):
        return [(reduced if "R" in (a[0], b[0]) else free)(a[1] + b[1])]
    return [None]


def _index_dims(rank: int, window_dims: Sequence[int]) -> list[int]:
    """Positions of the non-window dims of a gather's output or a scatter's updates, in
    the order of the indices' dims (the last of which is the index vector)."""
    return [d for d in range(rank) if d not in window_dims]


@rule("gather")
def _gather(an, nf, nm, ins):
    operand, indices = ins
    dn = nf.params["dimension_numbers"]
    if operand[0] == "P" and indices[0] != "P":
        return [_gather_rows(an, nf, nm, operand, indices)]
    if not _params_equal(nf, nm):
        return [None]
    indices_rank = len(an.full.vars[nf.inputs[1]].shape)
    out_rank = len(an.full.vars[nf.outputs[0]].shape)
    positions = _index_dims(out_rank, dn.offset_dims)
    if indices[0] == "R" or (indices[0] == "P" and indices[2] != 0) \
            or (indices[0] == "F" and indices[1] != 0):
        return [None]
    if indices[0] != "P":
        return _generic(an, nf, nm, ins) if operand[0] != "P" else [None]
    di = indices[1]
    if di == indices_rank - 1:
        return [None]
    if operand == ZERO:
        return [ZERO]
    if operand[0] == "F":
        return [per_example(positions[di], operand[1])]
    if operand[0] == "P" and operand[1] in dn.operand_batching_dims:
        j = list(dn.operand_batching_dims).index(operand[1])
        if dn.start_indices_batching_dims[j] == di:
            return [per_example(positions[di], operand[2])]  # each example's own rows
    return [None]


def _gather_rows(an, nf, nm, operand: Kind, indices: Kind) -> Kind:
    """A gather from a per-example operand at batch-free indices that takes the batch dim
    whole (``x[:, idx]``): per-example along the output's dim for it."""
    dn = nf.params["dimension_numbers"]
    d = operand[1]
    if indices not in (ZERO, free(0)) or d in dn.collapsed_slice_dims \
            or d in dn.operand_batching_dims or d in dn.start_index_map:
        return None
    if not _params_equal(nf, nm, skip=("slice_sizes",)):
        return None
    sizes_f, sizes_m = list(nf.params["slice_sizes"]), list(nm.params["slice_sizes"])
    shape_f, shape_m = an.shapes(nf.inputs[0], nm.inputs[0])
    if sizes_f[d] != shape_f[d] or sizes_m[d] != shape_m[d]:
        return None
    sizes_f[d] = sizes_m[d] = 0
    if sizes_f != sizes_m:
        return None
    kept = [a for a in range(len(shape_f))
            if a not in dn.collapsed_slice_dims and a not in dn.operand_batching_dims]
    return per_example(dn.offset_dims[kept.index(d)], operand[2])


def _scatter_rows(an, nf, nm, operand: Kind, updates: Kind) -> Kind:
    """A scatter at batch-free indices of updates that take the batch dim whole (the
    transpose of `_gather_rows`): per-example along the operand's dim for it."""
    dn = nf.params["dimension_numbers"]
    if updates[1] not in dn.update_window_dims:
        return None
    shape_f, shape_m = an.shapes(nf.inputs[0], nm.inputs[0])
    kept = [a for a in range(len(shape_f))
            if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
    d = kept[list(dn.update_window_dims).index(updates[1])]
    if d in dn.scatter_dims_to_operand_dims:
        return None
    upd_f, upd_m = an.shapes(nf.inputs[2], nm.inputs[2])
    if upd_f[updates[1]] != shape_f[d] or upd_m[updates[1]] != shape_m[d]:
        return None
    if operand != ZERO and operand != per_example(d, updates[2]):
        return None
    return per_example(d, updates[2])


@rule("scatter-add", "scatter_add", "scatter")
def _scatter(an, nf, nm, ins):
    operand, indices, updates = ins
    if not _params_equal(nf, nm):
        return [None]
    dn = nf.params["dimension_numbers"]
    if indices in (ZERO, free(0)) and updates[0] == "P":
        return [_scatter_rows(an, nf, nm, operand, updates)]
    if indices[0] != "P" or indices[2] != 0:
        return _generic(an, nf, nm, ins) if "P" not in (operand[0], updates[0]) else [None]
    indices_rank = len(an.full.vars[nf.inputs[1]].shape)
    di = indices[1]
    if di == indices_rank - 1:
        return [None]
    if updates == ZERO:
        return [operand if nf.primitive != "scatter" else None]
    if updates[0] != "P":
        return [None]
    updates_rank = len(an.full.vars[nf.inputs[2]].shape)
    if _index_dims(updates_rank, dn.update_window_dims)[di] != updates[1]:
        return [None]
    if di in dn.scatter_indices_batching_dims:
        j = list(dn.scatter_indices_batching_dims).index(di)
        d = dn.operand_batching_dims[j]
        if operand != ZERO and (operand[0] != "P" or operand[1] != d):
            return [None]
        if operand != ZERO and operand[2] != updates[2]:
            return [None]
        return [per_example(d, updates[2])]  # each example's rows updated by its own
    if nf.primitive == "scatter":
        return [None]  # examples overwrite each other
    return [_unify(an, nf, [operand, reduced(updates[2] + 1)])]  # a sum over the examples


@rule("scan")
def _scan(an, nf, nm, ins):
    """A scan's body analysed with its carry's kinds to a fixed point; `xs` and `ys` are
    per-example along the dim after the scanned one."""
    params_f, params_m = nf.params, nm.params
    if not _params_equal(nf, nm, skip=("jaxpr",)):
        return [None] * len(nf.outputs)
    num_consts, num_carry = params_f["num_consts"], params_f["num_carry"]
    consts, carry, xs = ins[:num_consts], ins[num_consts:num_consts + num_carry], \
        ins[num_consts + num_carry:]
    if any(k[0] == "P" and k[1] == 0 for k in xs):
        return [None] * len(nf.outputs)  # a scan over the examples
    x_kinds = [per_example(k[1] - 1, k[2]) if k[0] == "P" else k for k in xs]
    body = an.sub(params_f["jaxpr"], params_m["jaxpr"])
    for _ in range(MAX_FIXPOINT_ROUNDS):
        env = body.run([*consts, *carry, *x_kinds])
        outs = [env(v) for v in body.full.outvars]
        joined = [_join(c, o) for c, o in zip(carry, outs[:num_carry])]
        if joined == list(carry):
            ys = [per_example(k[1] + 1, k[2]) if k is not None and k[0] == "P" else k
                  for k in outs[num_carry:]]
            return [*carry, *ys]
        carry = joined
    return [None] * len(nf.outputs)
