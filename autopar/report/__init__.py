"""Reports: what a plan means, for people.

In: `Plan`s (and, for pictures and measured timelines, the graph they run or the runtime's
task records). Out: text (`explain`, `diff_plans`, `compare` side by side from the same
cost model), pictures (`plot_layout`: which device holds which shard; `gantt`: simulated
or measured pipeline schedules) and host-level summaries.
"""

from autopar.report._alternatives import Alternative, alternatives
from autopar.report._compare import compare, pipeline_bubble, plan_figures
from autopar.report._differences import (
    Difference,
    TimeSplit,
    differences,
    explain_differences,
    layer_groups,
    time_split,
)
from autopar.report._explain import diff_plans, explain
from autopar.report._frontier import frontier_lines, on_frontier, pareto_frontier, plot_space
from autopar.report._gantt import (
    TaskRecord,
    gantt,
    gantt_compare,
    gantt_compare_figure,
    plan_schedule,
    simulate_schedule,
    step_time_comparison,
)
from autopar.report._hosts import (
    axes_across_hosts,
    matmul_weight_splits,
    weights_split_across_hosts,
)
from autopar.report._pictures import plot_layout

__all__ = [
    "Alternative",
    "alternatives",
    "Difference",
    "TaskRecord",
    "TimeSplit",
    "axes_across_hosts",
    "compare",
    "diff_plans",
    "differences",
    "explain_differences",
    "explain",
    "frontier_lines",
    "on_frontier",
    "pareto_frontier",
    "plot_space",
    "gantt",
    "gantt_compare",
    "gantt_compare_figure",
    "layer_groups",
    "matmul_weight_splits",
    "pipeline_bubble",
    "plan_figures",
    "plan_schedule",
    "plot_layout",
    "time_split",
    "simulate_schedule",
    "step_time_comparison",
    "weights_split_across_hosts",
]
