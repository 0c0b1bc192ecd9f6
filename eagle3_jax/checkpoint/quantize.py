"""Quantize float weights into the real checkpoint layouts (round-to-nearest), for making quantized
copies of models trained here (`scripts/quantize.py`) and quantized test models.

Each encoder takes an HF-orientation float matrix [out, in] and returns the tensors a published
checkpoint of that format ships for it (the suffixes after `<module>.`), so the files written
load through the same reader as a downloaded checkpoint:

- int4 (compressed-tensors pack-quantized, symmetric, group g): `weight_packed` int32 [out, in/8]
  (8 nibbles per little-endian word, value + 8), `weight_scale` bf16 [out, in/g], `weight_shape`;
- fp8_block (DeepSeek-V3): `weight` float8_e4m3fn, `weight_scale_inv` float32 per 128x128 block;
- mxfp4 (AMD Quark OCP MX): `weight` uint8 [out, in/2] (low nibble = even element, e2m1),
  `weight_scale` uint8 e8m0 [out, in/32];
- fp8_channel (AMD Quark ptpc_fp8): `weight` float8_e4m3fn, `weight_scale` float32 [out].
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ..weights.quant import E2M1_VALUES

FP8_MAX = 448.0
METHODS = ("int4_pack", "fp8_block", "mxfp4", "fp8_channel")


def _group_absmax(w: np.ndarray, group: int) -> np.ndarray:
    rows, cols = w.shape
    padded = np.zeros((rows, math.ceil(cols / group) * group), np.float32)
    padded[:, :cols] = np.abs(w)
    return padded.reshape(rows, -1, group).max(-1)


def encode_int4(w: np.ndarray, group: int = 32) -> dict[str, np.ndarray]:
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    scale = (np.maximum(_group_absmax(w, group), 1e-8) / 7.0).astype(ml_dtypes.bfloat16)
    s = np.repeat(scale.astype(np.float32), group, axis=1)[:, :cols]
    q = np.clip(np.round(w / s), -8, 7).astype(np.int64) + 8
    padded = np.zeros((rows, math.ceil(cols / 8) * 8), np.uint64)
    padded[:, :cols] = q
    words = np.zeros((rows, padded.shape[1] // 8), np.uint64)
    for j in range(8):
        words |= padded[:, j::8] << np.uint64(4 * j)
    return {"weight_packed": words.astype(np.uint32).view(np.int32), "weight_scale": scale,
            "weight_shape": np.array([rows, cols], np.int32)}


def encode_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> dict[str, np.ndarray]:
    w = np.asarray(w, np.float32)
    bo, bi = block
    rows, cols = w.shape
    padded = np.zeros((math.ceil(rows / bo) * bo, math.ceil(cols / bi) * bi), np.float32)
    padded[:rows, :cols] = np.abs(w)
    absmax = padded.reshape(padded.shape[0] // bo, bo, -1, bi).max(axis=(1, 3))
    scale = (np.maximum(absmax, 1e-8) / FP8_MAX).astype(np.float32)
    full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:rows, :cols]
    return {"weight": (w / full).astype(ml_dtypes.float8_e4m3fn), "weight_scale_inv": scale}


def encode_mxfp4(w: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"MXFP4 packs two elements per byte; the input dimension {cols} is odd")
    absmax = np.maximum(_group_absmax(w, 32), 2.0 ** -126)
    exponent = np.clip(np.floor(np.log2(absmax)) - 2, -127, 127).astype(np.int32)  # e2m1 max is 6 = 1.5 * 2^2
    scale = np.ldexp(np.float32(1), np.repeat(exponent, 32, axis=1)[:, :cols])
    x = w / scale
    magnitudes = E2M1_VALUES[:8]
    index = np.abs(np.abs(x)[..., None] - magnitudes).argmin(-1)
    nibble = (index | np.where(x < 0, 8, 0)).astype(np.uint8)
    return {"weight": (nibble[:, 0::2] | (nibble[:, 1::2] << 4)).astype(np.uint8),
            "weight_scale": (exponent + 127).astype(np.uint8)}


def encode_fp8_channel(w: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(w, np.float32)
    scale = (np.maximum(np.abs(w).max(axis=1), 1e-8) / FP8_MAX).astype(np.float32)
    return {"weight": (w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn), "weight_scale": scale}


def encode(w: np.ndarray, method: str, group_size: int = 32) -> dict[str, np.ndarray]:
    """The checkpoint tensors (suffix -> array) of one [out, in] weight quantized by `method`."""
    if method == "int4_pack":
        return encode_int4(w, group_size)
    if method == "fp8_block":
        return encode_fp8_block(w)
    if method == "mxfp4":
        return encode_mxfp4(w)
    if method == "fp8_channel":
        return encode_fp8_channel(w)
    raise ValueError(f"cannot quantize to {method!r}; supported: {', '.join(METHODS)}")


def quantization_config(method: str, ignore: tuple[str, ...] = (), group_size: int = 32) -> dict:
    """The config.json `quantization_config` a checkpoint of this format ships."""
    if method == "int4_pack":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                   "dynamic": False, "actorder": None, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
                "ignore": list(ignore)}
    if method == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": list(ignore)}
    if method == "mxfp4":
        spec = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "ch_axis": -1}
        return {"quant_method": "quark", "global_quant_config": {"weight": dict(spec, is_dynamic=False),
                                                                  "input_tensors": dict(spec, is_dynamic=True)},
                "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": list(ignore),
                "export": {"pack_method": "reorder", "weight_format": "real_quantized"}}
    if method == "fp8_channel":
        return {"quant_method": "quark", "global_quant_config": {
            "weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False},
            "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 1, "is_dynamic": True}},
            "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": list(ignore),
            "export": {"pack_method": "reorder", "weight_format": "real_quantized"}}
    raise ValueError(f"cannot quantize to {method!r}; supported: {', '.join(METHODS)}")
