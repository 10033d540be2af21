"""Backends: what one runtime does that the general cost model does not.

The general model (roofline compute, alpha-beta collectives, Alpa's pipeline latency)
holds for every device. What only one backend's runtime does lives in that backend's
module, behind the named methods of `Backend`:

- layout copies (`layout_copies`, `prices_layout_copies`, `layout_copy_seconds`):
  XLA:CPU copies GEMM operands into its kernels' memory order, priced at the profile's
  `transpose_bandwidth`; XLA:GPU makes none.
- returned gradients (`returned_gradient_seconds`): XLA:CPU copies a pipelined
  backward's weight gradients to row-major; XLA:GPU, 0.
- shared cores (`shared_cores_step_time`): XLA:CPU's devices share the host's
  `host_cores`, a pipeline's tasks costing `task_device_overhead` on them; XLA:GPU, None.
- collectives inside a program (`collective_latency`, `merged_latency_share`): XLA:CPU
  pays `collective_latency_by_group` once per collective and `combined_operand_latency`
  per merged operand; XLA:GPU the ring's latency, once per bucket.

`backend_for(cluster)` picks the backend by the cluster's `device_kind` (a `Cluster` or
its JSON dict): ``"cpu"`` is XLA:CPU, anything else XLA:GPU. A new accelerator adds one
module with a `Backend` subclass, registers it here by its device kind
(`register_backend`), and ships one profile (``cost_profiles/``) with the fields it reads.

**Example:**

```python
backend_for(Cluster.from_profile("cpu-local-measured")).name  # "xla:cpu"
backend_for(Cluster.from_profile("dgx-h100")).name            # "xla:gpu"
```
"""

from __future__ import annotations

from autopar._memo import memo
from autopar.cost.backends._base import Backend, LayoutCopy, cluster_field
from autopar.cost.backends._xla_cpu import XLA_CPU
from autopar.cost.backends._xla_gpu import XLA_GPU

# Backends by the start of a JAX device kind, lower-case; the longest match wins.
_BACKENDS: dict[str, Backend] = {}
# The backend of a device kind no registered prefix matches.
DEFAULT_BACKEND: Backend = XLA_GPU


def register_backend(device_kind: str, backend: Backend) -> None:
    """Run devices whose JAX `device_kind` starts with `device_kind` (case-insensitive)
    on `backend`.

    **Example:** ``register_backend("tpu", XLA_TPU)`` for ``"TPU v4"`` devices.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend needs a Backend instance, got {backend!r}")
    _BACKENDS[device_kind.lower()] = backend
    _lookup.cache_clear()


def backend_for(cluster) -> Backend:
    """The backend that runs `cluster`'s devices (a `Cluster` or its JSON dict), by its
    `device_kind`: the registered one whose prefix matches, else `DEFAULT_BACKEND`."""
    return _lookup(str(cluster_field(cluster, "device_kind") or "").lower())


@memo("cost.backend_lookup", "device kind", maxsize=256)
def _lookup(device_kind: str) -> Backend:
    matches = [prefix for prefix in _BACKENDS if device_kind.startswith(prefix)]
    return _BACKENDS[max(matches, key=len)] if matches else DEFAULT_BACKEND


register_backend("cpu", XLA_CPU)

__all__ = [
    "DEFAULT_BACKEND",
    "XLA_CPU",
    "XLA_GPU",
    "Backend",
    "LayoutCopy",
    "backend_for",
    "register_backend",
]
