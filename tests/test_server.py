"""The OpenAI-compatible server (eagle3_jax.serving) on the bundled kimi-mini + EAGLE-3 pair.

One server per module runs in-process on 127.0.0.1 (ephemeral port) over a Scheduler with a
chain draft. Reference outputs come from the same Scheduler running each prompt alone (greedy)
before the engine thread starts. The load test sends 200 requests at concurrency 64, with
malformed requests and clients that disconnect mid-stream, and then checks that no KV page leaked.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import pytest
from server_fixtures import ServerThread, parse_prometheus, request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "kimi-mini")
DRAFT = os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
MODEL = "kimi-mini"
MAX_SEQ_LEN = 256
MAX_REF_TOKENS = 48
PROMPTS = [  # various lengths; the last is longer than a prefill chunk (64 tokens)
    "Once upon a time",
    "Lily and Ben went to the park",
    "One day, a little dog",
    "Tom had a big red ball. He liked to play with it every day in the garden with his friend",
    "There was a little girl named Sue. " * 8 + "One day she",
]


# ---- fixtures -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """A running server and what the tests compare with: (server, engine, tok, refs by prompt ids)."""
    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.serving import AsyncEngine, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    target = e3.load_target(TARGET, dtype="float32")
    draft = e3.load_draft(DRAFT, target=target, dtype="float32")
    sched = Scheduler(target, draft=draft, spec=e3.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
                      max_num_seqs=64, max_seq_len=MAX_SEQ_LEN, page_size=16, prefill_chunk=64, prefix_caching=True)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    # Each prompt alone, greedy, stopping at EOS as the server does (this also compiles the programs).
    greedy = e3.SamplingParams(temperature=0.0, max_tokens=MAX_REF_TOKENS, stop_token_ids=tok.eos_ids)
    refs = {tuple(p): sched.generate([p], greedy)[0] for p in prompt_ids}
    engine = AsyncEngine(sched, tokenizer=tok).start()
    server = ServerThread(make_app(engine, MODEL, eos_token_ids=tok.eos_ids, tokenizer_dir=TARGET))
    try:
        yield server, engine, tok, refs
    finally:
        server.stop()
        engine.shutdown(timeout=30)


def expected(served, text: str, max_tokens: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish_reason) the server must answer for a greedy request."""
    _, _, tok, refs = served
    ids = tok.encode(text)
    ref = refs[tuple(ids)]
    out = ref.token_ids[:max_tokens]
    reason = "stop" if out and out[-1] in tok.eos_ids else "length"
    return tok.decode_continuation(ids, out), len(out), reason


def wait_idle(engine, timeout: float = 30.0) -> dict:
    """The engine's stats once nothing is queued, waiting or running (or the last ones at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        idle = s["num_waiting"] == 0 and s["num_running"] == 0 and s["request_queue_depth"] == 0
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def client(served):
    import openai

    return openai.OpenAI(base_url=f"{served[0].base_url}/v1", api_key="x", max_retries=0, timeout=60)


# ---- the official openai client -------------------------------------------------------------------------


def test_completions_match_scheduler(served):
    c = client(served)
    for prompt, max_tokens in [(PROMPTS[0], 24), (PROMPTS[3], 40)]:
        text, n, reason = expected(served, prompt, max_tokens)
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == reason
        assert r.usage.completion_tokens == n
        assert r.usage.prompt_tokens == len(served[2].encode(prompt))
        assert r.usage.total_tokens == r.usage.prompt_tokens + n

        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert streamed == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_token_id_prompt(served):
    _, _, tok, _ = served
    ids = tok.encode(PROMPTS[1])
    text, n, _ = expected(served, PROMPTS[1], 16)
    r = client(served).completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == n
    r = client(served).completions.create(model=MODEL, prompt=[ids], max_tokens=16, temperature=0)
    assert r.choices[0].text == text


def test_chat(served):
    c = client(served)
    messages = [{"role": "user", "content": PROMPTS[2]}]  # kimi-mini's template: the prompt is the content
    text, n, reason = expected(served, PROMPTS[2], 32)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == n

    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=32,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_stop_strings_cut_whole_and_streamed_replies(served):
    """A stop string that spans tokens ends the reply at the token that completes it (the chain
    draft may have accepted tokens past it), in whole and streamed replies, chat and completions."""
    _, _, tok, refs = served
    c = client(served)
    ids = tok.encode(PROMPTS[3])
    ref = refs[tuple(ids)].token_ids
    full = tok.decode_continuation(ids, ref)
    for a, b, include in [(5, 9, False), (17, 20, True), (30, 37, False)]:
        stop = full[a:b]
        cut = full.index(stop) + (len(stop) if include else 0)
        n = next(k for k in range(1, len(ref) + 1) if stop in tok.decode_continuation(ids, ref[:k]))
        kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_REF_TOKENS, temperature=0,
                  stop=[stop, "never seen"], extra_body={"include_stop_str_in_output": include})
        r = c.completions.create(**kw)
        assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == n and r.choices[0].model_extra["stop_reason"] == stop
        chunks = list(c.completions.create(stream=True, **kw))
        assert "".join(ch.choices[0].text for ch in chunks) == full[:cut]
        assert chunks[-1].choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": PROMPTS[3]}]
    stop = full[5:9]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop)
    assert r.choices[0].message.content == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full[: full.index(stop)]


def test_logprobs_and_echo(served):
    """Logprobs of every emitted token (accepted draft tokens included) equal plain decoding's, in
    whole and streamed replies, chat and completions; echo with max_tokens 0 scores the prompt as
    lm-eval's loglikelihood requests do."""
    import numpy as np

    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler

    _, engine, tok, refs = served
    ids = tok.encode(PROMPTS[1])
    plain = Scheduler(engine.scheduler.target, max_num_seqs=1, max_seq_len=MAX_SEQ_LEN).generate(
        [ids], e3.SamplingParams(max_tokens=24, logprobs=3, prompt_logprobs=3, stop_token_ids=tok.eos_ids))[0]
    c = client(served)
    kw = dict(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    r = c.completions.create(logprobs=3, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(plain.token_ids) == r.usage.completion_tokens
    np.testing.assert_allclose(lp.token_logprobs, [x.logprob for x in plain.logprobs], atol=1e-5, rtol=1e-5)
    assert all(len(top) in (3, 4) and max(top.values()) == pytest.approx(v, abs=1e-5)  # greedy: the best
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in plain.token_ids]
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:],
                                                                               lp.tokens))
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(logprobs=3, stream=True, **kw)
                if ch.choices[0].logprobs is not None]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset

    # echo + max_tokens 0: the prompt, its logprobs (none for the first token), nothing generated.
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], [x.logprob for x in plain.prompt_logprobs[1:]], atol=1e-5,
                               rtol=1e-5)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, echo=True, temperature=0)
    assert r.choices[0].text == PROMPTS[1] + tok.decode_continuation(ids, plain.token_ids[:5])
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, echo=True, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text

    messages = [{"role": "user", "content": PROMPTS[1]}]  # kimi-mini's template: the prompt is the content
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    np.testing.assert_allclose([x.logprob for x in content], [x.logprob for x in plain.logprobs], atol=1e-5,
                               rtol=1e-5)
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token and bytes(x.bytes).decode() == x.token
               for x in content)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            logprobs=True, stream=True))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.logprob for x in streamed] == [x.logprob for x in content] and streamed[0].top_logprobs == []


def test_n_choices_are_seeded_share_the_prompt_and_stream_by_index(served):
    """n choices: choice i is the request with seed + i, usage counts the prompt once, the later
    choices take the prompt's full pages from the prefix cache, streams carry each choice's index."""
    engine = served[1]
    c = client(served)
    prompt = PROMPTS[4]  # 8 full pages of 16 tokens
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    wait_idle(engine)
    before = engine.stats()
    r = c.completions.create(n=4, seed=1234, **kw)
    after = wait_idle(engine)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert len({ch.text for ch in r.choices}) > 1
    n_prompt = len(served[2].encode(prompt))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 4 * 12
    full = (n_prompt - 1) // 16 * 16
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 3 * full
    for i in range(4):
        one = c.completions.create(n=1, seed=1234 + i, **kw)
        assert one.choices[0].text == r.choices[i].text
    chunks = list(c.completions.create(n=3, seed=1234, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in range(3)]
    assert texts == [ch.text for ch in r.choices[:3]]
    assert chunks[-1].usage.completion_tokens == 3 * 12 and chunks[-1].usage.prompt_tokens == n_prompt
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], n=2, seed=5,
                                     max_tokens=6, temperature=1.0)
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.usage.completion_tokens <= 12


def test_acceptance_per_request_in_usage_and_metrics(served):
    """Each reply's usage carries its draft tokens proposed and accepted (spec_decode), and
    /metrics counts them under vLLM's names."""
    engine = served[1]
    before = engine.stats()
    r = client(served).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    spec = r.usage.model_extra["spec_decode"]
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"] and spec["num_draft_tokens"] % 3 == 0
    assert spec["mean_accept_length"] >= 1
    after = wait_idle(engine)
    assert after["num_draft_tokens_total"] - before["num_draft_tokens_total"] >= spec["num_draft_tokens"]
    text = request(served[0].port, "GET", "/metrics")[2]
    samples = parse_prometheus(text)
    for name in ("eagle3_spec_decode_num_drafts_total", "eagle3_spec_decode_num_draft_tokens_total",
                 "eagle3_spec_decode_num_accepted_tokens_total"):
        assert name in samples, name
    assert any(k.startswith("eagle3_spec_decode_num_accepted_tokens_per_pos_total") for k in samples)


def test_synthetic_acceptance_needs_the_servers_consent(served):
    """A request forcing acceptance gets a 400 unless the server was started to allow it; there
    every step of it accepts what the profile says."""
    from eagle3_jax.serving import make_app

    _, engine, tok, _ = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 13, "temperature": 0, "ignore_eos": True,
            "synthetic_acceptance": [1.0, 1.0, 1.0]}
    status, _, reply = request(served[0].port, "POST", "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "synthetic_acceptance"
    assert "--allow_synthetic_acceptance" in reply["error"]["message"]
    bench = ServerThread(make_app(engine, MODEL, eos_token_ids=tok.eos_ids, tokenizer_dir=TARGET,
                                  allow_synthetic_acceptance=True))
    try:
        status, _, reply = request(bench.port, "POST", "/v1/completions", body)
        assert status == 200, reply
        spec = reply["usage"]["spec_decode"]
        assert reply["usage"]["completion_tokens"] == 13 and spec["num_accepted_tokens"] == spec["num_draft_tokens"]
        status, _, reply = request(bench.port, "POST", "/v1/completions", {**body, "synthetic_acceptance": [0.5, 0.9]})
        assert status == 400 and "cannot increase" in reply["error"]["message"]
    finally:
        bench.stop()


def test_sampled_requests_are_seeded(served):
    c = client(served)
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.8, top_p=0.9, extra_body={"top_k": -1})
    a = c.completions.create(seed=7, **kw).choices[0].text
    b = c.completions.create(seed=7, **kw).choices[0].text
    assert a == b


def test_models_health_metrics(served):
    server = served[0]
    models = client(served).models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, _, body = request(server.port, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list" and body["data"][0]["max_model_len"] == MAX_SEQ_LEN
    assert request(server.port, "GET", "/health")[:3:2] == (200, {"status": "ok"})
    assert request(server.port, "GET", "/ready")[:3:2] == (200, {"status": "ready"})  # no warm-up running

    status, ctype, text = request(server.port, "GET", "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    samples = parse_prometheus(text)
    assert "# TYPE eagle3_generation_tokens_total counter" in text
    assert samples["eagle3_generation_tokens_total"] > 0 and samples["eagle3_prompt_tokens_total"] > 0
    assert samples["eagle3_mean_accept_length"] > 1.0  # the chain draft accepts tokens
    rates = [samples[f'eagle3_spec_acceptance_rate{{position="{k}"}}'] for k in (1, 2, 3)]
    assert 1.0 >= rates[0] >= rates[1] >= rates[2] >= 0.0
    for name in ("eagle3_num_requests_waiting", "eagle3_num_requests_running", "eagle3_kv_pages_free",
                 "eagle3_kv_pages_total", "eagle3_requests_finished_total", "eagle3_requests_aborted_total",
                 "eagle3_preemptions_total", "eagle3_request_queue_depth", "eagle3_engine_healthy"):
        assert name in samples, name
    assert any(k.startswith('eagle3_http_requests_total{route="/v1/completions",status="200"}') for k in samples)
    # where the serving path's time goes: the engine thread's steps hold the scheduler's host work
    assert samples["eagle3_scheduler_iterations_total"] > 0 and samples["eagle3_engine_deliver_seconds_total"] > 0
    assert samples["eagle3_engine_step_seconds_total"] >= samples["eagle3_scheduler_host_seconds_total"] > 0
    if sys.platform.startswith("linux"):  # threads' CPU time is read from /proc
        cpu = {role: samples[f'eagle3_thread_cpu_seconds_total{{thread="{role}"}}'] for role in ("engine", "event_loop")}
        assert cpu["engine"] > 0 and cpu["event_loop"] >= 0


def post_with_headers(port: int, path: str, body: dict) -> tuple[int, dict[str, str], str]:
    """One POST: (status, response headers, body text)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read().decode("utf-8")
    finally:
        conn.close()


def test_caps_and_ignored_fields_are_announced(served, caplog):
    """max_tokens cut to fit max_seq_len and unknown fields are told in the body, a header and the log."""
    import logging

    from eagle3_jax.serving.protocol import WARNINGS_HEADER

    server = served[0]
    prompt = [1] + [300] * (MAX_SEQ_LEN - 8)  # room for 7 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100000, "temperature": 0, "ignore_eos": True,
            "frobnicate": 1}
    with caplog.at_level(logging.WARNING):
        status, headers, text = post_with_headers(server.port, "/v1/completions", body)
    answer = json.loads(text)
    assert status == 200 and answer["usage"]["completion_tokens"] == 7
    assert answer["choices"][0]["finish_reason"] == "length"
    assert any("max_tokens=100000 was cut to 7" in w for w in answer["warnings"]), answer["warnings"]
    assert any("frobnicate" in w for w in answer["warnings"])
    assert "max_tokens=100000 was cut to 7" in headers[WARNINGS_HEADER] and "frobnicate" in headers[WARNINGS_HEADER]
    assert "The following fields were present in the request but ignored: {'frobnicate'}" in caplog.text

    status, headers, text = post_with_headers(server.port, "/v1/completions", dict(body, stream=True))
    assert status == 200 and "was cut to 7" in headers[WARNINGS_HEADER] and text.endswith("data: [DONE]\n\n")
    status, headers, _ = post_with_headers(server.port, "/v1/completions", _OK)
    assert status == 200 and WARNINGS_HEADER not in headers  # nothing changed, nothing said


# ---- validation -------------------------------------------------------------------------------------

_OK = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}

# (path, body or raw bytes, expected status, words the error message must contain, expected param)
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "JSON", None),
    ("/v1/completions", b'[1, 2]', 400, "JSON object", None),
    ("/v1/completions", dict(_OK, model="gpt-4"), 404, "gpt-4", "model"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 8}, 400, "prompt", "prompt"),
    ("/v1/completions", dict(_OK, prompt=5), 400, "prompt", "prompt"),
    ("/v1/completions", dict(_OK, prompt=[]), 400, "prompt", "prompt"),
    ("/v1/completions", dict(_OK, prompt=["a", "b"]), 400, "batched", "prompt"),
    ("/v1/completions", dict(_OK, prompt=[1, "x"]), 400, "prompt", "prompt"),
    ("/v1/completions", dict(_OK, max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", dict(_OK, max_tokens="8"), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", dict(_OK, temperature=-1), 400, "temperature", "temperature"),
    ("/v1/completions", dict(_OK, temperature="hot"), 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "temperature", "temperature"),
    ("/v1/completions", b'{"prompt": "a", "top_p": Infinity}', 400, "top_p", "top_p"),
    ("/v1/completions", dict(_OK, top_p=0), 400, "top_p", "top_p"),
    ("/v1/completions", dict(_OK, top_p=1.5), 400, "top_p", "top_p"),
    ("/v1/completions", dict(_OK, top_k=-2), 400, "top_k", "top_k"),
    ("/v1/completions", dict(_OK, top_k=2.5), 400, "top_k", "top_k"),
    ("/v1/completions", dict(_OK, seed=-1), 400, "seed", "seed"),
    ("/v1/completions", dict(_OK, seed=2**32), 400, "seed", "seed"),
    ("/v1/completions", dict(_OK, n=0), 400, "n=0", "n"),
    ("/v1/completions", dict(_OK, n=2, best_of=3), 400, "best_of", "best_of"),
    ("/v1/completions", dict(_OK, stream="yes"), 400, "stream", "stream"),
    ("/v1/completions", dict(_OK, stream_options={"include_usage": True}), 400, "stream", "stream_options"),
    ("/v1/completions", dict(_OK, stop_token_ids=[2, -1]), 400, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", dict(_OK, ignore_eos="no"), 400, "ignore_eos", "ignore_eos"),
    ("/v1/completions", dict(_OK, stop=["\n", ""]), 400, "stop", "stop"),
    ("/v1/completions", dict(_OK, stop=7), 400, "stop", "stop"),
    ("/v1/completions", dict(_OK, min_tokens=-1), 400, "min_tokens", "min_tokens"),
    ("/v1/completions", dict(_OK, min_tokens=9), 400, "max_tokens=8", "min_tokens"),
    ("/v1/completions", dict(_OK, include_stop_str_in_output="yes"), 400, "include_stop_str_in_output",
     "include_stop_str_in_output"),
    ("/v1/completions", dict(_OK, logprobs=21), 400, "max_logprobs", "logprobs"),
    ("/v1/completions", dict(_OK, presence_penalty=3), 400, "presence_penalty", "presence_penalty"),
    ("/v1/completions", dict(_OK, repetition_penalty=0), 400, "repetition_penalty", "repetition_penalty"),
    ("/v1/completions", dict(_OK, logprobs=True), 400, "logprobs", "logprobs"),
    ("/v1/completions", dict(_OK, max_tokens=0), 400, "echo", "max_tokens"),
    ("/v1/chat/completions", dict(_CHAT, echo=True), 400, "echo", "echo"),
    ("/v1/chat/completions", dict(_CHAT, top_logprobs=3), 400, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", dict(_CHAT, logprobs=True, top_logprobs=30), 400, "max_logprobs", "top_logprobs"),
    ("/v1/completions", dict(_OK, prompt=[1] * MAX_SEQ_LEN), 400, "max_seq_len", "prompt"),
    ("/v1/completions", dict(_OK, prompt=[1, 10**6]), 400, "", "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 8}, 400, "messages", "messages"),
    ("/v1/chat/completions", dict(_CHAT, messages="hi"), 400, "messages", "messages"),
    ("/v1/chat/completions", dict(_CHAT, messages=[{"role": "wizard", "content": "x"}]), 400, "role",
     "messages[0].role"),
    ("/v1/chat/completions", dict(_CHAT, messages=[{"role": "user", "content": 3}]), 400, "content",
     "messages[0].content"),
    ("/v1/chat/completions", dict(_CHAT, max_completion_tokens=0), 400, "max_completion_tokens",
     "max_completion_tokens"),
    ("/v1/chat/completions", dict(_CHAT, model="nope"), 404, "nope", "model"),
]


def test_malformed_requests_get_4xx(served):
    port = served[0].port
    failures = []
    for path, body, status, words, param in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else None
        got, ctype, answer = request(port, "POST", path, None if raw else body, raw=raw)
        err = answer.get("error", {}) if isinstance(answer, dict) else {}
        if (got != status or words not in err.get("message", "") or err.get("param") != param
                or err.get("type") != "invalid_request_error"):
            failures.append((path, body if raw else json.dumps(body)[:80], got, answer))
    assert not failures, failures
    status, _, answer = request(port, "GET", "/v1/nothing")
    assert status == 404 and "error" in answer
    # The server still serves afterwards, and nothing leaked.
    status, _, answer = request(port, "POST", "/v1/completions", _OK)
    assert status == 200 and answer["choices"][0]["text"] == expected(served, _OK["prompt"], 8)[0]
    s = wait_idle(served[1])
    assert s["num_free_pages"] == s["num_pages"]


# ---- the load test -------------------------------------------------------------------------------------

_MALFORMED = [dict(_OK, max_tokens=0), dict(_OK, temperature=-0.5), dict(_OK, top_p=0), dict(_OK, n=0),
              dict(_OK, model="other"), {"model": MODEL}, dict(_OK, prompt=[1] * 300), dict(_OK, seed=-3),
              dict(_OK, top_k=-7), "not json"]
_LENGTHS = [8, 16, 24, 32, 48]


def _plan(i: int) -> tuple[str, int, int]:
    """Request i of the load test: (kind, prompt index, max_tokens)."""
    prompt, max_tokens = i % len(PROMPTS), _LENGTHS[(i // 3) % len(_LENGTHS)]
    if i % 10 == 0:
        return "malformed", prompt, max_tokens
    if i % 10 == 5:
        return "disconnect", prompt, MAX_REF_TOKENS
    return ["completion", "completion_ids", "completion_stream", "chat", "chat_stream"][i % 5], prompt, max_tokens


async def _read_sse(resp, limit: int | None = None) -> list[dict]:
    """Parsed `data:` events (stops at [DONE], or after `limit` events)."""
    events = []
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[len(b"data: "):].strip()
        if payload == b"[DONE]":
            break
        events.append(json.loads(payload))
        if limit is not None and len(events) >= limit:
            break
    return events


async def _one(session, base: str, i: int, tok, refs) -> tuple[int, str, str | None]:
    """Send request i; returns (i, kind, None) when its answer is right, else an error text."""
    kind, p, max_tokens = _plan(i)
    text = PROMPTS[p]
    if kind == "malformed":
        body = _MALFORMED[(i // 10) % len(_MALFORMED)]
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        async with session.post(f"{base}/v1/completions", data=data,
                                headers={"Content-Type": "application/json"}) as resp:
            answer = await resp.json(content_type=None)
            ok = 400 <= resp.status < 500 and answer["error"]["message"]
            return i, kind, None if ok else f"status {resp.status}: {answer}"
    chat = kind.startswith("chat")
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = tok.encode(text) if kind == "completion_ids" else text
    if kind.endswith("stream") or kind == "disconnect":
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    url = f"{base}/v1/{'chat/completions' if chat else 'completions'}"
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return i, kind, f"status {resp.status}: {await resp.text()}"
        if kind == "disconnect":
            await _read_sse(resp, limit=2)
            resp.close()  # drop the connection mid-stream
            return i, kind, None
        if body.get("stream"):
            events = await _read_sse(resp)
            choices = [e["choices"][0] for e in events if e.get("choices")]
            got = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
            reason, n = choices[-1]["finish_reason"], events[-1]["usage"]["completion_tokens"]
        else:
            answer = await resp.json()
            choice = answer["choices"][0]
            got = choice["message"]["content"] if chat else choice["text"]
            reason, n = choice["finish_reason"], answer["usage"]["completion_tokens"]
    ids = tok.encode(text)
    out = refs[tuple(ids)].token_ids[:max_tokens]
    want = (tok.decode_continuation(ids, out), len(out), "stop" if out[-1] in tok.eos_ids else "length")
    return i, kind, None if (got, n, reason) == want else f"got {(got, n, reason)!r}, want {want!r}"


async def _load(base: str, tok, refs, num_requests: int, concurrency: int) -> list[tuple[int, str, str | None]]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def bounded(i):
            async with sem:
                try:
                    return await _one(session, base, i, tok, refs)
                except Exception as e:  # a timeout or broken answer is a failure of this request, not the run
                    return i, _plan(i)[0], f"{type(e).__name__}: {e}"

        return await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(num_requests))), 150)


@pytest.mark.slow  # about 30 s; the other server tests cover concurrent requests on a smaller scale
@pytest.mark.parametrize("num_requests,concurrency", [(100, 32), (200, 64)])
def test_load_under_concurrency(served, num_requests, concurrency):
    server, engine, tok, refs = served
    before = engine.stats()
    results = asyncio.run(_load(server.base_url, tok, refs, num_requests=num_requests, concurrency=concurrency))
    kinds = [k for _, k, _ in results]
    assert kinds.count("malformed") == num_requests // 10 and kinds.count("disconnect") == num_requests // 10
    failures = [(i, k, err) for i, k, err in results if err is not None]
    assert not failures, failures[:5]

    assert request(server.port, "GET", "/health")[0] == 200
    s = wait_idle(engine)
    assert s["num_waiting"] == 0 and s["num_running"] == 0
    assert s["num_free_pages"] == s["num_pages"], "KV pages leaked"
    assert s["num_requests_finished"] - before["num_requests_finished"] >= num_requests * 8 // 10
    assert s["num_requests_aborted"] > before["num_requests_aborted"]  # the disconnected streams were aborted
    # Still serving after the storm.
    status, _, answer = request(server.port, "POST", "/v1/completions", _OK)
    assert status == 200 and answer["choices"][0]["text"] == expected(served, _OK["prompt"], 8)[0]


# ---- pieces without the model ----------------------------------------------------------------------------


def test_incremental_detokenizer_holds_back_partial_utf8():
    from eagle3_jax.serving import IncrementalDetokenizer
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    prompt = tok.encode("Once upon")
    new = tok.encode("a time é 日本 and more", add_bos=False)  # byte-fallback tokens for é, 日, 本
    assert len(new) > 8
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push([t], final=k == len(new) - 1) for k, t in enumerate(new)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode_continuation(prompt, new) == " a time é 日本 and more"


def test_incremental_detokenizer_random_tokens():
    """Random ids, half of them byte tokens (often invalid UTF-8), pushed in random chunks: the
    pieces always concatenate to the whole decode, which equals decode_continuation."""
    import random

    from eagle3_jax.serving import IncrementalDetokenizer
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    rng = random.Random(0)
    for trial in range(300):
        prompt = tok.encode(rng.choice(["Once upon a time", "", "日本", "Hé said"]))
        new = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(1, 150))]
        detok, pieces, i = IncrementalDetokenizer(tok, prompt), [], 0
        while i < len(new):
            k = rng.randrange(1, 6)
            pieces.append(detok.push(new[i:i + k], final=i + k >= len(new)))
            i += k
        assert "".join(pieces) == detok.text == tok.decode_continuation(prompt, new), (trial, prompt, new)


def test_chat_template_rendering(tmp_path):
    from eagle3_jax.serving import ChatTemplate
    from eagle3_jax.text.chat_template import ChatTemplateError

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate.from_dir(TARGET).render(messages) == "Be brief.\nHi"  # a base model's template: plain lines
    with pytest.raises(ChatTemplateError, match="no chat template.*--chat_template"):  # none: refused, not guessed
        ChatTemplate.from_dir(tmp_path).render(messages)
    assert ChatTemplate.from_flag("join", tmp_path).render(messages) == "Be brief.\nHi"  # the fallback, when asked
    tpl = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "bos_token": "<s>"}))
    assert ChatTemplate.from_dir(tmp_path).render(messages) == "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


class _StubScheduler:
    """A scheduler double: add_request raises CapacityError for long prompts; step() always fails."""

    max_seq_len = 64

    def __init__(self):
        self.added, self.aborted = [], []

    def add_request(self, prompt_ids, sampling=None, request_id=None):
        from eagle3_jax.scheduler import CapacityError

        if len(prompt_ids) > 4:
            raise CapacityError("this request could never fit in the KV cache")
        self.added.append(request_id)
        return request_id

    def abort(self, request_id):
        self.aborted.append(request_id)
        return True

    def has_unfinished(self):
        return len(self.added) > len(self.aborted)

    def step(self):
        raise RuntimeError("device on fire")

    def stats(self):
        return {"num_waiting": 0, "num_running": 0, "num_pages": 8, "num_free_pages": 8}


def test_a_server_warming_up_in_the_background_answers_and_turns_ready():
    """warm_up(background=True): /health is 200 at once, /ready 503 with the progress until a lone
    greedy request's programs are compiled, then 200; a request sent before it is ready is answered
    with the tokens of a scheduler that never warmed up; the whole warm-up ends with its report
    and compiles what Scheduler.warm_up does."""
    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.serving import AsyncEngine, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    target = e3.load_target(TARGET, dtype="float32")

    def scheduler():
        return Scheduler(target, max_num_seqs=2, max_seq_len=MAX_SEQ_LEN, prefill_chunk=32)

    ids = tok.encode(PROMPTS[0])
    greedy = e3.SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=tok.eos_ids)
    ref = scheduler().generate([ids], greedy)[0].token_ids
    everything = scheduler().warm_up()
    sched = scheduler()
    engine = AsyncEngine(sched, tokenizer=tok).start()
    lines: list[str] = []
    gate = threading.Event()
    first_program = sched.warm

    def held_warm(program):  # the first compile waits until the test has looked at /ready
        gate.wait(30)
        first_program(program)

    sched.warm = held_warm
    server = ServerThread(make_app(engine, MODEL, eos_token_ids=tok.eos_ids, tokenizer_dir=TARGET))
    try:
        total = engine.warm_up(background=True, progress=lines.append)
        assert total == everything.programs
        assert request(server.port, "GET", "/health")[:3:2] == (200, {"status": "ok"})
        status, _, body = request(server.port, "GET", "/ready")
        assert status == 503 and body == {"status": "warming_up", "programs_compiled": 0, "programs_total": total}
        answer: dict = {}
        asking = threading.Thread(target=lambda: answer.update(request(
            server.port, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8,
                                                     "temperature": 0})[2]))
        asking.start()
        gate.set()
        asking.join(120)
        assert answer["choices"][0]["text"] == tok.decode_continuation(ids, ref)
        deadline = time.monotonic() + 300
        while engine.warming.compiled < total and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.warming.compiled == total and engine.warming.ready
        assert request(server.port, "GET", "/ready")[:3:2] == (200, {"status": "ready"})
        assert any(line.startswith("ready: a lone request's programs compiled") for line in lines), lines
        assert lines[-1].startswith(f"warm-up compiled {total} programs"), lines
    finally:
        server.stop()
        engine.shutdown(timeout=30)


def test_metrics_count_from_engine_start():
    """Counters, tau and per-position acceptance leave out what ran before AsyncEngine.start() (warm-up)."""
    from eagle3_jax.serving.async_engine import stats_since

    warm = {"generation_tokens_total": 40, "num_decode_steps_total": 10, "accepted_tokens_total": 30,
            "mean_accept_length": 3.0, "per_position_accepted_total": [9, 8, 3], "num_running": 0}
    now = {"generation_tokens_total": 100, "num_decode_steps_total": 30, "accepted_tokens_total": 70,
           "mean_accept_length": 70 / 30, "per_position_accepted_total": [25, 15, 5], "num_running": 2}
    since = stats_since(now, warm)
    assert (since["generation_tokens_total"], since["num_decode_steps_total"]) == (60, 20)
    assert since["mean_accept_length"] == 2.0 and since["per_position_accepted_total"] == [16, 7, 2]
    assert since["num_running"] == 2  # gauges are not counted from anywhere
    assert stats_since(warm, warm)["mean_accept_length"] == 1.0


def test_each_server_has_its_own_metrics_registry():
    from eagle3_jax.bench.http_client import parse_prometheus as parse
    from eagle3_jax.serving import ServerMetrics

    a = ServerMetrics(lambda: {"generation_tokens_total": 5, "engine_healthy": True})
    b = ServerMetrics(lambda: {"generation_tokens_total": 7, "engine_healthy": False,
                               "num_decode_steps_total": 4, "per_position_accepted_total": [2, 1]})
    a.count_http("/v1/completions", 200)
    a.count_http("/v1/completions", 200)
    sa, sb = parse(a.render().decode()), parse(b.render().decode())
    assert (sa["eagle3_generation_tokens_total"], sb["eagle3_generation_tokens_total"]) == (5, 7)
    assert sa['eagle3_http_requests_total{route="/v1/completions",status="200"}'] == 2
    assert not any(k.startswith("eagle3_http_requests_total") for k in sb)
    assert (sa["eagle3_engine_healthy"], sb["eagle3_engine_healthy"]) == (1, 0)
    assert sb['eagle3_spec_acceptance_rate{position="2"}'] == 0.25


def test_capacity_error_and_step_failure_are_reported():
    from eagle3_jax.serving import AsyncEngine, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    stub = _StubScheduler()
    engine = AsyncEngine(stub, tokenizer=load_tokenizer(TARGET), max_consecutive_failures=2).start()
    server = ServerThread(make_app(engine, "stub"))
    try:
        status, _, answer = request(server.port, "POST", "/v1/completions", {"prompt": [1, 2, 3, 4, 5]})
        assert status == 400 and "never fit" in answer["error"]["message"]
        for _ in range(2):  # each step failure fails the request with a 500; the second kills the engine
            status, _, answer = request(server.port, "POST", "/v1/completions", {"prompt": [1, 2]})
            assert status == 500 and "device on fire" in answer["error"]["message"], answer
        assert len(stub.aborted) == 2  # the failed requests were aborted in the scheduler
        status, _, answer = request(server.port, "GET", "/health")
        assert status == 503 and "restart" in answer["error"]["message"]
        status, _, answer = request(server.port, "POST", "/v1/completions", {"prompt": [1, 2]})
        assert status == 503
        assert parse_prometheus(request(server.port, "GET", "/metrics")[2])["eagle3_engine_healthy"] == 0
    finally:
        server.stop()
        engine.shutdown(timeout=10)
    assert not engine.is_running


def test_consumer_leaving_early_aborts():
    """Closing the delta stream before the finished delta aborts the request in the scheduler."""
    from eagle3_jax.scheduler import RequestDelta
    from eagle3_jax.serving import AsyncEngine

    class Endless(_StubScheduler):
        def step(self):
            live = [r for r in self.added if r not in self.aborted]
            return [RequestDelta(r, [5], time.perf_counter(), False, None, None) for r in live]

    stub = Endless()
    engine = AsyncEngine(stub).start()

    async def consume():
        n = 0
        async for delta in engine.generate([1, 2], None, request_id="r1"):
            n += len(delta.token_ids)
            if n >= 3:
                break  # the dropped generator is closed by asyncio's async-generator finalizer
        return n

    async def main():
        from contextlib import aclosing

        async with aclosing(engine.generate([1, 2], None, request_id="r2")) as gen:
            await anext(gen)
        task = asyncio.ensure_future(consume())
        return await task

    try:
        assert asyncio.run(main()) >= 3
        deadline = time.monotonic() + 10
        while set(stub.aborted) != {"r1", "r2"} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(stub.aborted) == {"r1", "r2"}
    finally:
        engine.shutdown(timeout=10)


def test_a_steps_deltas_reach_their_consumers_in_one_call_per_event_loop():
    """Every running request's delta of a step goes to its consumer's event loop in one
    cross-thread call (not one per request), each stream's deltas in order."""
    from eagle3_jax.scheduler import RequestDelta
    from eagle3_jax.serving import AsyncEngine

    class Counting(_StubScheduler):
        """Each request gets tokens 1 .. 5, one a step, the fifth finishing it."""

        steps = 0

        def step(self):
            self.steps += 1
            live = [r for r in self.added if r not in self.aborted and self.sent.get(r, 0) < 5]
            for r in live:
                self.sent[r] = self.sent.get(r, 0) + 1
            return [RequestDelta(r, [self.sent[r]], time.perf_counter(), self.sent[r] == 5, None, None) for r in live]

        def has_unfinished(self):
            return any(self.sent.get(r, 0) < 5 for r in self.added if r not in self.aborted)

    stub = Counting()
    stub.sent = {}
    engine = AsyncEngine(stub)
    requests = [f"r{i}" for i in range(8)]

    async def main():
        loop, calls = asyncio.get_running_loop(), []
        original = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            calls.append(threading.current_thread().name)
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted
        engine.start()  # all eight are queued before its first step

        async def consume(rid):
            return [d.token_ids[0] async for d in engine.generate([1, 2], None, request_id=rid)]

        tasks = [asyncio.ensure_future(consume(r)) for r in requests]
        streams = await asyncio.gather(*tasks)
        return streams, calls, stub.steps

    try:
        streams, calls, steps = asyncio.run(main())
    finally:
        engine.shutdown(timeout=10)
    assert streams == [[1, 2, 3, 4, 5]] * len(requests)
    engine_calls = [name for name in calls if name == engine._thread_name]
    # per step (and one per request's admission, its add's answer), not per request and step
    assert steps >= 5 and len(engine_calls) <= steps + len(requests) < 5 * len(requests)
