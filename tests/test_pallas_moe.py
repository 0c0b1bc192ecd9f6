"""The grouped expert matmul kernel (Pallas, interpret mode on CPU) against its XLA reference:
float and int4 weights, empty experts, groups not a multiple of the row tile, padding rows past
the groups, float32 and bfloat16 activations; and deviceless lowering for ROCm and CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.checkpoint.quantize import encode
from eagle3_jax.quant import QArray, QFormat
from pallas_kernels.moe import grouped_matmul, grouped_matmul_reference

SIZES = [5, 0, 17, 1, 0, 9]  # empty experts, a group longer than a tile, a lone row


def int4_weights(rng, e: int, k: int, n: int, group: int = 32) -> QArray:
    """Random int4 weights in the checkpoint's own packing (via the RTN encoder), as loaded."""
    from eagle3_jax.checkpoint.quant import int4_words_to_bytes

    values, scales = [], []
    for _ in range(e):
        t = encode(rng.standard_normal((n, k)).astype(np.float32), "int4_pack", group)  # HF [out, in]
        values.append(int4_words_to_bytes(t["weight_packed"]).T)
        scales.append(np.asarray(t["weight_scale"]).T)
    return QArray(jnp.asarray(np.stack(values)), jnp.asarray(np.stack(scales)), QFormat("int4", (group, 1), "bfloat16"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_grouped_matmul_equals_reference(weights, dtype):
    rng = np.random.default_rng(0)
    e, k, n_out, rows = len(SIZES), 64, 64, sum(SIZES) + 3  # 3 padding rows past the groups
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    if weights == "float":
        w = jnp.asarray(rng.standard_normal((e, k, n_out)) / 8, dtype)
    else:
        w = int4_weights(rng, e, k, n_out)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got = grouped_matmul(x, w, sizes, interpret=True)
    want = grouped_matmul_reference(x, w, sizes)
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol * float(np.abs(want).max()), rtol=tol)
    assert not np.asarray(got)[sum(SIZES):].any()


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_grouped_matmul_lowers_to_triton(platform):
    """Kimi-K2.5 expert shapes on one device's share: 7168 -> 256 columns (2048 split 8 ways), int4."""
    sds = jax.ShapeDtypeStruct
    e, k, n_out = 48, 7168, 256
    w = QArray(sds((e, k // 2, n_out), jnp.uint8), sds((e, k // 32, n_out), jnp.bfloat16), QFormat("int4", (32, 1), "bfloat16"))
    f = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, block_m=16, block_n=64))
    text = f.trace(sds((64, k), jnp.bfloat16), w, sds((e,), jnp.int32)).lower(lowering_platforms=(platform,)).as_text()
    assert "triton" in text and "eagle3_grouped_matmul" in text
