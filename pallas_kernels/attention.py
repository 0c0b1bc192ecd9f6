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
Portable subset only: grid + BlockSpecs, whole-array refs indexed in kernel, `fori_loop` with
traced bounds, 2-D dots with float32 accumulation, no scalar prefetch, no dynamic grid.
`paged_prefix_attention_reference` is the pure-jnp twin the tests compare with.
"""

from __future__ import annotations

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


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, *refs, page_size: int, tile: int, pages_per_split: int,
            row_blocks: int, scale: float, has_rope: bool, shared_value: bool):
    refs = list(refs)
    q2_ref = refs.pop(0) if has_rope else None
    k2_ref = refs.pop(0) if has_rope else None
    v_ref = None if shared_value else refs.pop(0)
    o_ref, lse_ref = refs
    b, split = pl.program_id(0), pl.program_id(2)
    h = pl.program_id(1) // row_blocks
    layer, length = layer_ref[0], lengths_ref[b]
    q = q_ref[...]
    q2 = q2_ref[...] if has_rope else None
    # the walk steps `tile` slots at a time: a page of page_size slots is page_size // tile steps
    tiles_per_page = page_size // tile
    first = split * pages_per_split * tiles_per_page
    last = jnp.minimum(first + pages_per_split * tiles_per_page, (length + tile - 1) // tile)
    rows = q.shape[0]
    dv = o_ref.shape[-1]

    def body(j, carry):
        m, l, acc = carry
        page = table_ref[b, j // tiles_per_page]
        within = pl.ds((j % tiles_per_page) * tile, tile)
        k = k_ref[layer, page, within, h, :]  # [tile, D]
        scores = _dot_t(q, k)
        if has_rope:
            scores = scores + _dot_t(q2, k2_ref[layer, page, within, h, :])
        slots = j * tile + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        valid = slots < length
        scores = jnp.where(valid, scores * scale, _NEG)
        m_new = jnp.maximum(m, scores.max(axis=1))
        p = jnp.where(valid, jnp.exp(scores - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        v = k if shared_value else v_ref[layer, page, within, h, :]
        acc = acc * alpha[:, None] + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                         precision=PRECISION, preferred_element_type=jnp.float32)
        return m_new, l * alpha + p.sum(axis=1), acc

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, dv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    seen = l > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0)
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
                           launch: AttentionLaunch | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of query rows over each row's committed prefix of paged K/V.

    q: [B, H, M, D] (H KV heads, M query rows each); q2 [B, H, M, D2] with k2_pool: a second
    score term (MLA's rope part). Pools [L, pages, page_size, H, D]; `v_pool` None = the values are
    `k_pool` (MLA's latent). block_table [B, P] int32, lengths [B] int32 (slots visible per row),
    `layer` the pool layer. `num_splits` 0 picks them (`default_splits`); on a GPU the pages must
    be ones the kernel can tile (`pages_fit`). `launch` (block rows, num_warps, num_stages) defaults to the launch
    table's entry for this form ("mla_attention" when the values are the keys, else
    "gqa_attention") on the architecture traced for. Returns out [B, H, M, Dv] float32
    (softmax-normalised over the prefix) and lse [B, H, M] float32 (-inf where a row's prefix is
    empty).
    """
    from jax.experimental.pallas import triton as plt

    b, h, m, d = q.shape
    _, _, page_size, _, _ = k_pool.shape
    dv = (k_pool if v_pool is None else v_pool).shape[-1]
    form = "mla_attention" if v_pool is None else "gqa_attention"
    launch = launch_table.launch(form) if launch is None else launch
    block = block_rows_for(m, dv, jnp.dtype(k_pool.dtype).itemsize, launch, 512 if form == "mla_attention" else 128)
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
        num_splits = default_splits(b, h, m, block_table.shape[1], dv, jnp.dtype(k_pool.dtype).itemsize, launch, form)
    pages_per_split = pl.cdiv(block_table.shape[1], num_splits)

    def row_spec(dim: int) -> pl.BlockSpec:  # axis 1 of the grid walks (head, row block) pairs
        return pl.BlockSpec((None, None, block, dim), lambda i, j, s: (i, j // row_blocks, j % row_blocks, 0))

    whole = pl.no_block_spec
    inputs = [jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32), block_table.astype(jnp.int32), q, k_pool]
    in_specs = [whole, whole, whole, row_spec(d), whole]
    if has_rope:
        inputs += [jnp.pad(q2, pad), k2_pool]
        in_specs += [row_spec(q2.shape[-1]), whole]
    if v_pool is not None:
        inputs.append(v_pool)
        in_specs.append(whole)
    tile = _tile(page_size, launch, jnp.dtype(k_pool.dtype).itemsize)
    kernel = functools.partial(_kernel, page_size=page_size, tile=tile, pages_per_split=pages_per_split,
                               row_blocks=row_blocks, scale=scale, has_rope=has_rope, shared_value=v_pool is None)
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


def paged_prefix_attention_reference(q, k_pool, v_pool, layer, block_table, lengths, *, scale, q2=None, k2_pool=None,
                                     **_) -> tuple[jax.Array, jax.Array]:
    """`paged_prefix_attention` in plain jnp: gather every page of the table, mask, softmax."""
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
