"""Restore a converted (Orbax) folder straight onto a device mesh, each process reading only its shards.

`orbax_io` reads a converted folder whole, one layer at a time, onto the host. On a mesh that is
wasteful and, across hosts, every host would read the whole model. Here every Orbax item is
restored as `jax.Array`s with the parameter's sharding (Orbax then reads, on each process, only the
chunks its devices hold), converted on device (float casts, uint8 bits -> float8, e4m3fn -> fnuz),
and written into its layer slot of the stacked segment arrays by a donated in-place update, so a
device holds the stacked weights plus one layer at most.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..config.model import ModelConfig
from ..runtime.sharding import param_shardings
from ..weights.params import ParamSpec, abstract_params, flat_specs, segment_specs
from ..weights.quant import QArray, QFormat
from .errors import CheckpointError
from .orbax_io import _checkpointer, _item_dir, _read_marker, _short, _validate_marker


def can_restore_sharded(path: str, cfg: ModelConfig) -> bool:
    """Whether every stored tensor maps onto its parameter without host work: not the case when a
    quantized folder is loaded dequantized (that decode runs on the host, `orbax_io`)."""
    tensors = _read_marker(path).get("tensors", {})
    return all(tensors.get(name, {}).get("quant") is None or spec.quant is not None
               for name, spec in flat_specs(cfg).items())


def _layer_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked leaf (the `layers` axis is never split)."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


def _stored_format(entry: dict[str, Any]) -> QFormat:
    q = entry["quant"]
    return QFormat(q["format"], tuple(q["block"]), q["scale_dtype"])


def _restore_target(spec: ParamSpec, entry: dict[str, Any], sharding) -> Any:
    """ShapeDtypeStructs of what the item stores for one parameter, placed by `sharding`."""
    if entry.get("quant") is None:
        return jax.ShapeDtypeStruct(spec.shape, np.dtype(entry["dtype"]), sharding=sharding)
    stored = _stored_format(entry)
    return {"values": jax.ShapeDtypeStruct(stored.values_shape(spec.shape), np.uint8, sharding=sharding.values),
            "scales": jax.ShapeDtypeStruct(stored.scales_shape(spec.shape), np.dtype(stored.scale_dtype),
                                           sharding=sharding.scales)}


def _fnuz(bits: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """On-device twin of `checkpoint.quant.fp8_e4m3fn_to_fnuz` (same bits, scale x2, -0 -> 0, NaN -> NaN)."""
    out = jnp.where(bits == 0x80, jnp.uint8(0), bits)
    out = jnp.where((bits & 0x7F) == 0x7F, jnp.uint8(0x80), out)
    return jax.lax.bitcast_convert_type(out, jnp.float8_e4m3fnuz), scales.astype(jnp.float32) * 2


def _convert(raw: Any, spec: ParamSpec, dtype) -> Any:
    """A restored item entry -> the on-device parameter (traced inside the update program)."""
    if spec.quant is None:
        return raw.astype(jnp.float32 if spec.float32 else dtype)
    values, scales = raw["values"], raw["scales"]
    fmt = spec.quant
    if fmt.fmt.startswith("fp8"):
        if fmt.fnuz:
            values, scales = _fnuz(values, scales)
        else:
            values, scales = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn), scales.astype(jnp.float32)
    return QArray(values, scales, fmt)


def _insert_layer(stacks: dict, raw: dict, index, specs: tuple, dtype) -> dict:
    """Write one restored layer (converted) into slot `index` of the stacked arrays; `specs` is
    the layer's (name, ParamSpec) pairs, a tuple so the program can take it as a static argument."""
    def put(stack, layer):
        return jax.lax.dynamic_update_index_in_dim(stack, layer.astype(stack.dtype), index, 0)

    return {name: jax.tree.map(put, stacks[name], _convert(raw[name], spec, dtype)) for name, spec in specs}


_insert = jax.jit(_insert_layer, static_argnames=("specs", "dtype"), donate_argnums=(0,))


def _zeros(abstract, shardings):
    """Stacked zero arrays created on the mesh (never on one device first)."""
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings)()


def restore_sharded(path: str | os.PathLike, cfg: ModelConfig, dtype, mesh: Mesh) -> dict:
    """The stacked parameter tree of the converted folder `path`, placed on `mesh` by the
    logical-axis rules (quantized weights as QArrays). Same values as reading the folder whole."""
    path = os.fspath(path)
    tensors = _validate_marker(path, _read_marker(path), cfg)
    dtype = jnp.dtype(dtype)
    flat = flat_specs(cfg)
    abstract = abstract_params(cfg, dtype)
    shardings = param_shardings(abstract, cfg, mesh)
    ckptr = _checkpointer()

    def restore(layer: int | None, names: list[str], sharding_of) -> dict:
        item = _item_dir(path, layer)
        if not os.path.isdir(item):
            raise CheckpointError(f"{item} is missing from the converted checkpoint; re-run scripts/convert.py")
        target = {_short(n): _restore_target(flat[n], tensors[n], sharding_of(n)) for n in names}
        try:
            return ckptr.restore(item, target)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{item} does not hold what its marker records ({e}); re-run scripts/convert.py") from e

    try:
        top = [n for n in ("embed", "final_norm", "lm_head") if n in abstract]
        raw = restore(None, top, lambda n: shardings[n])
        tree: dict = {n: jax.jit(lambda r, n=n: _convert(r, flat[n], dtype), out_shardings=shardings[n])(raw[n])
                      for n in top}
        segments = []
        for (kind, start, stop), seg_specs, seg_abstract, seg_shardings in zip(
                cfg.segments, segment_specs(cfg), abstract["segments"], shardings["segments"]):
            per_layer = {n: jax.tree.map(_layer_sharding, s, is_leaf=lambda x: isinstance(x, NamedSharding))
                         for n, s in seg_shardings.items()}
            layer_specs = tuple((n, flat[f"layers.{start}.{n}"]) for n in seg_specs)
            stacks = _zeros(seg_abstract, seg_shardings)
            for i in range(start, stop):
                names = [f"layers.{i}.{n}" for n in seg_specs]
                if any((flat[f"layers.{i}.{n}"].quant is None) != (spec.quant is None) for n, spec in layer_specs):
                    raise CheckpointError(f"layer {i} is quantized differently from layer {start} of its segment; "
                                          "load with dequantize=True")
                raw = restore(i, names, lambda full: per_layer[full.split(".", 2)[2]])
                stacks = _insert(stacks, raw, np.int32(i - start), layer_specs, dtype)
            segments.append(stacks)
        tree["segments"] = tuple(segments)
        return tree
    finally:
        ckptr.close()
