"""The Plan: plain data describing how a train step runs on a cluster."""

from autopar.plan._plan import InputInfo, Plan, Stage

__all__ = ["InputInfo", "Plan", "Stage"]
