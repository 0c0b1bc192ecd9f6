"""The speculative programs: prefill (target + draft) and one decode step.

One step, all on device: target verify over the tree (ancestor mask, positions by depth, aux
features captured) -> acceptance -> compact the accepted path into the target cache -> draft extend
over the accepted (feature, next token) pairs -> draft expansion of the next tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import kv_cache
from ..config import ModelConfig
from ..draft import DraftConfig
from ..sampling import SamplingArrays, sample
from ..target import forward
from .propose import DraftTree, draft_extend, expand
from .tree import SpecConfig, ancestor_mask, depths, path_to
from .verify import accept, commit_path, emitted_tokens


def spec_prefill(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig, spec: SpecConfig,
                 tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, tokens: jax.Array, prompt_lens: jax.Array,
                 sp: SamplingArrays, counter: jax.Array | None = None, following: jax.Array | None = None,
                 absorb: bool | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) -> first token [B], caches, draft tree.

    The tokens go after each row's cached prefix (cache lengths, equal in both caches), so a long
    prompt can be prefilled in chunks. `following` [B] is the prompt token after a chunk that is
    not the prompt's last, or -1 for a final chunk (the default): a final chunk samples the first
    generated token with key `counter` (default 0) and the draft pairs its last feature with it.
    The first token and tree are meaningful for final chunks only. `absorb` picks the MLA form
    (see target.forward) of the target and, for an MLA draft, of the draft's extend.
    """
    b, t = tokens.shape
    if counter is None:
        counter = jnp.zeros((b,), jnp.int32)
    if following is None:
        following = jnp.full((b,), -1, jnp.int32)
    positions = tcache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, aux, tcache = forward(tparams, tcfg, tokens, positions, tcache, absorb=absorb)
    last = (prompt_lens - 1)[:, None]
    first = sample(jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0], sp, counter)
    tcache = kv_cache.advance(tcache, prompt_lens)
    # Draft pair t = (feature t, token t+1); the last pair's next token follows the chunk.
    after = jnp.where(following >= 0, following, first)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    next_tokens = jnp.where(jnp.arange(t)[None, :] == last, after[:, None], shifted)
    root_logits, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, aux, next_tokens, prompt_lens, absorb)
    tree = expand(dparams, dcfg, dcache, root_logits, root_hidden, first, spec)
    return first, tcache, dcache, tree


def spec_step(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig, spec: SpecConfig,
              tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, tree: DraftTree, sp: SamplingArrays,
              counter: jax.Array):
    """Verify `tree`, emit tokens [B, D+1] (-1 padded) and counts [B]; return caches and next tree."""
    anc = ancestor_mask(tree.parents)
    depth = depths(anc)
    start = tcache.lengths
    logits, aux, tcache = forward(tparams, tcfg, tree.tokens, start[:, None] + depth, tcache, tree_mask=anc)
    node, bonus = accept(logits, tree.tokens, tree.parents, anc, depth, sp, counter)
    n_accept = jnp.take_along_axis(depth, node[:, None], axis=1)[:, 0]
    path = path_to(anc, depth, node, spec.max_accept + 1)
    out = emitted_tokens(tree.tokens, path, n_accept, bonus)
    count = n_accept + 1
    tcache = commit_path(tcache, path, count)

    features = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    next_tokens = jnp.where(out >= 0, out, 0)
    root_logits, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, features, next_tokens, count)
    next_tree = expand(dparams, dcfg, dcache, root_logits, root_hidden, bonus, spec)
    return out, count, tcache, dcache, next_tree, counter + count
