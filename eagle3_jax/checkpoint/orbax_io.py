"""Our converted checkpoint format: Orbax items, one per layer, plus a completion marker.

Layout of a converted folder:

    config.json (+ tokenizer / generation files copied from the HF folder)
    globals/            Orbax item {embed, final_norm, lm_head?}
    layers/<i>/         Orbax item {attn_norm, q_proj, ..., experts_gate, ...} of layer i
    eagle3_complete.json  written last: format tag, dtype, every tensor's shape and dtype

One item per layer keeps conversion and loading memory bounded to a layer. Conversion writes
into `<out_dir>.partial-<pid>` and renames it into place only after the marker is written, so a
crash or interrupt never leaves a folder `is_orbax_dir` accepts. Tensors are stored exactly as
the HF reader produces them, so HF -> Orbax -> read is bit-identical to reading HF directly.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator

import numpy as np

from ..config import ModelConfig
from ..params import flat_specs
from .errors import CheckpointError
from .hf_loader import Plan, build_param, layer_of, plan_hf, resolve_dtype
from .safetensors_io import open_hf_checkpoint

MARKER = "eagle3_complete.json"
FORMAT = "eagle3-jax-orbax"
VERSION = 1
_WEIGHT_MARKERS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_MAX_AUX_BYTES = 64 * 1024 * 1024


def is_orbax_dir(path: str | os.PathLike) -> bool:
    """True only for a complete converted folder (its completion marker is present and valid)."""
    try:
        return _read_marker(os.fspath(path))["format"] == FORMAT
    except (OSError, ValueError, KeyError, TypeError):
        return False


def looks_like_partial_orbax(path: str | os.PathLike) -> bool:
    """A folder that holds Orbax conversion output but no completion marker."""
    p = os.fspath(path)
    if not os.path.isdir(p) or os.path.exists(os.path.join(p, MARKER)):
        return False
    return ".partial-" in os.path.basename(os.path.normpath(p)) or any(
        os.path.isdir(os.path.join(p, d)) for d in ("globals", "layers")
    )


def _read_marker(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    if not isinstance(marker, dict):
        raise ValueError("marker is not a JSON object")
    return marker


def _item_dir(root: str, layer: int | None) -> str:
    return os.path.join(root, "globals") if layer is None else os.path.join(root, "layers", str(layer))


def _short(name: str) -> str:
    """Key inside a layer item: `layers.3.q_proj` -> `q_proj` (Orbax tree keys stay simple)."""
    return name.split(".", 2)[2] if layer_of(name) is not None else name


def _checkpointer():
    import orbax.checkpoint as ocp  # imported lazily: Orbax is only needed for this format

    return ocp.StandardCheckpointer()


def _save_item(ckptr: Any, path: str, tree: dict[str, np.ndarray]) -> None:
    """Write one Orbax item and wait for it, so at most one layer is in flight."""
    ckptr.save(path, tree)
    ckptr.wait_until_finished()


def _copy_aux_files(hf_dir: str, out_dir: str) -> list[str]:
    """Copy config.json and other small non-weight files (tokenizer, generation config) so the
    converted folder is self-contained; weights and pickles are never copied."""
    copied = []
    for name in sorted(os.listdir(hf_dir)):
        src = os.path.join(hf_dir, name)
        if not os.path.isfile(src) or any(m in name for m in _WEIGHT_MARKERS) or name == MARKER:
            continue
        if os.path.getsize(src) > _MAX_AUX_BYTES:
            continue
        shutil.copy2(src, os.path.join(out_dir, name))
        copied.append(name)
    return copied


def _write_marker(root: str, marker: dict[str, Any]) -> None:
    tmp = os.path.join(root, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MARKER))


def _dtype_name(d: np.dtype) -> str:
    return np.dtype(d).name


def save_orbax(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    cfg: ModelConfig,
    progress: bool = True,
    dtype: str | np.dtype | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert an HF safetensors folder to our Orbax format, one layer at a time, atomically.

    `dtype` None keeps the tensors exactly as `read_flat_params(hf_dir, cfg)` returns them
    (dequantized weights float32); "bfloat16" / "float16" / "float32" casts every tensor except
    the float32 router params (use bfloat16 for Kimi-K2.5: its int4 experts are 8x larger as
    float32). Returns the completion marker (a summary: tensors, dtype, bytes).
    """
    from tqdm.auto import tqdm

    hf_dir, out_dir = os.fspath(hf_dir), os.path.abspath(os.fspath(out_dir))
    out_dtype = resolve_dtype(dtype)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"no config.json in {hf_dir}; pass the HF model folder (config.json + safetensors)")
    if os.path.exists(out_dir) and not overwrite:
        raise CheckpointError(f"output folder {out_dir} already exists; choose another --out_dir or pass --overwrite")
    plan = plan_hf(open_hf_checkpoint(hf_dir), cfg)  # validate before writing anything
    partial = f"{out_dir}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.join(partial, "layers"))
    try:
        tensors, nbytes = _write_items(plan, partial, out_dtype, progress, tqdm)
        aux = _copy_aux_files(hf_dir, partial)
        marker = {
            "format": FORMAT,
            "version": VERSION,
            "model_type": cfg.model_type,
            "num_layers": cfg.num_layers,
            "dtype": None if out_dtype is None else _dtype_name(out_dtype),
            "source": os.path.abspath(hf_dir),
            "num_bytes": nbytes,
            "aux_files": aux,
            "tensors": tensors,
        }
        _write_marker(partial, marker)
        _swap_into_place(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return marker


def _write_items(plan: Plan, root: str, dtype: np.dtype | None, progress: bool, tqdm: Any) -> tuple[dict, int]:
    tensors: dict[str, dict[str, Any]] = {}
    nbytes = 0
    groups = plan.groups()
    ckptr = _checkpointer()
    try:
        with tqdm(total=len(groups), desc="convert", unit="layer", disable=not progress) as bar:
            for layer, names in groups:
                bar.set_postfix_str("globals" if layer is None else f"layer {layer}")
                tree = {}
                for name in names:
                    arr = build_param(plan, name, dtype)
                    tree[_short(name)] = arr
                    tensors[name] = {"shape": list(arr.shape), "dtype": _dtype_name(arr.dtype)}
                    nbytes += arr.nbytes
                _save_item(ckptr, _item_dir(root, layer), tree)
                del tree
                bar.update(1)
    finally:
        ckptr.close()
    return tensors, nbytes


def _swap_into_place(partial: str, out_dir: str) -> None:
    """Rename the finished folder into place; an existing out_dir (overwrite) is moved aside
    first and deleted only after the new one is in place."""
    if not os.path.exists(out_dir):
        os.rename(partial, out_dir)
        return
    old = f"{out_dir}.old-{os.getpid()}"
    os.rename(out_dir, old)
    os.rename(partial, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _validate_marker(path: str, marker: dict[str, Any], cfg: ModelConfig) -> dict[str, dict[str, Any]]:
    tensors = marker.get("tensors")
    if marker.get("format") != FORMAT or not isinstance(tensors, dict):
        raise CheckpointError(f"{os.path.join(path, MARKER)} is not an {FORMAT} marker; re-run scripts/convert.py")
    specs = flat_specs(cfg)
    problems = [f"missing tensor {n}" for n in specs if n not in tensors]
    problems += [f"unexpected tensor {n}" for n in tensors if n not in specs]
    problems += [
        f"tensor {n} has shape {tensors[n]['shape']} but config.json implies {list(s.shape)}"
        for n, s in specs.items()
        if n in tensors and tuple(tensors[n]["shape"]) != s.shape
    ]
    if problems:
        raise CheckpointError(
            f"converted checkpoint {path} does not match the {cfg.model_type} config ({len(problems)} problem(s)): "
            + "; ".join(problems[:25])
            + ". Load it with the config.json it was converted with, or re-convert with scripts/convert.py"
        )
    return tensors


def iter_orbax_layers(
    path: str | os.PathLike, cfg: ModelConfig, dtype: str | np.dtype | None = None
) -> Iterator[tuple[int | None, dict[str, np.ndarray]]]:
    """Same contract as `iter_hf_layers`, for a converted folder. Validation against `cfg` (from
    the marker alone) happens before the first yield."""
    path = os.fspath(path)
    try:
        marker = _read_marker(path)
    except FileNotFoundError as e:
        raise CheckpointError(
            f"{path} is an incomplete Orbax conversion (no {MARKER}): the conversion was interrupted. Delete it and "
            "re-run scripts/convert.py"
        ) from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, MARKER)} is unreadable ({e}); re-run scripts/convert.py") from e
    tensors = _validate_marker(path, marker, cfg)
    return _restore_layers(path, cfg, tensors, resolve_dtype(dtype))


def _restore_layers(path: str, cfg: ModelConfig, tensors: dict, dtype: np.dtype | None) -> Iterator:
    specs = flat_specs(cfg)
    groups: dict[int | None, list[str]] = {}
    for name in specs:
        groups.setdefault(layer_of(name), []).append(name)
    ckptr = _checkpointer()
    try:
        for layer in [None] + list(range(cfg.num_layers)):
            item = _item_dir(path, layer)
            if not os.path.isdir(item):
                raise CheckpointError(f"{item} is missing from the converted checkpoint; re-run scripts/convert.py")
            restored = ckptr.restore(item)
            out = {}
            for name in groups.get(layer, []):
                arr = np.asarray(restored.get(_short(name)))
                if arr.shape != specs[name].shape or _dtype_name(arr.dtype) != tensors[name]["dtype"]:
                    raise CheckpointError(
                        f"{item}: {name} is {arr.dtype} {list(arr.shape)} but the marker records "
                        f"{tensors[name]['dtype']} {tensors[name]['shape']}; the folder is corrupt, re-run scripts/convert.py"
                    )
                want = np.dtype(np.float32) if specs[name].float32 else dtype
                out[name] = arr if want is None or arr.dtype == want else arr.astype(want)
            yield layer, out
    finally:
        ckptr.close()
