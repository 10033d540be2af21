"""autopar: automatic data, operator and pipeline parallelism for JAX train steps.

```python
@autopar.autoparallel
def train_step(state, batch):
    loss, grads = autopar.value_and_grad(loss_fn)(state.params, batch)
    ...
```
"""

from autopar import cost, distributed
from autopar._autoparallel import AutoParallel, autoparallel
from autopar._markers import grad, layer_boundary, value_and_grad
from autopar._planning import plan
from autopar.cluster import Cluster, Link, LogicalMesh
from autopar.graph import OpGraph, Role, trace
from autopar.intra import MemoryBudgetError, ShardingPlan
from autopar.manual import MegatronConfig, megatron_grid_search, megatron_plan
from autopar.plan import Plan
from autopar.report import compare

__version__ = "0.1.0"

__all__ = [
    "AutoParallel",
    "Cluster",
    "Link",
    "LogicalMesh",
    "MegatronConfig",
    "MemoryBudgetError",
    "OpGraph",
    "Plan",
    "Role",
    "ShardingPlan",
    "autoparallel",
    "compare",
    "cost",
    "distributed",
    "grad",
    "layer_boundary",
    "megatron_grid_search",
    "megatron_plan",
    "plan",
    "trace",
    "value_and_grad",
]
