"""Widen a Llama-family model's attention heads to a larger head_dim without changing what it computes.

Some engines take only certain head widths (vLLM's CPU attention: head_dim 32 to 512), so a small
model with 8-lane heads (the bundled stories260K pair) cannot be served there as it is. Widening
from d to D = f x d lanes (f a power of two) keeps every attention score and output:

- q and k: with HF's rotate-half rotary layout, lane i < d/2 of a head pairs with lane i + d/2 at
  frequency base^(-2i/d). At width D, lane f x i has frequency base^(-2fi/D), the same one, so
  lane i moves to f x i and lane d/2 + i to D/2 + f x i; the other lanes are zero, and add nothing to
  q . k. (Rotary scalings that act per frequency, llama3 and linear, keep this too.)
- the softmax scale falls from d^-1/2 to D^-1/2, so q is multiplied by sqrt(f) (exact when f is a
  power of four; otherwise within a rounding of float32);
- v's d lanes take the first d of the D, and o_proj reads them from there: the zero lanes add zero.

The weights of an EAGLE-3 draft (`midlayer.self_attn.*`) widen the same way. Only the projections'
output rows (q, k, v) and o_proj's input columns change; config.json's `head_dim` is set to D.
`rewrite_hf_folder` applies such a rewrite to a folder, read whole (meant for small models), the
output written beside its place and swapped in complete.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import math
import os
import shutil
from typing import Callable

import numpy as np

from .atomic import atomic_dir

_WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")


def head_lanes(d: int, D: int, rotary: bool) -> np.ndarray:
    """Where each of a head's d lanes goes in the widened D-lane head."""
    if not rotary:
        return np.arange(d)
    f, half = D // d, np.arange(d // 2)
    return np.concatenate([f * half, D // 2 + f * half])


def _widen_rows(w: np.ndarray, heads: int, d: int, D: int, rotary: bool, scale: float = 1.0) -> np.ndarray:
    """A projection's output rows [heads x d, ...] -> [heads x D, ...], each head's lanes moved."""
    out = np.zeros((heads, D) + w.shape[1:], w.dtype)
    out[:, head_lanes(d, D, rotary)] = w.reshape((heads, d) + w.shape[1:]) * np.asarray(scale, w.dtype)
    return out.reshape((heads * D,) + w.shape[1:])


def _widen_columns(w: np.ndarray, heads: int, d: int, D: int) -> np.ndarray:
    """o_proj's input columns [..., heads x d] -> [..., heads x D], each head's d lanes first."""
    out = np.zeros(w.shape[:-1] + (heads, D), w.dtype)
    out[..., :d] = w.reshape(w.shape[:-1] + (heads, d))
    return out.reshape(w.shape[:-1] + (heads * D,))


def widen_tensors(tensors: dict[str, np.ndarray], config: dict, head_dim: int) -> dict[str, np.ndarray]:
    """HF tensors of a Llama-family model or EAGLE-3 draft with heads of `config`'s head_dim -> the
    same with heads of `head_dim` lanes (see the module's docstring)."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = int(config.get("head_dim") or config["hidden_size"] // heads)
    f = head_dim // d
    if head_dim <= d or head_dim % d or f & (f - 1) or d % 2:
        raise ValueError(f"head_dim {head_dim} is not a power-of-two multiple of the model's even head_dim {d}; "
                         f"choose {2 * d}, {4 * d}, ...")
    widened = {}
    for key, w in tensors.items():
        proj = key.rsplit(".", 2)[-2] if key.endswith((".weight", ".bias")) and ".self_attn." in key else None
        if proj in ("q_proj", "k_proj"):
            n = heads if proj == "q_proj" else kv_heads
            w = _widen_rows(w, n, d, head_dim, rotary=True, scale=math.sqrt(f) if proj == "q_proj" else 1.0)
        elif proj == "v_proj":
            w = _widen_rows(w, kv_heads, d, head_dim, rotary=False)
        elif proj == "o_proj" and key.endswith(".weight"):
            w = _widen_columns(w, heads, d, head_dim)
        widened[key] = w
    return widened


def widened(tensors: dict[str, np.ndarray], config: dict, head_dim: int) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, config.json dict) -> the same model with heads of `head_dim` lanes."""
    return widen_tensors(tensors, config, head_dim), {**config, "head_dim": head_dim}


Rewrite = Callable[[dict[str, np.ndarray], dict], tuple[dict[str, np.ndarray], dict]]


def rewrite_hf_folder(src: str | os.PathLike, out: str | os.PathLike, rewrite: Rewrite, *,
                      overwrite: bool = False) -> str:
    """Write `src` (an HF folder: config.json + safetensors, read whole) to `out` with its tensors and
    config as `rewrite(tensors, config)` returns them, in one model.safetensors, every other file
    copied. Returns `out`'s absolute path."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = os.fspath(src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors, metadata = {}, None
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        with safe_open(path, "np") as f:
            metadata = metadata or f.metadata()
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    if not tensors:
        raise ValueError(f"{src} holds no .safetensors files")
    tensors, config = rewrite(tensors, config)
    with atomic_dir(out, "rewritten model folder", overwrite=overwrite, inputs={"the source folder": src}) as tmp:
        for name in os.listdir(src):
            path = os.path.join(src, name)
            if os.path.isfile(path) and not any(fnmatch.fnmatch(name, p) for p in _WEIGHT_FILES):
                shutil.copyfile(path, os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata=metadata)
    return os.path.abspath(out)


def widen_head_dim(src: str | os.PathLike, out: str | os.PathLike, head_dim: int, *, overwrite: bool = False) -> str:
    """Write `src` with its heads widened to `head_dim` lanes to `out` (`rewrite_hf_folder`)."""
    return rewrite_hf_folder(src, out, lambda tensors, config: widened(tensors, config, head_dim), overwrite=overwrite)
