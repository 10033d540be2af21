"""autopar: automatic data, operator and pipeline parallelism for JAX train steps.

```python
@autopar.autoparallel
def train_step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    ...
```

The top level holds what a user calls; everything else is reached through its part
(`autopar.graph.trace`, `autopar.cluster.LogicalMesh`, `autopar.report.explain`,
`autopar.manual.MegatronConfig`, `autopar.app.AutoParallel`, ...). A plan explains and
compares itself: `plan.explain()`, `plan.diff(other)`.

This module only re-exports. The parts form a line, each importing only parts before it
(`tests/test_layering.py` checks it):

    choices, _progress, _version     base: names of choices, progress logging, the version
    graph      trace a step into an OpGraph; the marks a user writes
    cluster    Cluster, LogicalMesh, cost profiles
    cost       the cost model: collectives, compute, pipeline latency, stage memory
    profile    measure this machine into a cost profile
    intra      operator parallelism: sharding rules, strategies, the ILP
    errors     the exceptions a user may catch (MemoryBudgetError)
    inter      pipeline parallelism: graph passes, submeshes, the stage DP
    plan       Plan: plain data, JSON
    search     plan(): options, microbatches, the pipeline search, the plan cache
    manual     Megatron-LM style plans scored by the same cost model
    lower      Plan -> jax.jit with shardings
    distributed  several processes: launch, arrays across processes, agreeing on a plan
    checkpoint save a state, restore it onto another plan's shardings (orbax)
    runtime    the pipeline runtime
    report     explain, diff, compare, pictures, Gantt charts
    space      the explored plan space: every plan priced, its frontier (autopar.space.explore)
    app        autoparallel, the command line, the demo, the examples
"""

from autopar import checkpoint, distributed, errors
from autopar._version import __version__
from autopar.app import autoparallel, compare, score
from autopar.cluster import Cluster
from autopar.graph import grad, layer_boundary, value_and_grad
from autopar.manual import megatron_grid_search, megatron_plan
from autopar.plan import Plan
from autopar.search import PlanOptions, plan

__all__ = [
    "Cluster",
    "Plan",
    "PlanOptions",
    "__version__",
    "autoparallel",
    "checkpoint",
    "compare",
    "distributed",
    "errors",
    "grad",
    "layer_boundary",
    "megatron_grid_search",
    "megatron_plan",
    "plan",
    "score",
    "value_and_grad",
]
