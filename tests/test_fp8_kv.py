"""The FP8 KV cache (kv_cache_dtype="fp8"): float8 slots with a scale per token per 128 lanes,
quantized as written, dequantized as read; bounded error against the compute-dtype cache; greedy
speculative == plain and prefix caching exact through the scheduler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.models.target import forward


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_quantize_round_trip(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 512)) * np.array([1e-3, 1.0, 1e3])[:, None], jnp.float32)
    slots = kv_cache.quantize(x, dtype)
    assert slots.values.dtype == dtype and slots.scales.shape == (4, 3, 4)  # a scale per 128 lanes
    y = kv_cache.dequantize(slots, jnp.float32)
    rel = float(jnp.sqrt(jnp.mean((x - y) ** 2, axis=-1) / jnp.mean(x ** 2, axis=-1)).max())
    assert rel < 0.035  # 3 mantissa bits: ~2.6 % rms whatever the magnitude
    zeros = kv_cache.quantize(jnp.zeros((2, 64)), dtype)  # one group of 64 lanes, scale 1, exact
    assert zeros.scales.shape == (2, 1) and not kv_cache.dequantize(zeros, jnp.float32).any()


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported; use one of auto, fp8"):
        e3.Engine(random_target(FAMILIES["llama"]), max_batch_size=1, max_seq_len=32, kv_cache_dtype="int8")


@pytest.mark.parametrize("family,dtype", [("deepseek_v3", jnp.bfloat16), ("llama", jnp.bfloat16),
                                          ("minimax_m2", jnp.float32), ("deepseek_v3", jnp.float32)])
def test_logit_error_against_the_compute_dtype_cache_is_bounded(family, dtype):
    """A 26-token prefill then a 4-token verify: logits over the FP8 cache against the cache in the
    model's dtype. Measured: 5-7 % rms in every family (MLA and GQA; bfloat16 and float32 models),
    what e4m3's 3 mantissa bits give random tiny models, which amplify errors more than trained
    ones. The random MiniMax is checked in float32: in bfloat16 its own logits are 28 % rms off
    its float32 ones, which would hide the cache's error."""
    target = random_target(FAMILIES[family], dtype=dtype)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 30)), jnp.int32)
    step = jax.jit(forward, static_argnums=1)

    def verify_logits(kv_cache_dtype):
        cache = target.init_cache(2, 64, kv_cache_dtype)
        assert cache.fp8 == (kv_cache_dtype == "fp8")
        _, _, cache = step(target.params, target.config, ids[:, :26], jnp.broadcast_to(jnp.arange(26), (2, 26)), cache)
        cache = kv_cache.advance(cache, jnp.asarray([26, 20]))
        positions = cache.lengths[:, None] + jnp.arange(4)[None]
        return np.asarray(step(target.params, target.config, ids[:, 26:], positions, cache)[0])

    want, got = verify_logits("auto"), verify_logits("fp8")
    rms = lambda a: np.sqrt((a ** 2).mean())  # noqa: E731
    assert rms(got - want) < 0.1 * rms(want) and np.abs(got - want).max() < 0.25 * np.abs(want).max()


def test_scheduler_with_fp8_pages_is_exact_to_itself():
    """Each token is quantized alone as it is written, so a token's bytes do not depend on what
    shares its pass: greedy tree speculation equals plain decoding, and prompts that hit the prefix
    cache (a second run) equal their first run, on FP8 pages."""
    target = random_target(FAMILIES["deepseek_v3"])
    prompts = [[1, 2, 3, 4, 5] * 8, [4, 5], [6] * 9]
    sp = e3.SamplingParams(max_tokens=12)
    plain = e3.Scheduler(target, max_num_seqs=2, max_seq_len=96, kv_cache_dtype="fp8")
    spec = e3.Scheduler(target, random_draft(target), e3.SpecConfig(3, 2, 6), max_num_seqs=2, max_seq_len=96,
                        kv_cache_dtype="fp8", prefix_caching=True)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    assert spec.stats()["prefix_cache_hits_total"] > 0 and spec.stats()["kv_cache_dtype"] == "fp8"
    assert spec._executor.state.tk.values.dtype == jnp.float8_e4m3fn


def test_server_over_fp8_pages():
    """The OpenAI server over a Scheduler with FP8 pages (the demo pair, chain speculation):
    completions answer the Scheduler's own greedy text, chat answers, /metrics counts the tokens."""
    import os

    pytest.importorskip("aiohttp")
    from server_fixtures import ServerThread, parse_prometheus, request

    from eagle3_jax.serving import AsyncEngine, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder, draft_folder = os.path.join(root, "checkpoints", "kimi-mini"), os.path.join(root, "checkpoints", "kimi-mini-eagle3")
    tok = load_tokenizer(folder)
    target = e3.load_target(folder, dtype="bfloat16")
    sched = e3.Scheduler(target, e3.load_draft(draft_folder, target=target, dtype="bfloat16"), e3.SpecConfig(3, 1, 4),
                         max_num_seqs=4, max_seq_len=128, prefill_chunk=64, kv_cache_dtype="fp8")
    prompt = "Once upon a time"
    want = sched.generate([tok.encode(prompt)], e3.SamplingParams(max_tokens=16, stop_token_ids=tok.eos_ids))[0]
    engine = AsyncEngine(sched, tokenizer=tok).start()
    server = ServerThread(make_app(engine, "kimi-mini", eos_token_ids=tok.eos_ids, tokenizer_dir=folder))
    try:
        status, _, body = request(server.port, "POST", "/v1/completions",
                                  {"model": "kimi-mini", "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == tok.decode_continuation(tok.encode(prompt), want.token_ids)
        status, _, body = request(server.port, "POST", "/v1/chat/completions",
                                  {"model": "kimi-mini", "max_tokens": 8,
                                   "messages": [{"role": "user", "content": "Tell me a story."}]})
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] > 0
        status, _, text = request(server.port, "GET", "/metrics")
        assert status == 200 and parse_prometheus(text)["eagle3_generation_tokens_total"] > 0
    finally:
        server.stop()
        engine.shutdown(timeout=30)
