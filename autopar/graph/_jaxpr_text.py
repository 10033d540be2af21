"""`params_text`: a node's parameters as text, sub-jaxprs printed once per structure.

In: a node's `params` (a scan's body, a while's or cond's jaxprs among them). Out: exactly
``sorted(map(str, params.items()))``, the text `structural_fingerprint` hashes, with each
parameter that holds a jaxpr printed by JAX's printer only the first time its *structure*
is seen in a search. A layer stack traced one iteration per sub-scan has as many scan
bodies (forward and backward) as layers, each a distinct object of the same structure:
llama-8B@64's 34 layers hold 66, and printing them was 0.34 of the 0.62 CPU s its
fingerprints and layer cuts took per microbatch count (0.24 with this memo; its layer
clustering in all: `python -m benchmarks.investigations.front_end --row llama-8B@64`).

The structure (`_Structure`) records everything JAX's printer reads (`core.pp_toplevel_jaxpr`):
each equation's primitive, its parameters (sub-jaxprs by their own structure, every other
value by the text the printer gives it), the printed type of every variable, literals as
printed, which variables and sub-jaxprs are the same object (the printer names them by
first use and prints a sub-jaxpr used twice once), and, for a primitive with a printing
rule of its own (`core.pp_eqn_rules`: `custom_jvp_call` reads its functions' names), the
equation as that rule prints it alone. Two jaxprs of equal structure therefore print the
same text, so the memo hands back what the printer would: the text is the same as
before, only computed once.
"""

from __future__ import annotations

import re
from typing import Any

from jax.extend import core

from autopar._memo import declare

try:  # the printer's own pieces (a private module: fall back to printing when it moves)
    from jax._src import core as _jax_core
except ImportError:  # pragma: no cover - depends on the JAX version
    _jax_core = None

_ADDRESS = re.compile(r" at 0x([0-9a-fA-F]+)")

# (parameter name, structure of its value) -> ``str((name, value))``; a search makes a
# few dozen (forward and backward bodies per microbatch size), each key some 10-100 kB.
_TEXT: dict[tuple, str] = declare(
    {}, "graph.param_texts", "parameter name and its jaxpr value's structure -> its text")
_TEXT_LIMIT = 256  # entries; cleared when full


def params_text(params: dict) -> list[str]:
    """``sorted(map(str, params.items()))``, a jaxpr-valued parameter's text memoised by
    its structure (see the module docstring)."""
    texts = []
    for name, value in params.items():
        if _holds_jaxpr(value):
            texts.append(_jaxpr_param_text(name, value))
        else:
            texts.append(str((name, value)))
    return sorted(texts)


def _holds_jaxpr(value: Any) -> bool:
    if isinstance(value, (core.Jaxpr, core.ClosedJaxpr)):
        return True
    return type(value) is tuple and any(
        isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value)


def _jaxpr_param_text(name: str, value: Any) -> str:
    if _jax_core is None:
        return str((name, value))
    try:
        key = (name, _Structure().of_value(value))
    except _Unknown:  # a value the structure does not take apart: printed as before
        return str((name, value))
    text = _TEXT.get(key)
    if text is None:
        if len(_TEXT) >= _TEXT_LIMIT:
            _TEXT.clear()
        text = _TEXT[key] = str((name, value))
    return text


class _Unknown(Exception):
    """A parameter value `_Structure` does not take apart."""


class _Structure:
    """The structure of a jaxpr as a nested tuple (see the module docstring). One instance
    per parameter value: variables and sub-jaxprs numbered in order of first sight."""

    def __init__(self) -> None:
        self.vars: dict[int, int] = {}
        self.jaxprs: dict[int, int] = {}
        self._alive: list = []  # keeps numbered objects alive, so no id is reused

    def of_value(self, value: Any) -> tuple:
        if isinstance(value, core.ClosedJaxpr):
            return ("closed", self.of_jaxpr(value.jaxpr))
        if isinstance(value, core.Jaxpr):
            return ("jaxpr", self.of_jaxpr(value))
        if type(value) is tuple and any(
                isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
            if not all(isinstance(v, (core.Jaxpr, core.ClosedJaxpr)) for v in value):
                # printed as text with its jaxprs inside: not taken apart here
                raise _Unknown("a tuple of jaxprs and other values")
            return ("tuple", *(self.of_value(v) for v in value))
        if isinstance(value, frozenset):
            return ("frozenset", type(value), f"{', '.join(repr(e) for e in sorted(value))}")
        text = str(value)
        if " at 0x" in text:
            text = _ADDRESS.sub(lambda m: " at 0x" + "X" * len(m.group(1)), text)
        return ("text", type(value), text)

    def of_jaxpr(self, jaxpr) -> tuple:
        seen = self.jaxprs.get(id(jaxpr))
        if seen is not None:
            return ("seen", seen)
        self.jaxprs[id(jaxpr)] = len(self.jaxprs)
        self._alive.append(jaxpr)
        return (
            "let", len(jaxpr.eqns),
            tuple(self.binder(v) for v in jaxpr.constvars),
            tuple(self.binder(v) for v in jaxpr.invars),
            tuple(self.eqn(e) for e in jaxpr.eqns),
            tuple(self.atom(a) for a in jaxpr.outvars),
        )

    def eqn(self, eqn) -> tuple:
        rule = _jax_core.pp_eqn_rules.get(eqn.primitive)
        alone = None
        if rule is not None and rule not in _PARAMS_ONLY_RULES:
            # what the rule prints, which may read more than the parameters
            alone = str(_jax_core.pp_eqn(eqn, _jax_core.JaxprPpContext(),
                                         _jax_core.JaxprPpSettings()).format())
        return (
            eqn.primitive, eqn.primitive.name, alone,
            tuple((k, self.of_value(eqn.params[k])) for k in sorted(eqn.params)),
            tuple(self.atom(a) for a in eqn.invars),
            tuple(self.binder(v) for v in eqn.outvars),
        )

    def binder(self, v) -> tuple:
        """A variable where it is bound, with its type (the printer prints it there)."""
        if isinstance(v, _jax_core.DropVar):
            return ("drop", _aval_text(v.aval))
        return (self.atom(v), _aval_text(v.aval))

    def atom(self, a) -> int | tuple:
        """A variable where it is read, by its number (every variable of a closed jaxpr
        is bound in it, with its type); a literal as printed."""
        if isinstance(a, core.Literal):
            return ("literal", a.pretty_print(None), _aval_text(a.aval))
        number = self.vars.get(id(a))
        if number is None:
            number = self.vars[id(a)] = len(self.vars)
            self._alive.append(a)
        return number


def _aval_text(aval: Any) -> Any:
    """The aval itself where JAX interns it (a `ShapedArray`: the same fields, the same
    object, so the same printed type), else its printed type."""
    if type(aval) is _jax_core.ShapedArray:
        return aval
    return _jax_core.pp_aval(aval, None)


def _params_only_rules() -> frozenset:
    """JAX's printing rules that print an equation from its parameters, variables and
    sub-jaxprs alone, which the structure records: each drops or reshapes parameters
    (`accuracy` or `out_dtype` when None, a `sharding` or `shape` the binder's type
    implies, dimension numbers as lists, `jit`'s defaults, whose body's variables it
    names after the equation's). A rule not named here is printed alone instead."""
    if _jax_core is None:
        return frozenset()
    from jax._src import pjit
    from jax._src.lax import lax

    names = ("_unary_with_accuracy_pp_rule", "_binary_with_out_dtype_pp_rule",
             "_convert_elt_type_pp_rule", "_dot_general_pp_rule", "_broadcast_in_dim_pp_rule")
    rules = {getattr(lax, name, None) for name in names} | {getattr(pjit, "_pjit_pp_rule", None)}
    return frozenset(rules - {None})


_PARAMS_ONLY_RULES = _params_only_rules()
