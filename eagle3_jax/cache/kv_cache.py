"""KV cache: dense (one slot row per sequence) or paged (a shared pool of fixed-size pages).

Layouts (stacked over all layers, so one scan over layers indexes it):
- GQA: `k`, `v` hold K and V, [..., kv_heads, head_dim].
- MLA: `k` holds the normalised latent `kv_a_layernorm(c_kv)` [..., kv_lora_rank] and `v` the
  roped shared key `k_pe` [..., qk_rope_head_dim]; per-head K/V are never stored.
The leading axes are [L, B, S] (dense) or [L, num_pages, page_size] (paged). A paged cache also
carries `block_table` [B, P]: logical slot s of row b lives at page block_table[b, s // page_size],
offset s % page_size, so a row sees at most P * page_size slots. Page 0 is the reserved scratch
page: unassigned table entries point at it, so writes of padding rows and padded tokens land
there and are never visible to a real query.

A forward pass writes the K/V of its T new tokens at slots `lengths[b] + t` and leaves `lengths`
alone; the caller decides how many of them to keep (`advance`). Slots at or past a row's length
are never visible to later queries, so rejected or padded tokens need no clean-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.launch import scatter_in_place

from ..config.model import ModelConfig

SCRATCH_PAGE = 0


@struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [B] int32: committed tokens per sequence
    block_table: jax.Array | None = None  # [B, P] int32 page ids (paged layout only)

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def page_size(self) -> int:
        """Slots per page (paged layout)."""
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        """Slots one row can address."""
        return self.block_table.shape[1] * self.k.shape[2] if self.paged else self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def _feature_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if cfg.attention == "mla":
        return (cfg.kv_lora_rank,), (cfg.qk_rope_head_dim,)
    kv = (cfg.num_kv_heads, cfg.head_dim)
    return kv, kv


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Dense shapes of `k` and `v`: [L, batch, max_len, ...]."""
    fk, fv = _feature_shapes(cfg)
    return (cfg.num_layers, batch, max_len) + fk, (cfg.num_layers, batch, max_len) + fv


def cache_axes(cfg: ModelConfig) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """Logical axes of dense `k` and `v` (see runtime/sharding.py); a paged pool has no batch axis."""
    if cfg.attention == "mla":
        return ("layers", "batch", "seq", "kv_lora"), ("layers", "batch", "seq", None)
    kv = ("layers", "batch", "seq", "kv_heads", None)
    return kv, kv


def paged_axes(cfg: ModelConfig) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """Logical axes of paged pools [L, pages, page_size, ...]: pages are shared by all rows."""
    k_axes, v_axes = cache_axes(cfg)
    return ("layers", None, None) + k_axes[3:], ("layers", None, None) + v_axes[3:]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    ks, vs = cache_shapes(cfg, batch, max_len)
    return KVCache(k=jnp.zeros(ks, dtype), v=jnp.zeros(vs, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """Zeroed page pools (k, v) [L, num_pages, page_size, ...]; page 0 is the scratch page."""
    ks, vs = cache_shapes(cfg, num_pages, page_size)
    return jnp.zeros(ks, dtype), jnp.zeros(vs, dtype)


def paged_view(k: jax.Array, v: jax.Array, block_table: jax.Array, lengths: jax.Array) -> KVCache:
    """A paged KVCache over pools k, v for the rows of `block_table` [B, P]."""
    return KVCache(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32), block_table=jnp.asarray(block_table, jnp.int32))


def viewed_page_size(cache: KVCache, page_size: int = 16) -> int:
    """Slots per page of `as_pages`' view: a paged cache's own, `page_size` where a dense cache's
    length is a multiple of it, else the whole row."""
    if cache.paged:
        return cache.page_size
    s = cache.k.shape[2]
    return page_size if s % page_size == 0 else s


def as_pages(cache: KVCache, page_size: int = 16) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(k pool, v pool, block table) of any cache: a paged one as it is; a dense one [L, B, S, ...]
    viewed (no copy) as B * S / page_size pages of `page_size` slots, row b owning its own run."""
    if cache.paged:
        return cache.k, cache.v, cache.block_table
    layers, b, s = cache.k.shape[:3]
    ps = viewed_page_size(cache, page_size)
    table = jnp.arange(b * (s // ps), dtype=jnp.int32).reshape(b, s // ps)

    def view(pool):
        return pool.reshape((layers, b * (s // ps), ps) + pool.shape[3:])

    return view(cache.k), view(cache.v), table


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit `n[b]` more tokens of each sequence (those written by the last forward)."""
    return cache.replace(lengths=cache.lengths + jnp.asarray(n, jnp.int32))


def _physical(cache: KVCache, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Logical slots [B, T] -> (page, offset) [B, T]; slots past the table map out of range (dropped)."""
    ps = cache.page_size
    idx = slots // ps
    inside = idx < cache.block_table.shape[1]
    page = jnp.take_along_axis(cache.block_table, jnp.clip(idx, 0, cache.block_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, cache.k.shape[1]), slots % ps


def _rows(slots: jax.Array) -> jax.Array:
    b, t = slots.shape
    return jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))


def _slot_index(cache: KVCache, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Index of logical slots [B, T] into one layer of the buffers: (page, offset) of a paged
    cache, (row, slot) of a dense one."""
    return _physical(cache, slots) if cache.paged else (_rows(slots), slots)


def _on_bits(update, buf: jax.Array, *values: jax.Array) -> jax.Array:
    """`update(buf, *values)`, a scatter that only moves elements, run on their bits when they are
    floats narrower than 32 bits (bfloat16, float16, float8): XLA:CPU cannot scatter those, so it
    widens the whole buffer (every layer's pages) to float32 and back at every write, where a
    scatter of unsigned integers of the same width is done in place. The bitcasts are free, and the
    same on every backend (a zero fill is +0.0)."""
    if not jnp.issubdtype(buf.dtype, jnp.floating) or buf.dtype.itemsize >= 4:
        return update(buf, *values)
    bits = jnp.dtype(f"uint{8 * buf.dtype.itemsize}")
    out = update(jax.lax.bitcast_convert_type(buf, bits), *(jax.lax.bitcast_convert_type(v, bits) for v in values))
    return jax.lax.bitcast_convert_type(out, buf.dtype)


def write(cache: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Scatter the new tokens' k_new, v_new [B, T, ...] into `layer` at slots lengths[b] + t.

    Slots past the end of a row are dropped.
    """
    t = k_new.shape[1]
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = (jnp.asarray(layer),) + _slot_index(cache, slots)

    def put(buf, new, idx):
        return _on_bits(lambda bits, new: bits.at[idx].set(new, mode="drop"), buf, new.astype(buf.dtype))

    return cache.replace(k=scatter_in_place(put, cache.k, k_new, idx), v=scatter_in_place(put, cache.v, v_new, idx))


def read_slots(cache: KVCache, layer: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k, v [B, W, ...] of the logical slots [B, W] of each row at `layer` (slots past a row's end: 0)."""
    idx = (layer,) + _slot_index(cache, slots)
    return (cache.k.at[idx].get(mode="fill", fill_value=0), cache.v.at[idx].get(mode="fill", fill_value=0))


def read(cache: KVCache, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every slot of every row at `layer`: k, v [B, max_len, ...] (paged: gathered through the table)."""
    if not cache.paged:
        return cache.k[layer], cache.v[layer]

    def gather(pool):
        pages = pool[layer][cache.block_table]  # [B, P, page_size, ...]
        return pages.reshape((pages.shape[0], -1) + pages.shape[3:])

    return gather(cache.k), gather(cache.v)


def move(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy slots src[b, d] -> dst[b, d] of each row, in every layer (reads happen before writes)."""
    src_idx, dst_idx = _slot_index(cache, src), _slot_index(cache, dst)

    def copy(buf, src_idx, dst_idx):
        every_layer = (slice(None),)
        return _on_bits(lambda bits: bits.at[every_layer + dst_idx].set(
            bits.at[every_layer + src_idx].get(mode="fill", fill_value=0), mode="drop"), buf)

    return cache.replace(k=scatter_in_place(copy, cache.k, src_idx, dst_idx),
                         v=scatter_in_place(copy, cache.v, src_idx, dst_idx))


def read_block(cache: KVCache, layer: jax.Array, start: jax.Array, size: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """k, v [B, size, ...] of `size` consecutive logical slots of each row at `layer` from slot
    `start` on, and those slots [size]. A block that would run past the row is moved back to end
    with it (its slots say so; a caller that walks blocks masks the slots an earlier block read).
    Paged: `size` is a multiple of the page size and the block's pages are gathered through the
    table; only they are read, never the whole layer."""
    if not cache.paged:
        s = cache.k.shape[2]
        first = jnp.minimum(start, s - size)

        def take(buf):
            begin = (layer, 0, first) + (0,) * (buf.ndim - 3)
            return jax.lax.dynamic_slice(buf, begin, (1, buf.shape[1], size) + buf.shape[3:])[0]

        return take(cache.k), take(cache.v), first + jnp.arange(size, dtype=jnp.int32)
    ps, width = cache.page_size, cache.block_table.shape[1]
    n = size // ps
    first_page = jnp.minimum(start // ps, width - n)
    pages = jax.lax.dynamic_slice_in_dim(cache.block_table, first_page, n, axis=1)  # [B, n]

    def gather(pool):
        block = pool.at[layer, pages].get(mode="clip")  # [B, n, ps, ...]
        return block.reshape((block.shape[0], size) + block.shape[3:])

    return gather(cache.k), gather(cache.v), first_page * ps + jnp.arange(size, dtype=jnp.int32)


@struct.dataclass
class Visible:
    """Which cache slots each of T new queries sees: every slot below `prefix` [B], and of the W
    slots from there on those `window` [B, T, W] marks (a tree's ancestors, causal new tokens, or
    a draft frontier's scratch slots). `window_is_new`: the window is the slots the queries' own
    K/V were written to (the Pallas path then uses them as computed rather than read back)."""

    prefix: jax.Array
    window: jax.Array
    window_is_new: bool = struct.field(pytree_node=False, default=True)

    @property
    def end(self) -> jax.Array:
        """One past the last slot any query of the batch may see (a scalar)."""
        return jnp.max(self.prefix) + self.window.shape[-1]

    def mask(self, slots: jax.Array) -> jax.Array:
        """bool [B, T, n]: which of the logical `slots` [n] each query sees."""
        w = self.window.shape[-1]
        rel = slots[None, :] - self.prefix[:, None]  # [B, n]: index among the window's slots
        in_window = (rel >= 0) & (rel < w)
        index = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], self.window.shape[:2] + slots.shape)
        return (rel < 0)[:, None, :] | (in_window[:, None, :] & jnp.take_along_axis(self.window, index, axis=2))


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool)), (batch, t, t))
