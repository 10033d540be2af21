"""The search: a train step, its arguments, a cluster and `PlanOptions` in, a `Plan` out.

- `_options`: `PlanOptions`, every option declared once with its default and check;
- `_api`: `plan()` (a dry run) and `search()` (trace, cache, search), `graph_for_plan`;
- `_pipeline`: method "auto": one search's flow, microbatch counts x the stage DP
  (`autopar.inter`); `_schedules`: the schedule a choice runs and interleaving;
  `_stack`: a scanned layer stack's cuts;
- `_single_mesh`: operator parallelism on one mesh (`autopar.intra`);
- `_microbatch`: the batch's size and arguments cut to one microbatch;
- `_pins`: the user's pins (`constraints=`): a pytree of shardings or `LogicalPins`;
- `_cache`: plans on disk, keyed by program, cluster, options and autopar's code.
"""

from autopar.search._api import graph_for_plan, plan, search
from autopar.search._cache import PlanCache, cache_key, code_version
from autopar.search._microbatch import batch_size, microbatch_args
from autopar.search._options import (
    OPTION_NAMES,
    PlanOptions,
    options_from,
    resolve_cluster,
    takes_plan_options,
)
from autopar.search._pins import LogicalPins, resolve_pins
from autopar.search._pipeline import search_plan
from autopar.search._single_mesh import plan_one_mesh, shard_options

__all__ = [
    "LogicalPins",
    "OPTION_NAMES",
    "PlanCache",
    "PlanOptions",
    "batch_size",
    "cache_key",
    "code_version",
    "graph_for_plan",
    "microbatch_args",
    "options_from",
    "plan",
    "plan_one_mesh",
    "resolve_cluster",
    "resolve_pins",
    "search",
    "search_plan",
    "shard_options",
    "takes_plan_options",
]
