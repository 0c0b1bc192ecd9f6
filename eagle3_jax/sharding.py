"""Device mesh, logical-axis rules, and multi-host start-up.

Every param and cache array names its logical axes (params.py, kv_cache.py). One table maps them
to the mesh axes `data`, `tensor`, `expert`: attention heads and MLP columns over `tensor`, routed
experts over `expert`, the batch over `data`. A dimension that does not divide evenly by its mesh
axis is replicated instead (correct, just less spread), so any model runs on any mesh.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import kv_cache
from .config import ModelConfig
from .params import stacked_axes

MESH_AXES = ("data", "tensor", "expert")

# logical axis -> mesh axis (None = replicated)
RULES: Mapping[str, str | None] = {
    "batch": "data",
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "embed": None,
    "norm": None,
    "q_lora": None,
    "kv_lora": None,
    "layers": None,
    "seq": None,
}


def make_mesh(data: int = 1, tensor: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A (data, tensor, expert) mesh over `devices` (default: all devices, in order)."""
    devices = list(jax.devices() if devices is None else devices)
    need = data * tensor * expert
    if need != len(devices):
        raise ValueError(
            f"mesh data={data} x tensor={tensor} x expert={expert} = {need} devices, but {len(devices)} are "
            "available; choose sizes whose product is the device count"
        )
    return Mesh(np.asarray(devices).reshape(data, tensor, expert), MESH_AXES)


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Map logical axes to a PartitionSpec, replicating dims that do not divide evenly."""
    spec, used = [], set()
    for name, size in zip(axes, shape):
        mesh_axis = RULES.get(name) if name else None
        if mesh_axis is None or mesh_axis in used or size % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return PartitionSpec(*spec)


def _place(arr, axes, mesh: Mesh) -> jax.Array:
    sharding = NamedSharding(mesh, partition_spec(axes, np.shape(arr), mesh))
    if isinstance(arr, jax.Array):
        return jax.device_put(arr, sharding)
    # Host arrays: each process builds only its own shards (multi-host safe, no full copy per device).
    host = np.asarray(arr)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(tree: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place a stacked param tree (host or device arrays) on `mesh` by the logical-axis rules."""
    axes = stacked_axes(cfg)
    return jax.tree.map(lambda a, ax: _place(a, ax, mesh), tree, axes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, (str, type(None))) for e in x))


def shard_cache(cache: kv_cache.KVCache, cfg: ModelConfig, mesh: Mesh) -> kv_cache.KVCache:
    k_axes, v_axes = kv_cache.cache_axes(cfg)
    return cache.replace(k=_place(cache.k, k_axes, mesh), v=_place(cache.v, v_axes, mesh),
                         lengths=_place(cache.lengths, ("batch",), mesh))


def shard_pages(k: jax.Array, v: jax.Array, cfg: ModelConfig, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """Place paged KV pools [L, pages, page_size, ...]: heads / latents split like a dense cache."""
    k_axes, v_axes = kv_cache.paged_axes(cfg)
    return _place(k, k_axes, mesh), _place(v, v_axes, mesh)


def initialize_distributed() -> None:
    """Join a multi-host run (one process per host) before any other JAX call.

    Reads the standard `jax.distributed` settings: on managed clusters (SLURM, TPU, ...) JAX finds
    them itself; otherwise set EAGLE3_COORDINATOR (host:port of process 0), EAGLE3_NUM_PROCESSES
    and EAGLE3_PROCESS_ID. After it, `jax.devices()` lists every host's devices, so `make_mesh`
    spans the whole job.
    """
    coordinator = os.environ.get("EAGLE3_COORDINATOR")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["EAGLE3_NUM_PROCESSES"]),
            process_id=int(os.environ["EAGLE3_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
