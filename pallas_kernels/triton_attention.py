"""Paged attention over a row's committed prefix as `triton.jit` kernels, launched by
`triton_call.call` (through jax_triton on a GPU, Triton's interpreter on a CPU host).

The contract is attention.py's: query rows of a KV head (GQA: the group's query heads x T tokens;
absorbed MLA: every head x T tokens of the one latent "head") against the row's pages below its
length, an online softmax in float32, partial (out, lse) per KV split, merged by
`attention.merge_splits`. A program is one (KV head x row tile, row, KV split): it holds a row
tile's float32 accumulator in registers and reads each page of its split once, so a tile of
`block_rows` rows reads the prefix once for all of them. With 64-row tiles (the launch table's MLA
entries) Kimi-K2.5's heads x draft tokens per device, 8 x 4 in the tensor-parallel layout and 64 x
1 in the data-parallel one, read each page once per step; 64 x 4 reads it 4 times (128-row tiles do
not fit a GPU's registers: launch.py). A block-table entry of -1 names a page this device does not
hold (a row spread over the data shards): its slots are never read.

Two kernels share the walk:
- `paged_prefix_attention_kernel`, over pages in the compute dtype: [rows, lanes] tiles, two dots a
  step (scores, then probabilities x values);
- `paged_prefix_attention_fp8_kernel`, over FP8 pages (uint8 bits, decoded in registers, a float32
  scale per slot per group of lanes): each group's part of the scores is scaled, and for values the
  probabilities before the dot, so the decoded tile stays exact in the compute dtype; the queries,
  keys, values and accumulator are [groups x row parts, rows / parts, lanes] and the dots are batched
  over them (Triton gives each batch entry of a batched dot its own warps, so Kimi's 4 groups fill
  8 warps only in 2 row parts: `AttentionLaunch.row_parts`, which AMD's entries use). Scaling the
  decoded tile instead makes the compiler decode it in both dots' operand layouts, the scores' copy
  in every warp, which spills on AMD and on sm_90.

Strides are constexprs, so the compiler knows each slot's lanes start 16-byte aligned and loads
them in vectors. Any lane width and page size: a block is the power of two >= 16 that Triton's
shapes and dots need, the real lanes and slots masked within it (Kimi's 512 + 64 lanes and pages of
16 or 64 slots fill their blocks; a small test model's 8-lane heads over 4-slot pages run the same
code); FP8 pages' scale groups likewise padded to a power of two (384-lane heads: 3 of 4). MLA's
rope key is scaled as one group (64 lanes in every model served; a wider one is refused).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import launch as launch_table
from pallas_kernels import triton_call
from pallas_kernels.attention import Fp8Scales, block_rows_for, default_splits, merge_splits
from pallas_kernels.launch import AttentionLaunch

_NEG = tl.constexpr(-1e30)  # a global the kernel reads must be a constexpr


@triton.jit
def _fp8_decode(bits, FNUZ: tl.constexpr):
    """float8 e4m3 bits -> float32 (e4m3fn, bias 7, or e4m3fnuz, bias 8, when FNUZ): the sign,
    exponent and mantissa bits placed at float16's read as the value times 2^(bias - 15), so one
    multiply makes it (float16 subnormals convert exactly to float32). Integer ops, not a float8
    cast: ROCm's Triton has no e4m3fnuz conversion, and sm_80 none of either. NaN codes are never
    written."""
    b = bits.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    value = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return value * (128.0 if FNUZ else 256.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """a . b with float32 accumulation; under Triton's interpreter, of float32 copies (it multiplies
    16-bit floats wrongly; the copies are exact, so the products and sums are the ones a matrix
    unit accumulating in float32 forms)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _slots_tile(base, slot_stride, slots, real, WIDTH: tl.constexpr, LANES: tl.constexpr):
    """The `slots` x LANES lanes of a page (WIDTH of them real), [slots, LANES]; 0 where not real."""
    lanes = tl.arange(0, LANES)
    return tl.load(base + slots[:, None] * slot_stride + lanes[None, :],
                   mask=real[:, None] & (lanes < WIDTH)[None, :], other=0)


@triton.jit
def paged_prefix_attention_kernel(
        layer_ptr, lengths_ptr, table_ptr, q_ptr, k_ptr, ks_ptr, q2_ptr, k2_ptr, k2s_ptr, v_ptr, vs_ptr, starts_ptr,
        scale, pages_per_split, out_ptr, lse_ptr,
        table_stride: tl.constexpr, q_b: tl.constexpr, q_h: tl.constexpr, q_m: tl.constexpr,
        q2_b: tl.constexpr, q2_h: tl.constexpr, q2_m: tl.constexpr,
        k_l: tl.constexpr, k_p: tl.constexpr, k_s: tl.constexpr, k_h: tl.constexpr,
        ks_l: tl.constexpr, ks_p: tl.constexpr, ks_s: tl.constexpr, ks_h: tl.constexpr,
        k2_l: tl.constexpr, k2_p: tl.constexpr, k2_s: tl.constexpr, k2_h: tl.constexpr,
        k2s_l: tl.constexpr, k2s_p: tl.constexpr, k2s_s: tl.constexpr, k2s_h: tl.constexpr,
        v_l: tl.constexpr, v_p: tl.constexpr, v_s: tl.constexpr, v_h: tl.constexpr,
        vs_l: tl.constexpr, vs_p: tl.constexpr, vs_s: tl.constexpr, vs_h: tl.constexpr,
        o_b: tl.constexpr, o_h: tl.constexpr, o_s: tl.constexpr, o_m: tl.constexpr,
        lse_b: tl.constexpr, lse_h: tl.constexpr, lse_s: tl.constexpr,
        PAGE: tl.constexpr, TILE: tl.constexpr, TILE_P: tl.constexpr, BLOCK_M: tl.constexpr,
        ROW_BLOCKS: tl.constexpr, KW: tl.constexpr, KW_P: tl.constexpr, D2: tl.constexpr, D2_P: tl.constexpr,
        VW: tl.constexpr, VW_P: tl.constexpr, HAS_ROPE: tl.constexpr, SHARED_VALUE: tl.constexpr,
        SLIDING: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Over pages in the compute dtype: [rows, lanes] tiles; *_P the power of two >= 16 a Triton
    block needs, the real lanes (KW, D2, VW) and slots a step (TILE) masked within it."""
    b, split = tl.program_id(1), tl.program_id(2)
    h, row_block = tl.program_id(0) // ROW_BLOCKS, tl.program_id(0) % ROW_BLOCKS
    # the layer's and the page's offsets in 64 bits: a pool's layer stride passes 2^31 elements
    layer, length = tl.load(layer_ptr).to(tl.int64), tl.load(lengths_ptr + b)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_lanes = tl.arange(0, KW_P)
    q = tl.load(q_ptr + b * q_b + h * q_h + rows[:, None] * q_m + q_lanes[None, :],
                mask=(q_lanes < KW)[None, :], other=0.0)  # [BLOCK_M, KW_P]
    if HAS_ROPE:
        rope_lanes = tl.arange(0, D2_P)
        q2 = tl.load(q2_ptr + b * q2_b + h * q2_h + rows[:, None] * q2_m + rope_lanes[None, :],
                     mask=(rope_lanes < D2)[None, :], other=0.0)
    tiles_per_page: tl.constexpr = PAGE // TILE
    first = split * pages_per_split * tiles_per_page
    last = tl.minimum(first + pages_per_split * tiles_per_page, tl.cdiv(length, TILE))
    if SLIDING:  # each row's first visible slot (its token's window); tiles below every row's are not read
        row_start = tl.load(starts_ptr + b * TOKENS + rows % TOKENS)
        first = tl.maximum(first, tl.min(row_start, axis=0) // TILE)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VW_P], tl.float32)
    step = tl.arange(0, TILE_P)
    for j in range(first, last):
        page = tl.load(table_ptr + b * table_stride + j // tiles_per_page).to(tl.int64)
        slots = (j % tiles_per_page) * TILE + step
        # the step's real slots, on a page this device holds (compared as a block: Triton's
        # interpreter cannot mask by a block and-ed with a scalar condition)
        real = (step < TILE) & (tl.full([TILE_P], 0, tl.int32) <= page)
        keys = _slots_tile(k_ptr + layer * k_l + page * k_p + h * k_h, k_s, slots, real, KW, KW_P)
        scores = _dot(q, tl.trans(keys), IEEE, INTERPRETED)  # [BLOCK_M, TILE_P]
        if HAS_ROPE:
            rope = _slots_tile(k2_ptr + layer * k2_l + page * k2_p + h * k2_h, k2_s, slots, real, D2, D2_P)
            scores += _dot(q2, tl.trans(rope), IEEE, INTERPRETED)
        seen = (real & ((j * TILE + step) < length))[None, :]
        if SLIDING:
            seen = seen & ((j * TILE + step)[None, :] >= row_start[:, None])
        scores = tl.where(seen, scores * scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(seen, tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        if SHARED_VALUE:  # MLA: the values are the latent keys
            values = keys
        else:
            values = _slots_tile(v_ptr + layer * v_l + page * v_p + h * v_h, v_s, slots, real, VW, VW_P)
        acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, IEEE, INTERPRETED)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    out_lanes = tl.arange(0, VW_P)
    tl.store(out_ptr + b * o_b + h * o_h + split * o_s + rows[:, None] * o_m + out_lanes[None, :], out,
             mask=(out_lanes < VW)[None, :])
    tl.store(lse_ptr + b * lse_b + h * lse_h + split * lse_s + rows,
             tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")))


@triton.jit
def _grouped(base, slot_stride, slots, GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, WIDTH: tl.constexpr,
             LANES: tl.constexpr):
    """Pointers to `slots` x GROUPS x LANES lanes of a page (WIDTH of them real), as [GROUPS_P,
    slots, LANES] (GROUPS padded to a power of two), and the mask of the real ones."""
    groups, lanes = tl.arange(0, GROUPS_P), tl.arange(0, LANES)
    pointers = base + groups[:, None, None] * WIDTH + slots[None, :, None] * slot_stride + lanes[None, None, :]
    return pointers, (groups < GROUPS)[:, None, None] & (lanes < WIDTH)[None, None, :]


@triton.jit
def _real_groups(GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, PARTS: tl.constexpr):
    """[GROUPS_P * PARTS, 1, 1]: whether entry g * PARTS + s of a batch is a real group's."""
    return ((tl.arange(0, GROUPS_P * PARTS) // PARTS) < GROUPS)[:, None, None]


@triton.jit
def _scales(base, slot_stride, slots, real, GROUPS: tl.constexpr, GROUPS_P: tl.constexpr):
    """The `slots`' float32 scales of a page, [GROUPS_P, 1, slots] (0 where a group or slot is not real)."""
    groups = tl.arange(0, GROUPS_P)
    return tl.load(base + slots[None, None, :] * slot_stride + groups[:, None, None],
                   mask=(groups < GROUPS)[:, None, None] & real[None, None, :], other=0.0)


@triton.jit
def _grouped_dot(a, b, GROUPS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """[GROUPS, M, K] . [GROUPS, K, N] -> [GROUPS, M, N] float32: one 2-D dot for one group."""
    if GROUPS == 1:
        out = _dot(tl.reshape(a, [a.shape[1], a.shape[2]]), tl.reshape(b, [b.shape[1], b.shape[2]]), IEEE, INTERPRETED)
        out = tl.reshape(out, [1, a.shape[1], b.shape[2]])
    else:
        out = _dot(a, b, IEEE, INTERPRETED)
    return out


@triton.jit
def _group_rows(GROUPS: tl.constexpr, PARTS: tl.constexpr, SUB: tl.constexpr, first_row, WIDTH: tl.constexpr,
                row_stride: tl.constexpr):
    """Offsets of [GROUPS * PARTS, SUB, 1]: entry (g * PARTS + s, r) is row first_row + s * SUB + r's
    lane group g (its first lane, g * WIDTH)."""
    batch = tl.arange(0, GROUPS * PARTS)
    rows = first_row + tl.arange(0, SUB)[None, :]
    if PARTS > 1:
        rows += (batch % PARTS)[:, None] * SUB
    return ((batch // PARTS)[:, None] * WIDTH + rows * row_stride)[:, :, None]


@triton.jit
def _each_part(x, PARTS: tl.constexpr):
    """[GROUPS, a, b] -> [GROUPS * PARTS, a, b]: each group once per row part."""
    if PARTS == 1:
        return x
    return tl.reshape(tl.broadcast_to(x[:, None, :, :], [x.shape[0], PARTS, x.shape[1], x.shape[2]]),
                      [x.shape[0] * PARTS, x.shape[1], x.shape[2]])


@triton.jit
def _per_group(x, GROUPS: tl.constexpr, PARTS: tl.constexpr):
    """[rows, n] -> [GROUPS * PARTS, rows / PARTS, n]: entry (g * PARTS + s, r) is row s * rows / PARTS + r
    (one part: [1, rows, n], which broadcasts over the groups)."""
    if PARTS == 1:
        out = x[None, :, :]
    else:
        sub: tl.constexpr = x.shape[0] // PARTS
        pieces = tl.reshape(x, [1, PARTS, sub, x.shape[1]])
        out = tl.reshape(tl.broadcast_to(pieces, [GROUPS, PARTS, sub, x.shape[1]]), [GROUPS * PARTS, sub, x.shape[1]])
    return out


@triton.jit
def paged_prefix_attention_fp8_kernel(
        layer_ptr, lengths_ptr, table_ptr, q_ptr, k_ptr, ks_ptr, q2_ptr, k2_ptr, k2s_ptr, v_ptr, vs_ptr, starts_ptr,
        scale, pages_per_split, out_ptr, lse_ptr,
        table_stride: tl.constexpr, q_b: tl.constexpr, q_h: tl.constexpr, q_m: tl.constexpr,
        q2_b: tl.constexpr, q2_h: tl.constexpr, q2_m: tl.constexpr,
        k_l: tl.constexpr, k_p: tl.constexpr, k_s: tl.constexpr, k_h: tl.constexpr,
        ks_l: tl.constexpr, ks_p: tl.constexpr, ks_s: tl.constexpr, ks_h: tl.constexpr,
        k2_l: tl.constexpr, k2_p: tl.constexpr, k2_s: tl.constexpr, k2_h: tl.constexpr,
        k2s_l: tl.constexpr, k2s_p: tl.constexpr, k2s_s: tl.constexpr, k2s_h: tl.constexpr,
        v_l: tl.constexpr, v_p: tl.constexpr, v_s: tl.constexpr, v_h: tl.constexpr,
        vs_l: tl.constexpr, vs_p: tl.constexpr, vs_s: tl.constexpr, vs_h: tl.constexpr,
        o_b: tl.constexpr, o_h: tl.constexpr, o_s: tl.constexpr, o_m: tl.constexpr,
        lse_b: tl.constexpr, lse_h: tl.constexpr, lse_s: tl.constexpr,
        PAGE: tl.constexpr, TILE: tl.constexpr, TILE_P: tl.constexpr, BLOCK_M: tl.constexpr,
        ROW_BLOCKS: tl.constexpr, KG: tl.constexpr, KG_P: tl.constexpr, KW: tl.constexpr, KW_P: tl.constexpr,
        D2: tl.constexpr, D2_P: tl.constexpr, VG: tl.constexpr, VG_P: tl.constexpr, VW: tl.constexpr,
        VW_P: tl.constexpr,
        HAS_ROPE: tl.constexpr, SHARED_VALUE: tl.constexpr, FNUZ: tl.constexpr, PARTS: tl.constexpr,
        SLIDING: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Over FP8 pages: lanes in KG (keys) / VG (values) scale groups of KW / VW lanes, [groups x
    PARTS, rows / PARTS, lanes] tiles; KG_P / VG_P the groups padded to a power of two, KW_P / VW_P /
    D2_P the power of two >= 16 a Triton block needs, the real groups, lanes and slots a step (TILE)
    masked within them."""
    b, split = tl.program_id(1), tl.program_id(2)
    h, row_block = tl.program_id(0) // ROW_BLOCKS, tl.program_id(0) % ROW_BLOCKS
    # the layer's and the page's offsets in 64 bits: a pool's layer stride passes 2^31 elements
    layer, length = tl.load(layer_ptr).to(tl.int64), tl.load(lengths_ptr + b)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    SUB: tl.constexpr = BLOCK_M // PARTS
    q_lanes = tl.arange(0, KW_P)
    q = tl.load(q_ptr + b * q_b + h * q_h + _group_rows(KG_P, PARTS, SUB, row_block * BLOCK_M, KW, q_m)
                + q_lanes[None, None, :], mask=_real_groups(KG, KG_P, PARTS) & (q_lanes < KW)[None, None, :],
                other=0.0)  # [KG_P * PARTS, SUB, KW_P]
    if HAS_ROPE:
        rope_lanes = tl.arange(0, D2_P)
        q2 = tl.load(q2_ptr + b * q2_b + h * q2_h + rows[:, None] * q2_m + rope_lanes[None, :],
                     mask=(rope_lanes < D2)[None, :], other=0.0)
    tiles_per_page: tl.constexpr = PAGE // TILE
    first = split * pages_per_split * tiles_per_page
    last = tl.minimum(first + pages_per_split * tiles_per_page, tl.cdiv(length, TILE))
    if SLIDING:  # each row's first visible slot (its token's window); tiles below every row's are not read
        row_start = tl.load(starts_ptr + b * TOKENS + rows % TOKENS)
        first = tl.maximum(first, tl.min(row_start, axis=0) // TILE)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([VG_P * PARTS, SUB, VW_P], tl.float32)
    step = tl.arange(0, TILE_P)
    for j in range(first, last):
        page = tl.load(table_ptr + b * table_stride + j // tiles_per_page).to(tl.int64)
        slots = (j % tiles_per_page) * TILE + step
        # the step's real slots, on a page this device holds (compared as a block: Triton's
        # interpreter cannot mask by a block and-ed with a scalar condition)
        real = (step < TILE) & (tl.full([TILE_P], 0, tl.int32) <= page)
        key_at, key_lanes = _grouped(k_ptr + layer * k_l + page * k_p + h * k_h, k_s, slots, KG, KG_P, KW, KW_P)
        keys = tl.load(key_at, mask=key_lanes & real[None, :, None], other=0)  # [KG_P, TILE_P, KW_P]
        keys = _each_part(_fp8_decode(keys, FNUZ).to(q.dtype), PARTS)  # [KG_P * PARTS, TILE_P, KW_P]
        partial = _grouped_dot(q, tl.permute(keys, (0, 2, 1)), KG_P * PARTS, IEEE, INTERPRETED)  # [.., SUB, TILE_P]
        key_scales = _each_part(_scales(ks_ptr + layer * ks_l + page * ks_p + h * ks_h, ks_s, slots, real, KG, KG_P),
                                PARTS)
        if PARTS == 1:
            scores = tl.sum(partial * key_scales, axis=0)
        else:
            scores = tl.reshape(tl.sum(tl.reshape(partial * key_scales, [KG_P, PARTS, SUB, TILE_P]), axis=0),
                                [BLOCK_M, TILE_P])
        if HAS_ROPE:
            rope = tl.load(k2_ptr + layer * k2_l + page * k2_p + h * k2_h + rope_lanes[:, None] + slots[None, :] * k2_s,
                           mask=(rope_lanes < D2)[:, None] & real[None, :], other=0)
            rope = _fp8_decode(rope, FNUZ).to(q2.dtype)
            rope_part = _dot(q2, rope, IEEE, INTERPRETED)
            rope_part = rope_part * tl.load(k2s_ptr + layer * k2s_l + page * k2s_p + h * k2s_h
                                            + slots[None, :] * k2s_s, mask=real[None, :], other=0.0)
            scores += rope_part
        seen = (real & ((j * TILE + step) < length))[None, :]
        if SLIDING:
            seen = seen & ((j * TILE + step)[None, :] >= row_start[:, None])
        scores = tl.where(seen, scores * scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(seen, tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        if SHARED_VALUE:  # MLA: the values are the latent keys, with their scales
            values, value_scales = keys, key_scales
        else:
            value_at, value_lanes = _grouped(v_ptr + layer * v_l + page * v_p + h * v_h, v_s, slots, VG, VG_P, VW, VW_P)
            values = tl.load(value_at, mask=value_lanes & real[None, :, None], other=0)
            values = _each_part(_fp8_decode(values, FNUZ).to(q.dtype), PARTS)
            value_scales = _each_part(_scales(vs_ptr + layer * vs_l + page * vs_p + h * vs_h, vs_s, slots, real, VG,
                                              VG_P), PARTS)
        weights = _per_group(p, VG_P, PARTS) * value_scales  # [VG_P * PARTS, SUB, TILE_P]
        acc = acc * _per_group(alpha[:, None], VG_P, PARTS) + _grouped_dot(weights.to(values.dtype), values,
                                                                           VG_P * PARTS, IEEE, INTERPRETED)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    seen = l_i > 0
    out = tl.where(_per_group(seen[:, None], VG_P, PARTS),
                   acc / _per_group(tl.where(seen, l_i, 1.0)[:, None], VG_P, PARTS), 0.0)
    out_lanes = tl.arange(0, VW_P)
    tl.store(out_ptr + b * o_b + h * o_h + split * o_s + _group_rows(VG_P, PARTS, SUB, row_block * BLOCK_M, VW, o_m)
             + out_lanes[None, None, :], out, mask=_real_groups(VG, VG_P, PARTS) & (out_lanes < VW)[None, None, :])
    tl.store(lse_ptr + b * lse_b + h * lse_h + split * lse_s + rows,
             tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")))


def _pow2(n: int) -> int:
    """The power of two >= n."""
    return 1 << (max(n, 1) - 1).bit_length()


def _block(width: int) -> int:
    """The power of two >= 16 a Triton block of `width` real elements takes."""
    return max(16, _pow2(width))


def paged_prefix_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array | None, layer, block_table: jax.Array,
                           lengths: jax.Array, *, scale: float, q2: jax.Array | None = None,
                           k2_pool: jax.Array | None = None, num_splits: int = 0, interpret: bool | None = None,
                           launch: AttentionLaunch | None = None, scales: Fp8Scales | None = None,
                           starts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of query rows over each row's committed prefix of paged K/V.

    q: [B, H, M, D] (H KV heads, M query rows each); q2 [B, H, M, D2] with k2_pool: a second
    score term (MLA's rope part). Pools [L, pages, page_size, H, D]; `v_pool` None = the values are
    `k_pool` (MLA's latent). block_table [B, P] int32 (-1: a page another device holds, never
    read), lengths [B] int32 (slots visible per row), `layer` the pool layer. `num_splits` 0 picks
    them (`attention.default_splits`). `launch` (block rows, slots a step, num_warps, num_stages)
    defaults to the launch table's entry for this form ("mla_attention" when the values are the
    keys, else "gqa_attention"; "..._fp8" over FP8 pages) on the architecture traced for. `scales`: the pools hold float8 bits (uint8) with these scales
    [L, pages, page_size, H, groups] (see `attention.Fp8Scales`). `starts` [B, T] int32 (a
    sliding-window layer): row m is token m % T's, which sees no slot below starts[b, t]; tiles
    below every row's are not read. `interpret` None: through
    jax_triton on a GPU, Triton's interpreter elsewhere. Returns out [B, H, M, Dv] float32
    (softmax-normalised over the prefix) and lse [B, H, M] float32 (-inf where a row's prefix is
    empty).
    """
    b, h, m, d = q.shape
    _, _, page_size, _, _ = k_pool.shape
    shared_value = v_pool is None
    dv = (k_pool if shared_value else v_pool).shape[-1]
    form = "mla_attention" if shared_value else "gqa_attention"
    if launch is None:
        launch = launch_table.launch(form + ("_fp8" if scales is not None else ""))
    itemsize = jnp.dtype(q.dtype).itemsize
    block = block_rows_for(m, dv, itemsize, launch, 512 if shared_value else 128)
    rows = -(-m // block) * block
    tile = launch.tile(page_size, itemsize) or page_size
    if page_size % tile:
        tile = page_size  # a page a step (its slots padded to a block and masked)
    if scales is None:
        kernel, widths = paged_prefix_attention_kernel, dict(KW=d, KW_P=_block(d), VW=dv, VW_P=_block(dv))
    else:  # lanes in scale groups: the scores and probabilities scaled per group
        kg, vg = scales.k.shape[-1], (scales.k if shared_value else scales.v).shape[-1]
        kernel = paged_prefix_attention_fp8_kernel
        if scales.k2 is not None and scales.k2.shape[-1] != 1:
            raise ValueError(f"the FP8 attention kernel scales a rope key of {q2.shape[-1]} lanes as one group; "
                             f"its pool has {scales.k2.shape[-1]} scale groups")
        parts = launch.row_parts if kg > 1 else 1  # the batched dots' row parts, 16 rows or more each
        while parts > 1 and (block // parts < 16 or block % parts):
            parts //= 2
        widths = dict(KG=kg, KG_P=_pow2(kg), KW=d // kg, KW_P=_block(d // kg), VG=vg, VG_P=_pow2(vg), VW=dv // vg,
                      VW_P=_block(dv // vg), FNUZ=bool(scales.fnuz), PARTS=parts)
    if num_splits <= 0:  # interpreted, programs run one after another: a split only adds its overhead
        interpreting = triton_call.interpreted() if interpret is None else interpret
        num_splits = 1 if interpreting else default_splits(b, h, m, block_table.shape[1], dv, itemsize, launch, form,
                                                           page_size, jnp.dtype(k_pool.dtype).itemsize)
    pages_per_split = -(-block_table.shape[1] // num_splits)
    pad = ((0, 0), (0, 0), (0, rows - m), (0, 0))
    q = jnp.pad(q, pad)
    q2 = jnp.pad(q2, pad) if q2 is not None else q[..., :16]
    absent = jnp.zeros((1,), jnp.float32)  # a pointer the kernel's flags keep it from reading
    k_scales = scales.k if scales is not None else absent
    k2 = k2_pool if k2_pool is not None else k_pool
    k2_scales = scales.k2 if scales is not None and scales.k2 is not None else absent
    v = v_pool if v_pool is not None else k_pool
    v_scales = scales.v if scales is not None and scales.v is not None else absent
    out_shapes = [jax.ShapeDtypeStruct((b, h, num_splits, rows, dv), jnp.float32),
                  jax.ShapeDtypeStruct((b, h, num_splits, rows), jnp.float32)]

    def pool_strides(x):  # [L, pages, slots, heads, lanes] -> the first four strides (0s for an absent one)
        return triton_call.strides(x)[:4] if x.ndim == 5 else (0, 0, 0, 0)

    out_strides = triton_call.strides(out_shapes[0])
    lse_strides = triton_call.strides(out_shapes[1])
    args = [jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), block_table.astype(jnp.int32), q,
            k_pool, k_scales, q2, k2, k2_scales, v, v_scales,
            absent if starts is None else starts.astype(jnp.int32), float(scale), int(pages_per_split)]
    # strides as constexprs: the compiler then knows each slot's lanes start 16-byte aligned and
    # loads them in vectors (as scalar arguments they would be unknown, and loaded an element at a time)
    stride_names = ("table_stride q_b q_h q_m q2_b q2_h q2_m k_l k_p k_s k_h ks_l ks_p ks_s ks_h k2_l k2_p k2_s k2_h "
                    "k2s_l k2s_p k2s_s k2s_h v_l v_p v_s v_h vs_l vs_p vs_s vs_h o_b o_h o_s o_m lse_b lse_h lse_s").split()
    stride_values = (block_table.shape[1], *triton_call.strides(q)[:3], *triton_call.strides(q2)[:3],
                     *pool_strides(k_pool), *pool_strides(k_scales), *pool_strides(k2), *pool_strides(k2_scales),
                     *pool_strides(v), *pool_strides(v_scales), *out_strides[:4], *lse_strides[:3])
    out, lse = triton_call.call(
        # a row's heads and row tiles on the grid's first axis, which GPUs dispatch first: the tiles
        # that read the same pages run side by side, so a page re-read by the next tile comes from L2
        kernel, out_shapes, *args, grid=(h * (rows // block), b, num_splits),
        num_warps=launch.num_warps, num_stages=launch.num_stages, interpret=interpret,
        name=f"eagle3_paged_prefix_attention_{form.split('_')[0]}{'' if scales is None else '_fp8'}",
        **dict(zip(stride_names, stride_values)),
        PAGE=page_size, TILE=tile, TILE_P=_block(tile), BLOCK_M=block, ROW_BLOCKS=rows // block,
        D2=q2.shape[-1], D2_P=_block(q2.shape[-1]), HAS_ROPE=k2_pool is not None, SHARED_VALUE=shared_value,
        SLIDING=starts is not None, TOKENS=1 if starts is None else starts.shape[1],
        IEEE=q.dtype == jnp.float32, **widths)
    out, lse = merge_splits(out, lse)
    return out[:, :, :m], lse[:, :, :m]
