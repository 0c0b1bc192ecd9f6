"""Quantized weights that stay quantized on device, and the ops that use them.

A `QArray` stands for a float weight of logical shape [..., in, out] (our `x @ w` orientation,
experts stacked in front). It holds the checkpoint's packed `values` and its `scales`, and is
dequantized only inside the op that consumes it (`linear`, `dequantize`), so HBM holds the
checkpoint's bytes, not bf16 copies. Every format is one rule: element [i, o] is
`decode(values)[i, o] * scales[i // block[0], o // block[1]]`.

| format        | values                                  | scales (block)                          | source                               |
|---------------|-----------------------------------------|-----------------------------------------|--------------------------------------|
| `int4`        | uint8 [.., in/2, out], low nibble first, nibble - 8 | float [.., in/g, out] (g, 1)  | compressed-tensors pack-quantized    |
| `mxfp4`       | uint8 [.., in/2, out], low nibble first, e2m1      | uint8 e8m0 [.., in/32, out] (32, 1) | AMD Quark OCP MXFP4                |
| `fp8_block`   | float8 [.., in, out]                    | float32 [.., in/128, out/128] (128, 128)| DeepSeek-V3 / MiniMax-M2 block FP8   |
| `fp8_channel` | float8 [.., in, out]                    | float32 [.., 1, out] (in, 1)            | AMD Quark ptpc_fp8 (EAGLE-3 drafts)  |

Float8 values are OCP `float8_e4m3fn`, or `float8_e4m3fnuz` (gfx942; converted on load by
`checkpoint.quant.fp8_e4m3fn_to_fnuz`: same bits, scales doubled). A
QArray carries the logical axes of the weight it replaces: values and scales are sharded along
the same axes (see runtime/sharding.py), so a shard dequantizes with its own scales.

Activations: weights are dequantized to the activation dtype (W4A16, W8A16) unless the QArray's
`act` is "int8" (W4A8, int4 only): tokens are quantized per row to int8 on the fly and each
32-wide group is an int8 x int4 dot accumulated in int32, then scaled.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

# The precision every matmul of the model and of the Triton kernels states: HIGHEST keeps float32
# operands in IEEE float32 on GPUs, where a default-precision float32 dot runs as TF32 (sm_90) or
# xf32 (gfx942), so float32 reference runs are float32 there too.
# bfloat16 and integer operands are unaffected, and XLA:CPU computes float32 dots in full anyway.
PRECISION = jax.lax.Precision.HIGHEST

FORMATS = ("int4", "mxfp4", "fp8_block", "fp8_channel")
PACKED_FORMATS = ("int4", "mxfp4")
ACTIVATIONS = ("float", "int8")

# OCP e2m1 magnitudes by the low three bits; bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


@dataclasses.dataclass(frozen=True)
class QFormat:
    """How one weight is stored on device (static; part of the parameter layout)."""

    fmt: str
    block: tuple[int, int]  # (in, out) extent of one scale; fp8_channel: (0, 1) = the whole input dim
    scale_dtype: str = "float32"  # dtype of `scales` as stored by the checkpoint
    fnuz: bool = False  # float8 values in e4m3fnuz (gfx942) rather than OCP e4m3fn
    act: str = "float"  # "float": dequantize to the activation dtype; "int8": W4A8

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"quantized format {self.fmt!r} is not supported; supported: {', '.join(FORMATS)}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation mode {self.act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.act == "int8" and self.fmt != "int4":
            raise ValueError(f"int8 activations (W4A8) need int4 weights; {self.fmt} weights run with float activations")

    @property
    def values_dtype(self) -> np.dtype:
        if self.fmt in PACKED_FORMATS:
            return np.dtype(np.uint8)
        return np.dtype(ml_dtypes.float8_e4m3fnuz if self.fnuz else ml_dtypes.float8_e4m3fn)

    def scale_block(self, shape: tuple[int, ...]) -> tuple[int, int]:
        bi, bo = self.block
        return (shape[-2] if bi == 0 else bi), bo

    def values_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of `values` for a logical [..., in, out] weight."""
        if self.fmt in PACKED_FORMATS:
            return tuple(shape[:-2]) + (shape[-2] // 2, shape[-1])
        return tuple(shape)

    def scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        bi, bo = self.scale_block(shape)
        return tuple(shape[:-2]) + (math.ceil(shape[-2] / bi), math.ceil(shape[-1] / bo))

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes on device (values + scales) for a logical weight of `shape`."""
        return (math.prod(self.values_shape(shape)) * self.values_dtype.itemsize
                + math.prod(self.scales_shape(shape)) * np.dtype(self.scale_dtype).itemsize)


@struct.dataclass
class QArray:
    """Packed values + scales standing for a float weight [..., in, out]; see the module doc."""

    values: jax.Array
    scales: jax.Array
    qformat: QFormat = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the float weight."""
        s = tuple(self.values.shape)
        return s[:-2] + (2 * s[-2], s[-1]) if self.qformat.fmt in PACKED_FORMATS else s

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize

    def __getitem__(self, index) -> "QArray":
        """Index the leading (stacked layer / expert) axes; the matrix axes stay whole."""
        return QArray(self.values[index], self.scales[index], self.qformat)


# ---- decoding ----------------------------------------------------------------------------------


def _unpack_nibbles(values: jax.Array) -> jax.Array:
    """uint8 [..., in/2, out] -> int32 nibbles [..., in, out]; element 2b is byte b's low nibble."""
    v = values.astype(jnp.int32)
    both = jnp.stack([v & 0xF, v >> 4], axis=-2)  # [..., in/2, 2, out]
    return both.reshape(values.shape[:-2] + (2 * values.shape[-2], values.shape[-1]))


def decode_values(q: QArray) -> jax.Array:
    """The unscaled element values as float32 [..., in, out]."""
    fmt = q.qformat.fmt
    if fmt == "int4":
        return (_unpack_nibbles(q.values) - 8).astype(jnp.float32)
    if fmt == "mxfp4":
        return jnp.asarray(E2M1_VALUES)[_unpack_nibbles(q.values)]
    return float8_view(q).astype(jnp.float32)


def float8_view(q: QArray) -> jax.Array:
    """An FP8 weight's values as float8. They may be held as their raw bytes (uint8, as the
    memory planner declares them: XLA:CPU has no float8 arithmetic and would widen whole stacked
    float8 weights ahead of the layer loop, where a GPU widens one layer's slice in it); the
    bytes are viewed in place."""
    if q.values.dtype == jnp.uint8:
        return jax.lax.bitcast_convert_type(q.values, q.qformat.values_dtype)
    return q.values


def decode_scales(q: QArray) -> jax.Array:
    """Scales as float32 (e8m0 bytes -> 2^(byte - 127); 255 is NaN in OCP)."""
    if q.qformat.fmt == "mxfp4":
        e = q.scales.astype(jnp.int32)
        return jnp.where(e == 255, jnp.nan, jnp.ldexp(jnp.ones(e.shape, jnp.float32), e - 127))
    return q.scales.astype(jnp.float32)


def _expand_scales(scales: jax.Array, shape: tuple[int, ...], block: tuple[int, int]) -> jax.Array:
    """Scales [..., ceil(in/bi), ceil(out/bo)] -> one per element [..., in, out]."""
    bi, bo = block
    s = scales
    if bi > 1:
        s = jnp.repeat(s, bi, axis=-2)[..., : shape[-2], :]
    if bo > 1:
        s = jnp.repeat(s, bo, axis=-1)[..., : shape[-1]]
    return s


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """The float weight a QArray stands for, computed in float32 and cast to `dtype`; a plain
    (unquantized) weight is returned as it is."""
    if not isinstance(w, QArray):
        return w
    shape = w.shape
    full = decode_values(w) * _expand_scales(decode_scales(w), shape, w.qformat.scale_block(shape))
    return full.astype(dtype)


# ---- ops -------------------------------------------------------------------------------------------


def quantize_rows_int8(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-row int8 activations: x [M, K] -> (int8 [M, K/group, group], float32 row scale [M, 1])."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-30) / 127.0
    q = jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape[0], x.shape[1] // group, group), scale


def _int4_groups(w: QArray) -> jax.Array:
    """int4 weight values as int8 [..., K/g, g, N]."""
    g = w.qformat.block[0]
    k, n = w.shape[-2:]
    if k % g:
        raise ValueError(f"W4A8 needs the input dimension ({k}) to be a multiple of the group size ({g})")
    return (_unpack_nibbles(w.values) - 8).astype(jnp.int8).reshape(w.shape[:-2] + (k // g, g, n))


def _w4a8_matmul(x: jax.Array, w: QArray) -> jax.Array:
    """x [..., in] @ int4 w [in, out] with per-row int8 activations and int32 group accumulation."""
    k, n = w.shape
    lead = x.shape[:-1]
    xq, x_scale = quantize_rows_int8(x.reshape(-1, k), w.qformat.block[0])
    acc = jnp.einsum("mgk,gkn->mgn", xq, _int4_groups(w), preferred_element_type=jnp.int32, precision=PRECISION)  # exact per group
    y = jnp.einsum("mgn,gn->mn", acc.astype(jnp.float32), decode_scales(w), precision=PRECISION) * x_scale
    return y.reshape(lead + (n,)).astype(x.dtype)


def _ragged_w4a8(xs: jax.Array, w: QArray, group_sizes: jax.Array) -> jax.Array:
    """W4A8 grouped matmul: the same int8 x int4 group dots per expert group of rows, one K group
    at a time (a scan: ragged_dot does not batch), accumulated in float32."""
    e, _, n = w.shape
    xq, x_scale = quantize_rows_int8(xs, w.qformat.block[0])
    expert_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(xs.shape[0]), side="right")
    row_scales = decode_scales(w)[jnp.clip(expert_of_row, 0, e - 1)]  # [M, K/g, N]

    def one_group(y, parts):
        xg, wg, sg = parts  # [M, g], [E, g, N], [M, N]
        acc = jax.lax.ragged_dot(xg, wg, group_sizes, preferred_element_type=jnp.int32, precision=PRECISION)
        return y + acc.astype(jnp.float32) * sg, None

    parts = (jnp.moveaxis(xq, 1, 0), jnp.moveaxis(_int4_groups(w), 1, 0), jnp.moveaxis(row_scales, 1, 0))
    y, _ = jax.lax.scan(one_group, jnp.zeros((xs.shape[0], n), jnp.float32), parts)
    return (y * x_scale).astype(xs.dtype)


def ragged_linear(xs: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul: rows xs [M, in] sorted by group, weights [G, in, out] (float or QArray);
    rows past sum(group_sizes) give zeros."""
    if isinstance(w, QArray) and w.qformat.act == "int8":
        return _ragged_w4a8(xs, w, group_sizes)
    return jax.lax.ragged_dot(xs, dequantize(w, xs.dtype), group_sizes, precision=PRECISION)


def linear(x: jax.Array, w, out_dtype=None) -> jax.Array:
    """x [..., in] @ w [in, out] for a float or quantized weight; `out_dtype` (e.g. float32 for
    logits) is the accumulation and result dtype, else the usual promotion of x and w."""
    if isinstance(w, QArray):
        if w.qformat.act == "int8":
            y = _w4a8_matmul(x, w)
            return y if out_dtype is None else y.astype(out_dtype)
        w = dequantize(w, x.dtype)
    if out_dtype is None:
        return jnp.matmul(x, w, precision=PRECISION)
    return jnp.dot(x, w, preferred_element_type=out_dtype, precision=PRECISION)


def take(w, ids: jax.Array):
    """w[ids] on the leading (expert) axis, for float and quantized weights alike: a quantized
    weight is gathered in its packed bytes, so only the chosen experts are read."""
    return w[ids]


def expert_matmul(x: jax.Array, w) -> jax.Array:
    """Per-assignment expert matmul: x [n, k, in] with gathered weights [n, k, in, out] -> [n, k, out]."""
    if isinstance(w, QArray) and w.qformat.act == "int8":
        return jax.vmap(jax.vmap(_w4a8_matmul))(x[:, :, None, :], w)[:, :, 0, :]
    return jnp.einsum("nki,nkio->nko", x, dequantize(w, x.dtype), precision=PRECISION)
