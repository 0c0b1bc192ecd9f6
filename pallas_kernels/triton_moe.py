"""Grouped matmuls for routed experts as `triton.jit` kernels, launched by `triton_call.call`
(through jax_triton on a GPU, Triton's interpreter on a CPU host): rows sorted by expert times each
expert's weight, quantized weights dequantized in registers, never materialised.

The contract, the weight formats and the tile plan are moe.py's (the XLA twins are there): a
program per (row tile of one expert, column tile, K split). How K is walked is where decode
shapes spend their time:
- A K step holds several scale groups (up to the launch table's `max_packed_k`): int4 and MXFP4
  step over `block_k / group` groups at once, each byte row meeting its group's scale broadcast
  over the group's rows in registers, so Kimi-K2.5's K = 7168 in groups of 32 is 56 steps of 128
  on sm_90 (a step a group would be 224 serial steps of 32). The activations' columns are pre-split into even and
  odd halves per K step (not per group), so each step is still two plain 2-D dots.
- W4A8 keeps its exact integer group sums with several groups per step: each group's int8 x int4
  products are summed by a dot batched over the step's groups ([groups, rows, group / 2] x
  [groups, group / 2, columns]), then each group's partial is scaled and the groups added.
- Split-K where tiles are few: when row tiles x column tiles would leave most of the device's
  compute units idle (a decode step over a few experts), the K steps are shared out among
  `splits` programs that each write a float32 partial; the partials are summed in XLA (in a fixed
  order: deterministic), and the fused gate/up form then applies its SwiGLU there, as the one-split
  kernel does in registers.
- Each byte once: a K step's activations are loaded once for both weights of the fused gate/up,
  and only the tile's rows of its expert (the rest of the 16-row window is masked off). A program
  still loads its rows once per column tile, which at decode shapes (a few rows per expert) is
  what a wide column tile keeps small against the weights (the launch table's `max_block_n`;
  pallas_kernels/traffic.py counts the bytes).
Float8 K steps stay within one scale block (a 128 x 128 block holds two steps of 64, or one of 128);
a per-column scale multiplies the accumulator once after the K loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from eagle3_jax.weights.quant import QArray, quantize_rows_int8
from pallas_kernels import launch as launch_table
from pallas_kernels import triton_call
from pallas_kernels.launch import MoeLaunch
from pallas_kernels.moe import TILES, largest_dividing, layout_error, split_even_odd, tile_plan, tiles_up_to


@triton.jit
def _e4m3(bits, FNUZ: tl.constexpr):
    """float8 e4m3 bytes (uint8) -> float32, OCP e4m3fn or (FNUZ) e4m3fnuz, with integer ops only
    (moe.decode_e4m3's arithmetic: ROCm's Triton has no e4m3fnuz conversion)."""
    b = bits.to(tl.int32)
    bias: tl.constexpr = 8 if FNUZ else 7
    sign, exp, man = b >> 7, (b >> 3) & 15, b & 7
    normal = ((sign << 31) | ((exp + (127 - bias)) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * (2.0 ** (-2 - bias))
    value = tl.where(exp == 0, tl.where(sign == 1, -sub, sub), normal)
    if FNUZ:
        nan = b == 0x80
    else:
        nan = (b & 0x7F) == 0x7F
    return tl.where(nan, float("nan"), value)


@triton.jit
def _e2m1(nibbles):
    """OCP e2m1 nibbles (int32 0..15) -> float32."""
    exp, man = (nibbles >> 1) & 3, nibbles & 1
    magnitude = tl.where(exp == 0, man.to(tl.float32) * 0.5, (((exp + 126) << 23) | (man << 22)).to(tl.float32,
                                                                                                       bitcast=True))
    return tl.where(nibbles >= 8, -magnitude, magnitude)


@triton.jit
def _e8m0(bits):
    """OCP e8m0 scale bytes -> 2^(bits - 127) as float32; 255 is NaN."""
    b = bits.to(tl.int32)
    power = tl.where(b == 0, (b * 0 + (1 << 22)).to(tl.float32, bitcast=True), (b << 23).to(tl.float32, bitcast=True))
    return tl.where(b == 255, float("nan"), power)


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    """a . b accumulated in float32, every operand as it is (the kernels ask for IEEE float32 so a
    float32 run is float32 on a GPU); under the interpreter, of float32 copies (it multiplies
    16-bit floats wrongly; the copies are exact)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _group_scales(s_ptr, s_e, s_k, expert, k, cols, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, MXFP4: tl.constexpr):
    """The step's scales broadcast to its packed byte rows: [BLOCK_K / 2, BLOCK_N] float32 (byte
    row r holds elements 2r and 2r + 1 of the step, both in group 2r // GROUP)."""
    groups: tl.constexpr = BLOCK_K // GROUP
    s = tl.load(s_ptr + expert * s_e + (k * groups + tl.arange(0, groups))[:, None] * s_k + cols[None, :])
    if MXFP4:
        s = _e8m0(s)
    else:
        s = s.to(tl.float32)
    s = tl.broadcast_to(s[:, None, :], [groups, GROUP // 2, BLOCK_N])
    return tl.reshape(s, [BLOCK_K // 2, BLOCK_N])


@triton.jit
def _activations(x_ptr, x_m, rows, live, k, BLOCK_K: tl.constexpr, PACKED: tl.constexpr):
    """The tile's activations of K step `k`, read once for every weight of the step and only for
    the tile's rows of its expert (`live`; the others are zeros, and their results are never
    stored): packed formats' even and odd halves [BLOCK_M, BLOCK_K / 2] (`split_even_odd`), else
    the step's [BLOCK_M, BLOCK_K] twice."""
    if PACKED:
        half: tl.constexpr = BLOCK_K // 2
        lanes = tl.arange(0, half)
        first = tl.load(x_ptr + rows[:, None] * x_m + k * BLOCK_K + lanes[None, :], mask=live[:, None], other=0)
        second = tl.load(x_ptr + rows[:, None] * x_m + k * BLOCK_K + half + lanes[None, :], mask=live[:, None],
                         other=0)
    else:
        lanes = k * BLOCK_K + tl.arange(0, BLOCK_K)
        first = tl.load(x_ptr + rows[:, None] * x_m + lanes[None, :], mask=live[:, None], other=0)
        second = first
    return first, second


@triton.jit
def _packed_step(even, odd, w_ptr, w_e, w_k, s_ptr, s_e, s_k, expert, k, cols,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, MXFP4: tl.constexpr,
                 W4A8: tl.constexpr, INTERPRETED: tl.constexpr):
    """One K step of an int4 / MXFP4 / W4A8 weight against the step's even and odd activation
    halves: float32 [BLOCK_M, BLOCK_N]."""
    half: tl.constexpr = BLOCK_K // 2
    lanes = tl.arange(0, half)
    packed = tl.load(w_ptr + expert * w_e + (k * half + lanes)[:, None] * w_k + cols[None, :]).to(tl.int32)
    low, high = packed & 15, packed >> 4
    if W4A8:
        # exact int8 x int4 sums per group (small integers, exact in bfloat16; partial sums are
        # integers below 2^24, exact in float32): a dot batched over the step's groups, then each
        # group's scale
        groups: tl.constexpr = BLOCK_K // GROUP
        rows_n: tl.constexpr = even.shape[0]
        operand: tl.constexpr = tl.float32 if INTERPRETED else tl.bfloat16  # (the interpreter's 16-bit floats)
        e3 = tl.permute(tl.reshape(even.to(operand), [rows_n, groups, GROUP // 2]), (1, 0, 2))
        o3 = tl.permute(tl.reshape(odd.to(operand), [rows_n, groups, GROUP // 2]), (1, 0, 2))
        l3 = tl.reshape((low - 8).to(operand), [groups, GROUP // 2, BLOCK_N])
        h3 = tl.reshape((high - 8).to(operand), [groups, GROUP // 2, BLOCK_N])
        sums = _dot(e3, l3, INTERPRETED) + _dot(o3, h3, INTERPRETED)  # [groups, BLOCK_M, BLOCK_N]
        s = tl.load(s_ptr + expert * s_e + (k * groups + tl.arange(0, groups))[:, None] * s_k + cols[None, :])
        out = tl.sum(sums * s.to(tl.float32)[:, None, :], axis=0)
    else:
        scale = _group_scales(s_ptr, s_e, s_k, expert, k, cols, BLOCK_K, GROUP, BLOCK_N, MXFP4)
        if MXFP4:
            w_low, w_high = _e2m1(low), _e2m1(high)
        else:
            w_low, w_high = (low - 8).to(tl.float32), (high - 8).to(tl.float32)
        w_low = (w_low * scale).to(even.dtype)
        w_high = (w_high * scale).to(even.dtype)
        out = _dot(even, w_low, INTERPRETED) + _dot(odd, w_high, INTERPRETED)
    return out


@triton.jit
def _step(xa, xb, w_ptr, w_e, w_k, s_ptr, s_e, s_k, s_n, expert, k, cols, col_tile,
          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
          SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, FNUZ: tl.constexpr, COLUMN_SCALES: tl.constexpr,
          INTERPRETED: tl.constexpr):
    """One K step of one weight for one tile against the step's activations (`_activations`: xa
    the step's, or xa / xb its even / odd halves): float32 [BLOCK_M, BLOCK_N]. FMT: 0 float,
    1 int4, 2 MXFP4, 3 W4A8, 4 float8."""
    if FMT == 0 or FMT == 4:
        lanes = k * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + expert * w_e + lanes[:, None] * w_k + cols[None, :])
        if FMT == 4:
            w = _e4m3(w, FNUZ)
            if not COLUMN_SCALES:  # e4m3 values are exact in bfloat16: unscaled, nothing is rounded
                if SCALE_COLS == 1:
                    s = tl.load(s_ptr + expert * s_e + ((k * BLOCK_K) // SCALE_ROWS) * s_k + cols)
                else:
                    s = tl.load(s_ptr + expert * s_e + ((k * BLOCK_K) // SCALE_ROWS) * s_k
                                + ((col_tile * BLOCK_N) // SCALE_COLS) * s_n)
                w = w * s
        out = _dot(xa, w.to(xa.dtype), INTERPRETED)
    else:
        out = _packed_step(xa, xb, w_ptr, w_e, w_k, s_ptr, s_e, s_k, expert, k, cols, BLOCK_K, BLOCK_N, GROUP,
                           FMT == 2, FMT == 3, INTERPRETED)
    return out


@triton.jit
def grouped_matmul_kernel(
        expert_ptr, first_ptr, end_ptr, x_ptr, xs_ptr, w1_ptr, s1_ptr, w2_ptr, s2_ptr,
        out_ptr,
        x_m: tl.constexpr, w_e: tl.constexpr, w_k: tl.constexpr, s_e: tl.constexpr, s_k: tl.constexpr,
        s_n: tl.constexpr, o_s: tl.constexpr, o_w: tl.constexpr, o_m: tl.constexpr, steps_per_split: tl.constexpr,
        NUM_EXPERTS: tl.constexpr, K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr,
        SCALE_COLS: tl.constexpr, FNUZ: tl.constexpr, COLUMN_SCALES: tl.constexpr, TWO: tl.constexpr,
        FUSED_SWIGLU: tl.constexpr, INTERPRETED: tl.constexpr):
    """A program: row tile `program_id(0)` (one expert's rows), column tile 1, K split 2. Writes
    float32 partials [splits, weights, rows, Nout] or, FUSED_SWIGLU (one split, two weights),
    silu(gate) * up in the output's dtype."""
    tile, col_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(expert_ptr + tile)
    if expert < NUM_EXPERTS:
        first, end = tl.load(first_ptr + tile), tl.load(end_ptr + tile)
        rows = first + tl.arange(0, BLOCK_M)
        live = rows < end  # the window's rows past this expert's end are the next tile's
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(split * steps_per_split, tl.minimum((split + 1) * steps_per_split, K_STEPS)):
            xa, xb = _activations(x_ptr, x_m, rows, live, k, BLOCK_K, FMT == 1 or FMT == 2 or FMT == 3)
            acc1 += _step(xa, xb, w1_ptr, w_e, w_k, s1_ptr, s_e, s_k, s_n, expert, k, cols, col_tile,
                          BLOCK_K, BLOCK_N, FMT, GROUP, SCALE_ROWS, SCALE_COLS, FNUZ, COLUMN_SCALES, INTERPRETED)
            if TWO:
                acc2 += _step(xa, xb, w2_ptr, w_e, w_k, s2_ptr, s_e, s_k, s_n, expert, k, cols, col_tile,
                              BLOCK_K, BLOCK_N, FMT, GROUP, SCALE_ROWS, SCALE_COLS, FNUZ, COLUMN_SCALES,
                              INTERPRETED)
        if COLUMN_SCALES:  # one scale per output column over all of K (a linear factor: fine per split)
            acc1 = acc1 * tl.load(s1_ptr + expert * s_e + cols)[None, :]
            if TWO:
                acc2 = acc2 * tl.load(s2_ptr + expert * s_e + cols)[None, :]
        if FMT == 3:  # W4A8: each row's int8 quantization scale
            row_scale = tl.load(xs_ptr + rows, mask=live, other=0.0)[:, None]
            acc1 = acc1 * row_scale
            acc2 = acc2 * row_scale
        keep = live[:, None]
        where = rows[:, None] * o_m + cols[None, :]
        if FUSED_SWIGLU:  # as the XLA path: gate and up rounded to the output dtype, silu in float32
            gate = acc1.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = acc2.to(out_ptr.dtype.element_ty).to(tl.float32)
            silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + where, (silu * up).to(out_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(out_ptr + split * o_s + where, acc1, mask=keep)
            if TWO:
                tl.store(out_ptr + split * o_s + o_w + where, acc2, mask=keep)


_FMT = {"float": 0, "int4": 1, "mxfp4": 2, "w4a8": 3, "fp8_block": 4, "fp8_channel": 4}


@dataclasses.dataclass(frozen=True)
class _Walk:
    """How the kernel walks one weight's K (static)."""

    fmt: str  # a key of _FMT
    block_k: int
    group: int  # scale group along K of a packed format (its K step holds whole groups)
    scale_rows: int
    scale_cols: int
    fnuz: bool = False
    column_scales: bool = False

    @property
    def label(self) -> str:
        return self.fmt + ("_fnuz" if self.fnuz else "")


def _walk(w, k: int, launch: MoeLaunch) -> _Walk:
    error = layout_error(w, k)
    if error:
        raise ValueError(f"the Triton grouped matmul cannot take this weight: {error}")
    steps = tiles_up_to(launch.max_block_k) or (16,)
    if not isinstance(w, QArray):
        return _Walk("float", largest_dividing(steps, k), k, k, 1)
    q = w.qformat
    bi, bo = q.scale_block(w.shape)
    if q.fmt in ("int4", "mxfp4"):  # whole groups a step: the largest power-of-two multiple of the group
        block_k = bi  # up to the table's packed step that divides K
        while block_k * 2 <= launch.max_packed_k and k % (block_k * 2) == 0:
            block_k *= 2
        return _Walk("w4a8" if q.act == "int8" else q.fmt, block_k, bi, bi, bo)
    # float8: a step stays within one scale block; a per-column scale is applied after the K loop
    block_k = largest_dividing(steps, k, bi) or largest_dividing(TILES, k, bi)
    return _Walk(q.fmt, block_k, bi, bi, bo, fnuz=q.fnuz, column_scales=bi >= k and bo == 1)


def _block_n(walk: _Walk, n_out: int, max_block_n: int) -> int:
    """The column tile: the largest power of two up to `max_block_n` dividing the columns and their
    scale blocks. W4A8 holds each K step's group sums [groups, rows, columns] before it scales and
    adds them, so its columns are cut by the groups a step: what a program holds stays that of a
    [rows, max_block_n] tile."""
    if walk.fmt == "w4a8":
        max_block_n = max(TILES[-1], max_block_n // (walk.block_k // walk.group))
    sizes = (n_out, *([walk.scale_cols] if walk.scale_cols > 1 else []))
    return largest_dividing(tiles_up_to(max_block_n), *sizes) or largest_dividing(TILES, *sizes)


def choose_splits(programs: int, k_steps: int, launch: MoeLaunch) -> int:
    """K splits for a launch of `programs` (row tiles x column tiles): enough to reach about
    `launch.target_programs` programs (set per architecture from its compute units), each split
    keeping `launch.min_split_steps` K steps or more; 1 where tiles are plenty."""
    if launch.target_programs <= 0:
        return 1
    want = -(-launch.target_programs // max(programs, 1))
    return max(1, min(want, k_steps // max(launch.min_split_steps, 1)))


def _bytes(values: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(values, jnp.uint8) if jnp.dtype(values.dtype).itemsize == 1 else values



def _grouped_call(x: jax.Array, ws: tuple, group_sizes: jax.Array, *, swiglu: bool, interpret: bool | None,
                  launch: MoeLaunch | None, splits: int, name: str) -> jax.Array:
    launch = launch_table.launch("moe") if launch is None else launch
    out_dtype = x.dtype if swiglu else jnp.float32
    n, k = x.shape
    walks = tuple(_walk(w, k, launch) for w in ws)
    if len(set(walks)) != 1:
        raise ValueError("fused gate/up needs both weights in the same format and scale layout")
    walk = walks[0]
    e, n_out = ws[0].shape[0], ws[0].shape[-1]
    block_m, block_n = launch.block_m, _block_n(walk, n_out, launch.max_block_n)
    row_scale = jnp.zeros((1,), jnp.float32)  # a pointer only W4A8 reads
    if walk.fmt == "w4a8":
        xq, row_scale = quantize_rows_int8(x, walk.group)
        x = xq.reshape(n, k)
    if walk.fmt in ("int4", "mxfp4", "w4a8"):
        x = split_even_odd(x, walk.block_k)
    expert, first, end, tiles = tile_plan(group_sizes, n, block_m)
    k_steps = k // walk.block_k
    if splits <= 0:
        splits = choose_splits(tiles * (n_out // block_n), k_steps, launch)
    steps_per_split = -(-k_steps // min(splits, k_steps))
    splits = -(-k_steps // steps_per_split)  # none empty
    pad = lambda a: jnp.pad(a, ((0, block_m), (0, 0)))  # noqa: E731  (a tile's row window never runs off the end)
    x = pad(x)
    if walk.fmt == "w4a8":
        row_scale = pad(row_scale)
    # float8 weights cross as their bytes (decoded in kernel with integer ops)
    values = [_bytes(w.values) if isinstance(w, QArray) else w for w in ws]
    scales = [w.scales if isinstance(w, QArray) else jnp.zeros((1, 1, 1), jnp.float32) for w in ws]
    fused = swiglu and splits == 1
    rows = n + block_m
    shape = (rows, n_out) if fused else (splits, len(ws), rows, n_out)
    out_shape = jax.ShapeDtypeStruct(shape, out_dtype if fused else jnp.float32)
    o_strides, w_strides, s_strides = (triton_call.strides(a) for a in (out_shape, values[0], scales[0]))
    two = len(ws) == 2
    [out] = triton_call.call(
        grouped_matmul_kernel, [out_shape], expert, first, end, x, row_scale, values[0], scales[0],
        values[-1], scales[-1],
        grid=(tiles, n_out // block_n, splits), num_warps=launch.num_warps, num_stages=launch.num_stages,
        interpret=interpret, name=f"{name}_{walk.label}",  # the weight format shows in profiles and the gate
        # every stride a constexpr: addresses fold into the code and scalar registers stay free
        x_m=x.shape[1], w_e=w_strides[0], w_k=w_strides[1], s_e=s_strides[0], s_k=s_strides[1], s_n=s_strides[2],
        o_s=0 if fused else o_strides[0],
        o_w=0 if fused else o_strides[1], o_m=o_strides[-2], steps_per_split=steps_per_split,
        NUM_EXPERTS=e, K_STEPS=k_steps, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=walk.block_k, FMT=_FMT[walk.fmt],
        GROUP=walk.group, SCALE_ROWS=walk.scale_rows, SCALE_COLS=walk.scale_cols, FNUZ=walk.fnuz,
        COLUMN_SCALES=walk.column_scales, TWO=two, FUSED_SWIGLU=fused)
    if not fused:  # the splits' partials, summed in a fixed order
        out = jnp.sum(out, axis=0)
        if swiglu:  # as the kernel's fused form: gate and up rounded to the output dtype, silu in float32
            gate, up = (part.astype(out_dtype).astype(jnp.float32) for part in out)
            out = ((gate * jax.nn.sigmoid(gate)).astype(out_dtype).astype(jnp.float32) * up).astype(out_dtype)
        else:
            out = out[0]
    # rows no tile wrote (past the groups) hold whatever the buffer held: select, never multiply
    grouped = jnp.arange(n)[:, None] < jnp.sum(group_sizes)
    return jnp.where(grouped, out[:n], jnp.zeros((), out.dtype))


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *, interpret: bool | None = None,
                   launch: MoeLaunch | None = None, splits: int = 0) -> jax.Array:
    """Rows x [N, K] sorted by expert @ w[expert] -> float32 [N, Nout] (moe.grouped_matmul's
    contract). `splits` 0: K splits chosen from the launch (`choose_splits`)."""
    return _grouped_call(x, (w,), group_sizes, swiglu=False, interpret=interpret, launch=launch, splits=splits,
                         name="eagle3_grouped_matmul")


def grouped_swiglu(x: jax.Array, w_gate, w_up, group_sizes: jax.Array, *, interpret: bool | None = None,
                   launch: MoeLaunch | None = None, splits: int = 0) -> jax.Array:
    """silu(x @ w_gate[expert]) * (x @ w_up[expert]) for rows x [N, K] sorted by expert -> [N, I] in
    x's dtype; both weights in the same format."""
    return _grouped_call(x, (w_gate, w_up), group_sizes, swiglu=True, interpret=interpret, launch=launch,
                         splits=splits, name="eagle3_grouped_swiglu")
