"""Target side of a step: accept a prefix of the draft tree, emit tokens, compact the cache.

Greedy: follow the child whose token equals the target argmax at its parent; the bonus token is
the argmax at the deepest accepted node.

Sampled (lossless): the draft is treated as one-hot. At the current node with target distribution
p (after temperature / top-k / top-p), siblings are tried in index order: sibling x is accepted
with probability r(x) / sum(r), where r is p with the already-rejected siblings zeroed; on
acceptance the walk moves to it, and when every child is rejected (or at a leaf) the bonus token
is drawn from r / sum(r). Each step then emits exactly the target's distribution.

Synthetic (benchmarking only, rows with `SamplingArrays.accept_profile`): the step accepts a depth
drawn from the row's per-position profile, along each node's first child, whatever the target
says, and the bonus token is the target's at that node. The step's cost is then that of a draft
with that acceptance; its output is not the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..cache import kv_cache
from ..sampling.sampler import SamplingArrays, filtered_logits, filtered_per_position, hold_back_stops, request_keys

SYNTHETIC_STREAM = 0x5E1EC7  # folded into a row's key: synthetic draws apart from its sampling draws


def greedy_accept(logits: jax.Array, tokens: jax.Array, parents: jax.Array, anc: jax.Array,
                  depth: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (deepest accepted node [B], bonus token [B])."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N]
    matches = tokens == jnp.take_along_axis(best, parents, axis=1)
    matches = matches.at[:, 0].set(True)
    accepted = jnp.all(jnp.where(anc, matches[:, None, :], True), axis=-1)  # every ancestor matched
    node = jnp.argmax(jnp.where(accepted, depth, -1), axis=-1).astype(jnp.int32)
    return node, jnp.take_along_axis(best, node[:, None], axis=1)[:, 0]


def _sampled_row(probs: jax.Array, tokens: jax.Array, parents: jax.Array, coins: jax.Array,
                 bonus_key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One sequence: probs [N, V] target distributions per node; coins [N] uniform in [0, 1)."""
    n = tokens.shape[0]

    def visit(i, state):
        cur, residual = state
        is_child = parents[i] == cur
        x = tokens[i]
        accept = is_child & (coins[i] * residual.sum() < residual[x])
        rejected = residual.at[x].set(0.0)
        residual = jnp.where(accept, probs[i], jnp.where(is_child, rejected, residual))
        return jnp.where(accept, i, cur), residual

    cur, residual = jax.lax.fori_loop(1, n, visit, (jnp.int32(0), probs[0]))
    residual = jnp.where(residual.sum() > 0, residual, probs[cur])  # float guard; p has mass somewhere
    bonus = jax.random.categorical(bonus_key, jnp.log(residual))
    return cur, bonus.astype(jnp.int32)


def target_probs(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
    """[B, N, V] logits -> the distributions each request samples from at each node."""
    return jax.nn.softmax(filtered_per_position(logits, sp), axis=-1)


def sampled_accept(logits: jax.Array, tokens: jax.Array, parents: jax.Array, sp: SamplingArrays,
                   counter: jax.Array, coins: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Lossless multi-candidate rejection sampling -> (deepest accepted node [B], bonus [B]).

    Randomness comes from each request's key at `counter` (tokens generated so far); `coins`
    [B, N] may be given to fix the acceptance draws (tests).
    """
    keys = request_keys(sp.seed, counter)
    coin_keys, bonus_keys = jax.vmap(lambda k: jax.random.split(k, 2))(keys).transpose(1, 0, 2)
    if coins is None:
        coins = jax.vmap(lambda k: jax.random.uniform(k, (tokens.shape[1],)))(coin_keys)
    probs = target_probs(logits, sp)
    return jax.vmap(_sampled_row)(probs, tokens, parents, coins, bonus_keys)


def synthetic_accept(logits: jax.Array, tokens: jax.Array, parents: jax.Array, sp: SamplingArrays,
                     counter: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Forced acceptance -> (accepted node [B], bonus [B]): one uniform u per row accepts depth
    #{d : u < profile[d]} (so P(depth > d) = profile[d] for a non-increasing profile), walking from
    the root to each node's first child (its draft's best) while there is one; the bonus is the
    target's token at that node (argmax, or drawn from the row's filtered distribution)."""
    b, n = tokens.shape
    keys = jax.vmap(lambda k: jax.random.fold_in(k, SYNTHETIC_STREAM))(request_keys(sp.seed, counter))
    coin_keys, bonus_keys = jax.vmap(lambda k: jax.random.split(k, 2))(keys).transpose(1, 0, 2)
    u = jax.vmap(jax.random.uniform)(coin_keys)
    profile = sp.accept_profile[:, : n - 1]
    wanted = jnp.sum(u[:, None] < profile, axis=1)
    index = jnp.arange(n)[None, :]

    def down(level, node):
        is_child = (parents == node[:, None]) & (index > 0)
        child = jnp.argmax(is_child, axis=1).astype(jnp.int32)
        return jnp.where(jnp.any(is_child, axis=1) & (level < wanted), child, node)

    node = jax.lax.fori_loop(0, n - 1, down, jnp.zeros((b,), jnp.int32))
    at_node = jnp.take_along_axis(logits, node[:, None, None], axis=1)[:, 0]
    filtered = filtered_logits(at_node, sp.temperature, sp.top_k, sp.top_p)
    drawn = jax.vmap(jax.random.categorical)(bonus_keys, filtered).astype(jnp.int32)
    bonus = jnp.where(sp.temperature > 0, drawn, jnp.argmax(at_node, axis=-1).astype(jnp.int32))
    return node, bonus


def accept(logits, tokens, parents, anc, depth, sp: SamplingArrays, counter):
    """Greedy rows (temperature 0) and sampled rows, each by its own rule; rows with a synthetic
    acceptance profile by `synthetic_accept` (only compiled in when the batch has one).

    The sampled rule (a sort over the vocabulary per node) is only compiled in when some row
    samples (`sp.sampled`, static). Both judge the target's distribution with stop tokens held back
    below min_tokens (the logits at a node of depth d predict the row's token number counter + d).
    """
    logits = hold_back_stops(logits, sp, counter[:, None] + depth)
    node, bonus = greedy_accept(logits, tokens, parents, anc, depth)
    if sp.sampled:
        sampled = sp.temperature > 0
        s_node, s_bonus = sampled_accept(logits, tokens, parents, sp, counter)
        node, bonus = jnp.where(sampled, s_node, node), jnp.where(sampled, s_bonus, bonus)
    if sp.accept_profile is not None:
        f_node, f_bonus = synthetic_accept(logits, tokens, parents, sp, counter)
        forced = sp.accept_profile[:, 0] >= 0
        node, bonus = jnp.where(forced, f_node, node), jnp.where(forced, f_bonus, bonus)
    return node, bonus


def emitted_tokens(tokens: jax.Array, path: jax.Array, n_accept: jax.Array, bonus: jax.Array) -> jax.Array:
    """[B, D+1]: the accepted draft tokens along `path`, then the bonus; -1 past the end."""
    d = jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]
    nxt = jnp.take_along_axis(tokens, jnp.concatenate([path[:, 1:], path[:, -1:]], axis=1), axis=1)
    return jnp.where(d < n_accept[:, None], nxt, jnp.where(d == n_accept[:, None], bonus[:, None], -1))


def commit_path(cache: kv_cache.KVCache, path: jax.Array, n_keep: jax.Array) -> kv_cache.KVCache:
    """Move the K/V of tree nodes `path` (written at lengths + node) to lengths + 0.., keep n_keep."""
    d = path.shape[1]
    src = cache.lengths[:, None] + path
    dst = cache.lengths[:, None] + jnp.arange(d, dtype=jnp.int32)[None, :]
    return kv_cache.advance(kv_cache.move(cache, src, dst), n_keep)
