"""The sharding rule registry: every rule, keyed by primitive name, put together here.

`PRIMITIVE_RULES` (`_rules.py`, single primitives, registered beside their definitions)
and `CONTROL_FLOW_RULES` (`_control_flow.py`: scan, while, cond) are composed explicitly;
`signature_of` looks a primitive up in both. A primitive in neither has no rule: the
planner replicates it and names it in the plan's warnings.
"""

from __future__ import annotations

from collections import ChainMap

from autopar.intra import (  # noqa: F401  (register rules)
    _rules_annotations,
    _rules_moe,  # noqa: F401  (registers ragged_dot_general)
    _rules_stack,
)
from autopar.intra._control_flow import CONTROL_FLOW_RULES
from autopar.intra._rules import PRIMITIVE_RULES, OpInfo, Rule
from autopar.intra._signature import Signature

# A view, not a copy: rules registered later with `register` are seen too.
SHARDING_RULES: ChainMap[str, Rule] = ChainMap(CONTROL_FLOW_RULES, PRIMITIVE_RULES)


def signature_of(op: OpInfo) -> Signature | None:
    """The signature of `op`, or None when no rule covers it (replicate it)."""
    rule = SHARDING_RULES.get(op.primitive)
    return None if rule is None else rule(op)
