"""Stop strings (`SamplingParams.stop`): matched on the decoded text across token boundaries, the
output ends at the token that completes one, and nothing after it is emitted or counted, with plain
decoding and under chain and tree speculation, greedy and sampled."""

from __future__ import annotations

import os

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.text.stream import TextStream, find_stop
from eagle3_jax.text.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIMI = os.path.join(ROOT, "checkpoints", "kimi-mini")
STORIES = os.path.join(ROOT, "checkpoints", "stories260K")
TEXT = "Once upon a time there was a little dog named Max. He liked to run in the park with his friend Lily."


def reference(tok, prompt, gen, stops, include=False, min_tokens=0):
    """(tokens kept, text) by brute force: the shortest token prefix, of at least min_tokens, whose
    text holds a stop string ending after the text of the first min_tokens - 1 tokens, and its
    text cut at the stop that ends first."""
    first = max(min_tokens, 1)
    checked_from = len(tok.decode_continuation(prompt, gen[: first - 1]))
    for k in range(first, len(gen) + 1):
        text = tok.decode_continuation(prompt, gen[:k])
        found = find_stop(text, stops, checked_from)
        if found is not None:
            at, stop = found
            return k, text[: at + (len(stop) if include else 0)]
    return len(gen), tok.decode_continuation(prompt, gen)


def random_stops(tok, prompt, gen, rng, count):
    """Random substrings (2 to 6 characters) of the generated text: most span a token boundary."""
    text = tok.decode_continuation(prompt, gen)
    stops = []
    while len(stops) < count:
        a = int(rng.integers(0, len(text) - 6))
        stops.append(text[a: a + int(rng.integers(2, 7))])
    return stops


@pytest.mark.parametrize("model", [KIMI, STORIES])
@pytest.mark.parametrize("include", [False, True])
def test_token_by_token_and_delta_pushes_cut_where_the_reference_does(model, include):
    tok = load_tokenizer(model)
    prompt = tok.encode("Once upon a time")
    gen = tok.encode(TEXT, add_bos=False)[4:]
    rng = np.random.default_rng(0)
    for trial in range(60):
        stops = random_stops(tok, prompt, gen, rng, 1 + trial % 3)
        min_tokens = (0, 1, 6)[trial % 3]
        want_k, want_text = reference(tok, prompt, gen, stops, include, min_tokens)
        one = TextStream(tok, prompt, stops, include, min_tokens)
        pieces, k = [], 0
        while k < len(gen) and not one.push([gen[k]]):
            pieces.append(one.take())
            k += 1
        assert k + 1 == want_k, (stops, k)  # stopped at the token that completed the stop
        pieces.append(one.take(final=True))
        assert "".join(pieces) == want_text, stops
        if not include and not min_tokens:  # (before min_tokens a stop string is plain text)
            assert not any(s in p for p in pieces for s in stops)  # streaming never showed a stop
        # The same tokens in uneven deltas: the same cut.
        bulk, i = TextStream(tok, prompt, stops, include, min_tokens), 0
        while i < want_k:
            step = int(rng.integers(1, 5))
            bulk.push(gen[i: min(i + step, want_k)], final=i + step >= want_k)
            i += step
        assert bulk.take(final=True) == want_text and bulk.stop == one.stop


def test_streaming_holds_back_only_a_possible_stop_prefix():
    tok = load_tokenizer(KIMI)
    prompt = tok.encode("Once upon a time")
    gen = tok.encode("Once upon a time there was a little", add_bos=False)[4:]
    text = tok.decode_continuation(prompt, gen)
    assert text.endswith(" little")
    stream = TextStream(tok, prompt, ["little cat", "was a big"])
    for t in gen:
        stream.push([t])
    assert stream.take() == text[: -len("little")]  # "little" may begin a stop string
    assert stream.take() == ""
    more = tok.encode("Once upon a time there was a little dog", add_bos=False)[4 + len(gen):]
    stream.push(more)
    assert stream.take() == tok.decode_continuation(prompt, gen + more)[len(text) - len("little"):]
    assert not TextStream(tok, prompt, ()).push(gen)


def test_bad_stop_values_are_refused():
    for bad in ("", [""], [1], 7):
        with pytest.raises(ValueError, match="stop"):
            e3.SamplingParams(stop=bad)
    assert e3.SamplingParams(stop="\n").stop == ("\n",)


@pytest.fixture(scope="module")
def demo_engines():
    """The bundled kimi-mini pair: plain, chain and tree engines sharing one target and tokenizer."""
    tok = load_tokenizer(KIMI)
    target = e3.load_target(KIMI, dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3"), target=target, dtype="float32")
    engines = {"plain": e3.Engine(target, max_batch_size=4, max_seq_len=128, tokenizer=tok),
               "chain": e3.Engine(target, draft, e3.SpecConfig(3, 1, 4), max_batch_size=4, max_seq_len=128,
                                  tokenizer=tok),
               "tree": e3.Engine(target, draft, e3.SpecConfig(3, 2, 6), max_batch_size=4, max_seq_len=128,
                                 tokenizer=tok)}
    return tok, engines


PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "Tom had a big red ball", "One day, a little dog"]


def check_stopped(tok, prompt, out, stops):
    """A finished output is cut at the token that completes its first stop string, no later."""
    text = tok.decode_continuation(prompt, out.token_ids)
    if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
        assert out.stop_reason in stops and find_stop(text, stops, 0) is not None
        assert find_stop(tok.decode_continuation(prompt, out.token_ids[:-1]), stops, 0) is None
        at, _ = find_stop(text, stops, 0)
        assert out.text == text[:at]
    else:
        assert find_stop(text, stops, 0) is None and out.text == text


# greedy: slow (the default run checks the sampled case, which takes the same stop paths)
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 0.8], ids=["greedy", "sampled"])
def test_generation_ends_at_the_stop_under_speculation(demo_engines, temperature):
    tok, engines = demo_engines
    prompts = [tok.encode(p) for p in PROMPTS]
    free = e3.SamplingParams(temperature=temperature, max_tokens=40, seed=3)
    rng = np.random.default_rng(1)
    for name, engine in engines.items():
        overshot = 0
        outs = engine.generate(prompts, free)
        stops = [random_stops(tok, p, o.token_ids, rng, 2) for p, o in zip(prompts, outs)]
        sps = [e3.SamplingParams(temperature=temperature, max_tokens=40, seed=3, stop=s) for s in stops]
        before = engine.scheduler.stats()["generation_tokens_total"]
        cut = engine.generate(prompts, sps)
        assert engine.scheduler.stats()["generation_tokens_total"] - before == sum(len(o.token_ids) for o in cut)
        for p, o, s, full in zip(prompts, cut, stops, outs):
            check_stopped(tok, p, o, s)
            if temperature == 0.0:  # greedy: the same tokens as without stops, up to the stop
                assert o.finish_reason == "stop" and o.token_ids == full.token_ids[: len(o.token_ids)]
            # tokens the last step committed past the stop were dropped
            overshot += sum(o.metrics["accept_lengths"]) + 1 - len(o.token_ids)
        if name != "plain":
            assert overshot > 0  # some speculative step accepted tokens past a stop: the case under test


def test_stop_strings_need_a_tokenizer(demo_engines):
    _, engines = demo_engines
    bare = e3.Engine(engines["plain"].target, max_batch_size=1, max_seq_len=64)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate([[1, 2]], e3.SamplingParams(stop=["x"]))
    assert bare.generate([[1, 2]], e3.SamplingParams(max_tokens=2))[0].text is None


def test_min_tokens_holds_stops_back_under_speculation(demo_engines):
    """Greedy with min_tokens: a stop token id and a stop string that occur early are held back
    (the id never emitted before min_tokens), the same tokens in every engine."""
    tok, engines = demo_engines
    prompt = tok.encode(PROMPTS[0])
    free = engines["plain"].generate([prompt], e3.SamplingParams(max_tokens=24))[0]
    early_id = free.token_ids[2]
    early_text = tok.decode_continuation(prompt, free.token_ids[:3])[-3:]
    sp = e3.SamplingParams(max_tokens=24, min_tokens=8, stop_token_ids=(early_id,), stop=[early_text])
    outs = {name: engine.generate([prompt], sp)[0] for name, engine in engines.items()}
    plain = outs["plain"].token_ids
    assert len(plain) >= 8 and early_id not in plain[:8]
    assert all(o.token_ids == plain for o in outs.values())
    assert e3.SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    with pytest.raises(ValueError, match="min_tokens"):
        e3.SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("stop", [(), ("zzqx",)], ids=["no-stop", "stop-string"])
def test_each_choice_is_decoded_once(demo_engines, monkeypatch, stop):
    """One TextStream per choice: on the engine thread for a request with stop strings (its deltas
    carry their text), else where its deltas are delivered; either way the reply's text is the
    decode of its tokens, streamed pieces and whole alike."""
    import asyncio

    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.serving import AsyncEngine
    from eagle3_jax.text import stream as text_stream

    tok, engines = demo_engines
    made = []
    real_init = text_stream.TextStream.__init__

    def counting_init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(text_stream.TextStream, "__init__", counting_init)
    sched = Scheduler(engines["chain"].target, engines["chain"].draft, e3.SpecConfig(3, 1, 4), max_num_seqs=4,
                      max_seq_len=128)
    engine = AsyncEngine(sched, tokenizer=tok).start()
    prompt = tok.encode(PROMPTS[1])
    sampling = e3.SamplingParams(temperature=0.8, max_tokens=24, seed=5, stop=stop)

    async def run():
        pieces, outputs = {}, {}
        async with engine.choices(prompt, sampling, n=3) as choices:
            async for i, delta in choices:
                pieces.setdefault(i, []).append(delta.text)
                if delta.finished:
                    outputs[i] = delta.output
        return pieces, outputs

    try:
        pieces, outputs = asyncio.run(run())
    finally:
        engine.shutdown(timeout=30)
    assert len(made) == 3  # one per choice, wherever it ran
    seeds = set()
    for i, out in outputs.items():
        text = tok.decode_continuation(prompt, out.token_ids)
        assert "".join(pieces[i]) == out.text == text
        seeds.add(tuple(out.token_ids))
    assert len(seeds) > 1  # choice i samples with seed + i
