"""Speculative decoding is lossless: greedy equals the baseline token for token, for every family,
chain and trees, with a random draft and with a draft steered to the baseline's future."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, draft_config_dict, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.models import draft as draft_lib
from eagle3_jax.spec_decode import propose
from eagle3_jax.spec_decode import step as step_lib

# The pair's equality cases are slow: the default run covers greedy losslessness through
# test_scheduler, test_logprobs, test_lossless_sampling, test_stop_strings, test_batch_invariant and
# test_demo_pair, the newest-JAX leg through test_kernel_engine.

SPECS = [e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6), e3.SpecConfig(4, 4, 12)]
PROMPTS = [[1, 2, 3], [7] * 11, [5, 9, 11, 13, 17]]
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)])
def pair(request):
    target = random_target(FAMILIES[request.param])
    draft = random_draft(target)
    base = e3.Engine(target, max_batch_size=4, max_seq_len=96).generate(PROMPTS, e3.SamplingParams(max_tokens=MAX_TOKENS))
    return target, draft, [o.token_ids for o in base]


def steered(monkeypatch, base_outputs, corrupt_rate: float):
    """Make the draft predict the baseline's token at (position + 2), wrong at a fixed pseudo-random
    `corrupt_rate` of the positions (the same positions every run).

    Draft position t pairs feature t with token t+1 and predicts token t+2. The logits put the
    steered token first and a fixed ranking after it, so trees still get distinct siblings. Both
    the draft's passes and the root's logits, which a step computes from the root's hidden state
    (the pair at draft position lengths - 1), are steered.
    """
    seqs = np.zeros((4, 160), np.int32)
    for i, (p, out) in enumerate(zip(PROMPTS, base_outputs)):
        full = p + out
        seqs[i, : len(full)] = full
    seqs = jnp.asarray(seqs)
    real_forward, real_expand = draft_lib.draft_forward, propose.expand

    def steer(positions, vocab):
        target_pos = jnp.clip(positions + 2, 0, seqs.shape[1] - 1)
        want = jnp.take_along_axis(seqs[: positions.shape[0]], target_pos, axis=1)
        hashed = (target_pos.astype(jnp.uint32) * jnp.uint32(2654435761)) >> 16
        wrong = (hashed % 1000) < int(corrupt_rate * 1000)
        want = jnp.where(wrong, (want + 1) % vocab, want)
        ranking = -0.01 * jnp.arange(vocab, dtype=jnp.float32)
        return jax.nn.one_hot(want, vocab) * 10.0 + ranking

    def fake_forward(params, cfg, embeds, hidden, positions, cache, *visibility):
        _, h, cache = real_forward(params, cfg, embeds, hidden, positions, cache, *visibility)
        return steer(positions, cfg.draft_vocab_size), h, cache

    def fake_propose(params, cfg, cache, root, spec):
        if spec is None:
            return propose.root_only(root.token), cache
        root_logits = steer((cache.lengths - 1)[:, None], cfg.draft_vocab_size)[:, 0]
        return real_expand(params, cfg, cache, root_logits, root.hidden, root.token, spec)

    monkeypatch.setattr(propose, "draft_forward", fake_forward)
    monkeypatch.setattr(step_lib, "propose", fake_propose)
    jax.clear_caches()  # the jitted step must be retraced with the steered draft, and again after


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"steps{s.num_steps}_topk{s.topk}_n{s.num_draft_tokens}")
def test_greedy_random_draft_equals_baseline(pair, spec):
    target, draft, base = pair
    outs = e3.Engine(target, draft=draft, spec=spec, max_batch_size=4, max_seq_len=96).generate(
        PROMPTS, e3.SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == base
    for o in outs:
        assert all(1 <= a <= spec.max_accept + 1 for a in o.metrics["accept_lengths"])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"steps{s.num_steps}_topk{s.topk}_n{s.num_draft_tokens}")
def test_greedy_steered_draft_equals_baseline_and_accepts_long_paths(pair, spec, monkeypatch):
    target, draft, base = pair
    steered(monkeypatch, base, corrupt_rate=0.3)
    try:
        outs = e3.Engine(target, draft=draft, spec=spec, max_batch_size=4, max_seq_len=96).generate(
            PROMPTS, e3.SamplingParams(max_tokens=MAX_TOKENS))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert [o.token_ids for o in outs] == base
    seen = {a for o in outs for a in o.metrics["accept_lengths"]}
    assert seen == set(range(1, spec.max_accept + 2)), seen  # reject, partial and full accepts all occur
    assert max(o.metrics["mean_accept_length"] for o in outs) > 2.0


def test_logprobs_of_accepted_tokens_equal_plain_decoding(pair, monkeypatch):
    """Each emitted token's logprob and top alternatives, accepted draft tokens and bonus tokens
    alike, equal plain decoding's (test_logprobs.py has the trained pairs)."""
    from test_logprobs import assert_same_logprobs

    target, draft, base = pair
    sp = e3.SamplingParams(max_tokens=MAX_TOKENS, logprobs=4)
    plain = e3.Engine(target, max_batch_size=4, max_seq_len=96).generate(PROMPTS, sp)
    steered(monkeypatch, base, corrupt_rate=0.3)
    try:
        outs = e3.Engine(target, draft=draft, spec=SPECS[2], max_batch_size=4, max_seq_len=96).generate(PROMPTS, sp)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert max(a for o in outs for a in o.metrics["accept_lengths"]) == SPECS[2].max_accept + 1
    for a, b in zip(plain, outs):
        assert b.token_ids == a.token_ids
        assert_same_logprobs(b.logprobs, a.logprobs)


def test_stop_tokens_and_budgets_cut_accepted_chunks(pair, monkeypatch):
    target, draft, base = pair
    steered(monkeypatch, base, corrupt_rate=0.0)  # every proposal accepted: chunks of 4 tokens
    try:
        stop = base[0][9]
        spec = e3.SpecConfig(3, 1, 4)
        eng = e3.Engine(target, draft=draft, spec=spec, max_batch_size=4, max_seq_len=96)
        outs = eng.generate(PROMPTS, [e3.SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)),
                                      e3.SamplingParams(max_tokens=7), e3.SamplingParams(max_tokens=MAX_TOKENS)])
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert outs[0].token_ids == base[0][: base[0].index(stop) + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == base[1][:7] and outs[1].finish_reason == "length"
    assert outs[2].token_ids == base[2]


def test_no_recompilation_between_steps_or_calls():
    """Greedy batches, sampled ones and sampled ones with top-k / top-p compile their own programs (a
    program branches on nothing the device computes), once: second calls of the same shapes (other
    prompts, other sampling values) compile nothing, and each program is traced once."""
    target = random_target(FAMILIES["llama"])
    eng = e3.Engine(target, draft=random_draft(target), spec=e3.SpecConfig(3, 2, 6), max_batch_size=2, max_seq_len=64)
    eng.generate([[1, 2, 3]], e3.SamplingParams(max_tokens=10))
    eng.generate([[1, 2, 3]], e3.SamplingParams(max_tokens=10, temperature=0.8, seed=3))
    eng.generate([[1, 2, 3]], e3.SamplingParams(max_tokens=10, temperature=0.8, top_k=5, seed=3))
    programs = eng.scheduler.programs
    before = programs.num_compiles
    eng.generate([[4, 5, 6, 7]], e3.SamplingParams(max_tokens=10))
    eng.generate([[4, 5, 6, 7]], e3.SamplingParams(max_tokens=10, temperature=0.5, seed=7))
    eng.generate([[4, 5, 6, 7]], e3.SamplingParams(max_tokens=10, temperature=0.5, top_p=0.9, seed=7))
    assert programs.num_compiles == before
    assert all(p._cache_size() == 1 for p in programs._programs.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_steps=0), "num_steps"),
        (dict(topk=0), "topk"),
        (dict(num_steps=3, topk=1, num_draft_tokens=6), "chain"),
        (dict(num_steps=2, topk=2, num_draft_tokens=12), "exceeds"),
        (dict(num_draft_tokens=1), "num_draft_tokens"),
    ],
)
def test_bad_spec_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        e3.SpecConfig(**kwargs)


def test_engine_rejects_mismatched_pairs():
    target = random_target(FAMILIES["llama"])
    with pytest.raises(ValueError, match="needs a draft"):
        e3.Engine(target, spec=e3.SpecConfig())
    with pytest.raises(TypeError, match="Draft"):
        e3.Engine(target, draft=object())
    num_layers = target.config.num_layers
    raw = draft_config_dict(target.config, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 0, num_layers]})
    with pytest.raises(ValueError, match="out of range"):  # reads a layer this target does not have
        e3.Engine(target, draft=random_draft(target, raw))
    other = random_target(dict(FAMILIES["llama"], hidden_size=2 * target.config.hidden_size))
    with pytest.raises(ValueError, match="another target"):
        e3.Engine(target, draft=random_draft(other))
