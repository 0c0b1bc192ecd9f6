"""Draft side of a step: expand a tree from the draft root (EAGLE-2), and after verification extend
the draft over the newly accepted pairs, which gives the next root.

Between steps a sequence's draft state is its `DraftRoot`: the last emitted token and the draft's
output hidden for the last accepted pair. A step first proposes a tree from it (`propose`), so
each step may pick its own speculation shape, or none at all.

Extend: the draft consumes the (target feature, next token) pairs of the tokens just accepted,
caching only those; its last output gives the root's children.

Expand: level 1 is the top-k of the root's draft distribution. At each later level the draft runs
on the current frontier (the `topk` best nodes by cumulative log-probability), each of which
proposes `topk` children; the best `topk` of those children form the next frontier. Finally the
`num_draft_tokens - 1` best candidates of all levels are kept, in candidate order, which puts
parents before children (a child's score never exceeds its parent's and ties go to the lower
index). Frontier K/V live in scratch slots past the committed draft cache and are overwritten by
the next extend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ..cache import kv_cache
from ..models.draft import DraftConfig, draft_forward, draft_head, draft_to_target_ids, project_features
from ..sampling.sampler import allowed_tokens
from .settings import SpecConfig


@struct.dataclass
class DraftTree:
    tokens: jax.Array  # [B, N] target token ids; tokens[:, 0] is the root (last emitted token)
    parents: jax.Array  # [B, N] tree index of each node's parent (parents[:, 0] = 0)


@struct.dataclass
class DraftRoot:
    token: jax.Array  # [B] last emitted token: the next tree's root, not yet in the target cache
    hidden: jax.Array  # [B, H] the hidden the draft handed on (draft.draft_forward) for the last accepted pair


def root_only(token: jax.Array) -> DraftTree:
    """The tree of a step that does not speculate: the root alone."""
    return DraftTree(tokens=token[:, None].astype(jnp.int32), parents=jnp.zeros((token.shape[0], 1), jnp.int32))


def propose(params: dict, cfg: DraftConfig, cache: kv_cache.KVCache, root: DraftRoot,
            spec: SpecConfig | None, root_mask: jax.Array | None = None) -> tuple[DraftTree, kv_cache.KVCache]:
    """The tree a step verifies (expanded from `root` by `spec`, or the root alone for None) and
    the cache holding the frontier's scratch K/V (see `expand`). `root_mask` [B, words]
    (structured output: the target tokens each row's grammar allows next) keeps the first level
    to allowed tokens."""
    if spec is None:
        return root_only(root.token), cache
    root_logits = draft_head(params, cfg, root.hidden)
    if root_mask is not None:
        root_logits = masked_draft_logits(params, root_logits, root_mask)
    return expand(params, cfg, cache, root_logits, root.hidden, root.token, spec)


def masked_draft_logits(params: dict, logits: jax.Array, masks: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [B, Vd] at -inf where the target-vocabulary bitmasks [B, words]
    forbid the token (read through the draft's vocabulary map); a row whose draft vocabulary has
    no allowed token keeps its logits (its proposals are then rejected by the target's masks)."""
    allowed = allowed_tokens(masks, draft_to_target_ids(params, jnp.arange(logits.shape[-1], dtype=jnp.int32)))
    masked = jnp.where(allowed, logits, -jnp.inf)
    return jnp.where(allowed.any(-1, keepdims=True), masked, logits)


def draft_extend(params: dict, cfg: DraftConfig, cache: kv_cache.KVCache, features: jax.Array,
                 next_tokens: jax.Array, n_valid: jax.Array, absorb: bool | None = None
                 ) -> tuple[jax.Array, jax.Array, kv_cache.KVCache]:
    """Append pairs (features[t], next_tokens[t]) at draft positions lengths + t, t < n_valid.

    Returns the draft logits [B, Vd] and output hidden [B, H] of each row's last valid pair, and
    the cache advanced by n_valid. `absorb` picks an MLA draft's form (see draft.draft_forward).
    """
    b, t = next_tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    visible = kv_cache.Visible(cache.lengths, kv_cache.causal_mask(b, t))
    embeds = params["embed"][next_tokens]
    logits, hidden, cache = draft_forward(params, cfg, embeds, project_features(params, cfg, features), positions, cache,
                                          visible, absorb)
    last = (n_valid - 1)[:, None]
    root_logits = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]
    root_hidden = jnp.take_along_axis(hidden, last[:, :, None], axis=1)[:, 0]
    return root_logits, root_hidden, kv_cache.advance(cache, n_valid)


def chunk_next_tokens(tokens: jax.Array, prompt_lens: jax.Array, following: jax.Array, first: jax.Array) -> jax.Array:
    """The token after each position of prompt chunks [B, T]: the chunk's own next token and, at a
    row's last valid position, the prompt token `following` the chunk (-1: the chunk ends the
    prompt, and the first generated token `first` follows it)."""
    t = tokens.shape[1]
    after = jnp.where(following >= 0, following, first)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    return jnp.where(jnp.arange(t)[None, :] == (prompt_lens - 1)[:, None], after[:, None], shifted)


def draft_prefill(params: dict, cfg: DraftConfig, cache: kv_cache.KVCache, aux: jax.Array, tokens: jax.Array,
                  prompt_lens: jax.Array, following: jax.Array, first: jax.Array, absorb: bool | None = None
                  ) -> tuple[kv_cache.KVCache, DraftRoot]:
    """The draft over a prompt chunk the target just prefilled (features `aux` [B, T, F] of
    `tokens` [B, T], `prompt_lens` valid; `following` and `first` as in `chunk_next_tokens`) ->
    (cache advanced by `prompt_lens`, root of the first draft tree). Draft pair t = (feature t,
    token t+1); the last pair's next token follows the chunk. The root is meaningful for final
    chunks only."""
    next_tokens = chunk_next_tokens(tokens, prompt_lens, following, first)
    _, root_hidden, cache = draft_extend(params, cfg, cache, aux, next_tokens, prompt_lens, absorb)
    return cache, DraftRoot(token=first, hidden=root_hidden)


def expand(params: dict, cfg: DraftConfig, cache: kv_cache.KVCache, root_logits: jax.Array, root_hidden: jax.Array,
           root_token: jax.Array, spec: SpecConfig) -> tuple[DraftTree, kv_cache.KVCache]:
    """Build the next draft tree from the root's draft logits/hidden -> (tree, cache).

    The returned cache has the same lengths and committed entries; past them it holds the
    frontier's scratch K/V, which the step's extend overwrites. Carry it on, not the cache passed
    in: keeping both alive makes XLA copy the whole draft page pool every step.
    """
    b = root_logits.shape[0]
    k, n = spec.topk, spec.num_draft_tokens
    base = cache.lengths
    scratch = max((spec.num_steps - 1) * k, 1)

    score, tok = jax.lax.top_k(jax.nn.log_softmax(root_logits, axis=-1), k)  # [B, k]
    pool_score, pool_tok = [score], [tok]
    pool_parent = [jnp.full((b, k), -1, jnp.int32)]
    front_pool = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    front_hidden = jnp.broadcast_to(root_hidden[:, None, :], (b, k, root_hidden.shape[-1]))
    front_anc = jnp.zeros((b, k, scratch), bool)
    offset = k
    for level in range(1, spec.num_steps):
        slot0 = (level - 1) * k
        own = jax.nn.one_hot(slot0 + jnp.arange(k), scratch, dtype=bool)  # [k, TMP]
        visible = front_anc | own[None]
        # The frontier's "new tokens" are the scratch slots: committed prefix + its visible scratch.
        positions = jnp.broadcast_to((base + level - 1)[:, None], (b, k))
        embeds = params["embed"][draft_to_target_ids(params, tok)]
        logits, hidden, cache = draft_forward(params, cfg, embeds, front_hidden, positions,
                                              cache.replace(lengths=base + slot0),
                                              kv_cache.Visible(base, visible, window_is_new=False))
        cache = cache.replace(lengths=base)
        child_score, child_tok = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, k, k]
        cand_score = (score[:, :, None] + child_score).reshape(b, k * k)
        cand_tok = child_tok.reshape(b, k * k)
        pool_score.append(cand_score)
        pool_tok.append(cand_tok)
        pool_parent.append(jnp.repeat(front_pool, k, axis=1))
        score, pick = jax.lax.top_k(cand_score, k)
        parent_local = pick // k
        tok = jnp.take_along_axis(cand_tok, pick, axis=1)
        front_pool = offset + pick
        front_hidden = jnp.take_along_axis(hidden, parent_local[:, :, None], axis=1)
        front_anc = jnp.take_along_axis(visible, parent_local[:, :, None], axis=1)
        offset += k * k

    pool_score = jnp.concatenate(pool_score, axis=1)
    pool_tok = jnp.concatenate(pool_tok, axis=1)
    pool_parent = jnp.concatenate(pool_parent, axis=1)
    _, chosen = jax.lax.top_k(pool_score, n - 1)  # ties -> lower index, so parents outrank children
    chosen = jnp.sort(chosen, axis=1)
    rows = jnp.arange(b)[:, None]
    tree_index = jnp.zeros(pool_score.shape, jnp.int32).at[rows, chosen].set(jnp.arange(1, n, dtype=jnp.int32))
    parent_pool = jnp.take_along_axis(pool_parent, chosen, axis=1)
    parents = jnp.where(parent_pool < 0, 0, jnp.take_along_axis(tree_index, jnp.maximum(parent_pool, 0), axis=1))
    tokens = draft_to_target_ids(params, jnp.take_along_axis(pool_tok, chosen, axis=1))
    tree = DraftTree(
        tokens=jnp.concatenate([root_token[:, None], tokens], axis=1).astype(jnp.int32),
        parents=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parents], axis=1).astype(jnp.int32),
    )
    return tree, cache
