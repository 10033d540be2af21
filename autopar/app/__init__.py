"""What users touch: the `autoparallel` decorator, the command line, the demo, the examples.

In: a train step (and, for the command line, a model name and a cluster). Out: a step that
plans on its first call and runs the plan (`AutoParallel`), printed plans and comparisons,
pictures. Everything before it (search, lower, runtime, report) is called from here.
"""

from autopar.app._autoparallel import AutoParallel, autoparallel
from autopar.app._compare import Comparison, compare, compare_planners
from autopar.app._score import Change, changes, score

__all__ = [
    "AutoParallel", "Change", "Comparison", "autoparallel", "changes", "compare",
    "compare_planners", "score",
]
