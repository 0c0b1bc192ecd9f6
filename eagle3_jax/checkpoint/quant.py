"""Host-side (numpy) decoding of the quantized checkpoint formats we load: dequantization to
float32 (int4 pack, block FP8, MXFP4, per-channel FP8), the int4 word -> byte view the on-device
format keeps, and the OCP fp8 -> fnuz conversion MI300-class GPUs need.

Dequantized weights come out as float32: int4 x bf16-scale and fp8 x f32-scale products are exact
in float32 but not in bfloat16, so float32 keeps the load lossless and leaves the single rounding
to the caller's cast to the compute dtype. All functions are vectorized numpy over one matrix.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ..weights.quant import E2M1_VALUES

_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


def fp8_scale_shape(shape: tuple[int, int], block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the `weight_scale_inv` grid for a weight of `shape`: one scale per (partial) block."""
    return (math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1]))


def dequant_fp8_block(
    weight: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int] = (128, 128)
) -> np.ndarray:
    """DeepSeek-V3 / MiniMax-M2 block fp8: `w[o, i] = float(weight[o, i]) * scale_inv[o // bo, i // bi]`.

    `weight` is float8 (e4m3fn or e5m2) [out, in]; `scale_inv` is [ceil(out/bo), ceil(in/bi)] (the
    last block row/column may be partial). Returns float32 [out, in]. Works one block row at a
    time so the transient scale row costs `in` floats, not a full expanded matrix.
    """
    if weight.ndim != 2 or np.dtype(weight.dtype) not in _FP8_DTYPES:
        raise ValueError(f"fp8 block weight must be a 2-D float8 array, got {weight.dtype} {list(weight.shape)}")
    bo, bi = block_size
    want = fp8_scale_shape(weight.shape, block_size)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv has shape {list(scale_inv.shape)} but a {list(weight.shape)} weight with {bo}x{bi} "
            f"blocks needs {list(want)}"
        )
    rows, cols = weight.shape
    out = weight.astype(np.float32)
    col_scales = np.repeat(np.asarray(scale_inv, dtype=np.float32), bi, axis=1)[:, :cols]
    for r in range(want[0]):
        out[r * bo : (r + 1) * bo] *= col_scales[r]
    return out


def int4_packed_shape(shape: tuple[int, int], group_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(weight_packed shape, weight_scale shape) for a logical [out, in] int4 weight."""
    rows, cols = shape
    return (rows, math.ceil(cols / 8)), (rows, math.ceil(cols / group_size))


def dequant_int4_pack(
    packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group_size: int
) -> np.ndarray:
    """compressed-tensors "pack-quantized" symmetric int4 (Kimi-K2.5 routed experts).

    `packed` int32 [out, ceil(in/8)]: nibble j (bits 4j..4j+3) of word k of a row holds element
    8k+j; value = nibble - 8. `scale` [out, ceil(in/group)] (bf16 in Kimi). `shape` is the
    checkpoint's `weight_shape` = [out, in]; padding nibbles past `in` are dropped.
    Returns float32 [out, in] = value * scale[o, i // group].
    """
    rows, cols = int(shape[0]), int(shape[1])
    want_packed, want_scale = int4_packed_shape((rows, cols), group_size)
    if packed.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)) or tuple(packed.shape) != want_packed:
        raise ValueError(
            f"weight_packed is {packed.dtype} {list(packed.shape)} but weight_shape {[rows, cols]} needs int32 {list(want_packed)}"
        )
    if tuple(scale.shape) != want_scale:
        raise ValueError(
            f"weight_scale has shape {list(scale.shape)} but weight_shape {[rows, cols]} with group {group_size} "
            f"needs {list(want_scale)}"
        )
    words = packed.view(np.uint32)
    nibbles = np.empty((rows, want_packed[1], 8), dtype=np.int8)
    for j in range(8):
        nibbles[:, :, j] = (words >> np.uint32(4 * j)) & np.uint32(0xF)
    nibbles -= 8
    out = nibbles.reshape(rows, -1)[:, :cols].astype(np.float32)
    s = np.asarray(scale, dtype=np.float32)
    if cols % group_size == 0:
        grouped = out.reshape(rows, cols // group_size, group_size)  # a view: scales in place
        grouped *= s[:, :, None]
    else:
        out *= np.repeat(s, group_size, axis=1)[:, :cols]
    return out


def fp8_e4m3fn_to_fnuz(weight: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP float8_e4m3fn weights + scales -> float8_e4m3fnuz (AMD gfx942, e.g. MI300X/MI325X).

    The same bit pattern is worth half as much in e4m3fnuz (exponent bias 8 instead of 7), so the
    bits are kept and the scale doubled; 0x80 (-0 in fn, NaN in fnuz) becomes 0x00, and fn's NaN
    patterns (0x7F, 0xFF) become fnuz's NaN 0x80 rather than the finite +-240 they would read as.
    `weight` may be float8_e4m3fn or the raw uint8 bits; the result has the matching kind
    (float8_e4m3fnuz or uint8 bits). Returns (weight, scale * 2) in the scale's dtype.
    """
    s = np.asarray(scale)
    return fnuz_values(weight), s * np.asarray(2, dtype=s.dtype)


def fnuz_values(weight: np.ndarray) -> np.ndarray:
    """The weight half of `fp8_e4m3fn_to_fnuz` (its scale must be doubled separately)."""
    kind = np.dtype(weight.dtype)
    if kind not in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)):
        raise ValueError(f"expected float8_e4m3fn weights or their uint8 bits, got {kind}")
    bits = weight.view(np.uint8)
    out = bits.copy()
    out[bits == 0x80] = 0x00
    out[(bits & 0x7F) == 0x7F] = 0x80
    return out if kind == np.dtype(np.uint8) else out.view(ml_dtypes.float8_e4m3fnuz)


def int4_words_to_bytes(packed: np.ndarray) -> np.ndarray:
    """compressed-tensors int32 words [out, W] (8 little-endian nibbles each) -> uint8 [out, 4W]:
    byte b holds elements 2b (low nibble) and 2b + 1 (high nibble), the on-device int4 layout."""
    words = np.ascontiguousarray(packed)
    return words.astype(words.dtype.newbyteorder("<"), copy=False).view(np.uint8)


def dequant_mxfp4(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """OCP MXFP4 (AMD Quark): `weight` uint8 [out, in/2], element 2b the low nibble of byte b, e2m1
    (bit 3 sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6); `scale` uint8 e8m0 [out, ceil(in/32)],
    2^(byte - 127) (255 is NaN). Returns float32 [out, in]."""
    if weight.dtype != np.uint8 or weight.ndim != 2:
        raise ValueError(f"MXFP4 weight must be uint8 [out, in/2], got {weight.dtype} {list(weight.shape)}")
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    if scale.dtype != np.uint8 or tuple(scale.shape) != (rows, math.ceil(cols / 32)):
        raise ValueError(f"MXFP4 scale must be uint8 {[rows, math.ceil(cols / 32)]}, got {scale.dtype} {list(scale.shape)}")
    nibbles = np.stack([weight & 0xF, weight >> 4], axis=-1).reshape(rows, cols)
    exponents = scale.astype(np.int32) - 127
    s = np.where(scale == 255, np.float32(np.nan), np.ldexp(np.float32(1), exponents)).astype(np.float32)
    return E2M1_VALUES[nibbles] * np.repeat(s, 32, axis=1)[:, :cols]


def dequant_fp8_channel(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-channel FP8 (AMD Quark ptpc_fp8): float8 [out, in] times one float scale per output row
    (`scale` [out] or [out, 1]). Returns float32 [out, in]."""
    if weight.ndim != 2 or np.dtype(weight.dtype) not in _FP8_DTYPES:
        raise ValueError(f"per-channel fp8 weight must be a 2-D float8 array, got {weight.dtype} {list(weight.shape)}")
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.shape != (weight.shape[0],):
        raise ValueError(f"per-channel fp8 scale has {s.size} values for {weight.shape[0]} output rows")
    return weight.astype(np.float32) * s[:, None]
