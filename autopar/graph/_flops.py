"""FLOP and memory-traffic counts per primitive equation.

A registry, `FLOP_RULES`, keyed by primitive name; each rule is registered beside its
definition with `register_flops`. A rule gets the input and output abstract values and the
equation params and returns a FLOP count. Primitives without a rule use the documented
default, `elementwise_flops`: one FLOP per output element. Explicit rules cover

* contractions: `dot_general` (exactly 2·batch·M·N·K) and `conv_general_dilated`
  (exactly 2 · output elements · input features per group · kernel spatial size);
* reductions and scans over an axis (`reduce_sum`, `argmax`, `cumsum`, ...): one FLOP per
  input element;
* pure data movement (`reshape`, `transpose`, `broadcast_in_dim`, `slice`, `gather`,
  `concatenate`, `convert_element_type`, ...) and the autopar markers: zero;
* random numbers: `random_bits` and key derivation count a Threefry hash per 32-bit word
  (`THREEFRY_OPS_PER_WORD`), key views (`random_wrap`, ...) zero;
* windows: generic `reduce_window` and `select_and_scatter_add` count one operation per
  window element (the `reduce_window_*` monoids count one per input element);
* control flow, whose FLOPs include the bodies: `scan` is body × length, `cond` the most
  expensive branch, `while` one body plus one condition evaluation (a lower bound: the trip
  count is not known when tracing);
* call primitives (`jit`, `custom_jvp_call`, `remat2`, ...) count their sub-jaxpr, so that a
  body holding them is counted right even though the tracer inlines them at top level.

Bytes: an equation reads the bytes of its inputs and writes those of its outputs; control
flow adds the traffic of its bodies with the same multipliers as its FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core

FlopRule = Callable[[Sequence[Any], Sequence[Any], Mapping[str, Any]], float]

FLOP_RULES: dict[str, FlopRule] = {}

# Primitives that call a sub-jaxpr and mean exactly "run this jaxpr", with the params key
# holding it. The tracer inlines them; the counters below recurse into them.
CALL_JAXPR_PARAM: dict[str, str] = {
    "jit": "jaxpr",  # the pjit primitive, named "jit" since jax 0.7
    "pjit": "jaxpr",  # its older name
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",  # older jax versions
    "remat2": "jaxpr",  # jax.checkpoint / jax.remat
    "checkpoint": "jaxpr",  # the same primitive under its newer name
}


def register_flops(*names: str) -> Callable[[FlopRule], FlopRule]:
    """Register a FLOP rule for one or more primitive names.

    **Arguments:**
    - `names`: primitive names (`eqn.primitive.name`), e.g. ``"dot_general"``.

    **Returns:** a decorator that stores the rule in `FLOP_RULES` and returns it unchanged.

    **Example:**

    ```python
    @register_flops("my_prim")
    def _my_prim_flops(in_avals, out_avals, params):
        return 3 * in_avals[0].size
    ```
    """

    def decorate(rule: FlopRule) -> FlopRule:
        for name in names:
            FLOP_RULES[name] = rule
        return rule

    return decorate


def aval_size(aval: Any) -> int:
    """Number of elements of an abstract value (0 for tokens and other shapeless values)."""
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else math.prod(shape)


def aval_nbytes(aval: Any) -> int:
    """Bytes of an abstract value; extended dtypes such as PRNG keys use their itemsize."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    return aval_size(aval) * int(dtype.itemsize)


# ---- the default and the simple families ----------------------------------------------


def elementwise_flops(in_avals: Sequence[Any], out_avals: Sequence[Any], params) -> float:
    """The default rule: one FLOP per output element (every output counted)."""
    return float(sum(aval_size(a) for a in out_avals))


@register_flops(
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "rev",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "concatenate",
    "split",
    "pad",
    "gather",
    "scatter",
    "select_and_gather_add",
    "iota",
    "copy",
    "copy_p",
    "convert_element_type",
    "bitcast_convert_type",
    "reduce_precision",
    "device_put",
    "sharding_constraint",
    "mesh_cast",
    "optimization_barrier",
    "stop_gradient",
    "layer_boundary",
    "grad_boundary",
)
def data_movement_flops(in_avals, out_avals, params) -> float:
    """Data movement (copies, layout and dtype changes) and markers: zero FLOPs."""
    return 0.0


@register_flops(
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
)
def reduction_flops(in_avals, out_avals, params) -> float:
    """Reductions and cumulative ops: one FLOP per element of the (first) operand."""
    return float(aval_size(in_avals[0]))


@register_flops("scatter-add", "scatter_add", "scatter-mul", "scatter_mul")
def scatter_combine_flops(in_avals, out_avals, params) -> float:
    """Scatter that combines: one FLOP per update element (operand, indices, updates)."""
    return float(aval_size(in_avals[2]))


@register_flops("sort")
def sort_flops(in_avals, out_avals, params) -> float:
    """Comparison sort: n·log2(n) comparisons along the sorted dimension, per row."""
    shape = in_avals[0].shape
    if not shape:
        return 0.0
    n = shape[params["dimension"]]
    return float(aval_size(in_avals[0]) * max(1.0, math.log2(max(n, 1))))


# ---- random numbers and windows --------------------------------------------------------

# Threefry-2x32 (Salmon et al. 2011) with 20 rounds: each round adds, rotates (two shifts
# and an or) and xors a pair of words, 5 integer ops; every 4 rounds a key injection adds
# 3 more. That is 20·5 + 5·3 = 115 ops per pair of 32-bit words, ~58 per word. rbg's
# RngBitGenerator (Philox on CPU and GPU) is of the same order, so one figure serves both.
THREEFRY_OPS_PER_WORD = 58


@register_flops("random_bits")
def random_bits_flops(in_avals, out_avals, params) -> float:
    """A hash per generated 32-bit word: `THREEFRY_OPS_PER_WORD` per word, words rounded up."""
    words_per_element = max(1, math.ceil(params.get("bit_width", 32) / 32))
    return float(aval_size(out_avals[0]) * words_per_element * THREEFRY_OPS_PER_WORD)


@register_flops("random_split", "random_fold_in", "random_seed")
def key_derivation_flops(in_avals, out_avals, params) -> float:
    """One threefry hash of a pair of words per derived key."""
    return float(aval_size(out_avals[0]) * 2 * THREEFRY_OPS_PER_WORD)


@register_flops("threefry2x32")
def threefry_flops(in_avals, out_avals, params) -> float:
    """The raw hash: `THREEFRY_OPS_PER_WORD` for each word of each of its two results."""
    return float(sum(aval_size(a) for a in out_avals) * THREEFRY_OPS_PER_WORD)


@register_flops("random_wrap", "random_unwrap", "random_clone")
def key_data_flops(in_avals, out_avals, params) -> float:
    """Views of key data as keys and back: no arithmetic."""
    return 0.0


def _window_size(params) -> int:
    return math.prod(params["window_dimensions"])


@register_flops("reduce_window")
def reduce_window_flops(in_avals, out_avals, params) -> float:
    """The generic window reduction: one application of its computation per window element
    per result element, for each reduced operand."""
    return float(sum(aval_size(a) for a in out_avals) * _window_size(params))


@register_flops("select_and_scatter_add")
def select_and_scatter_add_flops(in_avals, out_avals, params) -> float:
    """Per window (one per `source` element): a comparison per window element to select,
    then one add to scatter."""
    return float(aval_size(in_avals[0]) * (_window_size(params) + 1))


# ---- contractions ---------------------------------------------------------------------


@register_flops("dot_general")
def dot_general_flops(in_avals, out_avals, params) -> float:
    """2 · batch · M · N · K: one multiply and one add per output element and contracted index.

    The output holds batch·M·N elements; K is the product of the contracting dimensions.
    """
    (lhs_contract, _), _ = params["dimension_numbers"]
    lhs_shape = in_avals[0].shape
    contracted = math.prod(lhs_shape[d] for d in lhs_contract)
    return 2.0 * aval_size(out_avals[0]) * contracted


@register_flops("ragged_dot_general")
def ragged_dot_flops(in_avals, out_avals, params) -> float:
    """A grouped GEMM (`jax.lax.ragged_dot`): 2 · M · N · K for the rows it runs, each row
    against its own group only. With the ragged dimension contracted (the weight gradient,
    result ``[G, K, N]``) each of the M rows adds to one group's block: 2 · (size / G) · M.
    """
    rdn = params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = rdn.dot_dimension_numbers
    contracted = math.prod(in_avals[0].shape[d] for d in lhs_contract)
    size = aval_size(out_avals[0])
    if rdn.lhs_ragged_dimensions and rdn.lhs_ragged_dimensions[0] in lhs_contract:
        size //= max(1, out_avals[0].shape[0])  # the result's leading group dimension
    return 2.0 * size * contracted


@register_flops("conv_general_dilated")
def conv_flops(in_avals, out_avals, params) -> float:
    """2 · output elements · (input features per group × kernel spatial size).

    The kernel's input-feature dimension already holds the features per group.
    """
    rhs_spec = params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
    rhs_shape = in_avals[1].shape
    in_features_per_group = rhs_shape[rhs_spec[1]]
    kernel_spatial = math.prod(rhs_shape[d] for d in rhs_spec[2:])
    return 2.0 * aval_size(out_avals[0]) * in_features_per_group * kernel_spatial


# ---- calls and control flow ---------------------------------------------------------


def _open(jaxpr: Any) -> core.Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr


def _call_rule(jaxpr_param: str) -> FlopRule:
    """The rule of a call primitive whose sub-jaxpr is `params[jaxpr_param]`."""

    def call_flops(in_avals, out_avals, params) -> float:
        return jaxpr_flops(_open(params[jaxpr_param]))

    return call_flops


for _name, _jaxpr_param in CALL_JAXPR_PARAM.items():
    register_flops(_name)(_call_rule(_jaxpr_param))


@register_flops("scan")
def scan_flops(in_avals, out_avals, params) -> float:
    """The body's FLOPs times the number of iterations."""
    return params["length"] * jaxpr_flops(_open(params["jaxpr"]))


@register_flops("cond")
def cond_flops(in_avals, out_avals, params) -> float:
    """The most expensive branch (an upper bound on the branch actually taken)."""
    return max(jaxpr_flops(_open(b)) for b in params["branches"])


@register_flops("while")
def while_flops(in_avals, out_avals, params) -> float:
    """One body plus one condition: a lower bound, the trip count is unknown when tracing."""
    return jaxpr_flops(_open(params["body_jaxpr"])) + jaxpr_flops(_open(params["cond_jaxpr"]))


# ---- per equation and per jaxpr ---------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Bytes an equation reads and writes."""

    bytes_read: float
    bytes_written: float

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written)

    def scaled(self, factor: float) -> Traffic:
        return Traffic(self.bytes_read * factor, self.bytes_written * factor)


NO_TRAFFIC = Traffic(0.0, 0.0)


def flops(primitive: str, in_avals: Sequence[Any], out_avals: Sequence[Any], params) -> float:
    """FLOPs of one primitive application, by the registered rule or the default.

    **Arguments:**
    - `primitive`: the primitive's name.
    - `in_avals`, `out_avals`: abstract values (anything with `.shape` and `.dtype`).
    - `params`: the equation params.

    **Returns:** a float FLOP count.
    """
    rule = FLOP_RULES.get(primitive, elementwise_flops)
    return float(rule(in_avals, out_avals, params))


def eqn_flops(eqn: core.JaxprEqn) -> float:
    """FLOPs of one jaxpr equation (bodies of calls and control flow included)."""
    return flops(
        eqn.primitive.name,
        [a.aval for a in eqn.invars],
        [v.aval for v in eqn.outvars],
        eqn.params,
    )


def jaxpr_flops(jaxpr: core.Jaxpr) -> float:
    """Total FLOPs of a jaxpr's equations."""
    return float(sum(eqn_flops(eqn) for eqn in jaxpr.eqns))


def body_traffic(primitive: str, params: Mapping[str, Any]) -> Traffic:
    """The memory traffic of the sub-jaxprs an equation runs (zero for plain primitives)."""
    if primitive not in _BODY_PRIMITIVES:
        return NO_TRAFFIC
    return Traffic(*_body_bytes(primitive, params, {}))


def eqn_traffic(eqn: core.JaxprEqn) -> Traffic:
    """Bytes read and written by one equation; calls count only their body."""
    return Traffic(*_eqn_bytes(eqn, {}))


def jaxpr_traffic(jaxpr: core.Jaxpr) -> Traffic:
    """Total bytes read and written by a jaxpr's equations."""
    return Traffic(*_jaxpr_bytes(jaxpr, {}))


# The traffic above as (bytes read, bytes written) pairs of floats: the same additions and
# products in the same order as `Traffic.__add__` and `Traffic.scaled` make, so the same
# floats, without a `Traffic` per equation of every body, each aval's bytes computed once
# per walk (`_memo_nbytes`). A per-iteration trace of llama-8B@64 walks ~10,000 equations
# of its 64 sub-scans' bodies: its conversion to an OpGraph took 0.24, 0.23 CPU s (medians
# of 5 builds, two runs) and now 0.17, 0.11, interleaved on a loaded 2-core machine
# (`python -m benchmarks.investigations.trace_conversion --row llama-8B@64 --count 32`).

_BODY_PRIMITIVES = frozenset(CALL_JAXPR_PARAM) | {"scan", "cond", "while"}


def _body_bytes(primitive: str, params: Mapping[str, Any], nbytes: dict) -> tuple:
    if primitive in CALL_JAXPR_PARAM:
        return _jaxpr_bytes(_open(params[CALL_JAXPR_PARAM[primitive]]), nbytes)
    if primitive == "scan":
        read, written = _jaxpr_bytes(_open(params["jaxpr"]), nbytes)
        return read * params["length"], written * params["length"]
    if primitive == "cond":
        branches = [_jaxpr_bytes(_open(b), nbytes) for b in params["branches"]]
        return max(branches, key=lambda t: t[0] + t[1])
    if primitive == "while":
        body = _jaxpr_bytes(_open(params["body_jaxpr"]), nbytes)
        cond = _jaxpr_bytes(_open(params["cond_jaxpr"]), nbytes)
        return body[0] + cond[0], body[1] + cond[1]
    return 0.0, 0.0


def _eqn_bytes(eqn: core.JaxprEqn, nbytes: dict) -> tuple:
    name = eqn.primitive.name
    body = _body_bytes(name, eqn.params, nbytes) if name in _BODY_PRIMITIVES else (0.0, 0.0)
    if name in CALL_JAXPR_PARAM:
        return body
    read = float(sum(_memo_nbytes(a.aval, nbytes) for a in eqn.invars))
    written = float(sum(_memo_nbytes(v.aval, nbytes) for v in eqn.outvars))
    return read + body[0], written + body[1]


def _jaxpr_bytes(jaxpr: core.Jaxpr, nbytes: dict) -> tuple:
    read, written = 0.0, 0.0
    for eqn in jaxpr.eqns:
        eqn_read, eqn_written = _eqn_bytes(eqn, nbytes)
        read, written = read + eqn_read, written + eqn_written
    return read, written


def _memo_nbytes(aval: Any, nbytes: dict) -> int:
    """`aval_nbytes(aval)`, computed once per aval object while `nbytes` (id -> (aval,
    bytes)) lives: an equation's operand is most often the very aval of an earlier result.
    The aval is kept with its bytes, so its id cannot be reused while it is a key."""
    known = nbytes.get(id(aval))
    if known is None or known[0] is not aval:
        known = nbytes[id(aval)] = (aval, aval_nbytes(aval))
    return known[1]

