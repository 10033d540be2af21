"""A static proof that microbatching leaves the step's math unchanged.

In: the step traced at the full batch and at one microbatch (two `OpGraph`s of the same
program; the batch inputs' leading axis is B in one and B/m in the other) and m.
Out: `Proof(proven, reason)`: proven when every float value reaching the gradient boundary
(`autopar.value_and_grad`) at the full batch equals the mean of its values over the m
microbatches, exactly up to rounding, for any data; otherwise the reason (the first value
that could not be proven and what it is).

An abstract interpretation in the `eval_jaxpr` shape: one loop over the nodes of the two
graphs side by side (they must be the same program node for node, identity markers
aside), a rule per primitive, recursion into `scan` bodies. Every value gets a kind:

- ``F(i)``, batch-free: the same in every evaluation up to a factor, full = m^i x micro
  (a constant that is B in one trace and B/m in the other is ``F(1)``);
- ``P(d, e)``, per-example along dim d (the dim whose size is m times larger in the full
  trace): the rows of one example depend on that example only, through the same function
  in both traces up to a factor m^e (``e = -1``: scaled by 1/B, as a mean's cotangent);
- ``R(j)``, reduced over the batch, linearly: full = m^j x the mean over the microbatches
  (a sum over the batch is ``R(1)``, a mean ``R(0)``);
- ``ZERO`` (all zeros in both traces), and unknown (None).

Linear ops (adds of like kinds, products with batch-free factors, transposes, reshapes that
keep the batch dim major, broadcasts of batch-free values, dots contracting the batch dim
of per-example operands, scatter-adds of per-example rows) propagate; elementwise
nonlinear ops keep only ``P(d, 0)`` and ``F(0)``; anything that mixes examples any other way
(a nonlinear op on a batch reduction, a reduction other than a sum over the batch dim, a
slice, sort or cumulative op along it, an outer product of two examples) is unknown. The
proof holds when every float boundary value is ``R(0)``, ``F(0)`` or ``ZERO``: full =
mean over the microbatches. Comparing constants between the two traces is what makes
"divided by B" exact: a divisor the user hard-coded is the same in both traces (``F(0)``),
so a sum divided by it stays ``R(1)`` and is not proven.

Microbatches are the batch's contiguous row blocks, as `autopar.runtime` cuts them: "per
example" means that block k of m along dim d is microbatch k's value (a reshape that keeps
the batch dim major keeps that; rows of two examples in one block may mix).

Soundness over coverage: a primitive without a rule is unknown unless all its inputs are
``F(0)`` and its parameters equal in both traces (then it is ``F(0)``). The kinds and
constants are in `autopar.search._batch_kinds`, the rules in `autopar.search._batch_rules`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.graph import OpGraph, Role
from autopar.graph._trace import GRAD_BOUNDARY, trace_jaxpr
from autopar.search._batch_kinds import (
    ZERO,
    Kind,
    _changing,
    _const_kind,
    _is_float,
    describe,
    free,
    per_example,
    reduced,
)
from autopar.search._batch_rules import IDENTITIES, RULES, _generic, _identity

# Markers that are identities and may be present in one trace and not the other (the
# search marks layers automatically in its microbatch trace).
ALIASED = frozenset({"layer_boundary"})


@dataclass(frozen=True)
class Proof:
    """Whether the mean over microbatches provably equals the full batch's value at the
    gradient boundary; `reason` says why not (or what was proven)."""

    proven: bool
    reason: str
    # False where the two traces are not the same program node for node
    aligned: bool = True


def prove_microbatch_mean(full: OpGraph, micro: OpGraph, num_microbatches: int) -> Proof:
    """Prove that the float values reaching `full`'s gradient boundary are the mean of
    `micro`'s over `num_microbatches` microbatches (see the module docstring). `micro` is
    the same step traced at the microbatch's shapes."""
    m = num_microbatches
    if len(full.invars) != len(micro.invars):
        return Proof(False, "the two traces have different inputs", False)
    kinds = []
    for vf, vm in zip(full.invars, micro.invars):
        var_f, var_m = full.vars[vf], micro.vars[vm]
        if var_f.shape == var_m.shape:
            kinds.append(free(0))
        elif (var_f.role is Role.BATCH and _changing(var_f.shape, var_m.shape, m) == [0]):
            kinds.append(per_example(0, 0))
        else:
            return Proof(False, f"input {var_f.path} changes shape other than along its "
                                "batch dim")
    analysis = _Analysis(full, micro, m)
    try:
        env = analysis.run(kinds)
    except _Misaligned as err:
        return Proof(False, f"the full-batch and microbatch traces differ: {err}", False)
    boundary = [n for n in full.nodes if n.primitive == GRAD_BOUNDARY]
    if not boundary:
        return Proof(False, "the step has no gradient boundary")
    for node in boundary:
        for index, v in enumerate(node.outputs):
            var = full.vars[v]
            if not _is_float(var.dtype):
                continue
            kind = env(v)
            if kind not in (ZERO, free(0), reduced(0)):
                what = "the loss" if index == 0 else f"output {index} of value_and_grad"
                return Proof(False, f"{what} (shape {var.shape}) is {describe(kind)}"
                             + _first_unknown(analysis))
    return Proof(True, "every value reaching the gradient boundary is a mean over the "
                       "batch's examples or batch-free")


def _first_unknown(analysis: _Analysis) -> str:
    if analysis.first_unknown is None:
        return ""
    node, ins = analysis.first_unknown
    where = f" at {node.source}" if node.source else ""
    kinds = ", ".join(describe(k) for k in ins)
    return f"; the first value not proven is {node.primitive}{where} of ({kinds})"


class _Misaligned(Exception):
    pass


class _Analysis:
    """One pass over two aligned graphs (`run`), kinds by full-graph variable id."""

    def __init__(self, full: OpGraph, micro: OpGraph, m: int, bodies=None):
        self.full, self.micro, self.m = full, micro, m
        # scan bodies traced so far: {id(jaxpr): (jaxpr, graph)}, shared with sub-analyses
        self.bodies: dict[int, tuple[Any, OpGraph]] = {} if bodies is None else bodies
        # the first node whose known inputs gave an unknown output, with those inputs
        self.first_unknown: tuple | None = None

    def body(self, jaxpr) -> OpGraph:
        entry = self.bodies.get(id(jaxpr))
        if entry is None or entry[0] is not jaxpr:
            entry = self.bodies[id(jaxpr)] = (jaxpr, trace_jaxpr(jaxpr))
        return entry[1]

    def sub(self, jaxpr_f, jaxpr_m) -> _Analysis:
        """The analysis of a body (a scan's), its jaxpr in each trace."""
        return _Analysis(self.body(jaxpr_f), self.body(jaxpr_m), self.m, self.bodies)

    def run(self, in_kinds: Sequence[Kind]) -> Callable[[int], Kind]:
        full, micro = self.full, self.micro
        kinds: dict[int, Kind] = dict(zip(full.invars, in_kinds))
        pair: dict[int, int] = dict(zip(full.invars, micro.invars))
        alias_f, nodes_f = _unaliased(full)
        alias_m, nodes_m = _unaliased(micro)
        if len(nodes_f) != len(nodes_m):
            raise _Misaligned(f"{len(nodes_f)} against {len(nodes_m)} nodes")

        def read(v: int) -> int:
            return alias_f.get(v, v)

        for nf, nm in zip(nodes_f, nodes_m):
            if nf.primitive != nm.primitive or len(nf.inputs) != len(nm.inputs) \
                    or len(nf.outputs) != len(nm.outputs):
                raise _Misaligned(f"{nf.primitive} against {nm.primitive}")
            ins = []
            for vf, vm in zip(nf.inputs, nm.inputs):
                vf, vm = read(vf), alias_m.get(vm, vm)
                var_f, var_m = full.vars[vf], micro.vars[vm]
                if var_f.role is Role.CONST:
                    if var_m.role is not Role.CONST:
                        raise _Misaligned(f"a constant against a value at {nf.primitive}")
                    ins.append(_const_kind(var_f.value, var_m.value, self.m))
                else:
                    if pair.get(vf) != vm:
                        raise _Misaligned(f"the inputs of {nf.primitive} differ")
                    ins.append(kinds.get(vf))
            if nf.primitive in IDENTITIES:
                outs = _identity(self, nf, nm, ins)  # value by value, unknowns too
            elif any(k is None for k in ins):
                outs = [None] * len(nf.outputs)
            else:
                rule = RULES.get(nf.primitive, _generic)
                try:
                    outs = rule(self, nf, nm, ins)
                except (KeyError, IndexError, TypeError, ValueError):
                    outs = [None] * len(nf.outputs)  # a rule's assumption did not hold
            for vf, vm, kind in zip(nf.outputs, nm.outputs, outs):
                pair[vf] = vm
                kinds[vf] = self._checked(kind, vf, vm)
                if kinds[vf] is None and self.first_unknown is None \
                        and all(k is not None for k in ins):
                    self.first_unknown = (nf, tuple(ins))

        return lambda v: kinds.get(read(v))

    # shapes of aligned variables
    def shapes(self, vf: int, vm: int) -> tuple[tuple, tuple]:
        return self.full.vars[vf].shape, self.micro.vars[vm].shape

    def changing(self, vf: int, vm: int) -> list[int] | None:
        return _changing(*self.shapes(vf, vm), self.m)

    def _checked(self, kind: Kind, vf: int, vm: int) -> Kind:
        """`kind`, or None where the shapes contradict it (a per-example value changes
        along its dim d only; every other kind not at all)."""
        if kind is None or kind == ZERO:
            return kind
        dims = self.changing(vf, vm)
        if dims is None:
            return None
        if kind[0] == "P":
            return kind if dims == [kind[1]] else None
        return kind if not dims else None


def _unaliased(graph: OpGraph) -> tuple[dict[int, int], list]:
    """Identity markers left out: {marker output: the value it passes}, the other nodes."""
    alias: dict[int, int] = {}
    nodes = []
    for node in graph.nodes:
        if node.primitive in ALIASED:
            for i, o in zip(node.inputs, node.outputs):
                alias[o] = alias.get(i, i)
        else:
            nodes.append(node)
    return alias, nodes
