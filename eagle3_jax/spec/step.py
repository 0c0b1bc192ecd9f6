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
from ..logprobs import LogprobSettings, TokenLogprobs, token_logprobs
from ..sampling import PenaltyHistory, SamplingArrays, apply_penalties, processed_logits, sample
from ..target import forward
from .propose import DraftRoot, draft_extend, propose
from .settings import SpecConfig
from .tree import ancestor_mask, depths, path_to
from .verify import accept, commit_path, emitted_tokens


def chunk_next_tokens(tokens: jax.Array, prompt_lens: jax.Array, following: jax.Array, first: jax.Array) -> jax.Array:
    """The token after each position of prompt chunks [B, T]: the chunk's own next token and, at a
    row's last valid position, the prompt token `following` the chunk (-1: the chunk ends the
    prompt, and the first generated token `first` follows it)."""
    t = tokens.shape[1]
    after = jnp.where(following >= 0, following, first)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    return jnp.where(jnp.arange(t)[None, :] == (prompt_lens - 1)[:, None], after[:, None], shifted)


def plain_prefill(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tokens: jax.Array,
                  prompt_lens: jax.Array, sp: SamplingArrays, counter: jax.Array | None = None,
                  following: jax.Array | None = None, absorb: bool | None = None,
                  logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) after each row's cached prefix ->
    (first token [B] sampled with key `counter` (default 0) and penalties read from `history`
    (the sequence so far, this chunk included), aux features [B, T, F], cache advanced by
    `prompt_lens`, logprobs). `following` as in `spec_prefill`. `absorb` picks the MLA form (see
    target.forward). With `logprobs`, the logprobs [B, T] of each position's next token
    (`chunk_next_tokens`: raw for prompt tokens; the first generated token's as the settings say),
    else None."""
    b, t = tokens.shape
    if counter is None:
        counter = jnp.zeros((b,), jnp.int32)
    positions = tcache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, aux, tcache = forward(tparams, tcfg, tokens, positions, tcache, absorb=absorb)
    last = (prompt_lens - 1)[:, None]
    last_logits = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]
    judged = apply_penalties(last_logits, sp, history)
    first = sample(judged, sp, counter)
    lp = None
    if logprobs is not None:
        if following is None:
            following = jnp.full((b,), -1, jnp.int32)
        lp = token_logprobs(logits, chunk_next_tokens(tokens, prompt_lens, following, first), logprobs.k)
        if logprobs.processed:  # the first generated token's, from what it was sampled from
            first_lp = token_logprobs(processed_logits(judged[:, None], sp, counter[:, None]), first[:, None],
                                      logprobs.k)
            at_last = jnp.arange(t)[None, :] == last
            lp = jax.tree.map(lambda whole, one: jnp.where(at_last.reshape(at_last.shape + (1,) * (whole.ndim - 2)),
                                                           one, whole), lp, first_lp)
    return first, aux, kv_cache.advance(tcache, prompt_lens), lp


def plain_step(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tokens: jax.Array, sp: SamplingArrays,
               counter: jax.Array, logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None):
    """One token per row after `tokens` [B] (written at the cache's lengths) -> (next token [B]
    sampled with key `counter` and penalties read from `history`, aux feature [B, F] of `tokens`,
    cache advanced by one, its logprobs [B, 1] with `logprobs` else None)."""
    with jax.named_scope("verify"):  # the target pass (named as a speculative step's, for the accounting)
        logits, aux, tcache = forward(tparams, tcfg, tokens[:, None], tcache.lengths[:, None], tcache)
    with jax.named_scope("judge"):
        judged = apply_penalties(logits[:, 0], sp, history)
        nxt = sample(judged, sp, counter)
    lp = None if logprobs is None else emitted_logprobs(logits, judged[:, None], nxt[:, None], sp, counter, logprobs)
    return nxt, aux[:, 0], kv_cache.advance(tcache, jnp.ones_like(tcache.lengths)), lp


def emitted_logprobs(logits: jax.Array, judged: jax.Array, tokens: jax.Array, sp: SamplingArrays,
                     counter: jax.Array, logprobs: LogprobSettings) -> TokenLogprobs:
    """Logprobs of emitted tokens [B, P] from the raw logits [B, P, V] that predicted them, or,
    processed, from those logits as judged (penalised; token p is the row's generated token number
    counter + p)."""
    if logprobs.processed:
        logits = processed_logits(judged, sp, counter[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32))
    return token_logprobs(logits, tokens, logprobs.k)


def spec_prefill(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig,
                 tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, tokens: jax.Array, prompt_lens: jax.Array,
                 sp: SamplingArrays, counter: jax.Array | None = None, following: jax.Array | None = None,
                 absorb: bool | None = None, logprobs: LogprobSettings | None = None,
                 history: PenaltyHistory | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) -> first token [B], caches, draft root.

    The tokens go after each row's cached prefix (cache lengths, equal in both caches), so a long
    prompt can be prefilled in chunks. `following` [B] is the prompt token after a chunk that is
    not the prompt's last, or -1 for a final chunk (the default): a final chunk samples the first
    generated token with key `counter` (default 0) and the draft pairs its last feature with it.
    The first token and root are meaningful for final chunks only. `absorb` picks the MLA form
    (see target.forward) of the target and, for an MLA draft, of the draft's extend. `logprobs` as
    in `plain_prefill` (the last output; None without), and `history` (penalties).
    """
    b, t = tokens.shape
    if following is None:
        following = jnp.full((b,), -1, jnp.int32)
    first, aux, tcache, lp = plain_prefill(tparams, tcfg, tcache, tokens, prompt_lens, sp, counter, following, absorb,
                                           logprobs, history)
    # Draft pair t = (feature t, token t+1); the last pair's next token follows the chunk.
    next_tokens = chunk_next_tokens(tokens, prompt_lens, following, first)
    _, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, aux, next_tokens, prompt_lens, absorb)
    return first, tcache, dcache, DraftRoot(token=first, hidden=root_hidden), lp


def path_counts(tokens: jax.Array, anc: jax.Array, vocab: int) -> jax.Array:
    """[B, N, V]: per tree node, the counts of the draft tokens from the root down to it, itself
    included (its logits predict the token after it, once all of them are output); the root, the
    last emitted token, is counted in the output already."""
    below_root = anc & (jnp.arange(tokens.shape[1]) > 0)[None, None, :]
    return jnp.einsum("bij,bjv->biv", below_root.astype(jnp.int32), jax.nn.one_hot(tokens, vocab, dtype=jnp.int32))


def verify_tree(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tree) -> tuple:
    """The target's pass over a draft tree -> (logits [B, N, V], aux features [B, N, F], cache with
    the nodes' K/V written at lengths + node, ancestor mask, depths)."""
    anc = ancestor_mask(tree.parents)
    depth = depths(anc)
    logits, aux, tcache = forward(tparams, tcfg, tree.tokens, tcache.lengths[:, None] + depth, tcache, tree_mask=anc)
    return logits, aux, tcache, anc, depth


def judge(logits: jax.Array, tree, anc: jax.Array, depth: jax.Array, sp: SamplingArrays, counter: jax.Array,
          history: PenaltyHistory | None, max_accept: int) -> tuple:
    """Acceptance over a verified tree -> (emitted tokens [B, D+1], counts [B], accepted path [B, D+1],
    judged logits, bonus [B]). Penalties read `history` plus, at each node, the draft tokens on
    its path (the output it would have)."""
    judged = apply_penalties(logits, sp, history, lambda: path_counts(tree.tokens, anc, logits.shape[-1]))
    node, bonus = accept(judged, tree.tokens, tree.parents, anc, depth, sp, counter)
    n_accept = jnp.take_along_axis(depth, node[:, None], axis=1)[:, 0]
    path = path_to(anc, depth, node, max_accept + 1)
    return emitted_tokens(tree.tokens, path, n_accept, bonus), n_accept + 1, path, judged, bonus


def extend_accepted(dparams: dict, dcfg: DraftConfig, dcache: kv_cache.KVCache, aux: jax.Array, path: jax.Array,
                    out: jax.Array, count: jax.Array) -> tuple[jax.Array, kv_cache.KVCache]:
    """The draft over the accepted (target feature, next token) pairs -> (next root's hidden, cache)."""
    features = jnp.take_along_axis(aux, path[:, :, None], axis=1)
    _, root_hidden, dcache = draft_extend(dparams, dcfg, dcache, features, jnp.where(out >= 0, out, 0), count)
    return root_hidden, dcache


def spec_step(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig, spec: SpecConfig | None,
              tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, root: DraftRoot, sp: SamplingArrays,
              counter: jax.Array, logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None):
    """Propose a tree from `root` (`spec`; None: the root alone), verify it, emit tokens [B, D+1]
    (-1 padded; D = spec.max_accept, 0 for None) and counts [B]; return caches, next root, counter
    and, with `logprobs`, the emitted tokens' logprobs [B, D+1] (each read at the node that
    predicted the token: the accepted path's node before it), else None. Penalties read `history`
    plus, at each node, the draft tokens on its path (the output it would have).

    The phases (propose, verify, judge, commit, extend) are the functions a step is made of, each
    under its own name scope, so a profile and the step accounting (bench/step_accounting.py)
    see them apart."""
    with jax.named_scope("propose"):
        tree, dcache = propose(dparams, dcfg, dcache, root, spec)
    with jax.named_scope("verify"):
        logits, aux, tcache, anc, depth = verify_tree(tparams, tcfg, tcache, tree)
    with jax.named_scope("judge"):
        out, count, path, judged, bonus = judge(logits, tree, anc, depth, sp, counter, history,
                                                spec.max_accept if spec is not None else 0)
    with jax.named_scope("commit"):
        tcache = commit_path(tcache, path, count)
    with jax.named_scope("extend"):
        root_hidden, dcache = extend_accepted(dparams, dcfg, dcache, aux, path, out, count)
    lp = None
    if logprobs is not None:
        on_path = lambda a: jnp.take_along_axis(a, path[:, :, None], axis=1)  # noqa: E731
        lp = emitted_logprobs(on_path(logits), on_path(judged), out, sp, counter, logprobs)
    return out, count, tcache, dcache, DraftRoot(token=bonus, hidden=root_hidden), counter + count, lp
