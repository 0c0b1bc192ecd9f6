"""The host-memory tier of the prefix cache: pages the device pool evicts are copied to host slots
and copied back when a prompt needs them; agent sessions through a pool too small for them give
the tokens of an unbounded pool, find as much of their prefixes, and leak no page, on one device
and on data shards, in float32 and FP8 pages."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from random_models import FAMILIES, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import host_tier
from eagle3_jax.cache.host_tier import HostPageIndex

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def test_index_spills_evicted_pages_least_recently_used_first():
    index = HostPageIndex(first_slot=10, num_slots=2)
    assert index.spill([(b"a", 5, False), (b"b", 6, True)]) == ([5, 6], [10, 11])
    assert index.lookup(b"a", with_draft=True) is None  # a holds target K/V only
    assert index.lookup(b"a", with_draft=False) == 10  # ... and is now the most recently used
    assert index.spill([(b"c", 7, True)]) == ([7], [11])  # b, least recently used, makes room
    assert index.lookup(b"b", with_draft=False) is None
    assert index.spill([(b"a", 8, False)]) == ([], [])  # held already: no copy
    assert index.spill([(b"a", 9, True)]) == ([9], [10])  # ... unless it becomes draft-valid
    assert index.lookup(b"a", with_draft=True) == 10
    index.pinned.update({10, 11})  # slots being restored are never given away
    assert index.spill([(b"d", 3, True)]) == ([], [])
    index.pinned.clear()
    index.forget_all()
    assert index.num_cached == 0 and index.spill([(b"d", 3, True)])[0] == [3]


def test_a_host_pool_larger_than_the_machine_is_capped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert host_tier.host_slots_for(1.0, 1 << 20, available=None) == 1024
        assert host_tier.host_slots_for(64.0, 1 << 20, available=4 << 30) == 3 * 1024
    assert "host_kv_cache_gb=64 is more than this machine has available (4.0 GiB)" in caplog.text
    with pytest.raises(ValueError, match="host_kv_cache_gb must be >= 0"):
        host_tier.host_slots_for(-1, 1 << 20, available=None)


def sessions(rng: np.random.Generator, n: int) -> list[list[int]]:
    shared = [int(t) for t in rng.integers(1, 64, 9)]
    return [shared + [int(t) for t in rng.integers(1, 64, 5 + 3 * i)] for i in range(n)]


def agent_turns(sched: e3.Scheduler, turns: int = 3, n: int = 6) -> tuple[list[list[int]], dict]:
    """`n` sessions, turn after turn: each turn's prompt is the last one, its answer and a tool
    result. Returns every turn's tokens and the stats."""
    rng = np.random.default_rng(5)
    prompts, outs, sp = sessions(rng, n), [], e3.SamplingParams(max_tokens=6)
    for _ in range(turns):
        answers = [o.token_ids for o in sched.generate(prompts, sp)]
        outs += answers
        prompts = [p + a + [int(t) for t in rng.integers(1, 64, 7)] for p, a in zip(prompts, answers)]
    return outs, sched.stats()


def hit_rate(stats: dict) -> float:
    return stats["prefix_cache_hits_total"] / stats["prefix_cache_queries_total"]


def scheduler(target, kv_cache_dtype: str = "auto", **kw) -> e3.Scheduler:
    return e3.Scheduler(target, random_draft(target), e3.SpecConfig(3, 1, 4), max_num_seqs=2, max_seq_len=96,
                        page_size=4, prefix_caching=True, kv_cache_dtype=kv_cache_dtype, **kw)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sessions_through_a_small_pool_find_their_prefixes_on_the_host(kv_cache_dtype):
    target = random_target(FAMILIES["deepseek_v3"])
    want, unbounded = agent_turns(scheduler(target, kv_cache_dtype, num_pages=400))  # holds every session
    small, no_tier = agent_turns(scheduler(target, kv_cache_dtype, num_pages=32))
    got, tier = agent_turns(scheduler(target, kv_cache_dtype, num_pages=32, host_kv_cache_gb=0.01))
    assert got == want and small == want
    assert no_tier["prefix_cache_hits_total"] < unbounded["prefix_cache_hits_total"]  # the pool evicted them
    # A preempted request looks its prompt up again, so rates are compared, not totals.
    assert hit_rate(tier) >= 0.9 * hit_rate(unbounded) > hit_rate(no_tier)
    assert tier["prompt_tokens_total"] < 0.6 * no_tier["prompt_tokens_total"]
    assert 0 < tier["prefix_cache_host_hits_total"] <= tier["prefix_cache_hits_total"]
    assert tier["host_kv_pages_restored_total"] * 4 == tier["prefix_cache_host_hits_total"]
    assert tier["host_kv_pages_saved_total"] > 0 and tier["host_kv_bytes_saved_total"] > 0
    assert tier["num_free_pages"] == tier["num_pages"] and tier["num_host_cached_pages"] > 0


def test_a_host_tier_holding_few_pages_keeps_the_most_recent():
    target = random_target(FAMILIES["llama"])
    want, _ = agent_turns(scheduler(target))
    got, stats = agent_turns(scheduler(target, num_pages=32, host_kv_cache_gb=2e-5))  # a few pages
    assert got == want
    assert stats["num_host_cached_pages"] == stats["num_host_pages"] < 32
    assert stats["prefix_cache_host_hits_total"] > 0


@needs_8
def test_host_tier_on_data_shards_equals_one_device():
    """Each data shard keeps its own host slots: the pages its prefix cache evicts, restored
    onto its own pages."""
    want, _ = agent_turns(scheduler(random_target(FAMILIES["deepseek_v3"]), "fp8"), n=4)
    target = random_target(FAMILIES["deepseek_v3"], mesh=e3.make_mesh(2, 1, 4))
    got, stats = agent_turns(scheduler(target, "fp8", num_pages=40, host_kv_cache_gb=0.01), n=4)
    assert got == want
    assert stats["prefix_cache_host_hits_total"] > 0 and stats["num_free_pages"] == stats["num_pages"]


def test_the_host_tier_needs_prefix_caching():
    target = random_target(FAMILIES["llama"])
    with pytest.raises(ValueError, match="turn prefix_caching on with it"):
        e3.Scheduler(target, max_num_seqs=2, max_seq_len=32, host_kv_cache_gb=1)
