"""Sharding rules of single primitives, keyed by primitive name.

A rule turns one equation into a `Signature` (see `_signature.py`). Rules are registered
beside their definitions with `@register(...)` into `PRIMITIVE_RULES`. Control flow (scan,
while, cond) has its own rules in `_control_flow.py`; `_registry.py` puts the two tables
together, explicitly, into `SHARDING_RULES`. A primitive with no rule gets the replicated
strategy only, and the planner names it in the plan's warnings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.intra._signature import Labels, Signature


@dataclass(frozen=True)
class OpInfo:
    """What a rule sees of one equation."""

    primitive: str
    params: Any
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_const: tuple[bool, ...]  # operand is a literal or closed-over constant


Rule = Callable[[OpInfo], Signature | None]
PRIMITIVE_RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for the primitives `names` (here, or for a user's own primitive)."""
    def deco(rule: Rule) -> Rule:
        for name in names:
            PRIMITIVE_RULES[name] = rule
        return rule

    return deco


def primitive_signature(op: OpInfo) -> Signature | None:
    """The signature of a single primitive, or None when no rule covers it."""
    rule = PRIMITIVE_RULES.get(op.primitive)
    return None if rule is None else rule(op)


def _fresh(prefix: str, n: int) -> Labels:
    return tuple(f"{prefix}{i}" for i in range(n))


# ---- elementwise ------------------------------------------------------------------------

ELEMENTWISE = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh bitcast_convert_type cbrt ceil "
    "clamp conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp "
    "exp2 expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt "
    "max min mul ne neg nextafter not or population_count pow real reduce_precision rem round "
    "rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt "
    "square sub tan tanh xor stop_gradient optimization_barrier"
).split()


@register(*ELEMENTWISE)
def _elementwise(op: OpInfo) -> Signature:
    out_shape = op.out_shapes[0]
    labels = _fresh("d", len(out_shape))
    ins = []
    for shape in op.in_shapes:
        if len(shape) == 0:
            ins.append(())
        else:
            assert tuple(shape) == tuple(out_shape) or len(shape) == len(out_shape), (
                f"{op.primitive}: operand shape {shape} does not match result {out_shape}"
            )
            same = zip(labels, shape, out_shape)
            ins.append(tuple(lab if s == o else None for lab, s, o in same))
    outs = tuple(labels for _ in op.out_shapes)
    return Signature(tuple(ins), outs)


@register("layer_boundary", "grad_boundary")
def _identity_many(op: OpInfo) -> Signature:
    ins = tuple(_fresh(f"v{i}_", len(s)) for i, s in enumerate(op.in_shapes))
    return Signature(ins, ins)


# ---- contractions -----------------------------------------------------------------------


@register("dot_general")
def _dot_general(op: OpInfo) -> Signature:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs_nd, rhs_nd = len(op.in_shapes[0]), len(op.in_shapes[1])
    lhs: list[str | None] = [None] * lhs_nd
    rhs: list[str | None] = [None] * rhs_nd
    for i, (a, b) in enumerate(zip(lb, rb)):
        lhs[a] = rhs[b] = f"b{i}"
    for i, (a, b) in enumerate(zip(lc, rc)):
        lhs[a] = rhs[b] = f"k{i}"
    lhs_free = [d for d in range(lhs_nd) if d not in lb and d not in lc]
    rhs_free = [d for d in range(rhs_nd) if d not in rb and d not in rc]
    for i, d in enumerate(lhs_free):
        lhs[d] = f"m{i}"
    for i, d in enumerate(rhs_free):
        rhs[d] = f"n{i}"
    out = tuple(f"b{i}" for i in range(len(lb))) + tuple(lhs[d] for d in lhs_free)
    out += tuple(rhs[d] for d in rhs_free)
    return Signature((tuple(lhs), tuple(rhs)), (out,), {f"k{i}": "sum" for i in range(len(lc))})


@register("conv_general_dilated")
def _conv(op: OpInfo) -> Signature:
    dn = op.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs: list[str | None] = [None] * len(op.in_shapes[0])
    rhs: list[str | None] = [None] * len(op.in_shapes[1])
    out: list[str | None] = [None] * len(op.out_shapes[0])
    reductions = {}
    if op.params.get("batch_group_count", 1) == 1:
        lhs[lhs_spec[0]] = out[out_spec[0]] = "batch"
    if op.params.get("feature_group_count", 1) == 1:
        rhs[rhs_spec[0]] = out[out_spec[1]] = "out_feature"
        lhs[lhs_spec[1]] = rhs[rhs_spec[1]] = "in_feature"
        reductions["in_feature"] = "sum"
    return Signature((tuple(lhs), tuple(rhs)), (tuple(out),), reductions)


# ---- reductions and scans ---------------------------------------------------------------

_REDUCE_KIND = {
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_prod": "prod",
    "reduce_and": "and",
    "reduce_or": "or",
}


@register(*_REDUCE_KIND)
def _reduce(op: OpInfo) -> Signature:
    axes = set(op.params["axes"])
    labels = _fresh("d", len(op.in_shapes[0]))
    kind = _REDUCE_KIND[op.primitive]
    out = tuple(lab for d, lab in enumerate(labels) if d not in axes)
    return Signature((labels,), (out,), {labels[d]: kind for d in axes})


@register("argmax", "argmin")
def _arg_reduce(op: OpInfo) -> Signature:
    axes = set(op.params["axes"])
    labels = tuple(None if d in axes else f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature((labels,), (tuple(lab for lab in labels if lab is not None),))


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(op: OpInfo) -> Signature:
    axis = op.params["axis"]
    labels = tuple(None if d == axis else f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature((labels,), (labels,))


@register("sort")
def _sort(op: OpInfo) -> Signature:
    dim = op.params["dimension"]
    labels = tuple(None if d == dim else f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature(tuple(labels for _ in op.in_shapes), tuple(labels for _ in op.out_shapes))


@register("top_k")
def _top_k(op: OpInfo) -> Signature:
    nd = len(op.in_shapes[0])
    labels = tuple(None if d == nd - 1 else f"d{d}" for d in range(nd))
    return Signature((labels,), (labels, labels))


# ---- data movement ----------------------------------------------------------------------


@register("broadcast_in_dim")
def _broadcast_in_dim(op: OpInfo) -> Signature:
    out_shape = op.out_shapes[0]
    bdims = op.params["broadcast_dimensions"]
    out = list(_fresh("d", len(out_shape)))
    operand: list[str | None] = []
    for in_dim, out_dim in enumerate(bdims):
        same = op.in_shapes[0][in_dim] == out_shape[out_dim]
        operand.append(out[out_dim] if same else None)
    ins: list[Labels | None] = [tuple(operand)]
    ins += [None] * (len(op.in_shapes) - 1)  # dynamic shape operands, if any
    return Signature(tuple(ins), (tuple(out),))


@register("reshape")
def _reshape(op: OpInfo) -> Signature | None:
    if op.params.get("dimensions") is not None:
        return None
    in_shape, out_shape = op.in_shapes[0], op.out_shapes[0]
    ins: list[str | None] = [None] * len(in_shape)
    outs: list[str | None] = [None] * len(out_shape)
    for group_id, (in_dims, out_dims) in enumerate(_reshape_groups(in_shape, out_shape)):
        # Splitting the major non-unit dimension of a merged or split group is the same
        # contiguous block of elements on both sides (row-major layout).
        in_major = next((d for d in in_dims if in_shape[d] != 1), None)
        out_major = next((d for d in out_dims if out_shape[d] != 1), None)
        if in_major is not None and out_major is not None:
            ins[in_major] = outs[out_major] = f"g{group_id}"
    return Signature((tuple(ins),) + (None,) * (len(op.in_shapes) - 1), (tuple(outs),))


def _reshape_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Split the dimensions into the smallest consecutive runs whose element counts agree."""
    groups = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        in_dims: list[int] = []
        out_dims: list[int] = []
        in_size = out_size = 1
        while True:
            if i < len(in_shape) and (in_size <= out_size or j == len(out_shape)):
                in_size *= in_shape[i]
                in_dims.append(i)
                i += 1
            elif j < len(out_shape):
                out_size *= out_shape[j]
                out_dims.append(j)
                j += 1
            else:
                break
            if in_size == out_size:
                break
        groups.append((in_dims, out_dims))
    return groups


@register("transpose")
def _transpose(op: OpInfo) -> Signature:
    perm = op.params["permutation"]
    labels = _fresh("d", len(op.in_shapes[0]))
    return Signature((labels,), (tuple(labels[p] for p in perm),))


@register("squeeze")
def _squeeze(op: OpInfo) -> Signature:
    dims = set(op.params["dimensions"])
    labels = tuple(None if d in dims else f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature((labels,), (tuple(lab for lab in labels if lab is not None),))


@register("expand_dims")
def _expand_dims(op: OpInfo) -> Signature:
    dims = set(op.params["dimensions"])
    in_labels = _fresh("d", len(op.in_shapes[0]))
    it = iter(in_labels)
    out = tuple(None if d in dims else next(it) for d in range(len(op.out_shapes[0])))
    return Signature((in_labels,), (out,))


@register("concatenate")
def _concatenate(op: OpInfo) -> Signature:
    dim = op.params["dimension"]
    labels = tuple(None if d == dim else f"d{d}" for d in range(len(op.out_shapes[0])))
    return Signature(tuple(labels for _ in op.in_shapes), (labels,))


@register("split")
def _split(op: OpInfo) -> Signature:
    axis = op.params["axis"]
    labels = tuple(None if d == axis else f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature((labels,), tuple(labels for _ in op.out_shapes))


@register("pad")
def _pad(op: OpInfo) -> Signature:
    config = op.params["padding_config"]
    labels = tuple(
        f"d{d}" if (lo, hi, interior) == (0, 0, 0) else None
        for d, (lo, hi, interior) in enumerate(config)
    )
    return Signature((labels, ()), (labels,))


@register("slice")
def _slice(op: OpInfo) -> Signature:
    labels = _same_size_labels(op.in_shapes[0], op.out_shapes[0])
    return Signature((labels,), (labels,))


@register("rev")
def _rev(op: OpInfo) -> Signature:
    dims = set(op.params["dimensions"])
    labels = tuple(None if d in dims else f"d{d}" for d in range(len(op.in_shapes[0])))
    return Signature((labels,), (labels,))


@register("dynamic_slice")
def _dynamic_slice(op: OpInfo) -> Signature:
    labels = _same_size_labels(op.in_shapes[0], op.out_shapes[0])
    return Signature((labels,) + ((),) * (len(op.in_shapes) - 1), (labels,))


@register("dynamic_update_slice")
def _dynamic_update_slice(op: OpInfo) -> Signature:
    labels = _same_size_labels(op.in_shapes[0], op.in_shapes[1])
    return Signature((labels, labels) + ((),) * (len(op.in_shapes) - 2), (labels,))


def _same_size_labels(a: Sequence[int], b: Sequence[int]) -> Labels:
    return tuple(f"d{d}" if x == y else None for d, (x, y) in enumerate(zip(a, b)))


@register("iota")
def _iota(op: OpInfo) -> Signature:
    return Signature(tuple(None for _ in op.in_shapes), (_fresh("d", len(op.out_shapes[0])),))


# ---- gather and scatter (embedding lookup and its gradient) -----------------------------


@register("gather")
def _gather(op: OpInfo) -> Signature:
    dn = op.params["dimension_numbers"]
    slice_sizes = op.params["slice_sizes"]
    operand_shape, indices_shape = op.in_shapes
    out_nd = len(op.out_shapes[0])
    operand: list[str | None] = [None] * len(operand_shape)
    indices: list[str | None] = [None] * len(indices_shape)
    out: list[str | None] = [None] * out_nd
    reductions = {}
    # Batch dimensions: indices dimensions (except the index vector, the last) <-> output
    # dimensions that are not offset dimensions.
    batch_out = [d for d in range(out_nd) if d not in dn.offset_dims]
    for i, (idx_dim, out_dim) in enumerate(zip(range(len(indices_shape) - 1), batch_out)):
        indices[idx_dim] = out[out_dim] = f"b{i}"
    # Batching dimensions (take_along_axis): operand and indices share the batch.
    operand_batching = getattr(dn, "operand_batching_dims", ())
    indices_batching = getattr(dn, "start_indices_batching_dims", ())
    for op_dim, idx_dim in zip(operand_batching, indices_batching):
        operand[op_dim] = indices[idx_dim]
    # Offset dimensions: operand dimensions kept whole by the slice pass through.
    kept = [
        d
        for d in range(len(operand_shape))
        if d not in dn.collapsed_slice_dims and d not in operand_batching
    ]
    for d, out_dim in zip(kept, dn.offset_dims):
        if slice_sizes[d] == operand_shape[d]:
            operand[d] = out[out_dim] = f"o{d}"
    # An indexed dimension sliced to one element (an embedding table's vocabulary): each
    # device gathers from its shard with out-of-range rows masked, then partial sums are
    # reduced (Megatron's vocabulary-parallel embedding).
    for d in dn.collapsed_slice_dims:
        if slice_sizes[d] == 1 and d in dn.start_index_map:
            operand[d] = f"v{d}"
            reductions[f"v{d}"] = "sum"
    return Signature((tuple(operand), tuple(indices)), (tuple(out),), reductions)


@register("scatter-add", "scatter_add")
def _scatter_add(op: OpInfo) -> Signature:
    dn = op.params["dimension_numbers"]
    operand_shape, indices_shape, updates_shape = op.in_shapes
    operand_batching = getattr(dn, "operand_batching_dims", ())
    indices_batching = getattr(dn, "scatter_indices_batching_dims", ())
    operand: list[str | None] = [None] * len(operand_shape)
    indices: list[str | None] = [None] * len(indices_shape)
    updates: list[str | None] = [None] * len(updates_shape)
    reductions = {}
    # Scatter (batch) dimensions of the updates <-> indices dims: a split leaves each device
    # with a partial sum over the whole operand.
    scatter_dims = [d for d in range(len(updates_shape)) if d not in dn.update_window_dims]
    for i, (upd_dim, idx_dim) in enumerate(zip(scatter_dims, range(len(indices_shape) - 1))):
        updates[upd_dim] = indices[idx_dim] = f"b{i}"
        if idx_dim in indices_batching:
            # a batching dimension: each batch element writes its own operand slice
            operand[operand_batching[indices_batching.index(idx_dim)]] = f"b{i}"
        else:
            reductions[f"b{i}"] = "sum"
    window_operand = [
        d
        for d in range(len(operand_shape))
        if d not in dn.inserted_window_dims and d not in operand_batching
    ]
    for d, upd_dim in zip(window_operand, dn.update_window_dims):
        if updates_shape[upd_dim] == operand_shape[d]:
            operand[d] = updates[upd_dim] = f"o{d}"
    # Inserted (indexed) dimensions: each device owns a range of rows and drops the others.
    for d in dn.inserted_window_dims:
        operand[d] = f"v{d}"
    ins = (tuple(operand), tuple(indices), tuple(updates))
    return Signature(ins, (tuple(operand),), reductions)


# ---- random numbers (dropout, initialisation inside the step) ---------------------------
#
# Which splits keep the bits: the generated values must not depend on the split, so that a
# sharded step draws exactly what one device draws with the same key. JAX's PRNG
# implementations all meet this under XLA's SPMD partitioner (the "identical across
# shardings" row of the jax.random docs): threefry2x32 (the default; since JAX 0.5
# `jax_threefry_partitionable` is on) hashes each element's global index, so a device
# computes only its own block of any dimension; rbg/unsafe_rbg lower to XLA's
# RngBitGenerator, which the partitioner runs whole on every device and slices (the same
# bits, though not less work; the TPU-only flag `xla_tpu_spmd_rng_bit_generator_unsafe`
# gives that up, and plans do not assume it). tests/test_rules_rng_pool.py checks every
# split of each implementation against one device.


@register("random_bits", "random_split")
def _key_batch(op: OpInfo) -> Signature:
    """``random_bits(keys[*b], shape=s) -> bits[*b, *s]`` and ``random_split(keys[*b],
    shape=s) -> keys[*b, *s]``: each element is a function of its key and its index alone,
    so every dimension splits, the key batch together with the result's leading dims."""
    batch = _fresh("k", len(op.in_shapes[0]))
    new = _fresh("n", len(op.out_shapes[0]) - len(batch))
    return Signature((batch,), (batch + new,))


@register("random_seed", "random_wrap", "random_unwrap", "random_clone", "random_fold_in")
def _key_map(op: OpInfo) -> Signature:
    """Per-key maps over a batch of keys ``[*b]``: `random_wrap` takes key data
    ``uint32[*b, 2]`` to ``key[*b]``, `random_unwrap` the reverse, `random_seed` takes
    seeds ``[*b]``, `random_fold_in` keys and messages (``[*b]`` or a scalar). Only the key
    batch dimensions split; the key-data dimension stays whole."""
    key_shape = op.out_shapes[0] if op.primitive == "random_wrap" else op.in_shapes[0]
    batch = _fresh("k", len(key_shape))

    def labels(shape: tuple[int, ...]) -> Labels | None:
        if len(shape) == 0:
            return ()
        if tuple(shape[: len(batch)]) != tuple(key_shape):
            return None  # broadcast against the keys: used whole
        return batch + (None,) * (len(shape) - len(batch))

    ins = tuple(labels(s) for s in op.in_shapes)
    return Signature(ins, tuple(labels(s) for s in op.out_shapes))


# threefry2x32(key0, key1, count0, count1) -> (bits0, bits1): a pure elementwise hash of
# same-shaped (or scalar) operands, as `jax.random.threefry_2x32` binds it.
register("threefry2x32")(_elementwise)


# ---- windows (pooling) ------------------------------------------------------------------
#
# A window that spans one element of a dimension, steps by one and is not padded or dilated
# there maps each element to itself: that dimension splits (the batch and channels of a
# pooling layer). Any other dimension stays whole here; splitting it would need halo
# exchanges between neighbouring devices, which the cost model does not price.


def _window_labels(op: OpInfo, shape: tuple[int, ...], with_dilation: bool = True) -> Labels:
    params = op.params
    nd = len(shape)
    window = params["window_dimensions"]
    strides = params["window_strides"]
    padding = params.get("padding", ((0, 0),) * nd)
    base = params.get("base_dilation", (1,) * nd) if with_dilation else (1,) * nd
    dilation = params.get("window_dilation", (1,) * nd) if with_dilation else (1,) * nd
    return tuple(
        f"d{d}"
        if (window[d], strides[d], tuple(padding[d]), base[d], dilation[d]) == (1, 1, (0, 0), 1, 1)
        else None
        for d in range(nd)
    )


@register("reduce_window_max", "reduce_window_min", "reduce_window_sum")
def _reduce_window_monoid(op: OpInfo) -> Signature:
    labels = _window_labels(op, op.in_shapes[0])
    return Signature((labels,), (labels,))


@register("reduce_window")
def _reduce_window_generic(op: OpInfo) -> Signature:
    """``reduce_window(*operands, *init_values)``: operands and results share the window's
    pass-through dimensions; the scalar initial values are used whole."""
    num_operands = len(op.out_shapes)
    labels = _window_labels(op, op.in_shapes[0])
    ins = (labels,) * num_operands + ((),) * (len(op.in_shapes) - num_operands)
    return Signature(ins, (labels,) * num_operands)


@register("select_and_scatter_add")
def _select_and_scatter_add(op: OpInfo) -> Signature:
    """``select_and_scatter_add(source[pooled], operand) -> [operand]``: the gradient of a
    max pool, routed to each window's selected element."""
    labels = _window_labels(op, op.in_shapes[1], with_dilation=False)
    return Signature((labels, labels), (labels,))


@register("select_and_gather_add")
def _select_and_gather_add(op: OpInfo) -> Signature:
    """``select_and_gather_add(tangents, operand) -> [pooled]``: the JVP of a max pool."""
    labels = _window_labels(op, op.in_shapes[1])
    return Signature((labels, labels), (labels,))
