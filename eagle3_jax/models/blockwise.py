"""Softmax attention over a KV cache, a block of slots at a time: the XLA path's memory bound.

Attending over a whole row at once materialises, per layer, a copy of every slot's K/V (or MLA
latents) for the batch and float32 scores [B, heads, T, S]: temporaries that grow with the context
(at 64 sequences of 32K tokens, Kimi-K2.5's step held more temporaries than KV). Here a cache longer
than one block is walked in blocks of `block_slots` slots with an online softmax (running max,
denominator and float32 accumulator, as flash attention does), so the temporaries are one block's
K/V and scores whatever the context, and blocks past every row's last visible slot are skipped
(`lax.cond`: a batch of short rows in a long cache reads only what it uses). A cache that fits in
one block is attended in one pass, as before.

The walk is a `lax.scan` (reverse-differentiable, for training through `target.forward`). It
also returns (out, lse) partials: a row spread over the data shards (cache/spread.py) is attended
on each shard over the slots that shard holds, and the partials merged across the shards, as the
Triton kernel merges its KV splits.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from ..cache import kv_cache, spread

BLOCK_BYTES = 256 * 2**20  # one block's K/V and float32 scores for the whole batch, at the most
MAX_BLOCK_SLOTS = 4096

ScoresFn = Callable[[jax.Array, jax.Array], jax.Array]  # (k, v) [B, n, ...] -> float32 scores [B, ..., T, n]
MixFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (probs, k, v) -> out [B, ..., T, D], scores' order


def block_slots(cache: kv_cache.KVCache, queries: int, heads: int) -> int:
    """Slots per block for `queries` new tokens of `heads` score rows each: the most (a power of
    two, a multiple of the page size) whose K/V and scores for the batch stay within BLOCK_BYTES,
    at least one page (16 slots dense) and at most MAX_BLOCK_SLOTS."""
    row_bytes = jnp.dtype(cache.read_dtype).itemsize * sum(math.prod(a.shape[3:]) for a in (cache.k, cache.v))
    per_slot = cache.batch * (row_bytes + 4 * heads * queries)
    size = max(1, BLOCK_BYTES // max(per_slot, 1))
    size = min(1 << (size.bit_length() - 1), MAX_BLOCK_SLOTS)
    unit = cache.page_size if cache.paged else 16
    return max(unit, size - size % unit)


def _broadcast_mask(mask: jax.Array, ndim: int) -> jax.Array:
    """mask [B, T, n] -> [B, 1.., T, n] against scores of `ndim` dims (heads in the middle)."""
    return mask.reshape(mask.shape[:1] + (1,) * (ndim - 3) + mask.shape[1:])


_NEG = -1e30  # finite "minus infinity": a query that sees nothing in a block adds nothing


def attend(cache: kv_cache.KVCache, layer: jax.Array, visible: kv_cache.Visible, scores_of: ScoresFn, mix: MixFn,
           heads: int) -> jax.Array:
    """softmax(scores_of(k, v)) over the slots `visible` lets each query see, applied by `mix`;
    `heads`: score rows per query (for the block size). Output as `mix` returns it."""
    t = visible.window.shape[1]
    size = block_slots(cache, t, heads)
    if cache.spread is not None:  # rows spread over the data shards: each shard's part, merged
        out, lse = attend_partial(cache, layer, visible, scores_of, mix, min(size, cache.max_len))
        return spread.merge_partials(out, lse, cache.spread, cache.data_shards)[0]
    if size >= cache.max_len:
        k, v = kv_cache.read(cache, layer)
        scores = scores_of(k, v)
        mask = _broadcast_mask(visible.mask(jnp.arange(cache.max_len, dtype=jnp.int32)), scores.ndim)
        return mix(jax.nn.softmax(jnp.where(mask, scores, _NEG), axis=-1), k, v)
    return attend_partial(cache, layer, visible, scores_of, mix, size)[0]


def attend_partial(cache: kv_cache.KVCache, layer: jax.Array, visible: kv_cache.Visible, scores_of: ScoresFn,
                   mix: MixFn, size: int) -> tuple[jax.Array, jax.Array]:
    """The blockwise walk in blocks of `size` slots -> (out (float32, normalised), lse [B, ..., T])."""
    num_blocks = -(-cache.max_len // size)
    end = visible.end

    def block(i):
        start = i * size
        k, v, slots, held = kv_cache.read_block(cache, layer, start, size)
        scores = scores_of(k, v)
        seen = visible.mask(slots) & (slots >= start)[None, None, :]
        if held is not None:  # a spread row's slots on another shard's pages are that shard's part
            seen = seen & held[:, None, :]
        mask = _broadcast_mask(seen, scores.ndim)
        return jnp.where(mask, scores, _NEG), mask, k, v

    def update(carry, i):
        m, denom, acc = carry
        scores, mask, k, v = block(i)
        m_new = jnp.maximum(m, scores.max(-1))
        probs = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
        fade = jnp.exp(m - m_new)
        acc = acc * fade[..., None] + mix(probs, k, v).astype(jnp.float32)
        return m_new, denom * fade + probs.sum(-1), acc

    def shapes(i):
        scores, mask, k, v = block(i)
        return scores.max(-1), mix(scores, k, v)

    m_shape, acc_shape = jax.eval_shape(shapes, jnp.int32(0))
    carry = (jnp.full(m_shape.shape, _NEG, jnp.float32), jnp.zeros(m_shape.shape, jnp.float32),
             jnp.zeros(acc_shape.shape, jnp.float32))
    first = visible.first  # blocks past every query's last slot or below a sliding window's first are skipped

    def step(carry, i):
        return jax.lax.cond((i * size < end) & ((i + 1) * size > first), update, lambda c, _: c, carry, i), None

    (m, denom, acc), _ = jax.lax.scan(step, carry, jnp.arange(num_blocks, dtype=jnp.int32))
    denom = jnp.maximum(denom, 1e-30)  # a padding row may see nothing
    return acc / denom[..., None], m + jnp.log(denom)
