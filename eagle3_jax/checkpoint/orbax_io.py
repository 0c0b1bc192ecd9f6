"""Our converted checkpoint format: Orbax items, one per layer, plus a completion marker.

Layout of a converted folder:

    config.json (+ tokenizer / generation files copied from the HF folder)
    globals/            Orbax item {embed, final_norm, lm_head?}
    layers/<i>/         Orbax item {attn_norm, q_proj, ..., experts_gate, ...} of layer i
    eagle3_complete.json  written last: format tag, dtype, every tensor's shape and dtype

Quantized weights (see weights/quant.py) stay quantized: the item holds `{"values", "scales"}` for them
(float8 values as their uint8 bits) and the marker records their format, so a converted
Kimi-K2.5 keeps its int4 experts (~0.6 TB, not ~2 TB in bf16).

One item per layer keeps conversion and loading memory bounded to a layer. Conversion writes
into `<out_dir>.partial` and renames it into place only after the marker is written, so a
crash or interrupt never leaves a folder `is_orbax_dir` accepts; the partial folder records
which items are complete (`progress.json`), and re-running the same conversion resumes after
them. Tensors are stored exactly as the HF reader produces them, so HF -> Orbax -> read is
bit-identical to reading HF directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from ..config.model import ModelConfig
from ..weights.params import ParamSpec, flat_specs
from ..weights.quant import QArray, QFormat, dequantize
from . import quant as host_quant
from .atomic import check_output, clean_leftovers, swap_in
from .errors import CheckpointError
from .hf_loader import Plan, build_param, layer_of, plan_hf, resolve_dtype
from .safetensors_io import open_hf_checkpoint

MARKER = "eagle3_complete.json"
FORMAT = "eagle3-jax-orbax"
VERSION = 2
PROGRESS = "progress.json"
_WEIGHT_MARKERS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_MAX_AUX_BYTES = 64 * 1024 * 1024


def is_orbax_dir(path: str | os.PathLike) -> bool:
    """True only for a complete converted folder (its completion marker is present and valid)."""
    try:
        return _read_marker(os.fspath(path))["format"] == FORMAT
    except (OSError, ValueError, KeyError, TypeError):
        return False


def keeps_quantized(path: str | os.PathLike) -> bool:
    """Whether a complete converted folder holds quantized weights (False: converted dequantized)."""
    return bool(_read_marker(os.fspath(path)).get("quantization"))


def looks_like_partial_orbax(path: str | os.PathLike) -> bool:
    """A folder that holds Orbax conversion output but no completion marker."""
    p = os.fspath(path)
    if not os.path.isdir(p) or os.path.exists(os.path.join(p, MARKER)):
        return False
    return ".partial" in os.path.basename(os.path.normpath(p)) or any(
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
    _write_json(os.path.join(root, MARKER), marker)


def _dtype_name(d: np.dtype) -> str:
    return np.dtype(d).name


def _quant_entry(q: QFormat) -> dict[str, Any]:
    return {"format": q.fmt, "block": list(q.block), "scale_dtype": q.scale_dtype}


def _stored_item(arr) -> Any:
    """What goes into the Orbax item for one parameter; quantized values (all one byte wide) as
    uint8 bits, which every storage backend keeps."""
    if isinstance(arr, QArray):
        return {"values": np.asarray(arr.values).view(np.uint8), "scales": np.asarray(arr.scales)}
    return arr


def _tensor_entry(arr) -> tuple[dict[str, Any], int]:
    if isinstance(arr, QArray):
        return {"shape": list(arr.shape), "dtype": "quantized", "quant": _quant_entry(arr.qformat)}, int(arr.nbytes)
    return {"shape": list(arr.shape), "dtype": _dtype_name(arr.dtype)}, int(arr.nbytes)


def _fingerprint(hf_dir: str, cfg: ModelConfig, dtype: np.dtype | None) -> str:
    """Identifies one conversion (source folder, config, dtype), so only the same one resumes."""
    text = json.dumps([os.path.abspath(hf_dir), repr(cfg), None if dtype is None else _dtype_name(dtype), VERSION])
    return hashlib.sha256(text.encode()).hexdigest()


def save_orbax(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    cfg: ModelConfig,
    progress: bool = True,
    dtype: str | np.dtype | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert an HF safetensors folder to our Orbax format, one layer at a time, atomically.

    Weights `cfg` keeps quantized (`ParamSpec.quant`; all of the checkpoint's quantized weights
    unless `cfg.quant.resident` is False) are written in their quantized format. `dtype` None keeps
    the other tensors exactly as `read_flat_params(hf_dir, cfg)` returns them; "bfloat16" /
    "float16" / "float32" casts every float tensor except the float32 router params (dequantized
    weights are float32, so use bfloat16 when dequantizing). An interrupted conversion resumes
    where it stopped when run again with the same arguments. Returns the completion marker (a
    summary: tensors, dtype, bytes).
    """
    from tqdm.auto import tqdm

    hf_dir, out_dir = os.fspath(hf_dir), os.path.abspath(os.fspath(out_dir))
    out_dtype = resolve_dtype(dtype)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"no config.json in {hf_dir}; pass the HF model folder (config.json + safetensors)")
    check_output(out_dir, name="output folder", overwrite=overwrite, inputs={"HF folder": hf_dir})
    if cfg.quant is not None and cfg.quant.fnuz:
        raise CheckpointError("converted checkpoints store OCP float8 (e4m3fn); fnuz is chosen when loading, not converting")
    plan = plan_hf(open_hf_checkpoint(hf_dir), cfg)  # validate before writing anything
    partial = f"{out_dir}.partial"
    done = _resume_state(partial, _fingerprint(hf_dir, cfg, out_dtype))
    tensors, nbytes = _write_items(plan, partial, out_dtype, progress, tqdm, done)
    aux = _copy_aux_files(hf_dir, partial)
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "model_type": cfg.model_type,
        "num_layers": cfg.num_layers,
        "dtype": None if out_dtype is None else _dtype_name(out_dtype),
        "quantization": None if cfg.quant is None or not cfg.quant.resident else cfg.quant.method,
        "source": os.path.abspath(hf_dir),
        "num_bytes": nbytes,
        "aux_files": aux,
        "tensors": tensors,
    }
    _write_marker(partial, marker)
    os.remove(os.path.join(partial, PROGRESS))
    _swap_into_place(partial, out_dir)
    return marker


def _resume_state(partial: str, fingerprint: str) -> dict[str, Any]:
    """The progress record of an earlier run of the same conversion, or a fresh partial folder."""
    path = os.path.join(partial, PROGRESS)
    try:
        with open(path) as f:
            state = json.load(f)
        if state.get("fingerprint") == fingerprint and isinstance(state.get("items"), dict):
            return state
    except (OSError, ValueError):
        pass
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.join(partial, "layers"))
    state = {"fingerprint": fingerprint, "items": {}}
    _write_json(path, state)
    return state


def _write_items(plan: Plan, root: str, dtype: np.dtype | None, progress: bool, tqdm: Any,
                 state: dict[str, Any]) -> tuple[dict, int]:
    """Write every layer item not already recorded in `state` (which is updated after each)."""
    items: dict[str, dict] = state["items"]
    groups = plan.groups()
    ckptr = _checkpointer()
    try:
        with tqdm(total=len(groups), desc="convert", unit="layer", disable=not progress) as bar:
            bar.update(sum(1 for layer, _ in groups if _item_key(layer) in items))
            for layer, names in groups:
                if _item_key(layer) in items:
                    continue
                bar.set_postfix_str("globals" if layer is None else f"layer {layer}")
                tree, entries = {}, {}
                for name in names:
                    arr = build_param(plan, name, dtype)
                    tree[_short(name)] = _stored_item(arr)
                    entries[name] = _tensor_entry(arr)
                item = _item_dir(root, layer)
                shutil.rmtree(item, ignore_errors=True)  # a half-written item of an interrupted run
                _save_item(ckptr, item, tree)
                del tree
                items[_item_key(layer)] = {n: e for n, (e, _) in entries.items()} | {
                    "__bytes__": sum(b for _, b in entries.values())}
                _write_json(os.path.join(root, PROGRESS), state)
                bar.update(1)
    finally:
        ckptr.close()
    tensors = {n: e for item in items.values() for n, e in item.items() if n != "__bytes__"}
    return tensors, sum(item["__bytes__"] for item in items.values())


def _item_key(layer: int | None) -> str:
    return "globals" if layer is None else f"layers/{layer}"


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _swap_into_place(partial: str, out_dir: str) -> None:
    """Rename the finished folder into place; an existing out_dir (overwrite) is moved aside
    first and deleted only after the new one is in place (`atomic`'s swap)."""
    clean_leftovers(out_dir)
    swap_in(partial, out_dir)


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
    problems += [_quant_mismatch(n, tensors[n], s) for n, s in specs.items() if n in tensors]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(
            f"converted checkpoint {path} does not match the {cfg.model_type} config ({len(problems)} problem(s)): "
            + "; ".join(problems[:25])
            + ". Load it with the config.json it was converted with, or re-convert with scripts/convert.py"
        )
    return tensors


def _quant_mismatch(name: str, entry: dict[str, Any], spec: ParamSpec) -> str:
    """Why a stored tensor cannot become the (quantized) parameter `spec` describes; "" if it can.
    An unquantized spec takes anything: quantized entries are dequantized on restore."""
    if spec.quant is None:
        return ""
    stored = entry.get("quant")
    if stored is None:
        return (f"tensor {name} is stored unquantized but config.json's quantization_config keeps it {spec.quant.fmt} "
                "(it was converted with dequantization); load with dequantize=True or re-convert")
    want = _quant_entry(spec.quant)  # fnuz is a load-time choice, not part of the stored format
    return "" if stored == want else f"tensor {name} is stored as {stored} but config.json implies {want}"


def _restored(arr_or_item, spec: ParamSpec, entry: dict[str, Any], dtype: np.dtype | None, where: str):
    """One restored parameter: a QArray (kept quantized, fnuz applied when asked), or a float array
    (dequantized when the spec is not quantized but the folder is)."""
    if entry.get("quant") is None:
        arr = np.asarray(arr_or_item)
        if arr.shape != spec.shape or _dtype_name(arr.dtype) != entry["dtype"]:
            raise CheckpointError(
                f"{where}: {arr.dtype} {list(arr.shape)} but the marker records {entry['dtype']} {entry['shape']}; "
                "the folder is corrupt, re-run scripts/convert.py")
        want = np.dtype(np.float32) if spec.float32 else dtype
        return arr if want is None or arr.dtype == want else arr.astype(want)
    stored = QFormat(entry["quant"]["format"], tuple(entry["quant"]["block"]), entry["quant"]["scale_dtype"])
    fmt = spec.quant or stored
    values = np.asarray(arr_or_item["values"])
    scales = np.asarray(arr_or_item["scales"])
    if values.shape != stored.values_shape(spec.shape) or scales.shape != stored.scales_shape(spec.shape):
        raise CheckpointError(
            f"{where}: quantized parts {list(values.shape)} / {list(scales.shape)} do not fit a {stored.fmt} weight "
            f"{list(spec.shape)}; the folder is corrupt, re-run scripts/convert.py")
    if stored.fmt.startswith("fp8"):
        values = values.view(ml_dtypes.float8_e4m3fn)
    if spec.quant is None:
        full = np.asarray(dequantize(QArray(values, scales, stored)))
        return full if dtype is None else full.astype(dtype)
    if fmt.fnuz:
        values, scales = host_quant.fp8_e4m3fn_to_fnuz(values, scales)
    return QArray(values, scales, fmt)


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
                out[name] = _restored(restored.get(_short(name)), specs[name], tensors[name], dtype, f"{item}: {name}")
            yield layer, out
    finally:
        ckptr.close()
