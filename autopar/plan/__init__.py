"""The Plan: plain data describing how a train step runs on a cluster.

In: the search's (or a hand-made layout's) stages, each a layer range with its
`ShardingPlan`, and the traced graph's inputs. Out: a frozen `Plan` with a JSON round trip
and its predicted step time (`autopar.cost.pipeline_latency`). Imports nothing downstream.
"""

from autopar.plan._plan import FrontierPoint, InputInfo, Plan, Stage, input_infos

__all__ = ["FrontierPoint", "InputInfo", "Plan", "Stage", "input_infos"]
