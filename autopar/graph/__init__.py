"""Tracing: a train step and example arguments in, an `OpGraph` out.

Also the marks a user puts in the step (`layer_boundary`, and `value_and_grad`/`grad`,
which mark where the per-microbatch gradient ends and the optimizer update begins), and
`tied_state`, which pairs the step's returned state with the state it was given.
"""

from autopar.graph._annotations import ANNOTATION_PRIMITIVES, without_annotations
from autopar.graph._fusion import (
    FusionTraffic,
    attention_core,
    fusion_kind,
    fusion_traffic,
    kernel_roots,
    register_fusion,
    stored_residuals,
)
from autopar.graph._markers import grad, layer_boundary, marking_layers, value_and_grad
from autopar.graph._opgraph import Node, OpGraph, Role, Var, dtype_itemsize
from autopar.graph._stacked import StackedSplit, split_stacked
from autopar.graph._state import tied_state
from autopar.graph._trace import abstract_args, trace, trace_jaxpr

__all__ = [
    "ANNOTATION_PRIMITIVES",
    "FusionTraffic",
    "Node",
    "OpGraph",
    "Role",
    "StackedSplit",
    "Var",
    "abstract_args",
    "fusion_kind",
    "fusion_traffic",
    "kernel_roots",
    "attention_core",
    "dtype_itemsize",
    "grad",
    "layer_boundary",
    "marking_layers",
    "register_fusion",
    "stored_residuals",
    "split_stacked",
    "tied_state",
    "trace",
    "trace_jaxpr",
    "value_and_grad",
    "without_annotations",
]
