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
                 sp: SamplingArrays):
    """Prompts [B, T] (right-padded) -> first token [B], caches, first draft tree."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, aux, tcache = forward(tparams, tcfg, tokens, positions, tcache)
    last = (prompt_lens - 1)[:, None]
    first = sample(jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0], sp, jnp.zeros((b,), jnp.int32))
    tcache = kv_cache.advance(tcache, prompt_lens)
    # Draft pair t = (feature t, token t+1); the last pair's next token is the one just sampled.
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    next_tokens = jnp.where(jnp.arange(t)[None, :] == last, first[:, None], shifted)
    root_logits, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, aux, next_tokens, prompt_lens)
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
