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

FP8 (`kv_cache_dtype="fp8"`): `k` and `v` are `Fp8Slots`, float8 values (e4m3fn, or e4m3fnuz on
gfx942) with a float32 scale per slot per group of up to 128 lanes of the last axis (per head for
GQA; MLA's 512-wide latent has 4, its 64-wide rope key 1), stored beside the values in the same
layout, so a page carries its own scales. The scale is the group's absolute max over the float8
maximum, computed as each token is written: no calibration, and nothing a later token does
changes an earlier token's bytes, so a long multi-turn session cannot drift. Reads dequantize to
the compute dtype. MLA pays 576 + 5 * 4 = 596 bytes per token per layer for 1,152 in bfloat16
(0.52x); GQA with 128-wide heads 1 + 4/128 bytes per lane (0.52x).

A forward pass writes the K/V of its T new tokens at slots `lengths[b] + t` and leaves `lengths`
alone; the caller decides how many of them to keep (`advance`). Slots at or past a row's length
are never visible to later queries, so rejected or padded tokens need no clean-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from pallas_kernels.launch import scatter_in_place

from ..config.model import ModelConfig
from . import spread as spreading
from .spread import SCRATCH_PAGE, spread_rows  # noqa: F401 (SCRATCH_PAGE: named here by the scheduler's tables)

KV_CACHE_DTYPES = ("auto", "fp8")
SCALE_GROUP = 128  # lanes of the last axis sharing one FP8 scale


@struct.dataclass
class Fp8Slots:
    """KV slots in float8 with their scales: values [..., F] float8, scales [..., F // group]
    float32 (`group` = SCALE_GROUP lanes, or all F when F is not a multiple of it)."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim


def scale_groups(features: int) -> int:
    """Scales per slot for a last axis of `features` lanes."""
    return features // SCALE_GROUP if features % SCALE_GROUP == 0 else 1


def quantize(x: jax.Array, dtype) -> Fp8Slots:
    """x [..., F] -> float8 `dtype` values and a float32 scale per group of lanes (absmax / the
    format's max; an all-zero group gets scale 1)."""
    f = x.shape[-1]
    groups = scale_groups(f)
    xg = x.astype(jnp.float32).reshape(x.shape[:-1] + (groups, f // groups))
    amax = jnp.max(jnp.abs(xg), axis=-1)
    scales = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    values = (xg / scales[..., None]).reshape(x.shape).astype(dtype)
    return Fp8Slots(values, scales)


def dequantize(slots: Fp8Slots, dtype) -> jax.Array:
    """The slots' values in `dtype`."""
    f = slots.values.shape[-1]
    groups = slots.scales.shape[-1]
    xg = slots.values.astype(jnp.float32).reshape(slots.values.shape[:-1] + (groups, f // groups))
    return (xg * slots.scales[..., None]).reshape(slots.values.shape).astype(dtype)


def resolve_kv_dtype(kv_cache_dtype: str, fnuz: bool):
    """The float8 storage dtype for `kv_cache_dtype` ("fp8": e4m3fnuz where `fnuz`, the gfx942
    flavour, else e4m3fn), or None for "auto" (the compute dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return None
    return jnp.dtype(jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn)


def _zeros(shape: tuple[int, ...], dtype, fp8) -> jax.Array | Fp8Slots:
    if fp8 is None:
        return jnp.zeros(shape, dtype)
    return Fp8Slots(jnp.zeros(shape, fp8), jnp.ones(shape[:-1] + (scale_groups(shape[-1]),), jnp.float32))


def _map(fn, buf, *others):
    """fn over a buffer's arrays: the array itself, or an Fp8Slots' values and scales (with the
    matching parts of `others`)."""
    if isinstance(buf, Fp8Slots):
        return Fp8Slots(fn(buf.values, *(o.values for o in others)), fn(buf.scales, *(o.scales for o in others)))
    return fn(buf, *others)


def _load(buf, index, dtype=None, **kw) -> jax.Array:
    """buf[index] (`.at[].get(**kw)`), dequantized to `dtype` when buf holds float8 slots."""
    if isinstance(buf, Fp8Slots):
        return dequantize(Fp8Slots(buf.values.at[index].get(**kw), buf.scales.at[index].get(**kw)), dtype)
    return buf.at[index].get(**kw)


@struct.dataclass
class KVCache:
    k: jax.Array | Fp8Slots
    v: jax.Array | Fp8Slots
    lengths: jax.Array  # [B] int32: committed tokens per sequence
    block_table: jax.Array | None = None  # [B, P] int32 page ids (paged layout only)
    compute_dtype: jnp.dtype | None = struct.field(pytree_node=False, default=None)  # what FP8 slots read as
    data_shards: int = struct.field(pytree_node=False, default=1)  # see `on_data_shards`
    spread: jax.Array | None = None  # [B] bool: rows spread over the data shards (see `spread_rows`)

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

    @property
    def fp8(self) -> bool:
        return isinstance(self.k, Fp8Slots)

    @property
    def read_dtype(self):
        """The dtype reads return: the compute dtype of FP8 slots, else the buffers' own."""
        if not self.fp8:
            return self.k.dtype
        if self.compute_dtype is None:
            raise ValueError("a KVCache of FP8 slots needs the compute_dtype its reads return")
        return self.compute_dtype


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
    """Logical axes of paged pools [L, pages, page_size, ...]: the pages are split over the data
    shards (each holds its own rows' pages, see `on_data_shards`)."""
    k_axes, v_axes = cache_axes(cfg)
    return ("layers", "pages", None) + k_axes[3:], ("layers", "pages", None) + v_axes[3:]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, fp8=None) -> KVCache:
    """A zeroed dense cache in `dtype`, or in float8 `fp8` slots read as `dtype` (resolve_kv_dtype)."""
    ks, vs = cache_shapes(cfg, batch, max_len)
    return KVCache(k=_zeros(ks, dtype, fp8), v=_zeros(vs, dtype, fp8), lengths=jnp.zeros((batch,), jnp.int32),
                   compute_dtype=jnp.dtype(dtype))


def init_pages(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16, fp8=None) -> tuple:
    """Zeroed page pools (k, v) [L, num_pages, page_size, ...] (Fp8Slots with `fp8`); page 0 is
    the scratch page."""
    ks, vs = cache_shapes(cfg, num_pages, page_size)
    return _zeros(ks, dtype, fp8), _zeros(vs, dtype, fp8)


def paged_view(k, v, block_table: jax.Array, lengths: jax.Array, compute_dtype=None, data_shards: int = 1) -> KVCache:
    """A paged KVCache over pools k, v for the rows of `block_table` [B, P] (pages and rows split
    over `data_shards` data shards: see `on_data_shards`; rows spread over them: `spread_rows`)."""
    table = jnp.asarray(block_table, jnp.int32)
    return KVCache(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32), block_table=table,
                   compute_dtype=None if compute_dtype is None else jnp.dtype(compute_dtype), data_shards=data_shards,
                   spread=spread_rows(table, data_shards) if data_shards > 1 else None)


# ---- data-parallel pages ------------------------------------------------------------------------------

DATA_AXIS = "data"
_POOL, _ROWS, _WHOLE = PartitionSpec(None, DATA_AXIS), PartitionSpec(DATA_AXIS), PartitionSpec()


def on_data_shards(op, cache: KVCache, args: tuple, arg_specs: tuple, out_specs, writes: bool, held: bool = False):
    """`op(local cache, *args)` on each data shard of a paged cache whose pages and rows are split
    over the mesh's `data` axis (data-parallel attention): shard d holds pages
    [d * n, (d + 1) * n) of the pool (n = pages / data_shards) and rows [d * b, (d + 1) * b) of
    the batch, whose block tables name only its own pages (global ids; unassigned entries the
    scratch page 0, which shard 0 holds). Each shard reads and writes only its own pages, for its
    own rows: a `shard_map` over `data` alone (the `tensor` axis, heads, stays automatic). Pages of
    another shard are dropped when written and read as the shard's first page (`writes` says
    which), slots no query of a row on one shard sees. `held`: `op` also takes, after the cache,
    which of each row's pages [B, P] the shard holds (a spread row's are on every shard)."""
    n_local = cache.k.shape[1] // cache.data_shards

    def body(k, v, table, lengths, *args):
        local, here = local_pages(table, n_local)
        local = jnp.where(here, local, n_local if writes else 0)
        local_cache = KVCache(k, v, lengths, local, cache.compute_dtype)
        return op(local_cache, here, *args) if held else op(local_cache, *args)

    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(_POOL, _POOL, _ROWS, _ROWS, *arg_specs),
                         out_specs=out_specs, axis_names={DATA_AXIS}, check_vma=False)(
        cache.k, cache.v, cache.block_table, cache.lengths, *args)


def local_pages(table: jax.Array, n_local: int) -> tuple[jax.Array, jax.Array]:
    """Inside a shard_map over `data`: a block table's global page ids as this shard's local ids
    (shard d holds pages [d * n_local, (d + 1) * n_local)), and which of them it holds."""
    local = table - jax.lax.axis_index(DATA_AXIS) * n_local
    return local, (local >= 0) & (local < n_local)


def _pools(cache: KVCache) -> tuple:
    return cache.k, cache.v


def _split(cache: KVCache) -> bool:
    return cache.data_shards > 1


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

    return _map(view, cache.k), _map(view, cache.v), table


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
    return jax.lax.bitcast_convert_type(update(_bits(buf), *map(_bits, values)), buf.dtype)


def write(cache: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Scatter the new tokens' k_new, v_new [B, T, ...] into `layer` at slots lengths[b] + t.

    Slots past the end of a row are dropped.
    """
    if _split(cache):
        k, v = on_data_shards(lambda c, *a: _pools(write(c, *a)), cache, (layer, k_new, v_new), (_WHOLE, _ROWS, _ROWS),
                              (_POOL, _POOL), writes=True)
        return cache.replace(k=k, v=v)
    t = k_new.shape[1]
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = (jnp.asarray(layer),) + _slot_index(cache, slots)

    def put(buf, new, idx):
        return _on_bits(lambda bits, new: bits.at[idx].set(new, mode="drop"), buf, new.astype(buf.dtype))

    def store(buf, new):
        if isinstance(buf, Fp8Slots):
            new = quantize(new, buf.values.dtype)
        return _map(lambda b, n: scatter_in_place(put, b, n, idx), buf, new)

    return cache.replace(k=store(cache.k, k_new), v=store(cache.v, v_new))


def read_slots(cache: KVCache, layer: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k, v [B, W, ...] of the logical slots [B, W] of each row at `layer` (slots past a row's end: 0)."""
    if _split(cache):
        spread = jnp.zeros(cache.batch, bool) if cache.spread is None else cache.spread
        return on_data_shards(_read_slots_on_shard, cache, (layer, slots, spread), (_WHOLE, _ROWS, _ROWS),
                              (_ROWS, _ROWS), writes=False, held=True)
    idx = (layer,) + _slot_index(cache, slots)
    dt = cache.read_dtype
    return (_load(cache.k, idx, dt, mode="fill", fill_value=0), _load(cache.v, idx, dt, mode="fill", fill_value=0))


def _held_slots(cache: KVCache, held: jax.Array, slots: jax.Array) -> jax.Array:
    """Inside `on_data_shards`: which of the logical `slots` [B, W] lie on pages this shard holds."""
    column = slots // cache.page_size
    width = cache.block_table.shape[1]
    return jnp.take_along_axis(held, jnp.clip(column, 0, width - 1), axis=1) & (column < width)


def _read_slots_on_shard(cache: KVCache, held: jax.Array, layer: jax.Array, slots: jax.Array, spread: jax.Array):
    """`read_slots` on one data shard: a spread row's slot on a page another shard holds is read
    from there (`spread.gathered`, on the bits)."""
    idx = (layer,) + _slot_index(cache, slots)
    slot_held = _held_slots(cache, held, slots)

    def take(buf):
        bits = _bits(buf).at[idx].get(mode="fill", fill_value=0)[None]  # [1, B, W, ...]: gathered's layout
        bits = jax.lax.cond(jnp.any(spread), lambda v: spreading.gathered(v, slot_held, spread, DATA_AXIS),
                            lambda v: v, bits)
        return jax.lax.bitcast_convert_type(bits[0], buf.dtype)

    def load(buf):
        out = _map(take, buf)
        return dequantize(out, cache.read_dtype) if isinstance(out, Fp8Slots) else out

    return load(cache.k), load(cache.v)


def read(cache: KVCache, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every slot of every row at `layer`: k, v [B, max_len, ...] (paged: gathered through the table)."""
    if _split(cache):
        return on_data_shards(read, cache, (layer,), (_WHOLE,), (_ROWS, _ROWS), writes=False)
    dt = cache.read_dtype
    if not cache.paged:
        return _load(cache.k, layer, dt), _load(cache.v, layer, dt)

    def gather(pool):
        pages = _load(pool, (layer, cache.block_table), dt)  # [B, P, page_size, ...]
        return pages.reshape((pages.shape[0], -1) + pages.shape[3:])

    return gather(cache.k), gather(cache.v)


def move(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy slots src[b, d] -> dst[b, d] of each row, in every layer (reads happen before writes)."""
    if _split(cache):
        spread = jnp.zeros(cache.batch, bool) if cache.spread is None else cache.spread
        k, v = on_data_shards(_move_on_shard, cache, (src, dst, spread), (_ROWS, _ROWS, _ROWS), (_POOL, _POOL),
                              writes=True, held=True)
        return cache.replace(k=k, v=v)
    src_idx, dst_idx = _slot_index(cache, src), _slot_index(cache, dst)

    def copy(buf, src_idx, dst_idx):
        every_layer = (slice(None),)
        return _on_bits(lambda bits: bits.at[every_layer + dst_idx].set(
            bits.at[every_layer + src_idx].get(mode="fill", fill_value=0), mode="drop"), buf)

    def move_buf(buf):
        return _map(lambda b: scatter_in_place(copy, b, src_idx, dst_idx), buf)

    return cache.replace(k=move_buf(cache.k), v=move_buf(cache.v))


def _bits(x: jax.Array) -> jax.Array:
    """A float array's bits as unsigned integers of its width (integers as they are)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _move_on_shard(cache: KVCache, held: jax.Array, src: jax.Array, dst: jax.Array, spread: jax.Array) -> tuple:
    """`move` on one data shard (inside `on_data_shards`): a spread row's source slot may lie on a
    page another shard holds, so its value comes from there (`spread.gathered`); a destination on
    another shard's page is dropped here and written there."""
    src_idx, dst_idx = _slot_index(cache, src), _slot_index(cache, dst)
    src_held = _held_slots(cache, held, src)

    def copy(buf):
        every_layer = (slice(None),)
        bits = _bits(buf)
        values = bits.at[every_layer + src_idx].get(mode="fill", fill_value=0)
        values = jax.lax.cond(jnp.any(spread), lambda v: spreading.gathered(v, src_held, spread, DATA_AXIS),
                              lambda v: v, values)
        return jax.lax.bitcast_convert_type(bits.at[every_layer + dst_idx].set(values, mode="drop"), buf.dtype)

    return _map(copy, cache.k), _map(copy, cache.v)


def read_block(cache: KVCache, layer: jax.Array, start: jax.Array, size: int
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """k, v [B, size, ...] of `size` consecutive logical slots of each row at `layer` from slot
    `start` on, those slots [size], and which of them this device holds [B, size] (pages split
    over data shards: a spread row's other slots are another shard's; else None: all). A block that would run past the row is moved back to end
    with it (its slots say so; a caller that walks blocks masks the slots an earlier block read).
    Paged: `size` is a multiple of the page size and the block's pages are gathered through the
    table; only they are read, never the whole layer."""
    if _split(cache):
        def on_shard(local, held, layer, start):
            k, v, slots, _ = read_block(local, layer, start, size)
            pages = jax.lax.dynamic_slice_in_dim(held, slots[0] // local.page_size, size // local.page_size, axis=1)
            return k, v, slots, jnp.repeat(pages, local.page_size, axis=1)

        return on_data_shards(on_shard, cache, (layer, start), (_WHOLE, _WHOLE), (_ROWS, _ROWS, _WHOLE, _ROWS),
                              writes=False, held=True)
    if not cache.paged:
        s = cache.k.shape[2]
        first = jnp.minimum(start, s - size)

        def take(buf):
            begin = (layer, 0, first) + (0,) * (buf.ndim - 3)
            return jax.lax.dynamic_slice(buf, begin, (1, buf.shape[1], size) + buf.shape[3:])[0]

        def block(buf):
            out = _map(take, buf)
            return dequantize(out, cache.read_dtype) if isinstance(out, Fp8Slots) else out

        return block(cache.k), block(cache.v), first + jnp.arange(size, dtype=jnp.int32), None
    ps, width = cache.page_size, cache.block_table.shape[1]
    n = size // ps
    first_page = jnp.minimum(start // ps, width - n)
    pages = jax.lax.dynamic_slice_in_dim(cache.block_table, first_page, n, axis=1)  # [B, n]

    def gather(pool):
        block = _load(pool, (layer, pages), cache.read_dtype, mode="clip")  # [B, n, ps, ...]
        return block.reshape((block.shape[0], size) + block.shape[3:])

    return gather(cache.k), gather(cache.v), first_page * ps + jnp.arange(size, dtype=jnp.int32), None


@struct.dataclass
class Visible:
    """Which cache slots each of T new queries sees: every slot below `prefix` [B], and of the W
    slots from there on those `window` [B, T, W] marks (a tree's ancestors, causal new tokens, or
    a draft frontier's scratch slots). `window_is_new`: the window is the slots the queries' own
    K/V were written to (the kernel path then uses them as computed rather than read back).
    `start` [B, T] (a sliding-window layer, `sliding`): no slot below it is seen, where a cache's
    slot index is its token's position (a draft's committed pairs, the new tokens after them)."""

    prefix: jax.Array
    window: jax.Array
    window_is_new: bool = struct.field(pytree_node=False, default=True)
    start: jax.Array | None = None

    @property
    def end(self) -> jax.Array:
        """One past the last slot any query of the batch may see (a scalar)."""
        return jnp.max(self.prefix) + self.window.shape[-1]

    @property
    def first(self) -> jax.Array:
        """The lowest slot any query of the batch may see (a scalar)."""
        return jnp.int32(0) if self.start is None else jnp.min(self.start)

    def sliding(self, positions: jax.Array, size: int | None) -> "Visible":
        """These queries at `positions` [B, T] seeing only the last `size` tokens, themselves
        included (None: all of them)."""
        if size is None:
            return self
        return self.replace(start=jnp.maximum(positions - (size - 1), 0).astype(jnp.int32))

    def window_seen(self) -> jax.Array:
        """`window` [B, T, W] with a sliding window's bound applied to its slots (`prefix` on)."""
        if self.start is None:
            return self.window
        slots = self.prefix[:, None, None] + jnp.arange(self.window.shape[-1], dtype=jnp.int32)[None, None, :]
        return self.window & (slots >= self.start[:, :, None])

    def mask(self, slots: jax.Array) -> jax.Array:
        """bool [B, T, n]: which of the logical `slots` [n] each query sees."""
        w = self.window.shape[-1]
        rel = slots[None, :] - self.prefix[:, None]  # [B, n]: index among the window's slots
        in_window = (rel >= 0) & (rel < w)
        index = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], self.window.shape[:2] + slots.shape)
        seen = (rel < 0)[:, None, :] | (in_window[:, None, :] & jnp.take_along_axis(self.window, index, axis=2))
        if self.start is not None:
            seen = seen & (slots[None, None, :] >= self.start[:, :, None])
        return seen


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool)), (batch, t, t))
