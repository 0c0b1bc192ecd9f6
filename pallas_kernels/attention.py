"""Paged attention over a row's committed prefix, for decode and verify (Pallas, Triton-shaped).

The T new tokens of a decode or verify step attend to (a) the committed prefix of their row, held in
KV pages, and (b) each other through the draft tree's mask. This kernel does (a): for every row
and KV head it walks only the pages below the row's length (read through the block table, in
kernel) with an online softmax in float32, and returns the unnormalised-free partial result as
(out, lse), so that (b), a tiny [T, T] problem, is merged outside (`merge_partials`). Long
prefixes are split over `num_splits` programs per row and head (flash-decoding), merged the same
way.

One kernel serves both attention kinds, as "M query rows against one shared key per slot":
- GQA: per KV head, the group's query heads x T tokens are the rows; keys and values are that
  head's K and V pages;
- MLA (absorbed): all query heads x T tokens are the rows of the single "head"; the key is the
  latent (rank r) plus the roped key (dr) as two dots, and the value is the latent itself.

The rows of a head are cut into blocks of `block_rows` (power of two >= 16, Triton's smallest
dot), one program per (row, head x row block, split): each program holds a float32 [block_rows,
Dv] accumulator and its [block_rows, D] queries in registers for its whole walk, so the block, not
the heads x tokens of a step, sets the registers (Kimi-K2.5 verifying a 64-node tree has 64 x 64
MLA rows of 512 lanes). The blocks of one head read the same pages, which stay in L2 between them.
Block rows, num_warps and num_stages come from the launch table per architecture (launch.py).
FP8 pages (the KV cache's `kv_cache_dtype="fp8"`: float8 values with a float32 scale per slot per
group of lanes, eagle3_jax/cache/kv_cache.py) come in as their bits (uint8) beside their scales and
are decoded in registers (`fp8_decode`: integer ops into float32's fields, as Pallas' Triton
lowering casts from neither e4m3fnuz, gfx942's flavour, nor, before sm_89, e4m3fn). A group's scale
multiplies its part of the scores, and for values the probabilities before the dot, so the decoded
tile itself is exact in the compute dtype (3 mantissa bits) and never scaled.
Portable subset only: grid + BlockSpecs, whole-array refs indexed in kernel, `fori_loop` with
traced bounds, 2-D dots with float32 accumulation, no scalar prefetch, no dynamic grid.
`paged_prefix_attention_reference` is the pure-jnp twin the tests compare with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from eagle3_jax.weights.quant import PRECISION  # every dot states it: float32 stays IEEE float32 on GPUs
from pallas_kernels import launch as launch_table
from pallas_kernels.launch import AttentionLaunch

_NEG = -1e30
_MIN_ROWS = 16
# Programs a launch aims for when it picks its own KV splits: about two per multiprocessor of an
# H100 / H200 (132) or an MI300X-class GPU (304 CUs: one and a bit). A program walks its share of
# the prefix one tile after another, so with few programs the walk is latency-bound: measured on an
# H200 (benchmarks/notes/2026-11-27-gpu-proof-h200.md), Kimi-K2.5's batch-1 decode with 16 programs
# read its 8K prefix at 30 GB/s.
TARGET_PROGRAMS = 256
MAX_SPLITS = 32


def _rows_bucket(m: int) -> int:
    return max(_MIN_ROWS, pl.next_power_of_2(m))


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, D] . b [N, D]^T -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=PRECISION,
                               preferred_element_type=jnp.float32)


def fp8_decode(bits: jax.Array, fnuz: bool) -> jax.Array:
    """float8 e4m3 bits (uint8) -> float32: e4m3fn (exponent bias 7) or e4m3fnuz (bias 8, gfx942's).
    The sign, exponent and mantissa bits placed at float16's read as +-(1 + m / 8) 2^(e - 15), or for
    e = 0 as float16's subnormal +-m / 8 2^-14: one multiply by 2^(15 - bias) makes either the float8
    value (float16 subnormals convert exactly to normal float32s, which no device flushes). The NaN
    codes are never written."""
    b = bits.astype(jnp.int32)
    half = jax.lax.shift_left(b & 0x80, 8) | jax.lax.shift_left(b & 0x7F, 7)
    value = jax.lax.bitcast_convert_type(half.astype(jnp.int16), jnp.float16).astype(jnp.float32)
    return value * (2.0 ** (15 - (8 if fnuz else 7)))


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, *refs, page_size: int, tile: int, pages_per_split: int,
            row_blocks: int, scale: float, has_rope: bool, shared_value: bool, fp8: tuple[bool, int, int] | None):
    refs = list(refs)
    scaled = fp8 is not None  # (fnuz, key groups, value groups): pages of float8 bits with their scales
    ks_ref = refs.pop(0) if scaled else None
    q2_ref = refs.pop(0) if has_rope else None
    k2_ref = refs.pop(0) if has_rope else None
    k2s_ref = refs.pop(0) if has_rope and scaled else None
    v_ref = None if shared_value else refs.pop(0)
    vs_ref = None if shared_value or not scaled else refs.pop(0)
    o_ref, lse_ref = refs
    b, split = pl.program_id(0), pl.program_id(2)
    h = pl.program_id(1) // row_blocks
    layer, length = layer_ref[0], lengths_ref[b]
    fnuz, k_groups, v_groups = fp8 if scaled else (False, 1, 1)
    d, dv = q_ref.shape[-1], o_ref.shape[-1]
    kw, vw = d // k_groups, dv // v_groups
    qs = [q_ref[...]] if k_groups == 1 else [q_ref[:, pl.ds(g * kw, kw)] for g in range(k_groups)]
    q2 = q2_ref[...] if has_rope else None
    # the walk steps `tile` slots at a time: a page of page_size slots is page_size // tile steps
    tiles_per_page = page_size // tile
    first = split * pages_per_split * tiles_per_page
    last = jnp.minimum(first + pages_per_split * tiles_per_page, (length + tile - 1) // tile)
    rows = qs[0].shape[0]

    def body(j, carry):
        m, l, accs = carry[0], carry[1], carry[2:]
        page = table_ref[b, j // tiles_per_page]
        within = pl.ds((j % tiles_per_page) * tile, tile)

        def load(ref, scales_ref, g, width):  # a lane group of this tile's slots [tile, width], its scales [1, tile]
            x = ref[layer, page, within, h, pl.ds(g * width, width)]
            if scales_ref is None:
                return x, None
            return fp8_decode(x, fnuz).astype(qs[0].dtype), scales_ref[layer, page, within, h, g][None, :]

        def times(x, s):
            return x if s is None else x * s

        keys = [load(k_ref, ks_ref, g, kw) for g in range(k_groups)]
        parts = [times(_dot_t(qg, k), s) for qg, (k, s) in zip(qs, keys)]
        if has_rope:
            rope, rope_scales = load(k2_ref, k2s_ref, 0, q2.shape[-1])
            parts.append(times(_dot_t(q2, rope), rope_scales))
        scores = functools.reduce(jnp.add, parts)
        slots = j * tile + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        valid = slots < length
        scores = jnp.where(valid, scores * scale, _NEG)
        m_new = jnp.maximum(m, scores.max(axis=1))
        p = jnp.where(valid, jnp.exp(scores - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        values = keys if shared_value else [load(v_ref, vs_ref, g, vw) for g in range(v_groups)]
        accs = [acc * alpha[:, None] + jax.lax.dot_general(times(p, s).astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                           precision=PRECISION, preferred_element_type=jnp.float32)
                for acc, (v, s) in zip(accs, values)]
        return (m_new, l * alpha + p.sum(axis=1), *accs)

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            *(jnp.zeros((rows, vw), jnp.float32) for _ in range(v_groups)))
    m, l, *accs = jax.lax.fori_loop(first, last, body, init)
    seen = l > 0
    for g, acc in enumerate(accs):
        out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
        if v_groups == 1:
            o_ref[...] = out
        else:
            o_ref[:, pl.ds(g * vw, vw)] = out
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def pages_fit(page_size: int, launch: AttentionLaunch | None = None, form: str = "mla_attention",
              interpret: bool = False) -> bool:
    """Whether the kernel can walk pages of `page_size` slots (`AttentionLaunch.walks`; a dense
    cache whose length it cannot tile keeps the XLA path). Interpreted (a CPU host), any size runs."""
    launch = launch_table.launch(form) if launch is None else launch
    return interpret or launch.walks(page_size)


def _tile(page_size: int, launch: AttentionLaunch, itemsize: int) -> int:
    """Slots per step of the walk (`AttentionLaunch.tile`); interpreted, a page it cannot tile is
    walked whole."""
    return launch.tile(page_size, itemsize) or page_size


def default_splits(batch: int, heads: int, rows: int, table_pages: int, dv: int, itemsize: int,
                   launch: AttentionLaunch | None = None, form: str = "mla_attention") -> int:
    """KV splits per (row, head x row block) so a launch has about TARGET_PROGRAMS programs, at most
    MAX_SPLITS and one page of the table per split."""
    launch = launch_table.launch(form) if launch is None else launch
    block = block_rows_for(rows, dv, itemsize, launch, 512 if form == "mla_attention" else 128)
    programs = batch * heads * pl.cdiv(rows, block)
    return int(max(1, min(MAX_SPLITS, table_pages, TARGET_PROGRAMS // programs)))


def block_rows_for(rows: int, dv: int, itemsize: int, launch: AttentionLaunch, reference_dv: int) -> int:
    """Query rows per program: the launch table's block, which is set for 2-byte operands and
    values `reference_dv` wide (512 for MLA's latent, 128 for GQA); wider values or wider operands
    get proportionally fewer rows (the accumulator and the queries are what fill the registers);
    never more than the rows there are (padded to a power of two >= 16)."""
    budget = launch.block_rows * reference_dv * 2 // (max(dv, reference_dv) * max(itemsize, 2))
    return max(_MIN_ROWS, min(_rows_bucket(rows), 1 << (max(budget, 1).bit_length() - 1)))


def paged_prefix_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array | None, layer, block_table: jax.Array,
                           lengths: jax.Array, *, scale: float, q2: jax.Array | None = None,
                           k2_pool: jax.Array | None = None, num_splits: int = 0, interpret: bool = False,
                           launch: AttentionLaunch | None = None, scales: Fp8Scales | None = None
                           ) -> tuple[jax.Array, jax.Array]:
    """Attention of query rows over each row's committed prefix of paged K/V.

    q: [B, H, M, D] (H KV heads, M query rows each); q2 [B, H, M, D2] with k2_pool: a second
    score term (MLA's rope part). Pools [L, pages, page_size, H, D]; `v_pool` None = the values are
    `k_pool` (MLA's latent). block_table [B, P] int32, lengths [B] int32 (slots visible per row),
    `layer` the pool layer. `num_splits` 0 picks them (`default_splits`); on a GPU the pages must
    be ones the kernel can tile (`pages_fit`). `launch` (block rows, num_warps, num_stages) defaults to the launch
    table's entry for this form ("mla_attention" when the values are the keys, else
    "gqa_attention"; "..._fp8" over FP8 pages) on the architecture traced for. `scales`: the pools hold float8 bits
    (uint8) with these scales [L, pages, page_size, H, groups] (see `Fp8Scales`). Returns out
    [B, H, M, Dv] float32 (softmax-normalised over the prefix) and lse [B, H, M] float32 (-inf where
    a row's prefix is empty).
    """
    from jax.experimental.pallas import triton as plt

    b, h, m, d = q.shape
    _, _, page_size, _, _ = k_pool.shape
    dv = (k_pool if v_pool is None else v_pool).shape[-1]
    form = "mla_attention" if v_pool is None else "gqa_attention"
    if launch is None:  # FP8 pages have their own entries: decoding them takes registers
        launch = launch_table.launch(form + ("_fp8" if scales is not None else ""))
    itemsize = jnp.dtype(q.dtype).itemsize  # what the registers hold (FP8 pages are decoded to it)
    block = block_rows_for(m, dv, itemsize, launch, 512 if form == "mla_attention" else 128)
    rows = pl.cdiv(m, block) * block
    row_blocks = rows // block
    pad = ((0, 0), (0, 0), (0, rows - m), (0, 0))
    q = jnp.pad(q, pad)
    has_rope = q2 is not None
    if not pages_fit(page_size, launch, interpret=interpret):
        raise ValueError(f"pages of {page_size} slots are neither a multiple of "
                         f"{min(launch.block_slots, 16)} slots nor one power-of-two page of at least 16; use the XLA "
                         "path for this cache")
    if num_splits <= 0:
        num_splits = default_splits(b, h, m, block_table.shape[1], dv, itemsize, launch, form)
    pages_per_split = pl.cdiv(block_table.shape[1], num_splits)

    def row_spec(dim: int) -> pl.BlockSpec:  # axis 1 of the grid walks (head, row block) pairs
        return pl.BlockSpec((None, None, block, dim), lambda i, j, s: (i, j // row_blocks, j % row_blocks, 0))

    whole = pl.no_block_spec
    def pool(x, x_scales):  # a pool, and its scales when its pages are float8 bits
        return [(x, whole)] + ([] if scales is None else [(x_scales, whole)])

    operands = [(jnp.asarray(layer, jnp.int32).reshape(1), whole), (lengths.astype(jnp.int32), whole),
                (block_table.astype(jnp.int32), whole), (q, row_spec(d))] + pool(k_pool, scales and scales.k)
    if has_rope:
        operands += [(jnp.pad(q2, pad), row_spec(q2.shape[-1]))] + pool(k2_pool, scales and scales.k2)
    if v_pool is not None:
        operands += pool(v_pool, scales and scales.v)
    inputs, in_specs = (list(x) for x in zip(*operands))
    fp8 = None if scales is None else (scales.fnuz, scales.k.shape[-1], (scales.k if v_pool is None else scales.v).shape[-1])
    tile = _tile(page_size, launch, itemsize)
    kernel = functools.partial(_kernel, page_size=page_size, tile=tile, pages_per_split=pages_per_split,
                               row_blocks=row_blocks, scale=scale, has_rope=has_rope, shared_value=v_pool is None,
                               fp8=fp8)
    out_shape = [jax.ShapeDtypeStruct((b, h, num_splits, rows, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, num_splits, rows), jnp.float32)]
    out, lse = launch_table.call(pl.pallas_call(
        kernel,
        grid=(b, h * row_blocks, num_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, block, dv), lambda i, j, s: (i, j // row_blocks, s, j % row_blocks, 0)),
                   pl.BlockSpec((None, None, None, block), lambda i, j, s: (i, j // row_blocks, s, j % row_blocks))],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        name=f"eagle3_paged_prefix_attention_{form.split('_')[0]}",  # _mla / _gqa: the form shows in profiles
    ), out_shape, *inputs)
    out, lse = merge_splits(out, lse)
    return out[:, :, :m], lse[:, :, :m]


@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """The float32 scales of FP8 pools given as their bits: `k` [L, pages, page_size, H, groups]
    (a group per `d / groups` lanes), `v` the value pool's (GQA), `k2` the second key pool's (MLA's
    rope key); `fnuz`: the bits are e4m3fnuz (gfx942), else e4m3fn."""

    k: jax.Array
    v: jax.Array | None = None
    k2: jax.Array | None = None
    fnuz: bool = False


def merge_splits(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Partials over KV splits [B, H, S, M, Dv] / [B, H, S, M] -> one (out, lse)."""
    top = jnp.max(lse, axis=2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top)  # 0 for empty splits
    total = w.sum(axis=2)
    merged = (out * w[..., None]).sum(axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return merged, jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + top[:, :, 0], -jnp.inf)


def merge_partials(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax over the union of two disjoint key sets from their partial results (out [..., Dv],
    lse [...]); at least one side must see a key for every row."""
    top = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None]


def dequantized_pool(bits: jax.Array, scales: jax.Array, fnuz: bool) -> jax.Array:
    """float32 values of a pool of float8 bits [..., D] with its scales [..., groups]."""
    x = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn).astype(jnp.float32)
    groups = scales.shape[-1]
    return (x.reshape(x.shape[:-1] + (groups, -1)) * scales[..., None]).reshape(x.shape)


def paged_prefix_attention_reference(q, k_pool, v_pool, layer, block_table, lengths, *, scale, q2=None, k2_pool=None,
                                     scales: Fp8Scales | None = None, **_) -> tuple[jax.Array, jax.Array]:
    """`paged_prefix_attention` in plain jnp: gather every page of the table, mask, softmax."""
    if scales is not None:
        k_pool = dequantized_pool(k_pool, scales.k, scales.fnuz)
        v_pool = None if v_pool is None else dequantized_pool(v_pool, scales.v, scales.fnuz)
        k2_pool = None if k2_pool is None else dequantized_pool(k2_pool, scales.k2, scales.fnuz)

    def gather(pool):
        pages = pool[layer][block_table]  # [B, P, ps, H, D]
        return pages.reshape((pages.shape[0], -1) + pages.shape[3:])

    keys = gather(k_pool)
    scores = jnp.einsum("bhmd,bshd->bhms", q, keys, precision=PRECISION, preferred_element_type=jnp.float32)
    if q2 is not None:
        scores = scores + jnp.einsum("bhmd,bshd->bhms", q2, gather(k2_pool), precision=PRECISION,
                                     preferred_element_type=jnp.float32)
    visible = jnp.arange(keys.shape[1])[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None, :], scores * scale, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(visible[:, None, None, :], jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    values = keys if v_pool is None else gather(v_pool)
    out = jnp.einsum("bhms,bshd->bhmd", probs, values.astype(jnp.float32), precision=PRECISION)
    return out, lse
