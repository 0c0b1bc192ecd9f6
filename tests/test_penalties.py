"""Penalties (presence, frequency, repetition) under speculation: greedy speculative output equals
greedy plain output token for token on the bundled kimi-mini pair (test_lossless_sampling.py
checks the sampled distribution by exact enumeration)."""

from __future__ import annotations

import os

import pytest

import eagle3_jax as e3

pytestmark = pytest.mark.slow  # test_lossless_sampling checks penalties under speculation (default run and CI)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 403, 407, 286, 261], [1, 291, 276, 286, 261, 370, 298], [1, 90]]


@pytest.fixture(scope="module")
def pair():
    target = e3.load_target(os.path.join(ROOT, "checkpoints", "kimi-mini"), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3"), target=target, dtype="float32")
    return target, draft


def test_greedy_penalised_speculation_equals_plain_decoding(pair):
    target, draft = pair
    plain = e3.Engine(target, max_batch_size=4, max_seq_len=128)
    kinds = [dict(presence_penalty=1.5), dict(frequency_penalty=0.8), dict(repetition_penalty=1.6),
             dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.9)]
    sps = [e3.SamplingParams(max_tokens=48, **kw) for kw in kinds[: len(PROMPTS)]]
    unpenalised = plain.generate(PROMPTS, e3.SamplingParams(max_tokens=48))
    want = plain.generate(PROMPTS, sps)
    assert all(a.token_ids != b.token_ids for a, b in zip(want, unpenalised))  # the penalties bite
    mixed = plain.generate(PROMPTS, [sps[0], e3.SamplingParams(max_tokens=48), sps[2]])  # neighbours without
    assert [o.token_ids for o in mixed] == [want[0].token_ids, unpenalised[1].token_ids, want[2].token_ids]
    for spec in ("chain:3:1:4", "tree:4:3:10"):
        outs = e3.Engine(target, draft, e3.SpecConfig.parse(spec), max_batch_size=4, max_seq_len=128).generate(
            PROMPTS, sps)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want], spec
        assert max(a for o in outs for a in o.metrics["accept_lengths"]) >= 3  # accepted draft tokens judged too
    all_three = e3.SamplingParams(max_tokens=48, **kinds[3])
    again = e3.Engine(target, draft, e3.SpecConfig.parse("tree:4:3:10"), max_batch_size=4,
                      max_seq_len=128).generate(PROMPTS[:1], all_three)
    assert again[0].token_ids == plain.generate(PROMPTS[:1], all_three)[0].token_ids


def test_penalty_values_are_checked():
    for kw in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
               dict(repetition_penalty=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(kw))):
            e3.SamplingParams(**kw)
