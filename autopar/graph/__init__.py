"""Tracing: a train step and example arguments in, an `OpGraph` out."""

from autopar.graph._opgraph import Node, OpGraph, Role, Var
from autopar.graph._trace import trace

__all__ = ["Node", "OpGraph", "Role", "Var", "trace"]
