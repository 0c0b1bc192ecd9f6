"""Long prompts, exact: YaRN positions far past `original_max_position_embeddings` against
transformers, through the full forward and through the Engine's chunked prefill and paged,
blockwise attention; greedy speculative decoding equals plain decoding at that length, and a long
shared prefix is taken from the prefix cache."""

import numpy as np
import pytest

import eagle3_jax as e3

pytest.importorskip("torch")
import hf_models as H  # noqa: E402

NAME = "dsv3_yarn_long"  # YaRN factor 64 over 64 original positions, 4,096 positions
PROMPT = 2500


def _prompt(vocab: int, n: int = PROMPT, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_yarn_logits_far_past_the_original_positions(hf_model, jax_target):
    _, model = hf_model(NAME)
    target = jax_target(NAME)
    assert target.config.rope.original_max_position_embeddings == 64 and target.config.max_position_embeddings == 4096
    ids = np.asarray([_prompt(target.config.vocab_size)])
    ref, _ = H.hf_forward(model, ids)
    got = target.logits(ids)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-4, err


def test_engine_at_long_context_against_transformers(hf_model, jax_target, monkeypatch):
    """The prompt prefilled in chunks of 512 into 16-slot pages, attention walked in blocks of 256
    slots: each greedy token is transformers' argmax at its position (or within a near-tie of
    it), and the chain speculation's tokens equal plain decoding's."""
    from random_models import random_draft

    from eagle3_jax.models import blockwise

    monkeypatch.setattr(blockwise, "MAX_BLOCK_SLOTS", 256)
    _, model = hf_model(NAME)
    target = jax_target(NAME)
    prompt = _prompt(target.config.vocab_size, seed=1)
    sp = e3.SamplingParams(max_tokens=8)
    plain = e3.Engine(target, max_batch_size=1, max_seq_len=PROMPT + 16, prefill_chunk=512)
    tokens = plain.generate([prompt], sp)[0].token_ids
    ref, _ = H.hf_forward(model, np.asarray([prompt + tokens[:-1]]))
    for i, token in enumerate(tokens):
        row = ref[0, PROMPT - 1 + i]
        assert row[token] >= row.max() - 1e-4 * np.abs(row).max(), (i, token, int(row.argmax()))
    spec = e3.Engine(target, draft=random_draft(target), spec=e3.SpecConfig(3, 1, 4), max_batch_size=1,
                     max_seq_len=PROMPT + 16, prefill_chunk=512)
    assert spec.generate([prompt], sp)[0].token_ids == tokens


def test_long_shared_prefix_comes_from_the_prefix_cache(jax_target):
    """Two agent turns over a 2,000-token shared context: the second turn's prompt (the first's plus
    a tool result) takes the first's full pages from the prefix cache and decodes as without it."""
    target = jax_target(NAME)
    context = _prompt(target.config.vocab_size, 2000, seed=2)
    turn2 = context + _prompt(target.config.vocab_size, 40, seed=3)
    sp = e3.SamplingParams(max_tokens=6)
    cold = e3.Scheduler(target, max_num_seqs=1, max_seq_len=2100, prefill_chunk=512)
    want = cold.generate([turn2], sp)[0].token_ids
    warm = e3.Scheduler(target, max_num_seqs=1, max_seq_len=2100, prefill_chunk=512, prefix_caching=True)
    warm.generate([context], sp)
    assert warm.generate([turn2], sp)[0].token_ids == want
    stats = warm.stats()
    assert stats["prefix_cache_hits_total"] >= 1984  # every full 16-slot page of the shared context
