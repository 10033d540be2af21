"""The abstract values of `autopar.search._batch_linearity`'s proof: what a value of the
step is, in the full-batch trace against the microbatch's, and the constants' kinds.

- ``F(i)``, batch-free: the same in every evaluation up to a factor, full = m^i x micro;
- ``P(d, e)``, per-example along dim d (the dim m times larger in the full trace): block k
  of m along d is microbatch k's value, through the same function, up to a factor m^e;
- ``R(j)``, reduced over the batch, linearly: full = m^j x the mean over the microbatches;
- ``ZERO`` (all zeros in both traces), and unknown (None).

Kinds are small tuples: ``("0",)``, ``("F", i)``, ``("R", j)``, ``("P", d, e)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Kind = tuple | None  # None: unknown
ZERO = ("0",)
MAX_EXPONENT = 4  # |i| of a constant's ratio m^i between the traces that is recognised


def free(i: int) -> Kind:
    return ("F", i)


def reduced(j: int) -> Kind:
    return ("R", j)


def per_example(d: int, e: int) -> Kind:
    return ("P", d, e)


def describe(kind: Kind) -> str:
    if kind is None:
        return "not provably per-example or a batch mean"
    if kind == ZERO:
        return "zero"
    if kind[0] == "F":
        return "batch-free" + ("" if kind[1] == 0 else f" but scaled by B^{kind[1]}")
    if kind[0] == "R":
        return {0: "a mean over the batch", 1: "a sum over the batch (not divided by B)"}.get(
            kind[1], f"a batch mean scaled by B^{kind[1]}")
    return f"per-example along dim {kind[1]}" + (
        "" if kind[2] == 0 else f", scaled by B^{kind[2]}")



def _changing(shape_f: tuple, shape_m: tuple, m: int) -> list[int] | None:
    """Dims whose size in the full trace is m times the microbatch's; None when the
    shapes differ any other way."""
    if len(shape_f) != len(shape_m):
        return None
    dims = []
    for d, (a, b) in enumerate(zip(shape_f, shape_m)):
        if a == b:
            continue
        if a != m * b:
            return None
        dims.append(d)
    return dims


def _is_float(dtype: str) -> bool:
    try:
        return np.issubdtype(np.dtype(dtype), np.inexact)
    except TypeError:
        return "float" in dtype  # bfloat16 and the float8 types by name


def _const_kind(value_f: Any, value_m: Any, m: int) -> Kind:
    """A constant read at the same place of both traces: ``ZERO``, ``F(i)`` where the
    full trace's value is m^i times the microbatch's, else None."""
    try:
        a, b = np.asarray(value_f), np.asarray(value_m)
    except Exception:  # a typed PRNG key and the like: not compared
        return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if a.dtype == object:
        return None
    if np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
        if a.dtype.kind in "biuf" and not np.any(a):
            return ZERO
        return free(0)
    if a.dtype.kind not in "iuf":
        return None
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for i in range(-MAX_EXPONENT, MAX_EXPONENT + 1):
        if i and np.allclose(a64, b64 * float(m) ** i, rtol=1e-6, atol=0):
            return free(i)
    return None


def _join(a: Kind, b: Kind) -> Kind:
    if a == b:
        return a
    if a == ZERO:
        return b
    if b == ZERO:
        return a
    if a is None or b is None:
        return None
    if {a[0], b[0]} == {"F", "R"} and a[1] == b[1]:
        return reduced(a[1])
    return None
