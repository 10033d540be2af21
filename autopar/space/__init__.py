"""The explored plan space: every plan priced for a step on a cluster, and its frontier.

`explore(step, *args, cluster=...)` prices the Megatron-LM grid (every configuration,
feasible or not, with the reason) and every candidate autopar's search keeps, under the
budget and a few around its plan's peak memory; `Space.write` writes them as JSON Lines
with a header (schema version, cost profile and its hash, autopar's version, the
command), `load` reads them back, `Space.frontier()` / `space.plan.frontier()` give the
memory/time Pareto frontier, `Space.picture` draws it. `autopar space` is the command
line; docs/space.md describes the columns and the published set.
"""

from autopar.space._explore import DEFAULT_BUDGET_FRACTIONS, SCHEMA_VERSION, Space, explore
from autopar.space._io import load
from autopar.space._rows import COLUMNS

__all__ = ["COLUMNS", "DEFAULT_BUDGET_FRACTIONS", "SCHEMA_VERSION", "Space", "explore", "load"]
