"""Write a target in the HF safetensors layout (the inverse of the reader), e.g. for models trained here.

Keys are the family's canonical spelling (`keymap.canonical_hf_key`), matrices go back to HF's
[out, in] orientation and stacked experts back to one tensor per expert, so transformers,
vLLM, SGLang and `e3.load_target` all read the folder.
"""

from __future__ import annotations

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

    sources = {f"the source of {name}": os.path.dirname(os.path.abspath(src)) for name, src in (extra_files or {}).items()}
    with atomic_dir(out_dir, "HF model folder", overwrite=overwrite, inputs={**sources, **(inputs or {})}) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2, sort_keys=True)
        save_file(hf_tensors(flat, cfg), os.path.join(tmp, "model.safetensors"))
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, os.path.join(tmp, name))
    return os.path.abspath(out_dir)
