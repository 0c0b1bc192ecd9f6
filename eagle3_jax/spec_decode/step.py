"""The speculative decode step (plain prefill and decode steps are scheduler/steps.py's).

One step, all on device: draft expansion of a tree from each sequence's root (or the root alone,
for a step that does not speculate) -> target verify over the tree (ancestor mask, positions by
depth, aux features captured) -> acceptance -> compact the accepted path into the target cache ->
draft extend over the accepted (feature, next token) pairs, which gives the next root. The draft
cache is extended whatever the step's shape, so a sequence that stops speculating for a while
resumes with a draft that has seen every accepted token.

Structured output: a step may take token bitmasks, one per tree node (`verify_step`'s `masks`),
applied to the target's logits before acceptance, so every token it emits is one the grammar
allows and a sampled row keeps exactly the masked distribution (a draft token its parent's mask
forbids has no probability, so it is never accepted). The masks depend on the tree, so such a
step runs as programs the host works between: `propose` (under each row's root mask), the
target's pass over the tree (`verify_tree`), during which the host computes every node's mask
from the tree (structured/guide.py), then `accept_step` with those masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..cache import kv_cache
from ..config.model import ModelConfig
from ..models.draft import DraftConfig
from ..models.target import forward
from ..sampling.logprobs import LogprobSettings, emitted_logprobs
from ..sampling.sampler import PenaltyHistory, SamplingArrays, apply_penalties, apply_token_masks
from .propose import DraftRoot, DraftTree, draft_extend, propose
from .settings import SpecConfig
from .tree import ancestor_mask, depths, path_to
from .verify import accept, commit_path, emitted_tokens


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
          history: PenaltyHistory | None, max_accept: int, masks: jax.Array | None = None) -> tuple:
    """Acceptance over a verified tree -> (emitted tokens [B, D+1], counts [B], accepted path [B, D+1],
    judged logits, bonus [B]). Penalties read `history` plus, at each node, the draft tokens on
    its path (the output it would have); `masks` [B, N, words] keep each node's allowed tokens."""
    judged = apply_penalties(logits, sp, history, lambda: path_counts(tree.tokens, anc, logits.shape[-1]))
    judged = apply_token_masks(judged, masks)
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
    return verify_step(tparams, tcfg, dparams, dcfg, spec.max_accept if spec is not None else 0, tcache, dcache, tree,
                       sp, counter, logprobs, history)


def verify_step(tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: DraftConfig, max_accept: int,
                tcache: kv_cache.KVCache, dcache: kv_cache.KVCache, tree: DraftTree, sp: SamplingArrays,
                counter: jax.Array, logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None,
                masks: jax.Array | None = None):
    """`spec_step` after the proposal: verify `tree` (at most `max_accept` draft tokens accepted),
    with `masks` [B, N, words] (structured output) keeping each node's allowed tokens; same returns."""
    with jax.named_scope("verify"):
        logits, aux, tcache, _, _ = verify_tree(tparams, tcfg, tcache, tree)
    return accept_step(dparams, dcfg, max_accept, tcache, dcache, tree, logits, aux, sp, counter, logprobs, history,
                       masks)


def accept_step(dparams: dict, dcfg: DraftConfig, max_accept: int, tcache: kv_cache.KVCache,
                dcache: kv_cache.KVCache, tree: DraftTree, logits: jax.Array, aux: jax.Array, sp: SamplingArrays,
                counter: jax.Array, logprobs: LogprobSettings | None = None, history: PenaltyHistory | None = None,
                masks: jax.Array | None = None):
    """`verify_step` after the target's pass (`logits`, `aux` of `tree`, its K/V in `tcache`):
    judge, commit, extend; same returns. Apart, so that a structured-output step can fill its
    masks on the host while the target's pass runs."""
    anc = ancestor_mask(tree.parents)
    depth = depths(anc)
    with jax.named_scope("judge"):
        out, count, path, judged, bonus = judge(logits, tree, anc, depth, sp, counter, history, max_accept, masks)
    with jax.named_scope("commit"):
        tcache = commit_path(tcache, path, count)
    with jax.named_scope("extend"):
        root_hidden, dcache = extend_accepted(dparams, dcfg, dcache, aux, path, out, count)
    lp = None
    if logprobs is not None:
        on_path = lambda a: jnp.take_along_axis(a, path[:, :, None], axis=1)  # noqa: E731
        lp = emitted_logprobs(on_path(logits), on_path(judged), out, sp, counter, logprobs)
    return out, count, tcache, dcache, DraftRoot(token=bonus, hidden=root_hidden), counter + count, lp
