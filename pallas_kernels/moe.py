"""Grouped matmuls for routed experts (Pallas, Triton-shaped): rows sorted by expert times each
expert's weight, quantized weights dequantized in registers, never materialised.

`grouped_matmul(x, w, group_sizes)` computes, for rows x [N, K] sorted by expert (group e owns the
next group_sizes[e] rows), y[rows of e] = x[rows of e] @ w[e] in float32; rows past the groups give
zeros. `grouped_swiglu(x, w_gate, w_up, group_sizes)` is the fused first half of an expert MLP:
silu(x @ w_gate[e]) * (x @ w_up[e]) with both accumulators in one kernel, so x is read once and
the [N, I] gate and up products never reach memory.

Weights: a float array [E, K, Nout] or a `QArray` in any of the project's formats (weights/quant.py):
- int4 / mxfp4: uint8 [E, K/2, Nout], byte b holds elements 2b (low nibble) and 2b + 1 (high);
  int4 is nibble - 8 times a float scale per `g` input rows, mxfp4 an OCP e2m1 nibble times an
  e8m0 byte scale per 32. The K loop steps one scale group at a time and the activations' columns
  are pre-split into even and odd halves per group outside the kernel, so the low and high nibbles
  each meet their own half in a plain 2-D dot (no interleaving in registers).
- fp8_block / fp8_channel: float8 [E, K, Nout] (OCP e4m3fn or gfx942's e4m3fnuz) with float32
  scales per 128 x 128 block or per output column. The kernel bitcasts the bytes to int8 and
  decodes them with integer ops (no float8 conversion in kernel, which ROCm's Triton lacks for
  e4m3fnuz).
- W4A8 (int4 with `act="int8"`): activations quantized per row to int8 outside the kernel (as
  weights/quant.py does), int8 x int4 group dots computed exactly (as bfloat16 operands into a float32
  accumulator: small integers, integer partial sums below 2^24), then scaled.

Tiling: the grid walks (row tile, column tile) pairs. Which expert and rows a row tile covers is
worked out in XLA beforehand (`tile_plan`: each expert's rows are cut into tiles of `block_m`, so a
tile never mixes experts, and empty experts get no tile) and read in kernel. The number of row
tiles is N // block_m + min(E, N), so a decode step with a few routed assignments launches a few
tiles, each reading one routed expert's weights: the kernel's decode form, with no dependence on
how many experts the layer has. Tiles are powers of two; the row tile, the largest column tile and
K step, num_warps and num_stages come from the launch table per architecture (launch.py; a smaller
tile is taken where a weight's shape or scale blocks need one). A float8 weight scaled per output
column is scaled once after the K loop. `grouped_matmul_reference` and `grouped_swiglu_reference`
are the XLA twins (`quant.ragged_linear`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from eagle3_jax.weights.quant import PRECISION, QArray, quantize_rows_int8, ragged_linear
from pallas_kernels import launch as launch_table
from pallas_kernels.launch import MoeLaunch

_TILES = (256, 128, 64, 32, 16)  # power-of-two tiles, largest first; Triton's smallest dot is 16


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, precision=PRECISION, preferred_element_type=jnp.float32)


def _tiles_up_to(largest: int) -> tuple[int, ...]:
    return tuple(t for t in _TILES if t <= largest)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the kernel walks one weight (static)."""

    fmt: str  # "float" or a QFormat.fmt
    block_k: int  # K rows per step (one scale group for packed formats)
    scale_rows: int  # input rows sharing a scale (K for per-channel scales)
    scale_cols: int  # output columns sharing a scale
    fnuz: bool = False
    int8: bool = False  # W4A8
    column_scales: bool = False  # one scale per output column over all of K: applied once, after the K loop

    @property
    def packed(self) -> bool:
        return self.fmt in ("int4", "mxfp4")

    @property
    def label(self) -> str:
        """float / int4 / w4a8 / mxfp4 / fp8_block / fp8_channel (+ _fnuz): the kernel's name suffix."""
        if self.fmt == "float":
            return "float"
        return ("w4a8" if self.int8 else self.fmt) + ("_fnuz" if self.fnuz else "")


def _largest_dividing(choices: tuple[int, ...], *sizes: int) -> int | None:
    """The first of `choices` dividing every one of `sizes`, or None."""
    return next((c for c in choices if all(s % c == 0 for s in sizes)), None)


def layout_error(w, k: int) -> str | None:
    """Why the kernels cannot take weight `w` [E, K, Nout] against K-wide rows, or None if they can."""
    if k != w.shape[-2]:
        return f"rows have {k} columns but the weight's input dimension is {w.shape[-2]}"
    n_out = w.shape[-1]
    bi, bo = w.qformat.scale_block(w.shape) if isinstance(w, QArray) else (k, 1)
    if isinstance(w, QArray) and w.qformat.fmt in ("int4", "mxfp4"):
        if bi < 32 or bi & (bi - 1) or k % bi or bo != 1:
            return (f"{w.qformat.fmt} needs scale groups along K of a power of two >= 32 dividing K={k}, one per "
                    f"column (got {bi} x {bo})")
    elif _largest_dividing(_TILES, k, bi) is None:  # a K step stays inside one scale block
        return f"K={k} and the K scale block ({bi}) need a common power-of-two step >= 16"
    if _largest_dividing(_TILES, n_out, *([bo] if bo > 1 else [])) is None:
        return f"Nout={n_out} and the column scale block ({bo}) need a common power-of-two tile >= 16"
    return None


def _layout(w, k: int, max_block_k: int) -> _Layout:
    error = layout_error(w, k)
    if error:
        raise ValueError(f"the Pallas grouped matmul cannot take this weight: {error}")
    steps = _tiles_up_to(max_block_k) or (16,)
    if not isinstance(w, QArray):
        return _Layout("float", _largest_dividing(steps, k), k, 1)
    q = w.qformat
    bi, bo = q.scale_block(w.shape)
    if q.fmt in ("int4", "mxfp4"):  # one scale group per K step: its nibbles are split per group
        return _Layout(q.fmt, bi, bi, bo, int8=q.act == "int8")
    # float8: a per-column scale (one block over all of K) is applied once after the K loop, not
    # per step: loading it inside the loop is what gfx950's direct-to-LDS copies cannot take
    return _Layout(q.fmt, _largest_dividing(steps, k, bi) or _largest_dividing(_TILES, k, bi), bi, bo, fnuz=q.fnuz,
                   column_scales=bi >= k and bo == 1)


def _block_n(layouts: tuple[_Layout, ...], n_out: int, max_block_n: int) -> int:
    """Column tile: divides Nout and every column scale block, so a tile meets one scale per row."""
    sizes = (n_out, *(lay.scale_cols for lay in layouts if lay.scale_cols > 1))
    return _largest_dividing(_tiles_up_to(max_block_n), *sizes) or _largest_dividing(_TILES, *sizes)


def tile_plan(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Per row tile: (expert, first row, end row of its expert) for a static number of tiles
    (num_rows // block_m + min(E, num_rows), an upper bound: an expert with s rows needs at most
    s // block_m + 1 tiles, and at most min(E, num_rows) experts have rows); unused tiles get
    expert = E."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    count = max(1, num_rows // block_m + min(e, num_rows))
    i = jnp.arange(count, dtype=jnp.int32)
    expert = jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32)
    safe = jnp.minimum(expert, e - 1)
    first = starts[safe] + (i - (tile_end[safe] - tiles[safe])) * block_m
    return expert, first, ends[safe], count


# ---- element decoding (integer ops and bitcasts only: portable to every Triton target) -------------


def _f32_bits(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def decode_e4m3(bits: jax.Array, fnuz: bool) -> jax.Array:
    """float8 e4m3 bytes (int32 0..255) -> float32; OCP e4m3fn (bias 7, NaN at S.1111.111) or
    e4m3fnuz (bias 8, NaN at 0x80, no negative zero)."""
    bias = 8 if fnuz else 7
    sign, exp, man = bits >> 7, (bits >> 3) & 15, bits & 7
    normal = _f32_bits((sign << 31) | ((exp + (127 - bias)) << 23) | (man << 20))
    subnormal = man.astype(jnp.float32) * (2.0 ** (-2 - bias))
    value = jnp.where(exp == 0, jnp.where(sign == 1, -subnormal, subnormal), normal)
    nan = (bits == 0x80) if fnuz else ((bits & 0x7F) == 0x7F)
    return jnp.where(nan, jnp.nan, value)


def decode_e2m1(nibbles: jax.Array) -> jax.Array:
    """OCP e2m1 nibbles (int32 0..15) -> float32."""
    exp, man = (nibbles >> 1) & 3, nibbles & 1
    magnitude = jnp.where(exp == 0, man.astype(jnp.float32) * 0.5, _f32_bits(((exp + 126) << 23) | (man << 22)))
    return jnp.where(nibbles >= 8, -magnitude, magnitude)


def decode_e8m0(bits: jax.Array) -> jax.Array:
    """OCP e8m0 scale bytes (int32 0..255) -> 2^(bits - 127) as float32; 255 is NaN."""
    power = jnp.where(bits == 0, _f32_bits(jnp.full_like(bits, 1 << 22)), _f32_bits(bits << 23))
    return jnp.where(bits == 255, jnp.nan, power)


# ---- the kernel ----------------------------------------------------------------------------------


def _scale_tile(s_ref, lay: _Layout, expert, k, j, block_n: int) -> jax.Array:
    """The float32 scales of K step k and column tile j: [1, block_n] or [1, 1] (one block)."""
    row = pl.ds((k * lay.block_k) // lay.scale_rows, 1)
    cols = pl.ds(j * block_n, block_n) if lay.scale_cols == 1 else pl.ds((j * block_n) // lay.scale_cols, 1)
    s = s_ref[expert, row, cols]
    return decode_e8m0(s.astype(jnp.int32)) if lay.fmt == "mxfp4" else s.astype(jnp.float32)


def _step(x_ref, w_ref, s_ref, lay: _Layout, expert, rows, k, j, block_n: int) -> jax.Array:
    """One K step of one weight for one tile: float32 [block_m, block_n]."""
    cols = pl.ds(j * block_n, block_n)
    bk = lay.block_k
    if lay.fmt == "float":
        xk = x_ref[rows, pl.ds(k * bk, bk)]
        return _dot(xk, w_ref[expert, pl.ds(k * bk, bk), cols].astype(xk.dtype))
    if not lay.packed:  # float8 bytes, decoded with integer ops
        xk = x_ref[rows, pl.ds(k * bk, bk)]
        bits = jax.lax.bitcast_convert_type(w_ref[expert, pl.ds(k * bk, bk), cols], jnp.int8).astype(jnp.int32) & 0xFF
        w = decode_e4m3(bits, lay.fnuz)
        if not lay.column_scales:  # e4m3 values are exact in bfloat16: unscaled, nothing is rounded
            w = w * _scale_tile(s_ref, lay, expert, k, j, block_n)
        return _dot(xk, w.astype(xk.dtype))
    scale = _scale_tile(s_ref, lay, expert, k, j, block_n)
    half = bk // 2
    even, odd = x_ref[rows, pl.ds(k * bk, half)], x_ref[rows, pl.ds(k * bk + half, half)]
    packed = w_ref[expert, pl.ds(k * half, half), cols].astype(jnp.int32)
    low, high = packed & 15, packed >> 4
    if lay.int8:
        # W4A8: int8 x int4 products summed over one group, exactly. The operands are small integers,
        # exact in bfloat16, and every partial sum is an integer below 2^24, exact in the float32
        # accumulator: the same numbers as an int32 dot, without int8 dot-shape limits (K >= 32 on
        # some targets) or signedness rules. Then the group's scale.
        acc = (_dot(even.astype(jnp.bfloat16), (low - 8).astype(jnp.bfloat16))
               + _dot(odd.astype(jnp.bfloat16), (high - 8).astype(jnp.bfloat16)))
        return acc * scale
    decode = decode_e2m1 if lay.fmt == "mxfp4" else (lambda n: (n - 8).astype(jnp.float32))
    w_low, w_high = ((decode(n) * scale).astype(even.dtype) for n in (low, high))
    return _dot(even, w_low) + _dot(odd, w_high)


def _kernel(expert_ref, first_ref, end_ref, x_ref, *refs, layouts: tuple[_Layout, ...], has_scales: tuple[bool, ...],
            row_scaled: bool, num_experts: int, block_m: int, block_n: int, k_steps: int, swiglu: bool):
    from jax.experimental.pallas import triton as plt

    refs = list(refs)
    xs_ref = refs.pop(0) if row_scaled else None
    weights = []
    for scaled in has_scales:
        w_ref = refs.pop(0)
        weights.append((w_ref, refs.pop(0) if scaled else None))
    (o_ref,) = refs
    i, j = pl.program_id(0), pl.program_id(1)
    expert, first, end = expert_ref[i], first_ref[i], end_ref[i]
    rows = pl.ds(first, block_m)

    @pl.when(expert < num_experts)
    def _():
        def body(k, accs):
            return tuple(acc + _step(x_ref, w_ref, s_ref, lay, expert, rows, k, j, block_n)
                         for acc, (w_ref, s_ref), lay in zip(accs, weights, layouts))

        zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in weights)
        accs = jax.lax.fori_loop(0, k_steps, body, zeros)
        accs = tuple(acc * _scale_tile(s_ref, lay, expert, 0, j, block_n) if lay.column_scales else acc
                     for acc, (_, s_ref), lay in zip(accs, weights, layouts))
        if row_scaled:  # W4A8: each row's int8 quantization scale
            accs = tuple(acc * xs_ref[rows, pl.ds(0, 1)] for acc in accs)
        if swiglu:  # as the XLA path: gate and up rounded to the output dtype, silu in float32
            gate, up = (acc.astype(o_ref.dtype).astype(jnp.float32) for acc in accs)
            out = (gate * jax.nn.sigmoid(gate)).astype(o_ref.dtype).astype(jnp.float32) * up
        else:
            (out,) = accs
        keep = (first + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)) < end
        # masked: the window's rows past this expert's end belong to the next expert's tile
        plt.store(o_ref.at[rows, pl.ds(j * block_n, block_n)], out.astype(o_ref.dtype), mask=keep)


def _split_even_odd(x: jax.Array, group: int) -> jax.Array:
    """Columns of each K group reordered as [even columns | odd columns]."""
    n, k = x.shape
    return x.reshape(n, k // group, group // 2, 2).swapaxes(-1, -2).reshape(n, k)


def _weight_inputs(w) -> list[jax.Array]:
    return [w.values, w.scales] if isinstance(w, QArray) else [w]


def _grouped_call(x: jax.Array, ws: tuple, group_sizes: jax.Array, *, out_dtype, swiglu: bool, interpret: bool,
                  launch: MoeLaunch | None, name: str) -> jax.Array:
    from jax.experimental.pallas import triton as plt

    launch = launch_table.launch("moe") if launch is None else launch
    block_m = launch.block_m
    n, k = x.shape
    layouts = tuple(_layout(w, k, launch.max_block_k) for w in ws)
    if len(set(layouts)) != 1:
        raise ValueError("fused gate/up needs both weights in the same format and scale layout")
    lay = layouts[0]
    e, n_out = ws[0].shape[0], ws[0].shape[-1]
    block_n = _block_n(layouts, n_out, launch.max_block_n)
    row_scale = None
    if lay.int8:
        xq, row_scale = quantize_rows_int8(x, lay.block_k)
        x = xq.reshape(n, k)
    if lay.packed:
        x = _split_even_odd(x, lay.block_k)
    expert, first, end, tiles = tile_plan(group_sizes, n, block_m)
    pad = lambda a: jnp.pad(a, ((0, block_m), (0, 0)))  # noqa: E731  (a tile's row window never runs off the end)
    inputs = [expert, first, end, pad(x)] + ([pad(row_scale)] if lay.int8 else [])
    for w in ws:
        inputs += _weight_inputs(w)
    kernel = functools.partial(
        _kernel, layouts=layouts, has_scales=tuple(isinstance(w, QArray) for w in ws), row_scaled=lay.int8,
        num_experts=e, block_m=block_m, block_n=block_n, k_steps=k // lay.block_k, swiglu=swiglu)
    out_shape = jax.ShapeDtypeStruct((n + block_m, n_out), out_dtype)
    out = launch_table.call(pl.pallas_call(
        kernel,
        grid=(tiles, n_out // block_n),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.no_block_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        name=f"{name}_{lay.label}",  # the weight format shows in profiles and in the compile gate
    ), out_shape, *inputs)
    # rows no tile wrote (past the groups) hold whatever the buffer held: select, never multiply
    grouped = jnp.arange(n)[:, None] < jnp.sum(group_sizes)
    return jnp.where(grouped, out[:n], jnp.zeros((), out_dtype))


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, interpret: bool = False,
                   launch: MoeLaunch | None = None) -> jax.Array:
    """Rows x [N, K] sorted by expert @ w[expert] -> float32 [N, Nout] (see the module docstring).
    `launch` defaults to the launch table's "moe" entry for the architecture traced for."""
    return _grouped_call(x, (w,), group_sizes, out_dtype=jnp.float32, swiglu=False, interpret=interpret,
                         launch=launch, name="eagle3_grouped_matmul")


def grouped_swiglu(x: jax.Array, w_gate, w_up, group_sizes: jax.Array, *, interpret: bool = False,
                   launch: MoeLaunch | None = None) -> jax.Array:
    """silu(x @ w_gate[expert]) * (x @ w_up[expert]) for rows x [N, K] sorted by expert -> [N, I] in
    x's dtype; both weights in the same format."""
    return _grouped_call(x, (w_gate, w_up), group_sizes, out_dtype=x.dtype, swiglu=True, interpret=interpret,
                         launch=launch, name="eagle3_grouped_swiglu")


def grouped_matmul_reference(x: jax.Array, w, group_sizes: jax.Array, **_) -> jax.Array:
    """`grouped_matmul` through XLA (`quant.ragged_linear`: dequantize, then ragged_dot)."""
    return ragged_linear(x, w, group_sizes).astype(jnp.float32)


def grouped_swiglu_reference(x: jax.Array, w_gate, w_up, group_sizes: jax.Array, **_) -> jax.Array:
    """`grouped_swiglu` through XLA, exactly as the MoE layer's XLA path computes it."""
    return jax.nn.silu(ragged_linear(x, w_gate, group_sizes)) * ragged_linear(x, w_up, group_sizes)
