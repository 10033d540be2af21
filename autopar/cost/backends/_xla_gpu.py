"""XLA:GPU: the general model as it is; none of XLA:CPU's extra costs.

- No layout copies: cuBLAS takes either operand transposed, and XLA:GPU's transposes are
  tiled through shared memory (a `transpose` node's bytes are the roofline's).
- No returned-gradient copies: cuBLAS writes a result in either order.
- No shared cores: each GPU has its own streams, and the host's launches overlap the
  devices' work (`dispatch_overhead` is charged per task by the general model).
- Collectives pay the ring's alpha-beta latency (NCCL), and a merged collective pays
  its share of one bucket's latency: XLA:GPU's combiners issue one collective per bucket.
- Collectives run on their own CUDA stream beside independent compute (XLA's latency
  hiding scheduler issues them asynchronously): the profile's `overlap` share of their
  time is hidden, the rest taken by the SMs and memory bandwidth NCCL uses.

What GPUs do that is still general (a roofline with optional measured tables, any
accelerator may measure it) stays in the general model: `kernel_overhead` per kernel
(`autopar.cost.kernel_launch_time`), `fused_attention`, `gemm_shapes`.
"""

from __future__ import annotations

from autopar.cost.backends._base import Backend, LayoutCopy, cluster_field


class XlaGpu(Backend):
    """XLA:GPU (module docstring): every method answers "no such cost"."""

    name = "xla:gpu"

    def layout_copies(self, graph, node) -> tuple[LayoutCopy, ...]:
        return ()

    def prices_layout_copies(self, cluster) -> bool:
        return False

    def layout_copy_seconds(self, cluster, nbytes: float, fan_in: float = 1.0,
                            fused: bool = False, strided: bool = True) -> float:
        return 0.0

    def returned_gradient_seconds(self, cluster, nbytes: float) -> float:
        return 0.0

    def shared_cores_step_time(self, cluster, forward, backward, num_microbatches,
                               group_devices, schedule, num_device_groups):
        return None

    def collective_latency(self, cluster, group_size: int) -> float | None:
        return None

    def merged_latency_share(self, cluster, nbytes: float, threshold: float) -> float:
        return min(1.0, nbytes / threshold)

    def collective_concurrency(self, cluster) -> float:
        """The profile's `overlap` (module docstring)."""
        return float(cluster_field(cluster, "overlap") or 0.0)


XLA_GPU = XlaGpu()
