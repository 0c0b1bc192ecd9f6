"""Device mesh, logical-axis rules, and multi-host start-up.

Every param and cache array names its logical axes (params.py, kv_cache.py). One table maps them
to the mesh axes `data`, `tensor`, `expert`: attention heads and MLP columns over `tensor`, the
batch over `data`, and the routed experts over `data` x `expert` together (data-parallel
attention: each data shard runs attention for its own rows only, while the experts, the bulk of a
MoE's weights, are split over every device rather than replicated per data shard). A dimension
that does not divide evenly by its mesh axes is split over the trailing axes that divide it
(experts over `expert` alone), else replicated (correct, just less spread), so any model runs on
any mesh.
"""

from __future__ import annotations

import contextlib
import os
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..weights.lazy import LazyArray
from ..weights.params import stacked_axes
from ..weights.quant import QArray

MESH_AXES = ("data", "tensor", "expert")

# logical axis -> mesh axis, or mesh axes split together in this order (None = replicated)
RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "pages": "data",
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": ("data", "expert"),
    "expert_mlp": "tensor",
    "embed": None,
    "norm": None,
    "q_lora": None,
    "kv_lora": None,
    "layers": None,
    "seq": None,
}


def data_shards(mesh) -> int:
    """Data shards of a mesh (1 without one): data-parallel attention's row groups, each holding
    its own rows' KV pages."""
    return 1 if mesh is None else int(mesh.shape.get("data", 1))


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


def parse_mesh(sizes: str | Sequence[str]) -> tuple[int, int, int] | None:
    """Mesh sizes from a flag value: "data,tensor,expert" (or its list form); empty = no mesh."""
    items = [x.strip() for x in (sizes.split(",") if isinstance(sizes, str) else sizes) if x.strip()]
    if not items:
        return None
    try:
        dims = tuple(int(x) for x in items)
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"a mesh is three positive integers data,tensor,expert (e.g. 1,8,1); got {','.join(items)!r}")
    return dims  # type: ignore[return-value]


def axis_size(mesh, axes: str | tuple[str, ...] | None) -> int:
    """Devices a PartitionSpec entry splits a dimension over (1 for None)."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in names]))


def _spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def split_choices(name: str | None, sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """The mesh axes a logical axis may be split over, most spread first: the rule's axes without
    those of size 1 (one kept when all are), then its trailing axes alone (experts over `expert`
    where `data` x `expert` does not divide them)."""
    rule = RULES.get(name) if name else None
    if rule is None:
        return []
    axes = (rule,) if isinstance(rule, str) else tuple(rule)
    wide = tuple(a for a in axes if sizes[a] > 1) or axes[-1:]
    return [wide[i:] for i in range(len(wide))]


def _choose_split(name: str | None, mesh, used: set, divides) -> str | tuple[str, ...] | None:
    """The PartitionSpec entry for one dimension: the widest split choice whose axes are unused and
    whose size `divides(n)` accepts, else None (replicated)."""
    for axes in split_choices(name, mesh.shape):
        if not used.intersection(axes) and divides(axis_size(mesh, axes)):
            used.update(axes)
            return _spec_entry(axes)
    return None


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Map logical axes to a PartitionSpec, replicating dims that do not divide evenly."""
    used: set = set()
    return PartitionSpec(*(_choose_split(name, mesh, used, lambda n, size=size: size % n == 0)
                           for name, size in zip(axes, shape)))


def quantized_partition_spec(axes: tuple[str | None, ...], q: QArray, mesh) -> QArray:
    """PartitionSpecs (values, scales) for a quantized weight: a dim is split only where every
    shard of the values keeps whole scale blocks (a scale dim of 1 stays whole, values split)."""
    logical, vshape, sshape = q.shape, tuple(q.values.shape), tuple(q.scales.shape)
    nd = len(logical)
    block = (1,) * (nd - 2) + q.qformat.scale_block(logical)
    vspec, sspec, used = [], [], set()
    for d, name in enumerate(axes):
        def whole_blocks(n: int, d=d) -> bool:
            return vshape[d] % n == 0 and (sshape[d] == 1 or (logical[d] % n == 0 and (logical[d] // n) % block[d] == 0))

        entry = _choose_split(name, mesh, used, whole_blocks)
        vspec.append(entry)
        sspec.append(entry if sshape[d] > 1 else None)
    return QArray(PartitionSpec(*vspec), PartitionSpec(*sspec), q.qformat)


def leaf_partition_spec(axes: tuple[str | None, ...], leaf, mesh):
    """PartitionSpec of a param leaf (a QArray of two for a quantized weight)."""
    if isinstance(leaf, QArray):
        return quantized_partition_spec(axes, leaf, mesh)
    return partition_spec(axes, np.shape(leaf), mesh)


EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


def expert_axes(leaves: Mapping, axes: Mapping, mesh) -> dict:
    """Logical axes for the routed-expert weights of one segment or layer, splitting their
    intermediate width (`expert_mlp`) only if all three can: the expert-parallel MoE multiplies
    each shard's gate/up columns by the same rows of down. A quantized down whose scale groups do
    not divide into whole blocks per shard (e.g. width 96, groups of 32, 2 shards) keeps it whole,
    and gate/up then keep it whole too."""
    out = {name: axes[name] for name in EXPERT_WEIGHTS if name in axes}
    if len(out) < len(EXPERT_WEIGHTS):
        return out

    def splits(name: str) -> bool:
        spec = leaf_partition_spec(axes[name], leaves[name], mesh)
        values = spec.values if isinstance(spec, QArray) else spec
        d = axes[name].index("expert_mlp")
        return d < len(values) and values[d] is not None

    if not all(splits(name) for name in EXPERT_WEIGHTS):
        out = {name: tuple(None if a == "expert_mlp" else a for a in axes[name]) for name in EXPERT_WEIGHTS}
    return out


def param_axes(tree: dict, cfg: ModelConfig, mesh) -> dict:
    """The logical axes each leaf of a stacked tree is placed by: `stacked_axes(cfg)` with each
    segment's routed-expert axes made consistent (`expert_axes`)."""
    axes = stacked_axes(cfg)
    segments = tuple({**seg_axes, **expert_axes(seg, seg_axes, mesh)}
                     for seg, seg_axes in zip(tree["segments"], axes["segments"]))
    return {**axes, "segments": segments}


def _put(arr, sharding: NamedSharding) -> jax.Array:
    if isinstance(arr, jax.Array):
        return jax.device_put(arr, sharding)
    # Host arrays: each process builds only its own shards (multi-host safe, no full copy per
    # device); a checkpoint's LazyArray is read only for those shards.
    host = arr if isinstance(arr, LazyArray) else np.asarray(arr)
    blocks: dict = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:  # replicas of a block are read once
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in blocks:
            blocks[key] = host[index]
        return blocks[key]

    return jax.make_array_from_callback(host.shape, sharding, block)


def _leaf_sharding(leaf, axes, mesh: Mesh):
    """NamedSharding of a param leaf (a QArray of two for a quantized weight)."""
    spec = leaf_partition_spec(axes, leaf, mesh)
    if isinstance(leaf, QArray):
        return QArray(NamedSharding(mesh, spec.values), NamedSharding(mesh, spec.scales), leaf.qformat)
    return NamedSharding(mesh, spec)


def _place(arr, axes, mesh: Mesh):
    if isinstance(arr, kv_cache.Fp8Slots):  # scales [..., groups] split as the values' leading axes
        return kv_cache.Fp8Slots(_place(arr.values, axes, mesh), _place(arr.scales, axes[:-1] + (None,), mesh))
    sharding = _leaf_sharding(arr, axes, mesh)
    if isinstance(arr, QArray):
        return QArray(_put(arr.values, sharding.values), _put(arr.scales, sharding.scales), arr.qformat)
    return _put(arr, sharding)


def is_param_leaf(x) -> bool:
    return isinstance(x, QArray)


def param_shardings(tree: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """NamedShardings for a stacked param tree (arrays or ShapeDtypeStructs), QArray leaves included."""
    return jax.tree.map(lambda leaf, axes: _leaf_sharding(leaf, axes, mesh), tree, param_axes(tree, cfg, mesh),
                        is_leaf=is_param_leaf)


def shard_params(tree: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Place a stacked param tree (host or device arrays, QArrays) on `mesh` by the logical-axis rules."""
    return jax.tree.map(lambda a, ax: _place(a, ax, mesh), tree, param_axes(tree, cfg, mesh),
                        is_leaf=is_param_leaf)


def shard_cache(cache: kv_cache.KVCache, cfg: ModelConfig, mesh: Mesh) -> kv_cache.KVCache:
    k_axes, v_axes = kv_cache.cache_axes(cfg)
    return cache.replace(k=_place(cache.k, k_axes, mesh), v=_place(cache.v, v_axes, mesh),
                         lengths=_place(cache.lengths, ("batch",), mesh))


def shard_pages(k: jax.Array, v: jax.Array, cfg: ModelConfig, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """Place paged KV pools [L, pages, page_size, ...]: heads / latents split like a dense cache."""
    k_axes, v_axes = kv_cache.paged_axes(cfg)
    return _place(k, k_axes, mesh), _place(v, v_axes, mesh)


def replicate(tree, mesh: Mesh):
    """Place every array of `tree` (None leaves kept) whole on every device of `mesh`."""
    return jax.tree.map(lambda a: _place(a, (None,) * a.ndim, mesh), tree)


def mesh_context(mesh: Mesh | None):
    """Trace and run under `mesh` (`jax.set_mesh`), which makes the MoE expert-parallel
    (moe.expert_parallel); a no-op without a mesh. Every program over a sharded Target runs in it."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def to_host(x) -> np.ndarray:
    """A device array's value on this host. An array that spans other processes' devices (batch
    split over a multi-host `data` axis) is gathered from every process: a collective, so every
    process must read the same arrays in the same order, which the engines' lockstep loops do."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


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
