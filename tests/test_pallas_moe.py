"""The grouped expert kernels (Pallas, interpret mode on CPU) against their XLA references: every
weight format (float, int4, MXFP4, block and per-channel FP8 in e4m3fn and e4m3fnuz, W4A8), the
fused gate/up + SiLU, empty experts, groups not a multiple of the row tile, padding rows past the
groups, the decode form (many experts, few rows), float32 and bfloat16 activations; the in-kernel
element decoders over every bit pattern; deviceless lowering for ROCm and CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from moe_cases import FORMATS, SIZES, case, close, make_weight

from eagle3_jax.weights.quant import E2M1_VALUES, QArray, QFormat, decode_scales
from pallas_kernels import launch
from pallas_kernels.moe import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_swiglu,
    grouped_swiglu_reference,
    tile_plan,
)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_matmul_equals_reference(fmt, dtype):
    _, x, w, sizes = case(fmt, dtype)
    got = grouped_matmul(x, w, sizes, interpret=True)
    close(got, grouped_matmul_reference(x, w, sizes), dtype)
    assert got.dtype == jnp.float32 and not np.asarray(got)[sum(SIZES):].any()


@pytest.mark.parametrize("fmt", ["float", "int4", "mxfp4", "fp8_block_fnuz", "w4a8"])
def test_grouped_swiglu_equals_reference(fmt):
    dtype = jnp.bfloat16
    rng, x, w_gate, sizes = case(fmt, dtype)
    w_up = make_weight(rng, fmt, len(SIZES), *w_gate.shape[1:])
    w_up = w_up.astype(dtype) if fmt == "float" else w_up
    got = grouped_swiglu(x, w_gate, w_up, sizes, interpret=True)
    assert got.dtype == dtype
    close(got, grouped_swiglu_reference(x, w_gate, w_up, sizes), dtype)
    assert not np.asarray(got, np.float32)[sum(SIZES):].any()


def test_decode_form_launches_tiles_per_assignment_not_per_expert():
    """384 experts, 3 routed rows: 3 row tiles, each reading one routed expert."""
    sizes = np.zeros(384, np.int32)
    sizes[[7, 200, 383]] = 1
    _, x, w, sizes = case("int4", jnp.bfloat16, sizes=list(sizes), pad_rows=1)
    expert, first, _, count = tile_plan(sizes, x.shape[0], 16)
    assert count == 4 and list(np.asarray(expert)) == [7, 200, 383, 384]
    close(grouped_matmul(x, w, sizes, interpret=True), grouped_matmul_reference(x, w, sizes), jnp.bfloat16)


def test_element_decoders_cover_every_bit_pattern():
    bits = jnp.arange(256, dtype=jnp.int32)
    for fnuz, dt in ((False, ml_dtypes.float8_e4m3fn), (True, ml_dtypes.float8_e4m3fnuz)):
        want = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
        got = np.asarray(decode_e4m3(bits, fnuz))
        np.testing.assert_array_equal(got, want)
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # -0.0 where the format has it
    np.testing.assert_array_equal(np.asarray(decode_e2m1(jnp.arange(16, dtype=jnp.int32))), E2M1_VALUES)
    e8m0 = QArray(jnp.zeros((2, 1), jnp.uint8), jnp.arange(256, dtype=jnp.uint8)[None], QFormat("mxfp4", (32, 1), "uint8"))
    got, want = np.asarray(decode_e8m0(bits)), np.asarray(decode_scales(e8m0))[0]
    np.testing.assert_array_equal(got[1:], want[1:])
    assert got[0] == np.float32(2.0 ** -127)  # a float32 denormal, which XLA's CPU reference flushes to zero


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_grouped_kernels_lower_to_triton(platform):
    """Kimi-K2.5's expert shapes on one device's share (7168 -> 256 columns: 2048 split 8 ways) in
    int4 (gate/up fused, and W4A8), and FP8 block in e4m3fnuz (gfx942's flavour)."""
    sds = jax.ShapeDtypeStruct
    e, k, n_out = 48, 7168, 256

    def int4(act):
        return QArray(sds((e, k // 2, n_out), jnp.uint8), sds((e, k // 32, n_out), jnp.bfloat16),
                      QFormat("int4", (32, 1), "bfloat16", act=act))

    fp8 = QArray(sds((e, k, n_out), jnp.float8_e4m3fnuz), sds((e, k // 128, n_out // 128), jnp.float32),
                 QFormat("fp8_block", (128, 128), fnuz=True))
    x, sizes = sds((64, k), jnp.bfloat16), sds((e,), jnp.int32)
    for name, f, ws in (("eagle3_grouped_swiglu", grouped_swiglu, (int4("float"), int4("float"))),
                        ("eagle3_grouped_swiglu", grouped_swiglu, (int4("int8"), int4("int8"))),
                        ("eagle3_grouped_matmul", grouped_matmul, (fp8,))):
        with launch.deviceless(launch.PLATFORM_ARCH[platform]):
            lowered = jax.jit(lambda x, ws, s: f(x, *ws, s)).trace(x, ws, sizes).lower(lowering_platforms=(platform,))
        text = lowered.as_text()
        assert "triton" in text and name in text
