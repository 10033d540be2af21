"""autopar: automatic data, operator and pipeline parallelism for JAX train steps."""

from autopar._markers import grad, layer_boundary, value_and_grad

__version__ = "0.1.0"

__all__ = ["grad", "layer_boundary", "value_and_grad"]
