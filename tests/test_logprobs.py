"""Logprobs: every emitted token's logprob under speculation equals plain decoding's and a plain
forward's over the emitted sequence; prompt logprobs across chunks and preemption; processed mode.

The three families: DeepSeek-V3 (MLA + MoE) on the bundled kimi-mini pair (chain and tree), Llama
on the bundled stories260K pair (chain; both trained drafts, so steps accept several tokens),
MiniMax-M2 (GQA + MoE) and random DeepSeek / Llama in test_spec.py (slow-marked) with a
draft steered to accept long paths.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.sampling.logprobs import Logprob
from eagle3_jax.sampling.sampler import filtered_logits
from eagle3_jax.scheduler import Scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = {"kimi-mini": ("kimi-mini", "kimi-mini-eagle3"), "stories260K": ("stories260K", "stories260K-eagle3")}
PROMPTS = [[1, 403, 407, 286, 261], [1, 291, 276, 286, 261, 370, 298], [1, 90]]
# float32: a 1-token decode pass and a verify pass over several tokens round logits differently in
# the last bits; log-probabilities then agree to 1e-5 plus 1e-5 of their size (measured: up to
# 1.1e-5 at -5.39 on stories260K, whose logits are larger than kimi-mini's).
ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request):
    t, d = PAIRS[request.param]
    target = e3.load_target(os.path.join(ROOT, "checkpoints", t), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "checkpoints", d), target=target, dtype="float32")
    return target, draft


def assert_same_logprobs(a: list[Logprob], b: list[Logprob]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        np.testing.assert_allclose(x.logprob, y.logprob, atol=ATOL, rtol=RTOL)
        assert len(x.top) == len(y.top)
        np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], atol=ATOL, rtol=RTOL)
        assert [i for i, _ in x.top] == [i for i, _ in y.top]


PAD_TO = 64  # every reference forward runs at one length: one compiled program per model


def forward_logits(target, ids: list[int]) -> np.ndarray:
    """A plain causal forward's logits over `ids` (padded to PAD_TO: causal, so the padding after
    a position never changes it)."""
    assert len(ids) <= PAD_TO
    return np.asarray(target.logits([ids + [0] * (PAD_TO - len(ids))])[0][: len(ids)])


def forward_logprobs(target, prompt: list[int], output: list[int]) -> np.ndarray:
    """log_softmax of a plain causal forward over prompt + output: row i predicts token i + 1."""
    return np.asarray(jax.nn.log_softmax(forward_logits(target, prompt + output), axis=-1))


def test_greedy_logprobs_equal_plain_decoding_and_a_forward(pair):
    target, draft = pair
    sp = e3.SamplingParams(max_tokens=40, logprobs=5, prompt_logprobs=3)
    runs = {"plain": e3.Engine(target, max_batch_size=4, max_seq_len=128).generate(PROMPTS, sp)}
    for name in ("chain:3:1:4", "tree:4:3:10") if target.config.model_type != "llama" else ("chain:3:1:4",):
        engine = e3.Engine(target, draft, e3.SpecConfig.parse(name), max_batch_size=4, max_seq_len=128)
        runs[name] = engine.generate(PROMPTS, sp)
        assert max(a for o in runs[name] for a in o.metrics["accept_lengths"]) >= 3  # accepted draft tokens
    for prompt, plain, *spec in zip(PROMPTS, *runs.values()):
        assert len(plain.logprobs) == len(plain.token_ids) and len(plain.prompt_logprobs) == len(prompt)
        assert all(len(lp.top) == 5 for lp in plain.logprobs) and plain.prompt_logprobs[0] is None
        assert all(len(lp.top) == 3 for lp in plain.prompt_logprobs[1:])
        for out in spec:
            assert out.token_ids == plain.token_ids
            assert_same_logprobs(out.logprobs, plain.logprobs)
            assert_same_logprobs(out.prompt_logprobs, plain.prompt_logprobs)
        ref = forward_logprobs(target, prompt, plain.token_ids)
        n = len(prompt)
        want = ref[np.arange(n - 1, n - 1 + len(plain.token_ids)), plain.token_ids]
        np.testing.assert_allclose([lp.logprob for lp in plain.logprobs], want, atol=ATOL, rtol=RTOL)
        assert [lp.top[0][0] for lp in plain.logprobs] == plain.token_ids  # greedy: the best is the one emitted
        np.testing.assert_allclose([lp.logprob for lp in plain.prompt_logprobs[1:]],
                                   ref[np.arange(n - 1), prompt[1:]], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pair, mode", [("kimi-mini", "processed"), pytest.param("stories260K", "raw",
                                                                                marks=pytest.mark.slow)],
                         indirect=["pair"])
def test_sampled_speculative_logprobs_are_the_targets_after_the_same_prefix(pair, mode):
    """Sampled runs emit different tokens; each reported logprob must be the target's log-probability
    of the token after the emitted prefix: raw, or of the distribution it was drawn from."""
    target, draft = pair
    temperature, top_k, top_p = 0.8, 12, 0.9
    sps = [e3.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=24, seed=100 + i,
                             logprobs=4) for i in range(len(PROMPTS))]
    sched = Scheduler(target, draft, e3.SpecConfig.parse("tree:4:3:10"), max_num_seqs=4, max_seq_len=128,
                      logprobs_mode=mode)
    outs = sched.generate(PROMPTS, sps)
    assert sum(a - 1 for o in outs for a in o.metrics["accept_lengths"]) > 0
    for prompt, out in zip(PROMPTS, outs):
        n = len(prompt)
        logits = forward_logits(target, prompt + out.token_ids)[n - 1: n - 1 + len(out.token_ids)]
        if mode == "processed":
            m = len(out.token_ids)
            logits = np.asarray(filtered_logits(logits, np.full(m, temperature, np.float32), np.full(m, top_k, np.int32),
                                                np.full(m, top_p, np.float32)))
        ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        got = [lp.logprob for lp in out.logprobs]
        np.testing.assert_allclose(got, ref[np.arange(len(out.token_ids)), out.token_ids], atol=ATOL, rtol=RTOL)
        assert np.isfinite(got).all()  # a sampled token is never outside its own top-k / top-p
        tops = np.asarray([[v for _, v in lp.top] for lp in out.logprobs])
        np.testing.assert_allclose(tops, -np.sort(-ref, axis=-1)[:, :4], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pair", ["kimi-mini"], indirect=True)
def test_prompt_logprobs_across_chunks_and_preemption(pair):
    target, _ = pair
    prompts = [[1] + list(range(300, 300 + 17)), [1] + list(range(200, 211)), [1, 5, 6]] * 2
    sp = e3.SamplingParams(max_tokens=20, logprobs=2, prompt_logprobs=2)
    whole = Scheduler(target, max_num_seqs=6, max_seq_len=64, page_size=4).generate(prompts, sp)
    # Prompts in chunks of 5, and too few pages for all six: requests are preempted and recomputed.
    tight = Scheduler(target, max_num_seqs=6, max_seq_len=64, page_size=4, prefill_chunk=5, num_pages=26)
    outs = tight.generate(prompts, sp)
    assert tight.stats()["num_preemptions"] > 0
    for prompt, a, b in zip(prompts, whole, outs):
        assert b.token_ids == a.token_ids and len(b.prompt_logprobs) == len(prompt)
        assert_same_logprobs(b.prompt_logprobs, a.prompt_logprobs)
        assert_same_logprobs(b.logprobs, a.logprobs)


@pytest.mark.parametrize("pair", ["stories260K"], indirect=True)
def test_logprob_requests_are_checked(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="logprobs must be None or an integer >= 0"):
        e3.SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="max_logprobs=2"):
        Scheduler(target, max_num_seqs=1, max_seq_len=32, max_logprobs=2).add_request([1, 2],
                                                                                     e3.SamplingParams(logprobs=3))
    with pytest.raises(ValueError, match="logprobs_mode"):
        Scheduler(target, max_num_seqs=1, max_seq_len=32, logprobs_mode="logits")
    plain = Scheduler(target, max_num_seqs=2, max_seq_len=32).generate([[1, 2]], e3.SamplingParams(max_tokens=3))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None
