"""Write a target in the HF safetensors layout (the inverse of the reader), e.g. for models trained here.

Keys are the family's canonical spelling (`keymap.canonical_hf_key`), matrices go back to HF's
[out, in] orientation and stacked experts back to one tensor per expert, so transformers,
vLLM, SGLang and `e3.load_target` all read the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import numpy as np

from ..config.model import ModelConfig
from ..weights import keymap
from ..weights.params import flat_specs
from . import quantize
from .atomic import atomic_dir


def hf_tensors(flat: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Flat float params -> {HF key: array}. With `cfg.quant` set, the linear weights it covers are
    quantized (round-to-nearest, `quantize.encode`) into that format's checkpoint tensors."""
    specs = flat_specs(cfg)
    out: dict[str, np.ndarray] = {}

    def put(key: str, matrix: np.ndarray, name: str) -> None:
        if specs[name].quant is None:
            out[key] = np.ascontiguousarray(matrix)
            return
        base = key[: -len("weight")]
        for suffix, tensor in quantize.encode(matrix, cfg.quant.method, cfg.quant.group_size).items():
            out[base + suffix] = tensor

    for name, arr in flat.items():
        arr = np.asarray(arr)
        parts = name.split(".")
        if len(parts) == 3 and parts[2].startswith("experts_"):
            for e in range(arr.shape[0]):
                put(keymap.expert_hf_key(cfg, int(parts[1]), parts[2], e), arr[e].T, name)
            continue
        key = keymap.canonical_hf_key(name, cfg)
        transpose = arr.ndim == 2 and name != "embed"
        put(key, arr.T if transpose else arr, name)
    return out


def save_hf_target(out_dir: str, flat: dict[str, np.ndarray], cfg: ModelConfig, config_json: dict,
                   extra_files: dict[str, str] | None = None, *, overwrite: bool = False,
                   inputs: dict[str, str] | None = None) -> str:
    """Write config.json + model.safetensors (+ copies of `extra_files`: name -> source path) atomically.

    An existing `out_dir` (not empty) is replaced only with `overwrite`; an `out_dir` equal to,
    inside or containing one of `inputs` (name -> path) or an extra file's folder never is.
    """
    from safetensors.numpy import save_file

    with _hf_folder(out_dir, config_json, extra_files, overwrite, inputs) as tmp:
        save_file(hf_tensors(flat, cfg), os.path.join(tmp, "model.safetensors"))
    return os.path.abspath(out_dir)


@contextlib.contextmanager
def _hf_folder(out_dir: str, config_json: dict, extra_files: dict[str, str] | None, overwrite: bool,
               inputs: dict[str, str] | None = None):
    """A folder swapped in at `out_dir` once the block ends, holding config.json and copies of
    `extra_files` (name -> source path); the block writes the weights into it."""
    sources = {f"the source of {name}": os.path.dirname(os.path.abspath(src)) for name, src in (extra_files or {}).items()}
    with atomic_dir(out_dir, "HF model folder", overwrite=overwrite, inputs={**sources, **(inputs or {})}) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2, sort_keys=True)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
        yield tmp


def _random_hf_tensors(cfg: ModelConfig, seed: int, dtype: str):
    """(HF key, random tensor) one at a time, in HF orientation: norms ones, other floats N(0, 0.02)
    in `dtype` (float32 where the model keeps them so), quantized weights in their checkpoint format (`quantize.encode`).

    Encoding every routed expert (Kimi-K2.5: 384 x 3 per layer, seconds each) would take an hour, so
    one random matrix per expert shape is encoded and each expert stores a row rotation of it:
    valid encodings, distinct per expert, which is all a start-up or memory measurement needs.
    """
    import ml_dtypes

    rng = np.random.default_rng(seed)
    specs = flat_specs(cfg)
    floats = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]

    def random_float(shape: tuple[int, ...], dtype) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(dtype)

    def encoded(matrix: np.ndarray) -> dict[str, np.ndarray]:
        return quantize.encode(matrix, cfg.quant.method, cfg.quant.group_size)

    for name, spec in specs.items():
        parts = name.split(".")
        if name.endswith("norm"):
            yield keymap.canonical_hf_key(name, cfg), np.ones(spec.shape, np.float32 if spec.float32 else floats)
        elif len(parts) == 3 and parts[2].startswith("experts_"):
            num_experts, hf_shape = spec.shape[0], spec.shape[:0:-1]  # [E, in, out] -> each [out, in]
            shared = encoded(random_float(hf_shape, np.float32)) if spec.quant is not None else None
            for e in range(num_experts):
                base = keymap.expert_hf_key(cfg, int(parts[1]), parts[2], e)
                if shared is None:
                    yield base, random_float(hf_shape, floats)
                    continue
                shift = int(rng.integers(hf_shape[0]))
                for suffix, tensor in shared.items():
                    rows = tensor.shape[0] if tensor.ndim == 2 else 0
                    yield base[: -len("weight")] + suffix, np.roll(tensor, shift % rows, 0) if rows else tensor
        else:
            key = keymap.canonical_hf_key(name, cfg)
            hf_shape = spec.shape[::-1] if len(spec.shape) == 2 and name != "embed" else spec.shape
            matrix = random_float(hf_shape, np.float32 if spec.float32 or spec.quant is not None else floats)
            if spec.quant is None:
                yield key, matrix
            else:
                for suffix, tensor in encoded(matrix).items():
                    yield key[: -len("weight")] + suffix, tensor


def save_random_hf_target(out_dir: str, cfg: ModelConfig, config_json: dict, extra_files: dict[str, str] | None = None,
                          *, dtype: str = "bfloat16", seed: int = 0, shard_bytes: int = 2 << 30,
                          overwrite: bool = False) -> dict[str, int]:
    """Write config.json + random weights (`_random_hf_tensors`) as safetensors shards of about
    `shard_bytes` with their index, atomically, holding one shard in memory at a time: a model
    whose weights cannot be had here (Kimi-K2.5 cut to a few layers) for start-up and memory
    measurements. Returns {"tensors": ..., "bytes": ..., "shards": ...}."""
    from safetensors.numpy import save_file

    with _hf_folder(out_dir, config_json, extra_files, overwrite) as tmp:
        shards: list[dict[str, np.ndarray]] = []
        weight_map: dict[str, int] = {}
        shard: dict[str, np.ndarray] = {}
        total = held = 0

        def flush() -> None:
            nonlocal shard, held
            save_file(shard, os.path.join(tmp, f"part-{len(shards)}.safetensors"))
            shards.append(dict.fromkeys(shard))  # names only: the arrays are freed
            shard, held = {}, 0

        for key, tensor in _random_hf_tensors(cfg, seed, dtype):
            if shard and held + tensor.nbytes > shard_bytes:
                flush()
            shard[key] = np.ascontiguousarray(tensor)
            weight_map[key] = len(shards)
            held += tensor.nbytes
            total += tensor.nbytes
        flush()
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for i, name in enumerate(names):
            os.replace(os.path.join(tmp, f"part-{i}.safetensors"), os.path.join(tmp, name))
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return {"tensors": len(weight_map), "bytes": total, "shards": len(shards)}
