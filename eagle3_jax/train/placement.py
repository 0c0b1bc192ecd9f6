"""Where a training run's arrays live on the mesh.

The trainable state (float32 weights and the two AdamW moments, and with them the gradients) is
sharded ZeRO-3 style: each array split along one dimension over the mesh's devices, so a device
holds 1 / n of it and the step all-gathers the weights it computes with and reduce-scatters the
gradients (XLA's SPMD partitioner inserts both from the shardings alone). The split goes over as
many devices as divide the dimension: every axis of the mesh together when they can (the draft is
small beside the target, and every device of the target's mesh has room for its share), else the
widest single axis, else the array stays whole on every device (vectors a few thousand long: the
norms, a step counter). The batch is split over `data` as the trainer's `batch_spec` says.

Across hosts every process holds the same host data (its regenerated examples, its batch order) and
builds a global array from it (`global_array`: each device's block cut from the host copy), and
reads a sharded result back whole (`host_copy`, a collective every process makes); files are
written by process 0 alone (`writes_files`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..runtime.sharding import to_host


def axis_groups(mesh: Mesh) -> list[tuple[str, ...]]:
    """The mesh axes an array may be split over, most devices first: every axis of size > 1
    together, then each of them alone, widest first."""
    wide = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    singles = sorted(wide, key=lambda a: -mesh.shape[a])
    return ([tuple(wide)] if len(wide) > 1 else []) + [(a,) for a in singles]


def sharded_spec(shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec splitting an array of `shape` over the most devices: the first axis group
    (`axis_groups`) whose size divides one of its dimensions, along the largest such dimension;
    replicated when none does."""
    for axes in axis_groups(mesh):
        n = int(np.prod([mesh.shape[a] for a in axes]))
        dims = [d for d, size in enumerate(shape) if size % n == 0 and size >= n]
        if dims:
            dim = max(dims, key=lambda d: shape[d])
            entry = axes[0] if len(axes) == 1 else axes
            return PartitionSpec(*(entry if d == dim else None for d in range(len(shape))))
    return PartitionSpec()


def sharded_shardings(tree, mesh: Mesh):
    """A NamedSharding per array leaf of `tree` (arrays or ShapeDtypeStructs): `sharded_spec`."""
    return jax.tree.map(lambda x: NamedSharding(mesh, sharded_spec(tuple(np.shape(x)), mesh)), tree)


def replicated_shardings(tree, mesh: Mesh):
    """A NamedSharding per array leaf of `tree`: whole on every device."""
    return jax.tree.map(lambda x: NamedSharding(mesh, PartitionSpec()), tree)


def global_array(host, sharding: NamedSharding) -> jax.Array:
    """`host` (the same on every process) as one array laid out by `sharding`, which may span
    other processes' devices: each process places its own devices' blocks. `host`: an array, or
    anything shaped and indexed like one (feature_store.StoreRows), of which only those blocks are
    read."""
    if not (hasattr(host, "shape") and hasattr(host, "__getitem__")):
        host = np.asarray(host)
    return jax.make_array_from_callback(tuple(host.shape), sharding, lambda index: np.asarray(host[index]))


def host_copy(tree):
    """Every array of `tree` whole on this host (gathered from the other processes where it spans
    them: every process must call it alike)."""
    return jax.tree.map(to_host, tree)


def writes_files() -> bool:
    """Whether this process writes a run's files (checkpoints aside: Orbax coordinates those)."""
    return jax.process_index() == 0
