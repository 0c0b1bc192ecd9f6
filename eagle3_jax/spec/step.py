"""The step programs: prefill and one decode step, plain (target only) or speculative.

One step, all on device: draft expansion of a tree from each sequence's root (or the root alone,
for a step that does not speculate) -> target verify over the tree (ancestor mask, positions by
depth, aux features captured) -> acceptance -> compact the accepted path into the target cache ->
draft extend over the accepted (feature, next token) pairs, which gives the next root. The draft
cache is extended whatever the step's shape, so a sequence that stops speculating for a while
resumes with a draft that has seen every accepted token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import kv_cache
from ..config import ModelConfig
from ..draft import DraftConfig
from ..sampling import SamplingArrays, sample
from ..target import forward
from .propose import DraftRoot, draft_extend, propose
from .settings import SpecConfig
from .tree import ancestor_mask, depths, path_to
from .verify import accept, commit_path, emitted_tokens


def plain_prefill(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tokens: jax.Array,
                  prompt_lens: jax.Array, sp: SamplingArrays, counter: jax.Array | None = None,
                  absorb: bool | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) after each row's cached prefix ->
    (first token [B] sampled with key `counter` (default 0), aux features [B, T, F], cache
    advanced by `prompt_lens`). `absorb` picks the MLA form (see target.forward)."""
    b, t = tokens.shape
    if counter is None:
        counter = jnp.zeros((b,), jnp.int32)
    positions = tcache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, aux, tcache = forward(tparams, tcfg, tokens, positions, tcache, absorb=absorb)
    last = (prompt_lens - 1)[:, None]
    first = sample(jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0], sp, counter)
    return first, aux, kv_cache.advance(tcache, prompt_lens)


def plain_step(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tokens: jax.Array, sp: SamplingArrays,
               counter: jax.Array):
    """One token per row after `tokens` [B] (written at the cache's lengths) -> (next token [B]
    sampled with key `counter`, aux feature [B, F] of `tokens`, cache advanced by one)."""
    logits, aux, tcache = forward(tparams, tcfg, tokens[:, None], tcache.lengths[:, None], tcache)
    return sample(logits[:, 0], sp, counter), aux[:, 0], kv_cache.advance(tcache, jnp.ones_like(tcache.lengths))


def spec_prefill(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig,
                 tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, tokens: jax.Array, prompt_lens: jax.Array,
                 sp: SamplingArrays, counter: jax.Array | None = None, following: jax.Array | None = None,
                 absorb: bool | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) -> first token [B], caches, draft root.

    The tokens go after each row's cached prefix (cache lengths, equal in both caches), so a long
    prompt can be prefilled in chunks. `following` [B] is the prompt token after a chunk that is
    not the prompt's last, or -1 for a final chunk (the default): a final chunk samples the first
    generated token with key `counter` (default 0) and the draft pairs its last feature with it.
    The first token and root are meaningful for final chunks only. `absorb` picks the MLA form
    (see target.forward) of the target and, for an MLA draft, of the draft's extend.
    """
    b, t = tokens.shape
    if following is None:
        following = jnp.full((b,), -1, jnp.int32)
    first, aux, tcache = plain_prefill(tparams, tcfg, tcache, tokens, prompt_lens, sp, counter, absorb)
    last = (prompt_lens - 1)[:, None]
    # Draft pair t = (feature t, token t+1); the last pair's next token follows the chunk.
    after = jnp.where(following >= 0, following, first)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    next_tokens = jnp.where(jnp.arange(t)[None, :] == last, after[:, None], shifted)
    _, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, aux, next_tokens, prompt_lens, absorb)
    return first, tcache, dcache, DraftRoot(token=first, hidden=root_hidden)


def spec_step(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig, spec: SpecConfig | None,
              tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, root: DraftRoot, sp: SamplingArrays,
              counter: jax.Array):
    """Propose a tree from `root` (`spec`; None: the root alone), verify it, emit tokens [B, D+1]
    (-1 padded; D = spec.max_accept, 0 for None) and counts [B]; return caches, next root, counter."""
    tree, dcache = propose(dparams, dcfg, dcache, root, spec)
    max_accept = spec.max_accept if spec is not None else 0
    anc = ancestor_mask(tree.parents)
    depth = depths(anc)
    start = tcache.lengths
    logits, aux, tcache = forward(tparams, tcfg, tree.tokens, start[:, None] + depth, tcache, tree_mask=anc)
    node, bonus = accept(logits, tree.tokens, tree.parents, anc, depth, sp, counter)
    n_accept = jnp.take_along_axis(depth, node[:, None], axis=1)[:, 0]
    path = path_to(anc, depth, node, max_accept + 1)
    out = emitted_tokens(tree.tokens, path, n_accept, bonus)
    count = n_accept + 1
    tcache = commit_path(tcache, path, count)

    features = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    next_tokens = jnp.where(out >= 0, out, 0)
    _, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, features, next_tokens, count)
    return out, count, tcache, dcache, DraftRoot(token=bonus, hidden=root_hidden), counter + count
