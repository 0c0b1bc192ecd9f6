"""The step programs the scheduler runs apart from a speculative decode step: the target's prefill
and one plain decode step, and the prefill of an engine with a draft (the target's prefill, then
the draft over the same chunk, which gives the first draft tree's root). The speculative step
itself is spec_decode/step.py's `spec_step`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..models.draft import DraftConfig
from ..models.target import forward
from ..sampling.logprobs import LogprobSettings, emitted_logprobs, token_logprobs
from ..sampling.sampler import (
    PenaltyHistory,
    SamplingArrays,
    apply_penalties,
    apply_token_masks,
    processed_logits,
    sample,
)
from ..spec_decode.propose import chunk_next_tokens, draft_prefill


def plain_prefill(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tokens: jax.Array,
                  prompt_lens: jax.Array, sp: SamplingArrays, counter: jax.Array | None = None,
                  following: jax.Array | None = None, absorb: bool | None = None,
                  logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None,
                  masks: jax.Array | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) after each row's cached prefix ->
    (first token [B] sampled with key `counter` (default 0), penalties read from `history`
    (the sequence so far, this chunk included) and, with `masks` [B, words], only among the tokens
    each row's bitmask allows (structured output), aux features [B, T, F], cache advanced by
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
    judged = apply_token_masks(apply_penalties(last_logits, sp, history), masks)
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
               counter: jax.Array, logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None,
               masks: jax.Array | None = None):
    """One token per row after `tokens` [B] (written at the cache's lengths) -> (next token [B]
    sampled with key `counter`, penalties read from `history` and, with `masks` [B, words], among
    the allowed tokens only, aux feature [B, F] of `tokens`,
    cache advanced by one, its logprobs [B, 1] with `logprobs` else None)."""
    logits, aux, tcache = plain_forward(tparams, tcfg, tcache, tokens)
    nxt, lp = plain_sample(logits, sp, counter, logprobs, history, masks)
    return nxt, aux, kv_cache.advance(tcache, jnp.ones_like(tcache.lengths)), lp


def plain_forward(tparams: dict, tcfg: ModelConfig, tcache: kv_cache.KVCache, tokens: jax.Array) -> tuple:
    """The target's pass of `plain_step` -> (logits [B, 1, V], aux feature [B, F], cache holding
    the tokens' K/V, its lengths not advanced)."""
    with jax.named_scope("verify"):  # the target pass (named as a speculative step's, for the accounting)
        logits, aux, tcache = forward(tparams, tcfg, tokens[:, None], tcache.lengths[:, None], tcache)
    return logits, aux[:, 0], tcache


def plain_sample(logits: jax.Array, sp: SamplingArrays, counter: jax.Array, logprobs: LogprobSettings | None = None,
                 history: PenaltyHistory | None = None, masks: jax.Array | None = None) -> tuple:
    """The choice of `plain_step` from its pass's `logits` [B, 1, V] -> (next token [B], logprobs)."""
    with jax.named_scope("judge"):
        judged = apply_token_masks(apply_penalties(logits[:, 0], sp, history), masks)
        nxt = sample(judged, sp, counter)
    lp = None if logprobs is None else emitted_logprobs(logits, judged[:, None], nxt[:, None], sp, counter, logprobs)
    return nxt, lp


def spec_prefill(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig,
                 tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, tokens: jax.Array, prompt_lens: jax.Array,
                 sp: SamplingArrays, counter: jax.Array | None = None, following: jax.Array | None = None,
                 absorb: bool | None = None, logprobs: LogprobSettings | None = None,
                 history: PenaltyHistory | None = None, masks: jax.Array | None = None):
    """Prompt tokens [B, T] (right-padded; `prompt_lens` valid) -> first token [B], caches, draft root.

    The tokens go after each row's cached prefix (cache lengths, equal in both caches), so a long
    prompt can be prefilled in chunks. `following` [B] is the prompt token after a chunk that is
    not the prompt's last, or -1 for a final chunk (the default): a final chunk samples the first
    generated token with key `counter` (default 0) and the draft pairs its last feature with it.
    The first token and root are meaningful for final chunks only. `absorb` picks the MLA form
    (see target.forward) of the target and, for an MLA draft, of the draft's extend. `logprobs` as
    in `plain_prefill` (the last output; None without), `history` (penalties) and `masks`.
    """
    b, t = tokens.shape
    if following is None:
        following = jnp.full((b,), -1, jnp.int32)
    first, aux, tcache, lp = plain_prefill(tparams, tcfg, tcache, tokens, prompt_lens, sp, counter, following, absorb,
                                           logprobs, history, masks)
    dcache, root = draft_prefill(dparams, dcfg, dcache, aux, tokens, prompt_lens, following, first, absorb)
    return first, tcache, dcache, root, lp
