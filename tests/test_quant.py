"""Dequantization (int4 pack-quantized, block fp8) and the fp8 e4m3fn -> e4m3fnuz conversion,
each checked exactly against an independent decoding written here."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from eagle3_jax.checkpoint.quant import dequant_fp8_block, dequant_int4_pack, fp8_e4m3fn_to_fnuz


def _pack_int4_loop(values: np.ndarray) -> np.ndarray:
    """Reference packer, element by element: value v in [-8, 7] of column c goes to word c // 8 at
    bits 4 * (c % 8) as the unsigned nibble v + 8; words are read as little-endian int32."""
    rows, cols = values.shape
    words = math.ceil(cols / 8)
    out = np.zeros((rows, words), dtype=np.int64)
    for r in range(rows):
        for c in range(cols):
            out[r, c // 8] |= (int(values[r, c]) + 8) << (4 * (c % 8))
    return np.where(out >= 2**31, out - 2**32, out).astype(np.int32)


def _decode_int4_loop(values: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    rows, cols = values.shape
    out = np.zeros((rows, cols), dtype=np.float32)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = np.float32(values[r, c]) * np.float32(scale[r, c // group])
    return out


@pytest.mark.parametrize("rows,cols,group", [(3, 64, 32), (5, 77, 32), (4, 13, 8), (2, 40, 16), (7, 8, 32)])
def test_int4_matches_loop_decoder(rows, cols, group):
    rng = np.random.default_rng(rows * 100 + cols)
    values = rng.integers(-8, 8, size=(rows, cols))
    values[0, : min(cols, 16)] = np.arange(-8, 8)[: min(cols, 16)]  # every nibble value appears
    scale = (rng.standard_normal((rows, math.ceil(cols / group))) * 0.05).astype(ml_dtypes.bfloat16)
    packed = _pack_int4_loop(values)
    got = dequant_int4_pack(packed, scale, (rows, cols), group)
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    np.testing.assert_array_equal(got, _decode_int4_loop(values, scale, group))


def test_int4_sign_bit_words():
    # nibble 7 = 15 (value +7) sets bit 31: the word is negative as int32 and must still decode.
    values = np.full((1, 8), 7)
    packed = _pack_int4_loop(values)
    assert packed[0, 0] < 0
    got = dequant_int4_pack(packed, np.ones((1, 1), ml_dtypes.bfloat16), (1, 8), 32)
    np.testing.assert_array_equal(got, np.full((1, 8), 7.0, np.float32))


def test_int4_rejects_inconsistent_shapes():
    packed = np.zeros((4, 2), np.int32)
    with pytest.raises(ValueError, match="weight_packed"):
        dequant_int4_pack(packed, np.ones((4, 1), np.float32), (4, 17), 32)  # needs 3 words
    with pytest.raises(ValueError, match="weight_scale"):
        dequant_int4_pack(packed, np.ones((4, 2), np.float32), (4, 16), 32)  # needs 1 group


def _random_fp8(rng, shape) -> np.ndarray:
    bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x3C  # no NaN patterns
    return bits.view(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1), (7, 130)])
def test_fp8_block_matches_blockwise_reference(shape):
    rng = np.random.default_rng(shape[0])
    w = _random_fp8(rng, shape)
    sshape = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    scale = rng.uniform(1e-4, 1e-2, size=sshape).astype(np.float32)
    want = np.zeros(shape, np.float32)
    for bo in range(sshape[0]):
        for bi in range(sshape[1]):
            block = (slice(bo * 128, (bo + 1) * 128), slice(bi * 128, (bi + 1) * 128))
            want[block] = w[block].astype(np.float32) * scale[bo, bi]
    got = dequant_fp8_block(w, scale)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_fp8_block_elementwise_small_blocks():
    rng = np.random.default_rng(3)
    w = _random_fp8(rng, (5, 7))
    scale = rng.uniform(0.5, 2.0, size=(3, 3)).astype(np.float32)
    got = dequant_fp8_block(w, scale, block_size=(2, 3))
    for o in range(5):
        for i in range(7):
            assert got[o, i] == np.float32(float(w[o, i])) * scale[o // 2, i // 3]


def test_fp8_block_rejects_bad_scale_and_dtype():
    w = np.zeros((130, 10), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"needs \[2, 1\]"):
        dequant_fp8_block(w, np.ones((1, 1), np.float32))
    with pytest.raises(ValueError, match="float8"):
        dequant_fp8_block(np.zeros((4, 4), np.float32), np.ones((1, 1), np.float32))


def test_fnuz_conversion_all_bit_patterns():
    bits = np.arange(256, dtype=np.uint8)
    fn = bits.view(ml_dtypes.float8_e4m3fn)
    scale = np.array([0.375, 3.0], np.float32)
    fnuz, new_scale = fp8_e4m3fn_to_fnuz(fn, scale)
    assert fnuz.dtype == np.dtype(ml_dtypes.float8_e4m3fnuz)
    np.testing.assert_array_equal(new_scale, scale * 2)
    out_bits = fnuz.view(np.uint8)
    assert out_bits[0x80] == 0x00  # -0 -> +0 (0x80 is NaN in fnuz)
    a, b = fn.astype(np.float32), fnuz.astype(np.float32)
    finite = ~np.isnan(a)
    # Same bits, half the value: the doubled scale restores every finite weight exactly.
    np.testing.assert_array_equal(b[finite] * 2, a[finite])
    assert np.isnan(b[~finite]).all() and (~finite).sum() == 2
    # Only 0x80 and the two NaN patterns change bits.
    changed = np.nonzero(out_bits != bits)[0].tolist()
    assert changed == [0x7F, 0x80, 0xFF]


def test_fnuz_conversion_uint8_bits_and_bf16_scale():
    bits = np.array([[0x00, 0x80, 0x38, 0xB8]], np.uint8)
    out, s = fp8_e4m3fn_to_fnuz(bits, np.array([1.5], ml_dtypes.bfloat16))
    assert out.dtype == np.uint8 and out.tolist() == [[0x00, 0x00, 0x38, 0xB8]]
    assert s.dtype == np.dtype(ml_dtypes.bfloat16) and float(s[0]) == 3.0
    assert bits.tolist() == [[0x00, 0x80, 0x38, 0xB8]]  # input untouched
    with pytest.raises(ValueError, match="e4m3fn"):
        fp8_e4m3fn_to_fnuz(np.zeros(3, np.float32), np.ones(1, np.float32))
