"""What the grouped expert kernels' tests share: weights in every format with random bytes as
the device holds them, a case of rows sorted by expert, and the tolerance against the XLA twins."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from eagle3_jax.weights.quant import QArray, QFormat

SIZES = [5, 0, 17, 1, 0, 9]  # empty experts, a group longer than a tile, a lone row
FORMATS = ["float", "int4", "mxfp4", "fp8_block", "fp8_channel", "fp8_block_fnuz", "w4a8"]


def fp8_bytes(rng, shape, fnuz: bool) -> np.ndarray:
    """Random float8 values over every finite bit pattern."""
    bits = rng.integers(0, 256, shape).astype(np.uint8)
    nan = (bits == 0x80) if fnuz else ((bits & 0x7F) == 0x7F)
    bits[nan] = 0x01
    return bits.view(ml_dtypes.float8_e4m3fnuz if fnuz else ml_dtypes.float8_e4m3fn)


def make_weight(rng, fmt: str, e: int, k: int, n: int):
    """A weight [e, k, n] in format `fmt`, with random bytes as the device holds them."""
    if fmt == "float":
        return jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.float32)
    if fmt in ("int4", "w4a8"):
        values = rng.integers(0, 256, (e, k // 2, n)).astype(np.uint8)
        scales = (rng.uniform(0.5, 1.5, (e, k // 32, n)) / (4 * np.sqrt(k))).astype(ml_dtypes.bfloat16)
        return QArray(jnp.asarray(values), jnp.asarray(scales),
                      QFormat("int4", (32, 1), "bfloat16", act="int8" if fmt == "w4a8" else "float"))
    if fmt == "mxfp4":
        values = rng.integers(0, 256, (e, k // 2, n)).astype(np.uint8)
        scales = rng.integers(120, 125, (e, k // 32, n)).astype(np.uint8)
        return QArray(jnp.asarray(values), jnp.asarray(scales), QFormat("mxfp4", (32, 1), "uint8"))
    fnuz = fmt.endswith("fnuz")
    values = jnp.asarray(fp8_bytes(rng, (e, k, n), fnuz))
    if fmt.startswith("fp8_block"):
        scales = rng.uniform(0.5, 1.5, (e, -(-k // 128), -(-n // 128))) / (100 * np.sqrt(k))
        return QArray(values, jnp.asarray(scales, jnp.float32), QFormat("fp8_block", (128, 128), fnuz=fnuz))
    scales = rng.uniform(0.5, 1.5, (e, 1, n)) / (100 * np.sqrt(k))
    return QArray(values, jnp.asarray(scales, jnp.float32), QFormat("fp8_channel", (0, 1), fnuz=fnuz))


def close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # float32: 1e-4 (relative to the largest output) here and on a GPU, where every kernel dot is
    # HIGHEST (IEEE float32, not TF32 / xf32) and only the K-step summation order differs from XLA's;
    # bfloat16: 3e-2 (operands rounded to bfloat16 on both paths, at different points for scales)
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got, want, atol=tol * float(np.abs(want).max()), rtol=tol)


def case(fmt: str, dtype, sizes=SIZES, pad_rows: int = 3):
    rng = np.random.default_rng(len(fmt))
    k, n_out = (128, 128) if fmt.startswith("fp8_block") else (64, 64)
    x = jnp.asarray(rng.standard_normal((sum(sizes) + pad_rows, k)), dtype)
    w = make_weight(rng, fmt, len(sizes), k, n_out)
    if fmt == "float":
        w = w.astype(dtype)
    return rng, x, w, jnp.asarray(sizes, jnp.int32)
