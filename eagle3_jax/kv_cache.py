"""KV cache: one contiguous slot row per sequence, per-sequence lengths.

Layouts (stacked over all layers, so one scan over layers indexes it):
- GQA: `k`, `v` are [L, B, S, kv_heads, head_dim].
- MLA: `k` holds the normalised latent `kv_a_layernorm(c_kv)` [L, B, S, kv_lora_rank] and `v` the
  roped shared key `k_pe` [L, B, S, qk_rope_head_dim]; per-head K/V are never stored.

A forward pass writes the K/V of its T new tokens at slots `lengths[b] + t` and leaves `lengths`
alone; the caller decides how many of them to keep (`advance`). Slots at or past a row's length
are never visible to later queries, so rejected or padded tokens need no clean-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [B] int32: committed tokens per sequence

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    L = cfg.num_layers
    if cfg.attention == "mla":
        return (L, batch, max_len, cfg.kv_lora_rank), (L, batch, max_len, cfg.qk_rope_head_dim)
    kv = (L, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return kv, kv


def cache_axes(cfg: ModelConfig) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """Logical axes of `k` and `v` (see sharding.py)."""
    if cfg.attention == "mla":
        return ("layers", "batch", "seq", "kv_lora"), ("layers", "batch", "seq", None)
    kv = ("layers", "batch", "seq", "kv_heads", None)
    return kv, kv


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    ks, vs = cache_shapes(cfg, batch, max_len)
    return KVCache(k=jnp.zeros(ks, dtype), v=jnp.zeros(vs, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit `n[b]` more tokens of each sequence (those written by the last forward)."""
    return cache.replace(lengths=cache.lengths + jnp.asarray(n, jnp.int32))


def write(buf: jax.Array, layer: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """Scatter `new` [B, T, ...] into `buf[layer]` at slots lengths[b] + t (dropped past the end)."""
    b, t = new.shape[:2]
    slots = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    return buf.at[layer, rows, slots].set(new.astype(buf.dtype), mode="drop")


def visibility(lengths: jax.Array, tree_mask: jax.Array, max_len: int) -> jax.Array:
    """Which cache slots each new query sees: bool [B, T, S].

    Query t of row b sees the committed prefix (slots < lengths[b]) and the new token j (slot
    lengths[b] + j) iff tree_mask[b, t, j].
    """
    t = tree_mask.shape[-1]
    slots = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    rel = slots - lengths[:, None]  # [B, S]: index among the new tokens
    in_new = (rel >= 0) & (rel < t)
    new_ok = jnp.take_along_axis(tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], tree_mask.shape[:2] + (max_len,)), axis=2)
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & new_ok)


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool)), (batch, t, t))
