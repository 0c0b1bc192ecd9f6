"""Paged attention over a row's committed prefix, for decode and verify: the contract the Triton
kernel (triton_attention.py) implements, the pieces around it, and its XLA twin.

The T new tokens of a decode or verify step attend to (a) the committed prefix of their row, held in
KV pages, and (b) each other through the draft tree's mask. The kernel does (a): for every row and
KV head it walks only the pages below the row's length (read through the block table) with an
online softmax in float32, and returns the partial result as (out, lse), so that (b), a tiny
[T, T] problem, is merged outside (`merge_partials`). Long prefixes are split over KV splits per
row and head (flash-decoding, `default_splits`), merged the same way (`merge_splits`).

One kernel serves both attention kinds, as "M query rows against one shared key per slot":
- GQA: per KV head, the group's query heads x T tokens are the rows; keys and values are that
  head's K and V pages;
- MLA (absorbed): all query heads x T tokens are the rows of the single "head"; the key is the
  latent (rank r) plus the roped key (dr) as two dots, and the value is the latent itself.

The rows of a head are cut into tiles of `block_rows_for` rows (a power of two >= 16, Triton's
smallest dot), set by the launch table per architecture (launch.py) for what the registers hold.
FP8 pages (the KV cache's `kv_cache_dtype="fp8"`: float8 bits with a float32 scale per slot per
group of lanes, eagle3_jax/cache/kv_cache.py) are described by `Fp8Scales`.
`paged_prefix_attention_reference` is the pure-jnp twin the tests compare the kernel with.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle3_jax.weights.quant import PRECISION  # every dot states it: float32 stays IEEE float32 on GPUs
from pallas_kernels import launch as launch_table
from pallas_kernels.launch import AttentionLaunch

_MIN_ROWS = 16
# Programs a launch aims for when it picks its own KV splits: about two per multiprocessor of an
# H100 / H200 (132) or an MI300X-class GPU (304 CUs: one and a bit). A program walks its share of
# the prefix one tile after another, so with few programs the walk is latency-bound: measured on an
# H200 (benchmarks/notes/2026-11-27-gpu-proof-h200.md), Kimi-K2.5's batch-1 decode with 16 programs
# read its 8K prefix at 30 GB/s.
TARGET_PROGRAMS = 256
MAX_SPLITS = 32
# Every split loads its row tile's queries again: a split reads at least this many times as many
# key bytes as query bytes (the queries and keys of a slot are as wide), so they stay a small part
# of its loads (at Kimi-K2.5's 64-row tiles over bfloat16 pages: 256 slots a split).
MIN_KEYS_PER_QUERY_BYTE = 4


def _rows_bucket(m: int) -> int:
    return max(_MIN_ROWS, 1 << (max(m, 1) - 1).bit_length())


def default_splits(batch: int, heads: int, rows: int, table_pages: int, dv: int, itemsize: int,
                   launch: AttentionLaunch | None = None, form: str = "mla_attention", page_size: int = 16,
                   kv_itemsize: int | None = None) -> int:
    """KV splits per (row, head x row block) so a launch has about TARGET_PROGRAMS programs, at most
    MAX_SPLITS, one page of the table per split, and MIN_KEYS_PER_QUERY_BYTE key bytes a query byte
    (pages of `page_size` slots of `kv_itemsize` bytes a lane: FP8 pages 1)."""
    launch = launch_table.launch(form) if launch is None else launch
    block = block_rows_for(rows, dv, itemsize, launch, 512 if form == "mla_attention" else 128)
    programs = batch * heads * -(-rows // block)
    slots = table_pages * page_size
    by_reads = slots * (kv_itemsize or itemsize) // (MIN_KEYS_PER_QUERY_BYTE * block * itemsize)
    return int(max(1, min(MAX_SPLITS, table_pages, TARGET_PROGRAMS // programs, by_reads)))


def block_rows_for(rows: int, dv: int, itemsize: int, launch: AttentionLaunch, reference_dv: int) -> int:
    """Query rows per program: the launch table's block, which is set for 2-byte operands and
    values `reference_dv` wide (512 for MLA's latent, 128 for GQA); wider values or wider operands
    get proportionally fewer rows (the accumulator and the queries are what fill the registers);
    never more than the rows there are (padded to a power of two >= 16)."""
    budget = launch.block_rows * reference_dv * 2 // (max(dv, reference_dv) * max(itemsize, 2))
    return max(_MIN_ROWS, min(_rows_bucket(rows), 1 << (max(budget, 1).bit_length() - 1)))


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
                                     scales: Fp8Scales | None = None, starts=None, **_) -> tuple[jax.Array, jax.Array]:
    """`paged_prefix_attention` in plain jnp: gather every page of the table, mask, softmax."""
    if scales is not None:
        k_pool = dequantized_pool(k_pool, scales.k, scales.fnuz)
        v_pool = None if v_pool is None else dequantized_pool(v_pool, scales.v, scales.fnuz)
        k2_pool = None if k2_pool is None else dequantized_pool(k2_pool, scales.k2, scales.fnuz)

    def gather(pool):
        pages = pool[layer][jnp.maximum(block_table, 0)]  # [B, P, ps, H, D]
        return pages.reshape((pages.shape[0], -1) + pages.shape[3:])

    keys = gather(k_pool)
    held = jnp.repeat(block_table >= 0, k_pool.shape[2], axis=1)  # [B, S]: -1 entries are another device's pages
    scores = jnp.einsum("bhmd,bshd->bhms", q, keys, precision=PRECISION, preferred_element_type=jnp.float32)
    if q2 is not None:
        scores = scores + jnp.einsum("bhmd,bshd->bhms", q2, gather(k2_pool), precision=PRECISION,
                                     preferred_element_type=jnp.float32)
    slots = jnp.arange(keys.shape[1])
    visible = ((slots[None, :] < lengths[:, None]) & held)[:, None, None, :]  # [B, 1, 1, S]
    if starts is not None:  # row m is token m % T's, seeing no slot below its start
        row_start = jnp.tile(starts, (1, q.shape[2] // starts.shape[1]))  # [B, M]
        visible = visible & (slots[None, None, None, :] >= row_start[:, None, :, None])
    scores = jnp.where(visible, scores * scale, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    values = keys if v_pool is None else gather(v_pool)
    out = jnp.einsum("bhms,bshd->bhmd", probs, values.astype(jnp.float32), precision=PRECISION)
    return out, lse
