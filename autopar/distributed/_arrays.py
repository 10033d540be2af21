"""Arrays across processes: global batches, moves between stage meshes, reading results.

In a multi-process run an array may have shards on devices of several processes, or only on
another process's devices (a pipeline stage on another host). Every process still holds a
`jax.Array` object for it, and every process must make the same calls in the same order:
jitted programs, and transfers (JAX numbers cross-process transfers with a per-process
counter, so a process that takes no part must still call).

`transfer(x, sharding)` moves an array to a sharding on other devices:
- same devices: a jitted identity with the new output sharding (a collective if needed);
- from one process's devices to the same process's devices: `copy_to_devices` there (device
  to device, no host round trip), an empty placeholder elsewhere;
- between disjoint groups of processes with equally many devices: reshard on the source to
  the target layout, then one cross-process `jax.device_put` (needs
  `jax_cross_host_transfer_socket_address`, set by `autopar.distributed.initialize`); JAX
  supports this only when the layouts match and every shard changes process;
- otherwise through the host: replicate on the source, broadcast the value to every process
  with a collective, and build the target from each process's copy.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar._memo import memo


def global_batch(local_batch: Any, sharding: jax.sharding.Sharding | None = None) -> Any:
    """A global batch from each process's own rows (`jax.make_array_from_process_local_data`).

    Process i passes rows `[i * n, (i + 1) * n)` of the global batch; the result's leaves have
    `num_processes * n` rows. By default dim 0 is split over every device, process by
    process, so each process's rows stay on its own devices.

    **Arguments:**
    - `local_batch`: a pytree of this process's arrays (numpy or jax), rows on dim 0.
    - `sharding`: the global sharding (default: dim 0 over all devices in cluster order).

    **Returns:** the pytree of global `jax.Array`s.

    **Example:**

    ```python
    rows = global_rows // jax.process_count()
    local = {"tokens": tokens[pid * rows:(pid + 1) * rows], ...}
    batch = autopar.distributed.global_batch(local)
    state, metrics = train_step(state, batch)
    ```
    """

    def one(x):
        x = np.asarray(x)
        s = sharding or _rows_over_all_devices(x.ndim)
        return jax.make_array_from_process_local_data(s, x)

    return jax.tree.map(one, local_batch)


def _rows_over_all_devices(ndim: int) -> NamedSharding:
    from autopar.cluster import local_devices

    if ndim == 0:
        raise ValueError("a batch leaf is a scalar; every batch leaf needs rows on dim 0")
    mesh = Mesh(np.array(local_devices()), ("devices",))
    return NamedSharding(mesh, PartitionSpec("devices"))


def place(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """`x` as a global array with `sharding`, in a multi-process run.

    A committed `jax.Array` (a step's result, or one built by `global_batch` or `place`) is
    taken to be a global array, the same one on every process, and moves with `transfer`.
    Anything else (numpy, a Python number, an uncommitted array such as the result of
    `jnp.ones` or of a jit without sharded inputs) must hold the same full value on every
    process, and each process fills in its own shards from it. (Whether an array is
    global cannot be told from one process: an array on this process's devices only may be
    a process-local value or a global array another process sees as remote.)

    **Returns:** a `jax.Array` with `sharding`.
    """
    if isinstance(x, jax.Array) and x.committed:
        return transfer(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: host[index], dtype=host.dtype
    )


def transfer(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """Move `x` to `sharding`; every process calls it (see the module docstring).

    **Returns:** a `jax.Array` with `sharding` (no local shards where this process owns
    none of its devices).
    """
    source = x.sharding
    if source.device_set == sharding.device_set:
        return _reshard(x, sharding)
    me = jax.process_index()
    src_procs = _processes(source)
    dst_procs = _processes(sharding)
    if len(src_procs) == 1 and src_procs == dst_procs:
        if me in src_procs:
            return copy_to_devices(x, sharding)
        return _placeholder(x, sharding)
    if src_procs.isdisjoint(dst_procs) and len(source.device_set) == len(sharding.device_set):
        mirror = _mirror(source, sharding, x.ndim)
        if mirror is not None:
            TRANSFER_PATHS["cross_process"] += 1
            _SENDS_IN_FLIGHT[0] = True
            # Wait for the pull to finish here, so that no later collective of this
            # process's devices can queue in front of the transfer's other side. (The
            # sending process cannot wait for it: see `settle_transfers`.)
            return jax.block_until_ready(jax.device_put(_reshard(x, mirror), sharding))
    TRANSFER_PATHS["host"] += 1
    value = gather(x)
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: value[index], dtype=value.dtype
    )


def copy_to_devices(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`x` moved to `sharding` device to device, never through the host (Alpa's cross-mesh
    resharding, Zheng et al. 2022 section 5); every device of both is this process's.

    `jax.device_put` between meshes of different shapes reads the array back to the host
    whenever no source shard is exactly a target shard. Here instead:
    1. reshard on the source devices (a collective there) into `_staging(...)`: the
       target's layout on the source devices, a block of the target per source device
       (the source devices split into `copies` groups shaped like the target mesh, each
       holding every block, when the target has fewer devices);
    2. copy each block to its target device (one device-to-device copy per target shard).
    When the target has more devices than the source, or a count the source's does not
    divide, the source is replicated, one full copy goes to each target device and each
    slices out its block there (more bytes, still no host).

    **Returns:** a `jax.Array` with `sharding`.
    """
    if x.sharding.device_set == sharding.device_set:
        return _reshard(x, sharding)
    staging = _staging(x.sharding, sharding)
    TRANSFER_PATHS["device_to_device"] += 1
    if staging is not None:
        staged = x if x.sharding.is_equivalent_to(staging, x.ndim) else _reshard(x, staging)
        blocks = {s.device: s.data for s in staged.addressable_shards}
        sources = staging.mesh.devices[0].flat  # the first copy of the target's blocks
        targets = sharding.mesh.devices.flat
        pieces = [jax.device_put(blocks[src], dst) for src, dst in zip(sources, targets)]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)
    source_devices = _ordered_devices(x.sharding)
    everywhere = NamedSharding(Mesh(np.array(source_devices), ("devices",)), PartitionSpec())
    whole = _reshard(x, everywhere)
    blocks = {s.device: s.data for s in whole.addressable_shards}
    pieces = []
    for k, (dst, index) in enumerate(sharding.devices_indices_map(x.shape).items()):
        full = jax.device_put(blocks[source_devices[k % len(source_devices)]], dst)
        starts = tuple(0 if i.start is None else i.start for i in index)
        stops = tuple(n if i.stop is None else i.stop for i, n in zip(index, x.shape))
        pieces.append(_slice(full, starts, stops))
    return jax.make_array_from_single_device_arrays(x.shape, sharding, pieces)


# How many moves took each path (read by tests: a move between meshes must not take the
# host round trip).
TRANSFER_PATHS: dict[str, int] = {"device_to_device": 0, "cross_process": 0, "host": 0}


def _staging(source, target) -> NamedSharding | None:
    """`target`'s layout on `source`'s devices, the source devices as `copies` groups of
    the target mesh's shape, or None when that does not exist (`target` not a
    NamedSharding, or its device count not dividing the source's)."""
    if not isinstance(target, NamedSharding):
        return None
    devices = _ordered_devices(source)
    copies, rest = divmod(len(devices), target.mesh.devices.size)
    if rest or copies == 0:
        return None
    grid = np.array(devices).reshape(copies, *target.mesh.devices.shape)
    mesh = Mesh(grid, ("_copies", *target.mesh.axis_names))
    return NamedSharding(mesh, target.spec)


def _ordered_devices(sharding) -> list:
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _slice(x, starts, stops):
    return jax.lax.slice(x, starts, stops)


# Whether a cross-process transfer was issued since the last `settle_transfers`. Every
# process issues the same transfers in the same order, so all agree on it.
_SENDS_IN_FLIGHT = [False]
_SETTLE_TIMEOUT_MS = 30 * 60 * 1000
_settled = [0]  # barriers so far: each one's name


def settle_transfers() -> None:
    """Wait, on every process, until every cross-process transfer issued so far has
    arrived; every process calls it at the same point (a host barrier, no device work).

    The receiving process waits for each transfer as it issues it, but the sending one
    cannot: it has no shard of the result. If the sender then runs a collective over
    devices of both processes (reading results with `gather`, a jit on a mesh spanning
    them), its devices block in that collective, waiting for the receiver, while the
    receiver still waits for bytes the sender's devices must serve: a deadlock (issue 19:
    process 1 in a parameter transfer of the update, process 0 in the next `to_host`).
    A host barrier keeps the sender's devices free until the receiver has everything.
    Called at the end of every pipelined step and before every `gather`; a no-op when no
    transfer crossed processes since the last call.
    """
    if not _SENDS_IN_FLIGHT[0] or jax.process_count() == 1:
        return
    from jax._src import distributed

    _SENDS_IN_FLIGHT[0] = False
    _settled[0] += 1
    distributed.global_state.client.wait_at_barrier(
        f"autopar_transfers_{_settled[0]}", _SETTLE_TIMEOUT_MS
    )


def gather(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly global) array on every process, as numpy.

    Every process calls it, with the same global array (or the same uncommitted value, which
    is read directly). The array is replicated over its own devices and, when some process
    owns none of them, broadcast from the first owner with a collective over all devices.
    """
    if jax.process_count() == 1 or not x.committed:
        return np.asarray(x)
    settle_transfers()
    devices = sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
    replicated = NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())
    full = _reshard(x, replicated)
    owners = _processes(replicated)
    local = np.asarray(full.addressable_shards[0].data) if full.addressable_shards else None
    if len(owners) == jax.process_count():
        return local
    if local is None:
        local = np.zeros(x.shape, x.dtype)
    return np.asarray(
        multihost_utils.broadcast_one_to_all(local, is_source=jax.process_index() == min(owners))
    )


def to_host(tree: Any) -> Any:
    """`gather` every leaf of a pytree: the step's results as numpy on every process."""
    return jax.tree.map(lambda x: gather(x) if isinstance(x, jax.Array) else x, tree)


def _reshard(x: jax.Array, sharding) -> jax.Array:
    return _identity_to(sharding)(x)


@memo("distributed.identity_to", "sharding", maxsize=1024)
def _identity_to(sharding) -> Any:
    """A jitted identity with `sharding` as its result's layout, one per sharding: a new
    ``jax.jit(lambda ...)`` per call missed jit's caches and traced and compiled again on
    every move (about 10 ms of CPU each; 20 moves per step of a 2-stage, 4-microbatch
    local pipeline)."""
    return jax.jit(_identity, out_shardings=sharding)


def _identity(a):
    return a


def _processes(sharding) -> set[int]:
    return {d.process_index for d in sharding.device_set}


def _placeholder(x: jax.Array, sharding) -> jax.Array:
    """A global array with no shards on this process (it owns none of `sharding`'s devices)."""
    assert not sharding.addressable_devices, (
        f"a placeholder is for devices this process does not own, not {sharding}"
    )
    if sharding.is_fully_replicated:
        # `make_array_from_callback` reads the value of a replicated layout once even when
        # no device of it is local (it then puts it on none): a zero-byte stand-in.
        nothing = np.broadcast_to(np.zeros((), x.dtype), x.shape)
        return jax.make_array_from_callback(x.shape, sharding, lambda _: nothing,
                                            dtype=x.dtype)
    return jax.make_array_from_callback(x.shape, sharding, _never_called, dtype=x.dtype)


def _never_called(index):
    raise AssertionError(f"no shard of a placeholder array is local (index {index})")


def _mirror(source, target, ndim: int):
    """`target`'s layout on `source`'s devices, or None when `target` is not a NamedSharding.

    A cross-process `jax.device_put` needs source and target with the same layout; only
    the devices may differ.
    """
    if not isinstance(target, NamedSharding):
        return None
    devices = sorted(source.device_set, key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(target.mesh.devices.shape), target.mesh.axis_names)
    return NamedSharding(mesh, target.spec)
