"""Automatic prefix caching: reference-counted pages, keys, LRU eviction; on the kimi-mini pair,
cached requests give the tokens uncached ones give, speculation's hit rate equals plain
decoding's, n choices share their prompt, and no page leaks through aborts and preemptions."""

from __future__ import annotations

import os
import random

import pytest

import eagle3_jax as e3
from eagle3_jax.cache.pages import PageAllocator, PrefixCache, page_keys
from eagle3_jax.scheduler import Scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAIN = e3.SpecConfig(3, 1, 4)
PAGE = 4


def test_page_keys_name_the_tokens_before_and_the_token_after():
    seq = list(range(1, 20))
    keys = page_keys(seq, PAGE, 3)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert page_keys(seq[:13], PAGE, 3) == keys  # 3 pages + the token after them
    assert page_keys(seq, PAGE, 3, keys[:1]) == keys  # the rest hashed after keys computed before
    other_next = seq[:12] + [99]
    assert page_keys(other_next, PAGE, 3)[:2] == keys[:2] and page_keys(other_next, PAGE, 3)[2] != keys[2]
    changed_first = [7] + seq[1:]
    assert all(a != b for a, b in zip(page_keys(changed_first, PAGE, 3), keys))  # chained
    with pytest.raises(ValueError):
        PageAllocator(1)


def test_allocator_shares_caches_and_evicts_least_recently_used():
    alloc = PageAllocator(6)  # pages 1..5
    alloc.cache = cache = PrefixCache()
    a = alloc.allocate(3)
    keys = page_keys(list(range(20)), PAGE, 3)
    for k, p in zip(keys, a):
        cache.register(k, p, draft_valid=k != keys[2])
    assert cache.lookup(keys, with_draft=False) == a and cache.lookup(keys, with_draft=True) == a[:2]
    alloc.hold(a[:2])  # a second request shares two pages
    assert alloc.refs(a[0]) == 2 and alloc.num_free == 2
    alloc.free(a)  # the first leaves: two pages still held, the third cached and evictable
    assert alloc.num_free == 3 and alloc.num_held == 2 and cache.num_evictable == 1
    alloc.free(a[:2])
    assert alloc.num_free == 5 and alloc.num_held == 0 and cache.num_evictable == 3
    alloc.hold([a[1]])  # taken again: no longer evictable
    assert cache.num_evictable == 2 and alloc.num_free == 4
    fresh = alloc.allocate(3)  # 2 free pages first, then the least recently released cached one (a[2])
    assert a[2] in fresh and a[0] not in fresh and cache.lookup(keys, with_draft=False) == a[:2]
    with pytest.raises(MemoryError):
        alloc.allocate(2)
    alloc.free(fresh + [a[1]])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([a[1]])
    assert alloc.num_free == 5 and alloc.num_held == 0


@pytest.fixture(scope="module")
def pair():
    target = e3.load_target(os.path.join(ROOT, "checkpoints", "kimi-mini"), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3"), target=target, dtype="float32")
    return target, draft


def _scheduler(pair, speculate: bool, caching: bool, **kw) -> Scheduler:
    target, draft = pair
    kw = dict(dict(max_num_seqs=8, max_seq_len=160, page_size=PAGE, prefill_chunk=32), **kw)
    return Scheduler(target, draft if speculate else None, CHAIN if speculate else None, prefix_caching=caching, **kw)


SYSTEM = [1] + [300 + (i * 7) % 150 for i in range(37)]  # a shared "system prompt" of 38 tokens


def _turns(sched: Scheduler) -> tuple[list[list[int]], dict]:
    """Two waves: first turns sharing a system prompt, then second turns that extend each first
    turn's prompt and answer. Returns every output's tokens and the stats."""
    sp = e3.SamplingParams(max_tokens=20)
    first = [SYSTEM + [400 + i, 401 + i, 402] for i in range(4)]
    outs1 = sched.generate(first, sp)
    second = [p + o.token_ids + [403, 404 + i] for i, (p, o) in enumerate(zip(first, outs1))]
    outs2 = sched.generate(second, sp)
    return [o.token_ids for o in outs1 + outs2], sched.stats()


@pytest.fixture(scope="module")
def turns(pair):
    """(speculate, caching) -> `_turns` of a fresh scheduler, run once per module (the tests below
    read the same runs)."""
    runs = {}

    def get(speculate: bool, caching: bool) -> tuple[list[list[int]], dict]:
        if (speculate, caching) not in runs:
            runs[speculate, caching] = _turns(_scheduler(pair, speculate, caching=caching))
        return runs[speculate, caching]

    return get


@pytest.mark.parametrize("speculate", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "chain"])
def test_cached_prefixes_give_the_same_tokens(turns, speculate):
    want, off = turns(speculate, caching=False)
    got, on = turns(speculate, caching=True)
    assert got == want
    assert off["prefix_cache_queries_total"] == 0
    # Wave 1's requests are admitted together (each computes the system prompt); wave 2's find
    # their whole first turn (prompt and answer) cached, the system prompt's 9 pages at least.
    assert on["prefix_cache_hit_requests_total"] == 4 and on["prefix_cache_hits_total"] >= 4 * 9 * PAGE
    assert on["prompt_tokens_total"] + on["prefix_cache_hits_total"] == off["prompt_tokens_total"]
    assert on["num_free_pages"] == on["num_pages"]  # nothing held; cached pages are evictable


def test_speculation_hit_rate_equals_plain(turns):
    _, plain = turns(False, caching=True)
    _, spec = turns(True, caching=True)
    for key in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_hit_requests_total"):
        assert spec[key] == plain[key], key


def test_adaptive_admission_weighs_both_hits_and_a_drafted_turn_computes_a_plain_prefix_again(pair, turns):
    """Pages a plain prefill cached lack the draft's KV. With `auto`, first turns admitted without
    the draft and second turns with it: admission is told both hits (with the draft's KV: none),
    the drafted turns compute their prefix again, and every output is plain decoding's."""
    target, draft = pair
    sched = Scheduler(target, draft, e3.SpecConfig.auto(3), prefix_caching=True, max_num_seqs=8, max_seq_len=160,
                      page_size=PAGE, prefill_chunk=32)
    adaptive, told = sched.policy.adaptive, []
    judge = adaptive.wants_draft

    def first_turns_plain(key, rows=1, prompt_len=0, max_tokens=None, cached=(0, 0)):
        told.append(cached)
        judge(key, rows, prompt_len, max_tokens, cached)
        return len(told) > 4

    adaptive.wants_draft = first_turns_plain
    got, stats = _turns(sched)
    assert got == turns(False, caching=False)[0]
    assert told[:4] == [(0, 0)] * 4  # admitted together: nothing cached yet
    assert all(with_draft == 0 and plain >= 9 * PAGE for with_draft, plain in told[4:])
    assert stats["prefix_cache_hits_total"] == 0


def test_n_choices_share_the_prompt_and_are_seeded(pair):
    sched = _scheduler(pair, True, caching=True)
    prompt = SYSTEM + [410, 411]
    sps = [e3.SamplingParams(temperature=1.0, max_tokens=16, seed=7 + i) for i in range(4)]
    first = sched.add_request(prompt, sps[0])
    ids = [first] + [sched.add_request(prompt, sp, wait_for=first) for sp in sps[1:]]
    done = {}
    while sched.has_unfinished():
        for d in sched.step():
            if d.finished:
                done[d.request_id] = d.output.token_ids
    stats = sched.stats()
    full = (len(prompt) - 1) // PAGE
    assert stats["prefix_cache_hits_total"] == 3 * full * PAGE  # every later choice took the prompt's full pages
    assert stats["prompt_tokens_total"] == len(prompt) + 3 * (len(prompt) - full * PAGE)
    uncached = _scheduler(pair, True, caching=False)  # one request at a time
    alone = [uncached.generate([prompt], sp)[0].token_ids for sp in sps]
    assert [done[i] for i in ids] == alone  # each choice is its seed's, as if alone


def test_no_page_leaks_through_aborts_and_preemptions(pair):
    """120 mixed requests (shared prefixes, aborts, preemption from too few pages) under
    speculation with the cache: tokens equal an uncached run's, and every page comes back."""
    rng = random.Random(0)
    prefixes = [SYSTEM[:n] for n in (9, 17, 38)]
    prompts = [rng.choice(prefixes) + [rng.randrange(300, 450) for _ in range(rng.randrange(1, 9))]
               for _ in range(120)]
    sps = [e3.SamplingParams(max_tokens=rng.randrange(4, 14)) for _ in prompts]
    aborted = set(rng.sample(range(120), 18))

    def run(caching):
        sched = _scheduler(pair, True, caching, max_num_seqs=16, num_pages=50)
        ids = [sched.add_request(p, sp) for p, sp in zip(prompts, sps)]
        outs, steps = {}, 0
        while sched.has_unfinished():
            for d in sched.step():
                if d.finished:
                    outs[d.request_id] = d.output.token_ids
            steps += 1
            for i in [i for i in aborted if steps == 3 + i % 40]:
                sched.abort(ids[i])
        return [outs.get(i) for i in ids], sched.stats()

    want, _ = run(False)
    got, stats = run(True)
    assert stats["num_preemptions"] > 0 and stats["num_requests_aborted"] > 0
    assert stats["prefix_cache_hit_requests_total"] > 40
    finished = [i for i in range(120) if i not in aborted]
    assert [got[i] for i in finished] == [want[i] for i in finished]
    assert stats["num_free_pages"] == stats["num_pages"] and stats["num_running"] == 0
