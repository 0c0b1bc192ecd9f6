"""Batch-invariant numerics: in bfloat16 a token's logits do not depend on the pass it runs in, so
greedy speculation (chain and tree, dense Engine and paged Scheduler) emits greedy plain decoding's
tokens exactly."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import DEEPSEEK, LLAMA, MINIMAX, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.models import invariant
from eagle3_jax.models.target import forward
from eagle3_jax.text.tokenizer import load_tokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..", "checkpoints")
STORY_PROMPTS = [
    "Once upon a time", "Lily and Ben went to the park", "One day, a little dog", "Tom had a big red ball",
    "The sun was shining and", "There was a little girl named Sue", "Max wanted to play with his friend",
    "Mom said, \"Let's go", "The cat sat on the", "In a small town, there lived", "Sam found a shiny rock",
    "The bird flew over the", "Anna liked to draw", "It was a rainy day and", "The little boy was sad because",
    "Dad took the kids to the", "A big bear lived in the woods", "Sara and her mom baked", "The frog jumped into the",
    "Ben saw a box under the tree"]
CHAIN, TREE = e3.SpecConfig(3, 1, 4), e3.SpecConfig(4, 4, 12)
GREEDY = e3.SamplingParams(max_tokens=64)


def invariant_random_target(raw: dict, seed: int = 0):
    target = random_target(raw, dtype=jnp.bfloat16, seed=seed)
    target.config = dataclasses.replace(target.config, batch_invariant=True)
    return target


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, cfg, cache, tokens, positions, tree_mask):
    return forward(params, cfg, tokens, positions, cache, tree_mask)[::2]


def _run(target, cache, tokens, positions, tree_mask=None):
    b, t = tokens.shape
    if tree_mask is None:
        tree_mask = kv_cache.causal_mask(b, t)
    return _forward(target.params, target.config, cache, jnp.asarray(tokens, jnp.int32),
                    jnp.asarray(positions, jnp.int32), tree_mask)


def _paged(target, batch: int, max_len: int, page_size: int = 8):
    pages = max_len // page_size
    k, v = kv_cache.init_pages(target.config, batch * pages + 1, page_size, target.dtype)
    table = 1 + np.arange(batch * pages).reshape(batch, pages)
    return kv_cache.paged_view(k, v, table, np.zeros(batch))


@pytest.mark.parametrize("raw", [DEEPSEEK, MINIMAX, pytest.param(LLAMA, marks=pytest.mark.slow)],
                         ids=["mla_moe", "gqa_moe", "dense"])
def test_a_tokens_logits_do_not_depend_on_its_pass(raw):
    """One prefill of 40 tokens == prefill 30 + 5 decodes + a 5-token pass, == the row run alone,
    == a paged cache; and a tree pass gives each path the logits of decoding that path."""
    target = invariant_random_target(raw)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (3, 40))
    pos = np.broadcast_to(np.arange(40), (3, 40))
    full, cache = _run(target, kv_cache.init_cache(target.config, 3, 96, jnp.bfloat16), tokens, pos)
    full = np.asarray(full)

    steps, cache = [], _paged(target, 3, 64)
    for start, stop in [(0, 30)] + [(i, i + 1) for i in range(30, 35)] + [(35, 40)]:
        logits, cache = _run(target, cache, tokens[:, start:stop], pos[:, start:stop])
        cache = kv_cache.advance(cache, np.full(3, stop - start))
        steps.append(np.asarray(logits))
    np.testing.assert_array_equal(np.concatenate(steps, 1), full)
    alone, _ = _run(target, kv_cache.init_cache(target.config, 1, 48, jnp.bfloat16), tokens[1:2], pos[1:2])
    np.testing.assert_array_equal(np.asarray(alone)[0], full[1])

    # A tree after 30 committed tokens: root 0 -> {1, 2}, 1 -> 3, 2 -> 4; path 0-2-4 == tokens 30..32.
    prefix, cache = _run(target, kv_cache.init_cache(target.config, 1, 64, jnp.bfloat16), tokens[:1, :30], pos[:1, :30])
    cache = kv_cache.advance(cache, np.array([30]))
    parents = [-1, 0, 0, 1, 2]
    nodes = np.array([[tokens[0, 30], 7, tokens[0, 31], 9, tokens[0, 32]]])
    depth = np.array([0, 1, 1, 2, 2])
    mask = np.eye(5, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p], p = True, parents[p]
    tree, _ = _run(target, cache, nodes, 30 + depth[None], jnp.asarray(mask[None]))
    np.testing.assert_array_equal(np.asarray(tree)[0, [0, 2, 4]], full[0, 30:33])


def test_ancestor_slots_list_the_visible_new_tokens_root_first():
    mask = np.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    slots = np.asarray(invariant.ancestor_slots(jnp.array([10]), jnp.asarray(mask)))
    assert slots[0, 3, :3].tolist() == [10, 12, 13] and slots[0, 2, :2].tolist() == [10, 12]


def _random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(3, 13)).tolist() for _ in range(n)]


def _check_equal(runs: dict[str, list[list[int]]]):
    base = runs.pop("plain")
    for name, outs in runs.items():
        diverged = [i for i, (a, b) in enumerate(zip(outs, base)) if a != b]
        assert not diverged, f"{name}: prompts {diverged} diverge from plain greedy decoding"


def _greedy_runs(target, draft, prompts, max_seq_len: int, layouts=("dense", "paged"),
                 plain: dict | None = None) -> dict[str, list[list[int]]]:
    """Plain (Engine) and chain / tree through the dense Engine and / or the paged Scheduler; the
    plain run is kept in `plain` (when given) for the next call over the same prompts."""
    tokens = lambda outs: [o.token_ids for o in outs]  # noqa: E731
    plain = {} if plain is None else plain
    batch = len(prompts)  # one Engine batch: one set of programs to compile
    if "tokens" not in plain:
        engine = e3.Engine(target, max_batch_size=batch, max_seq_len=max_seq_len)
        plain["tokens"] = tokens(engine.generate(prompts, GREEDY))
    runs = {"plain": plain["tokens"]}
    for spec in (CHAIN, TREE):
        if "dense" in layouts:
            engine = e3.Engine(target, draft=draft, spec=spec, max_batch_size=batch, max_seq_len=max_seq_len)
            runs[f"{spec.name} dense"] = tokens(engine.generate(prompts, GREEDY))
        if "paged" in layouts:
            scheduler = e3.Scheduler(target, draft=draft, spec=spec, max_num_seqs=6, max_seq_len=max_seq_len,
                                     page_size=32)  # several pages a sequence, one block-table width
            runs[f"{spec.name} paged"] = tokens(scheduler.generate(prompts, GREEDY))
    return runs


# About 1.5-2 minutes each, mostly compiling: slow-marked. The default run checks both families' logits above,
# and batch-invariant speculation end to end on the demo pair (MLA + MoE, bfloat16) below.
@pytest.mark.slow
@pytest.mark.parametrize("raw", [DEEPSEEK, MINIMAX], ids=["mla_moe", "gqa_moe"])
def test_greedy_speculation_equals_plain_decoding_on_random_models(raw):
    target = invariant_random_target(raw)
    draft = random_draft(target)
    _check_equal(_greedy_runs(target, draft, _random_prompts(12, target.config.vocab_size), 96))


@pytest.fixture(scope="module")
def demo_pair():
    target = e3.load_target(os.path.join(ROOT, "kimi-mini"), dtype="bfloat16", batch_invariant=True)
    draft = e3.load_draft(os.path.join(ROOT, "kimi-mini-eagle3"), target=target, dtype="bfloat16")
    tok = load_tokenizer(target.path, bos_id=target.config.bos_token_id)
    return target, draft, [tok.encode(p, add_bos=True) for p in STORY_PROMPTS[:12]], {}


# About 1.5 minutes (compiling). The dense layout (Engine) is slow-marked: the random models above run it, and the
# paged one is what serving and `make demo` run.
@pytest.mark.parametrize("layout", ["paged", pytest.param("dense", marks=pytest.mark.slow)])
def test_greedy_speculation_equals_plain_decoding_on_the_demo_pair(demo_pair, layout):
    target, draft, prompts, plain = demo_pair  # `plain`: the baseline, decoded once for both layouts
    _check_equal(_greedy_runs(target, draft, prompts, 96, layouts=(layout,), plain=plain))


def test_batch_invariant_refuses_what_it_cannot_run():
    path = os.path.join(ROOT, "kimi-mini")
    with pytest.raises(ValueError, match="kernels='xla'"):
        e3.load_target(path, batch_invariant=True, kernels="triton")
    with pytest.raises(ValueError, match="one device"):
        e3.load_target(path, batch_invariant=True, mesh=object())
