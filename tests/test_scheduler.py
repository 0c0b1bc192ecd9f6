"""Continuous batching over the paged KV cache: outputs independent of concurrency, preemption,
chunked prefill, streaming, abort, capacity errors, and no page leaks."""

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.cache.pages import PageAllocator
from eagle3_jax.models.target import forward
from eagle3_jax.scheduler import CapacityError, Scheduler

CHAIN = e3.SpecConfig(3, 1, 4)
TREE = e3.SpecConfig(3, 2, 6)
PROMPTS = [[1, 2, 3], [7] * 11, [5, 9, 11, 13, 17], [4] * 29, [8, 6], [3] * 17]


def assert_no_leak(sched: Scheduler) -> None:
    s = sched.stats()
    assert s["num_free_pages"] == s["num_pages"] and s["num_waiting"] == 0 and s["num_running"] == 0


# Tests below that need no other size run schedulers of 2 sequences of up to 64 tokens: their
# programs compile once (conftest.py's compilation cache) and load in the others.
@pytest.fixture(scope="module")
def llama_pair():
    target = random_target(FAMILIES["llama"])
    return target, random_draft(target)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_paged_forward_equals_dense_forward(family):
    """The same tokens through a dense cache and through shuffled pages give the same logits."""
    target = random_target(FAMILIES[family])
    cfg = target.config
    b, page, width = 2, 4, 6
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (b, 13)), jnp.int32)
    step = jnp.asarray(rng.integers(1, cfg.vocab_size, (b, 3)), jnp.int32)

    dense = kv_cache.init_cache(cfg, b, page * width, jnp.float32)
    k, v = kv_cache.init_pages(cfg, 1 + b * width, page, jnp.float32)
    table = (1 + rng.permutation(b * width)).reshape(b, width)
    paged = kv_cache.paged_view(k, v, table, np.zeros(b))

    def run(cache):
        pos = jnp.broadcast_to(jnp.arange(13), (b, 13))
        a, _, cache = forward(target.params, cfg, prompt, pos, cache)
        cache = kv_cache.advance(cache, jnp.array([13, 9]))  # rows keep different lengths
        tree = jnp.broadcast_to(jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (b, 3, 3))
        bb, _, cache = forward(target.params, cfg, step, cache.lengths[:, None] + jnp.array([0, 1, 1]), cache, tree)
        cache = kv_cache.move(cache, cache.lengths[:, None] + jnp.array([[0, 2]]), cache.lengths[:, None] + jnp.arange(2))
        cache = kv_cache.advance(cache, 2)
        c, _, _ = forward(target.params, cfg, step[:, :1], cache.lengths[:, None], cache)
        return a, bb, c

    for x, y in zip(run(dense), run(paged)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5)


def test_page_allocator():
    alloc = PageAllocator(5)
    assert alloc.num_usable == 4 and alloc.num_free == 4
    pages = alloc.allocate(3)
    assert len(set(pages)) == 3 and 0 not in pages
    with pytest.raises(MemoryError):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    alloc.free(pages)
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages[:1])


@pytest.mark.parametrize("family", [
    # MLA + MoE run in the demo-pair test below, the other families' paged attention above
    "llama",
    pytest.param("deepseek_v3", marks=pytest.mark.slow),
    pytest.param("minimax_m2", marks=pytest.mark.slow),
])
def test_tree_outputs_equal_engine(family):
    """Paged GQA / MLA caches under a draft tree, with fewer sequence slots than requests."""
    target = random_target(FAMILIES[family])
    sp = e3.SamplingParams(max_tokens=12)
    ref = [o.token_ids for o in e3.Engine(target, max_batch_size=8, max_seq_len=64).generate(PROMPTS, sp)]
    # A tree with fewer sequence slots than requests (plain paged decoding: the demo-pair test).
    sched = Scheduler(target, random_draft(target), TREE, max_num_seqs=3, max_seq_len=64, page_size=4, prefill_chunk=16)
    assert [o.token_ids for o in sched.generate(PROMPTS, sp)] == ref
    assert_no_leak(sched)


def test_demo_pair_greedy_identical_at_concurrency_1_and_64_with_and_without_speculation():
    """The issue's criterion on the bundled kimi-mini pair (MLA + MoE target, EAGLE-3 draft)."""
    from eagle3_jax.text.tokenizer import load_tokenizer

    target = e3.load_target("checkpoints/kimi-mini", dtype="float32")
    draft = e3.load_draft("checkpoints/kimi-mini-eagle3", target=target, dtype="float32")
    tok = load_tokenizer("checkpoints/kimi-mini")
    with open("checkpoints/demo_prompts.txt", encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    distinct = [tok.encode(t) for t in texts]
    prompts = distinct * 8  # 64 requests
    sampling = [e3.SamplingParams(max_tokens=16 + 3 * (i % 5)) for i in range(len(prompts))]

    def run(d, spec, seqs, prompts, sampling):
        # a chunk budget of 1024 tokens prefills all 64 prompts in one step: the decode batch is 64
        # from the start (fewer batch buckets to compile), then shrinks as the budgets run out
        sched = Scheduler(target, d, spec, max_num_seqs=seqs, max_seq_len=256, prefill_chunk=1024, num_pages=1200)
        outs = sched.generate(prompts, sampling)
        assert_no_leak(sched)
        return [o.token_ids for o in outs], sched.stats()

    # One at a time, each distinct prompt with the longest budget: a request's greedy tokens are
    # that run's first max_tokens (the same tokens, cut by its own budget).
    alone, _ = run(None, None, 1, distinct, e3.SamplingParams(max_tokens=max(s.max_tokens for s in sampling)))
    base = [alone[i % len(distinct)][: s.max_tokens] for i, s in enumerate(sampling)]
    assert run(None, None, 64, prompts, sampling)[0] == base
    chain, stats = run(draft, CHAIN, 64, prompts, sampling)
    assert chain == base and stats["mean_accept_length"] > 2.0  # the trained draft really accepts


# plain: slow (test_logprobs' prompt-logprob test preempts plain decoding too)
@pytest.mark.parametrize("speculate", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "chain"])
def test_preemption_resumes_with_the_same_tokens(llama_pair, speculate):
    target, draft = llama_pair
    d, spec = (draft, CHAIN) if speculate else (None, None)
    sp = e3.SamplingParams(max_tokens=30)
    roomy = Scheduler(target, d, spec, max_num_seqs=6, max_seq_len=64, page_size=4)
    ref = [o.token_ids for o in roomy.generate(PROMPTS, sp)]
    # 24 pages of 4 slots: each request alone fits, all six together do not.
    tight = Scheduler(target, d, spec, max_num_seqs=6, max_seq_len=64, page_size=4, num_pages=25)
    outs = tight.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == ref
    assert tight.stats()["num_preemptions"] > 0 and sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert_no_leak(tight)


def test_sampled_tokens_do_not_depend_on_the_batch(llama_pair):
    target, draft = llama_pair
    sps = [e3.SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=s) for s in range(len(PROMPTS))]
    together = Scheduler(target, draft, CHAIN, max_num_seqs=8, max_seq_len=64).generate(PROMPTS, sps)
    alone = Scheduler(target, draft, CHAIN, max_num_seqs=2, max_seq_len=64)  # one request at a time
    for p, sp, out in zip(PROMPTS, sps, together):
        assert alone.generate([p], sp)[0].token_ids == out.token_ids


def test_chunked_prefill_equals_one_chunk(llama_pair):
    target, draft = llama_pair
    prompt = [int(x) for x in np.random.default_rng(3).integers(1, target.config.vocab_size, 45)]
    sp = e3.SamplingParams(max_tokens=10)
    outs = [Scheduler(target, draft, CHAIN, max_num_seqs=2, max_seq_len=64, prefill_chunk=c).generate([prompt], sp)[0]
            .token_ids for c in (7, 16, 64)]
    assert outs[0] == outs[1] == outs[2]


def test_streaming_deltas_stop_tokens_and_abort(llama_pair):
    target, draft = llama_pair
    sched = Scheduler(target, draft, CHAIN, max_num_seqs=2, max_seq_len=64)
    free = sched.generate([PROMPTS[0]], e3.SamplingParams(max_tokens=20))[0].token_ids
    stop = free[5]
    a = sched.add_request(PROMPTS[0], e3.SamplingParams(max_tokens=20, stop_token_ids=(stop,)))
    b = sched.add_request(PROMPTS[1], e3.SamplingParams(max_tokens=40))
    c = sched.add_request(PROMPTS[2], e3.SamplingParams(max_tokens=40))  # waits: max_num_seqs=2
    streamed, finished = {a: [], b: [], c: []}, {}
    steps = 0
    while sched.has_unfinished():
        for delta in sched.step():
            streamed[delta.request_id] += delta.token_ids
            if delta.finished:
                finished[delta.request_id] = delta
        steps += 1
        if steps == 3:
            assert sched.abort(b) and sched.abort(c)  # b is running, c still waiting
            assert not sched.abort(c) and not sched.abort("nope")
    assert finished[a].finish_reason == "stop" and streamed[a] == free[: free.index(stop) + 1]
    assert finished[a].output.token_ids == streamed[a]
    assert finished[b].finish_reason == finished[c].finish_reason == "abort"
    assert streamed[c] == [] and finished[b].output.token_ids == streamed[b]
    assert sched.stats()["num_requests_aborted"] == 2
    assert_no_leak(sched)


def test_bad_requests_are_rejected_and_lose_nothing(llama_pair):
    target, _ = llama_pair
    sched = Scheduler(target, max_num_seqs=2, max_seq_len=64, page_size=4, num_pages=9)
    with pytest.raises(CapacityError, match="needs .* KV pages"):
        sched.add_request([1] * 10, e3.SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="no room"):
        sched.add_request([1] * 64)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request([])
    with pytest.raises(ValueError, match="outside"):
        sched.add_request([1, target.config.vocab_size])
    ok = sched.add_request([1, 2], e3.SamplingParams(max_tokens=5), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="num_pages"):
        Scheduler(target, num_pages=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(target, max_num_seqs=0)
    deltas = []
    while sched.has_unfinished():
        deltas += sched.step()
    assert deltas[-1].request_id == ok and len(deltas[-1].output.token_ids) == 5
    assert_no_leak(sched)


def test_no_recompilation_for_repeated_shapes(llama_pair):
    target, draft = llama_pair
    sched = Scheduler(target, draft, TREE, max_num_seqs=2, max_seq_len=64, prefill_chunk=16)
    sched.generate(PROMPTS[:3], e3.SamplingParams(max_tokens=8))
    compiled = sched.programs.num_compiles
    assert compiled == len(sched.programs) > 0
    sched.generate(PROMPTS[:3], e3.SamplingParams(max_tokens=8))  # the same shapes again
    assert sched.programs.num_compiles == compiled


def test_compiled_programs_are_bounded_and_freed(llama_pair):
    """A least-recently-used bound on compiled programs (each XLA:CPU one holds many memory maps)."""
    target, _ = llama_pair

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    sps = [e3.SamplingParams(max_tokens=2 + 3 * i) for i in range(len(PROMPTS))]  # the batch shrinks: 4 buckets
    sched = Scheduler(target, max_num_seqs=8, max_seq_len=64, max_compiled_programs=2)
    ref = [o.token_ids for o in Scheduler(target, max_num_seqs=8, max_seq_len=64).generate(PROMPTS, sps)]
    before = maps()
    assert [o.token_ids for o in sched.generate(PROMPTS, sps)] == ref
    assert len(sched.programs) == 2 and sched.programs.num_compiles > 3
    del sched
    import gc

    gc.collect()
    assert maps() < before + 200  # the dropped executables' mappings are gone


def test_the_program_cache_default_follows_the_policy(llama_pair):
    """Adaptive speculation keeps twice the programs: its menu compiles several decode programs at
    each key it explores, and a bound just under its working set recompiles every pass."""
    target, draft = llama_pair
    kw = {"max_num_seqs": 2, "max_seq_len": 64}
    assert Scheduler(target, **kw).programs.capacity == 48
    assert Scheduler(target, draft, e3.SpecConfig(), **kw).programs.capacity == 48
    assert Scheduler(target, draft, e3.SpecConfig.auto(3), **kw).programs.capacity == 96
    assert Scheduler(target, draft, e3.SpecConfig.auto(3), max_compiled_programs=7, **kw).programs.capacity == 7
    with pytest.raises(ValueError, match="max_compiled_programs"):
        Scheduler(target, max_compiled_programs=1, **kw)


def test_warm_up_compiles_what_a_burst_of_short_requests_runs(llama_pair):
    """After warm_up a burst of prompts of up to one chunk compiles nothing, and its tokens and
    counters are those of a scheduler that never warmed up."""
    target, draft = llama_pair
    prompts = [PROMPTS[i] for i in (0, 1, 2, 4)]  # each fits one chunk
    sps = [e3.SamplingParams(max_tokens=3 + 2 * i) for i in range(4)]  # the batch shrinks as they finish

    def scheduler():
        return Scheduler(target, draft, TREE, max_num_seqs=2, max_seq_len=64, prefill_chunk=16)

    cold = scheduler()
    ref = [o.token_ids for o in cold.generate(prompts, sps)]
    warm = scheduler()
    report = warm.warm_up(sampled=False)  # greedy requests: the programs of greedy batches
    assert report.programs == report.wanted == warm.programs.num_compiles and report.max_batch == 2
    assert report.max_tokens >= 16 and "compiled" in str(report)
    assert [o.token_ids for o in warm.generate(prompts, sps)] == ref
    assert warm.programs.num_compiles == report.programs
    assert warm.stats()["generation_tokens_total"] == cold.stats()["generation_tokens_total"]
    assert_no_leak(warm)
    warm.add_request(PROMPTS[0])
    with pytest.raises(RuntimeError, match="before any request"):
        warm.warm_up()


def test_warm_up_covers_sampled_requests_with_and_without_top_k_top_p(llama_pair):
    """Sampled batches compile two forms (temperature alone sorts no vocabulary): after warm_up,
    requests of either kind, alone or together, compile nothing."""
    target, _ = llama_pair
    sched = Scheduler(target, max_num_seqs=2, max_seq_len=32, prefill_chunk=16)
    report = sched.warm_up()
    plain = e3.SamplingParams(temperature=0.8, seed=1, max_tokens=4)
    nucleus = e3.SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=2, max_tokens=4)
    sched.generate([PROMPTS[0]], plain)
    sched.generate([PROMPTS[0]], nucleus)
    sched.generate(PROMPTS[:2], [plain, nucleus])
    assert sched.programs.num_compiles == report.programs


def test_step_programs_branch_on_nothing_the_device_computes(llama_pair, monkeypatch):
    """On a GPU, XLA runs a device-side branch (`lax.cond`, stablehlo.case) by reading its predicate
    back and blocking the launching thread until the device gets there, so a step's launch would
    wait for its own work. No program the scheduler runs has one, whatever its batch's sampling
    settings: they pick the program (sampling.BatchFeatures). (A tree step samples its prefill's
    first token as plain decoding samples each token, and accepts its drafts under every rule.)"""
    from eagle3_jax.scheduler import programs
    lowered, run = [], programs.ProgramCache.run

    def lowering(cache, fn, static, key, *args):
        if key not in cache._programs:
            lowered.append((key[0], key[3][1], jax.jit(functools.partial(fn, *static)).lower(*args).as_text()))
        return run(cache, fn, static, key, *args)

    monkeypatch.setattr(programs.ProgramCache, "run", lowering)
    target, draft = llama_pair
    sched = Scheduler(target, draft, TREE, max_num_seqs=4, max_seq_len=64)
    greedy, sampled = e3.SamplingParams(max_tokens=4), e3.SamplingParams(temperature=0.8, top_p=0.9, seed=1,
                                                                         max_tokens=4)
    held_back = e3.SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=(3,), presence_penalty=0.5,
                                  max_tokens=4, logprobs=2)
    sched.generate(PROMPTS[:2], greedy)
    sched.generate(PROMPTS[:3], [greedy, sampled, held_back])
    features = {f for _, f, _ in lowered}
    assert {f.sampled for f in features} == {False, True} and any(f.holds_back and f.penalized for f in features)
    assert not [(kind, f) for kind, f, text in lowered if "stablehlo.case" in text]


def test_warm_up_stays_within_the_program_cache(llama_pair):
    target, _ = llama_pair
    sched = Scheduler(target, max_num_seqs=8, max_seq_len=64, max_compiled_programs=3)
    report = sched.warm_up()
    assert report.programs == len(sched.programs) == 3 < report.wanted
    greedy_only = Scheduler(target, max_num_seqs=8, max_seq_len=64, max_compiled_programs=3).warm_up(sampled=False)
    # each program for greedy batches and for sampled ones, with temperature alone and with top-k / top-p
    assert report.wanted == 3 * greedy_only.wanted
    assert report.max_batch == 0 and "not all of a lone request's" in str(report)
    assert "compile on first use" in str(report)


def test_warm_up_stops_where_the_host_map_limit_leaves_no_room(llama_pair):
    """XLA:CPU maps memory regions for each program it loads; under a vm.max_map_count that leaves
    room for about two more programs than the first (this process's real maps), the warm-up stops
    there rather than compile past the limit, and drops nothing it compiled."""
    from eagle3_jax.runtime.mapped_regions import MapBudget, mapped_regions

    target, _ = llama_pair
    sched = Scheduler(target, max_num_seqs=8, max_seq_len=64)
    queue = sched.warm_up_queue()
    queue.compile_next(sched.warm)
    per_program = sched.programs.regions_per_program
    assert per_program > 0
    sched.programs.budget = MapBudget(limit=mapped_regions() + int(2.5 * per_program), headroom=0)
    report = queue.run(sched.warm)
    assert report.held and 2 <= report.programs < report.wanted and len(sched.programs) == report.programs
    assert "memory-map limit" in str(report)
    assert sched.generate([PROMPTS[0]], e3.SamplingParams(max_tokens=4))[0].token_ids


def test_prefill_batch_padding_is_bounded():
    """Short prompts queued before a long one do not make a prefill of (rows x longest) padded
    positions beyond twice the chunk: the long one waits for the next step."""
    from eagle3_jax.scheduler.batch import RunningBatch, ScheduledRequest, prefill_fits
    from eagle3_jax.scheduler.metrics import SchedulerCounters
    from eagle3_jax.spec_decode.policy import PlainDecoding

    assert prefill_fits(1, 256, 16) and prefill_fits(2, 16, 16) and not prefill_fits(4, 16, 16)
    batch = RunningBatch(PlainDecoding(), SchedulerCounters(0), max_num_seqs=8, page_size=16, num_pages=64,
                         max_pages_per_seq=4, lookahead=1)
    prompts = [[1]] * 3 + [[2] * 24] + [[3]] * 4
    for i, p in enumerate(prompts):
        batch.waiting.append(ScheduledRequest(id=str(i), prompt=p, sampling=e3.SamplingParams(), budget=4,
                                              prefill_ids=list(p)))
    batch.admit()
    assert [n for _, n in batch.prefill_rows(32)] == [1] * 3  # 4 rows x 32 would be 128 > 2 x 32


def test_block_table_widths_step_by_half_octaves_past_16_pages():
    """A batch's width is the smallest bucket holding its widest row: powers of two, and from 16
    pages on 1.5x them too, so a row just past 256 slots (16-slot pages) makes the step attend over
    384, not 512; the cap (max_pages_per_seq) is always a width."""
    from eagle3_jax.scheduler.batch import width_bucket, width_buckets

    assert width_buckets(4, 16) == [4, 8, 16]
    assert width_buckets(4, 33) == [4, 8, 16, 24, 32, 33]
    assert width_buckets(4, 100) == [4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert [width_bucket(n, 4, 33) for n in (1, 5, 16, 17, 24, 25, 33, 40)] == [4, 8, 16, 24, 24, 32, 33, 33]
    for hi in range(4, 200):  # every width a batch can get is one the buckets list (warm-up compiles from it)
        widths = width_buckets(4, hi)
        assert widths == sorted(set(widths)) and {width_bucket(n, 4, hi) for n in range(1, hi + 1)} <= set(widths)


def test_decoding_rows_keep_admission_order_as_requests_join_and_leave():
    """The decoding set is kept as requests finish their prefill and leave, not found by a scan:
    it stays in admission order when an older request ends a long prompt after newer short ones,
    and its slots follow it."""
    from eagle3_jax.scheduler.batch import DECODE, PREFILL, RunningBatch, ScheduledRequest
    from eagle3_jax.scheduler.metrics import SchedulerCounters
    from eagle3_jax.spec_decode.policy import PlainDecoding

    batch = RunningBatch(PlainDecoding(), SchedulerCounters(0), max_num_seqs=8, page_size=16, num_pages=64,
                         max_pages_per_seq=4, lookahead=1)
    for i in range(6):
        batch.waiting.append(ScheduledRequest(id=str(i), prompt=[1], sampling=e3.SamplingParams(), budget=4,
                                              prefill_ids=[1]))
    batch.admit()
    rng = random.Random(0)
    for _ in range(40):
        prefilling = [r for r in batch.running.values() if r.state == PREFILL]
        if prefilling and rng.random() < 0.6:
            batch.start_decoding(rng.choice(prefilling))
        elif batch.running and rng.random() < 0.5:
            batch.leave(rng.choice(list(batch.running.values())))
        else:
            batch.waiting.append(ScheduledRequest(id=str(rng.random()), prompt=[1], sampling=e3.SamplingParams(),
                                                  budget=4, prefill_ids=[1]))
            batch.admit()
        want = [r for r in batch.running.values() if r.state == DECODE]
        assert batch.decoding() == want and batch.decoding_slots().tolist() == [r.slot for r in want]
        assert list(batch.prefilling.values()) == [r for r in batch.running.values() if r.state == PREFILL]
