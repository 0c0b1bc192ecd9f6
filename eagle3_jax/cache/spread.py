"""Context-parallel rows: one long sequence's KV pages spread over the data shards.

Data-parallel attention keeps each sequence on one data shard, so one shard holds and reads all
of a long sequence's KV: a 128K-token agent session at batch 1-4 fills one device's pool and
leaves the others idle. A spread row instead has its pages on every shard (the scheduler deals
its logical page j to shard j mod D) and sits at the same local index in every shard's part of
the batch, with the same state slot, block table and inputs: D replicas of one row. Each shard
attends over the pages it holds, as (out, lse) partials, and the partials are merged across the
shards by their log-sum-exp, as the attention kernel merges its KV splits (`merge_partials`); a
new token's K/V is kept by the shard holding its page (the others drop the write); moving slots
(committing a tree's accepted path) fetches each slot from the shard holding it.

The replicas compute the same thing on the same local shapes, so they agree bit for bit, except
where a collective sums over devices in an order that may differ per row (the experts'
psum-scatter): `agree` makes every replica take the first shard's value after each MoE layer, so
the tokens a replica samples and the state it writes are the same on every shard.

A row is spread exactly when its block table is the same at its place in every shard's part of
the batch (`spread_rows`): rows of one shard hold only that shard's pages, so two different
sequences never share a table, and padding rows (all scratch page) are not spread. Nothing else
marks a row; the programs need no new input.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCRATCH_PAGE = 0  # the page unassigned block-table entries name (kv_cache)


def spread_rows(block_table: jax.Array, shards: int) -> jax.Array:
    """bool [B]: the rows of a batch laid out as `shards` parts of B / shards rows whose block
    table is the same in every part (and not all scratch)."""
    b = block_table.shape[0] // shards
    parts = block_table.reshape(shards, b, -1)
    same = jnp.all(parts == parts[:1], axis=(0, 2)) & (parts[0, :, 0] != SCRATCH_PAGE)
    return jnp.tile(same, shards)


def _parts(x: jax.Array, shards: int) -> jax.Array:
    return x.reshape((shards, x.shape[0] // shards) + x.shape[1:])


def _rows(mask: jax.Array, ndim: int) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def merge_partials(out: jax.Array, lse: jax.Array, spread: jax.Array, shards: int) -> tuple[jax.Array, jax.Array]:
    """Attention partials out [B, ..., D] (normalised over the slots a shard holds) and lse
    [B, ...] (finite: a shard that holds none of a row's visible slots gives ~-1e30) -> (out, lse)
    with each spread row's replicas replaced by the softmax over all its slots and its log-sum-exp
    (the same values on every shard); other rows as they are. Skipped (no collective) when the
    batch has no spread row."""

    def merge(parts):
        out, lse = parts
        o, l = _parts(out.astype(jnp.float32), shards), _parts(lse, shards)
        top = l.max(axis=0)
        weight = jnp.exp(l - top)  # a shard that holds none of a row's visible slots: lse ~ -1e30, weight 0
        total = weight.sum(axis=0)
        merged = (weight[..., None] * o).sum(axis=0) / total[..., None]
        whole = jnp.broadcast_to(merged[None], o.shape).reshape(out.shape).astype(out.dtype)
        whole_lse = jnp.broadcast_to((top + jnp.log(total))[None], l.shape).reshape(lse.shape)
        return (jnp.where(_rows(spread, out.ndim), whole, out),
                jnp.where(_rows(spread, lse.ndim), whole_lse, lse).astype(lse.dtype))

    return jax.lax.cond(jnp.any(spread), merge, lambda parts: parts, (out, lse))


def agree(x: jax.Array, spread: jax.Array | None, shards: int) -> jax.Array:
    """x [B, ...] with each spread row's replicas set to the first shard's (see the module doc)."""
    if spread is None:
        return x

    def first(x):
        whole = jnp.broadcast_to(_parts(x, shards)[:1], _parts(x, shards).shape).reshape(x.shape)
        return jnp.where(_rows(spread, x.ndim), whole, x)

    return jax.lax.cond(jnp.any(spread), first, lambda x: x, x)


def gathered(values: jax.Array, held: jax.Array, spread: jax.Array, axis: str) -> jax.Array:
    """Inside a shard_map over the data shards (`axis`): slots' values [L, b, W, ...] read from
    this shard's pages, where `held` [b, W] says this shard holds the slot, completed for spread
    rows [b] from the shard holding each slot. Values of unsigned integer type (the caller moves
    bits): exactly one shard holds a slot, so the sum over the shards is its value."""
    def rows(mask):
        return mask.reshape((1,) + mask.shape + (1,) * (values.ndim - 1 - mask.ndim))

    local = jnp.where(rows(held), values, 0)
    total = jax.lax.psum(local.astype(jnp.uint32), axis).astype(values.dtype)
    return jnp.where(rows(spread), total, values)
