"""The exceptions autopar raises that a user may want to catch.

- `MemoryBudgetError` (a `ValueError`): no plan fits the memory budget; it carries the
  budget asked for (`budget`), the least memory per device any plan reaches
  (`least_memory`) and which budget it was (`kind`: "peak" or "footprint").

Wrong arguments raise the built-in `ValueError` and `TypeError`.
"""

from autopar.intra._ilp_problem import MemoryBudgetError

__all__ = ["MemoryBudgetError"]
