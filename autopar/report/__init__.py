"""Reports: text views of a Plan (explain, diff)."""

from autopar.report._explain import diff_plans, explain

__all__ = ["diff_plans", "explain"]
