"""Continuous batching over a paged KV cache: the Scheduler (its API, one iteration, results);
launches are launches.py's; admission, pages and preemption are the running batch's (batch.py).

Requests queue up and join or leave the running batch between steps. Each `step()`:

1. admits waiting requests first-come first-served while a sequence slot is free and the pages
   for their prompt fit (one page of growth per decoding request stays in reserve);
2. runs one prefill program over the next prompt chunks of admitted requests (a request takes up
   to `prefill_chunk` tokens per step; rows join while the step's budget of `prefill_chunk`
   tokens lasts); a request whose last chunk ran gets its first token and, with a draft, its
   first draft tree;
3. grows every decoding request's pages to cover the next step's writes; when pages run short
   the most recently admitted request is preempted: its pages are freed and it returns to the
   front of the queue, to be recomputed from prompt + generated tokens when readmitted;
4. runs one decode program over every decoding request, as the speculation policy plans it
   (spec_decode/policy.py): an EAGLE-3 step with a draft (draft expand, verify, accept, commit, draft
   extend, see spec_decode/step.py), one token without, and hands back each request's new tokens.

Structured output: requests may constrain their output (`SamplingParams.constraint`: a JSON
schema, a regex, a choice, a grammar; needs a tokenizer); each token is judged only among those
its grammar allows, in plain and speculative steps alike, so greedy output is the target's greedy
output under the constraint and sampled output its masked distribution. Grammars are compiled
once per distinct constraint (`Scheduler.grammars`, bounded). A step with such a row reads every
launched step first (its masks follow from every token so far) and, when it speculates, runs as
two programs with the host computing each tree node's mask between them (launches.py).

Target and draft K/V live in page pools shared by all requests; a request owns a list of pages
(its block table) that indexes both, and a state slot that keeps, on device, its last token and
(with a draft) the draft's hidden state from which the next step proposes (programs.py). Batch
size, chunk length and block-table width are bucketed to powers of two (widths from 16 pages on
also to 1.5x them: batch.width_buckets), so a few compiled programs serve every mix of requests.
A request's chunk boundaries depend only on its own length, and prefill always uses the same
attention form, so a request's greedy tokens do not depend on what runs beside it. A step's host
arguments are the batch's rows of per-slot tables (slots, prompt lengths, sampling settings, block
tables: slot_table.py), written when a request joins or gains pages and gathered by slots in one
go: two arrays per program, whatever the batch. A step's outputs are copied to the host behind
it (`Executor.prefetch`) and read after the next launch.

Multi-host: every process must launch the same programs. Either every process drives an
identical request stream (the steps depend only on the requests), or process 0 alone takes
requests and calls `lead()`, sending each step's inputs to the other processes, which sit in
`follow()` and run the same programs on their devices (lockstep.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Callable, Sequence

import numpy as np

from ..cache.pages import pages_for
from ..models.draft import Draft, with_target_kernels
from ..models.target import Target
from ..request import RequestOutput, cap_message, check_request, normalize_sampling, token_budget
from ..runtime.sharding import data_shards
from ..sampling.logprobs import Logprob, LogprobSettings
from ..sampling.sampler import SamplingParams
from ..spec_decode.policy import check_speculation, policy_for
from ..spec_decode.settings import AutoSpec, SpecConfig
from ..structured import GrammarCache, RequestGrammar
from ..text.stream import TextStream, output_text
from ..text.tokenizer import Tokenizer
from . import lockstep
from .batch import DONE, MIN_PAGES_BUCKET, PREFILL_CHUNK, RunningBatch, ScheduledRequest, width_bucket
from .launches import Launch, Launcher, time_steady_steps_only
from .metrics import SchedulerCounters
from .programs import Executor
from .warmup import WarmProgram, WarmUp, WarmUpQueue, run_on_padding, warmup_programs

logger = logging.getLogger(__name__)


LOGPROBS_MODES = ("raw", "processed")


class CapacityError(ValueError):
    """A request that can never fit in the KV cache, however long it waits."""


@dataclasses.dataclass(slots=True)
class RequestDelta:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new since this request's previous delta
    time: float  # time.perf_counter() when they reached the host
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    output: RequestOutput | None  # the whole output and metrics, once finished
    logprobs: list[Logprob] | None = None  # of token_ids, when the request asks for them
    prompt_logprobs: list[Logprob | None] | None = None  # on a request's first delta, when it asks for them
    # The settled text of token_ids where the request layer decodes the request (one with stop
    # strings), else None: its front end decodes it (text_stream.ChoiceText).
    text: str | None = None


def _checked_all(sched: "Scheduler", prompts: Sequence[Sequence[int]], sampling: list[SamplingParams]) -> tuple:
    """(checked prompts, grammars) of a `generate` call, all checked and compiled before any is
    queued; a max_tokens cut to fit max_seq_len is said in a warning (the first three, then a count)."""
    checked = [check_request(sched.target.config.vocab_size, sched.max_seq_len, p, sp, index=i,
                             decodes_text=sched.tokenizer is not None, max_logprobs=sched.max_logprobs)
               for i, (p, sp) in enumerate(zip(prompts, sampling))]
    grammars = [RequestGrammar.of(sched.grammars, sp.constraint) for sp in sampling]
    cuts = [(i, m) for i, (p, sp) in enumerate(zip(checked, sampling))
            if (m := cap_message(len(p), sp.max_tokens, sched.max_seq_len))]
    for i, message in cuts[:3]:
        logger.warning("prompt %d: %s", i, message)
    if len(cuts) > 3:
        logger.warning("... and for %d more prompts", len(cuts) - 3)
    return checked, grammars


def _pool_pages(num_pages: int | None, max_num_seqs: int, max_pages_per_seq: int, shards: int) -> int:
    """The KV pool's pages: `num_pages`, or by default enough for every sequence at full length,
    split in equal shares over the data shards (each keeps its first page back; a count that does
    not divide is rounded up, with a warning). A ValueError for a batch the shards cannot split."""
    if max_num_seqs % shards:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be a multiple of the mesh's data axis ({shards}): each "
                         f"data shard runs max_num_seqs / {shards} of the sequences")
    if num_pages is None:
        return shards * (max_num_seqs // shards * max_pages_per_seq + 1)
    if not isinstance(num_pages, (int, np.integer)) or num_pages < 2 * shards:
        reserved = "page 0 is reserved" if shards == 1 else f"each of the {shards} data shards reserves a page"
        raise ValueError(f"num_pages must be an integer >= {2 * shards} ({reserved}); got {num_pages!r}")
    rounded = -(-int(num_pages) // shards) * shards
    if rounded != num_pages:
        logger.warning("num_pages=%d rounded up to %d: %d data shards hold equal shares", num_pages, rounded, shards)
    return rounded


def _check_capacity(prompt: int, budget: int, reserve: int, page_size: int, usable: int) -> None:
    """CapacityError when a request of `prompt` + `budget` tokens (+ `reserve` slots of lookahead)
    needs more pages than the cache has in all."""
    need = pages_for(prompt + budget + reserve, page_size)
    if need > usable:
        raise CapacityError(f"a request of {prompt} prompt tokens + {budget} new tokens needs {need} KV pages of "
                            f"{page_size} slots, but the cache has only {usable}; lower max_tokens, shorten the prompt "
                            "or raise num_pages")


def _check_settings(lower_bounds: dict[str, tuple[object, int]], logprobs_mode: str) -> None:
    """A ValueError naming the first setting that is not an integer of at least its bound
    (`lower_bounds`: name -> (value, bound)), or a logprobs mode not known."""
    for name, (value, low) in lower_bounds.items():
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got {logprobs_mode!r}")


def _spread_len(context_parallel_len: int | None, num_pages: int, max_num_seqs: int, page_size: int) -> int:
    """The tokens from which a request is spread over the data shards (see Scheduler)."""
    if context_parallel_len is None:
        return num_pages // max_num_seqs * page_size + 1
    if not isinstance(context_parallel_len, (int, np.integer)) or context_parallel_len < 1:
        raise ValueError(f"context_parallel_len must be an integer >= 1 (tokens) or None; got {context_parallel_len!r}")
    return int(context_parallel_len)


def _attach_host_tier(launcher: Launcher, gib: float, prefix_caching: bool, shards: int) -> None:
    """Give the prefix cache a host tier of `gib` GiB (none for 0), copied by `launcher`."""
    if not gib:
        return
    if not prefix_caching:
        raise ValueError("host_kv_cache_gb keeps the prefix cache's evicted pages: turn prefix_caching on with it")
    slots = launcher.executor.enable_host_tier(gib, shards)
    if not slots:
        logger.warning("host_kv_cache_gb=%g holds less than a KV page per data shard: no host KV tier", gib)
        return
    launcher.batch.pages.attach_host_tier(slots, launcher)
    logger.info("host KV tier: %d pages (%.2f GiB) in host memory", slots * shards,
                slots * shards * launcher.executor.host_pages.bytes_per_page / (1 << 30))


class Scheduler:
    """Continuous-batching generation over a target, with an optional EAGLE-3 draft.

    With a `tokenizer`, requests may carry stop strings (`SamplingParams.stop`), matched on their
    text as `step()` emits tokens (the deltas of those requests carry their text); `generate`'s
    outputs carry their text (`RequestOutput.text`, cut at a stop string).

    Requests may ask for logprobs (`SamplingParams.logprobs`, `prompt_logprobs`) with up to
    `max_logprobs` top alternatives per token; `logprobs_mode` says of which distribution: "raw"
    (the target's, before any sampling setting) or "processed" (what the token was sampled or
    judged from; see sampling/logprobs.py). Steps that compute them are separate programs, compiled the
    first time a batch holds such a request.

    With `prefix_caching`, full KV pages whose contents are final are kept after their request
    leaves, keyed by the tokens they hold (and the token after: the draft's slots pair with it),
    and a request whose prompt starts with cached pages takes them instead of computing them
    again (batch.py says when a page is cached and when it may be shared); they are evicted least
    recently used when pages run short. `stats()` counts the hits (tokens and requests). With
    `host_kv_cache_gb` too, evicted pages are kept in that much host memory and copied back
    instead of computed again (cache/host_tier.py).

    `kv_cache_dtype`: "auto" (KV pages in the compute dtype) or "fp8" (float8 with a scale per
    token per 128 lanes, about half the bytes: kv_cache.Fp8Slots), for target and draft alike. On
    a `data` mesh a request of `context_parallel_len` tokens or more (prompt + max tokens) is
    spread over every data shard (batch.py); default: more than a row's share of the pool. At most
    `max_compiled_programs` compiled step programs are kept, fewer where more would pass vm.max_map_count
    (program_cache.py); default: 48, or 96 with adaptive speculation (its menu: several decode programs a key).

    Not thread-safe: one thread calls its methods (see serving.AsyncEngine for asyncio use).
    """

    def __init__(self, target: Target, draft: Draft | None = None, spec: SpecConfig | AutoSpec | None = None, *,
                 max_num_seqs: int = 64, max_seq_len: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 max_compiled_programs: int | None = None, overlap: bool = True, tokenizer: Tokenizer | None = None,
                 max_logprobs: int = 20, logprobs_mode: str = "raw", prefix_caching: bool = False,
                 kv_cache_dtype: str = "auto", context_parallel_len: int | None = None, host_kv_cache_gb: float = 0.0):
        self.spec = check_speculation(target, draft, spec)
        self.policy = policy_for(self.spec)
        if max_compiled_programs is None:
            max_compiled_programs = self.policy.program_cache_size
        _check_settings({"max_num_seqs": (max_num_seqs, 1), "max_seq_len": (max_seq_len, 2), "page_size": (page_size, 1),
                         "prefill_chunk": (prefill_chunk, 1), "max_compiled_programs": (max_compiled_programs, 2),
                         "max_logprobs": (max_logprobs, 0)}, logprobs_mode)
        self.max_logprobs = int(max_logprobs)
        self._logprob_settings = LogprobSettings(min(self.max_logprobs, target.config.vocab_size),
                                                 processed=logprobs_mode == "processed")
        self.target, self.tokenizer = target, tokenizer
        self.draft = None if draft is None else with_target_kernels(draft, target)
        self.max_num_seqs, self.max_seq_len = int(max_num_seqs), int(max_seq_len)
        self.page_size, self.prefill_chunk = int(page_size), int(prefill_chunk)
        self.lookahead = self.policy.lookahead
        self.overlap = bool(overlap)
        # With overlap a step launches before the previous one is read, so pages must cover one
        # more step than the host has seen.
        self._overshoot = self.policy.reserve(True)[0] if self.overlap else 0
        self.max_pages_per_seq = pages_for(self.max_seq_len + self.lookahead + self._overshoot, self.page_size)
        # Every prompt that fits one chunk prefills at one block-table width: fewer programs.
        self._prefill_width = width_bucket(pages_for(min(self.prefill_chunk, self.max_seq_len) + self.lookahead,
                                                     self.page_size), MIN_PAGES_BUCKET, self.max_pages_per_seq)
        shards = data_shards(target.mesh)
        num_pages = _pool_pages(num_pages, self.max_num_seqs, self.max_pages_per_seq, shards)
        self.counters = SchedulerCounters(self.policy.max_accept)
        self._batch = RunningBatch(self.policy, self.counters, max_num_seqs=self.max_num_seqs, page_size=self.page_size,
                                   num_pages=num_pages, max_pages_per_seq=self.max_pages_per_seq,
                                   lookahead=self.lookahead, prefix_caching=bool(prefix_caching), data_shards=shards,
                                   spread_len=_spread_len(context_parallel_len, num_pages, self.max_num_seqs, page_size))
        self._executor = Executor(target, self.draft, self.policy, int(num_pages), self.page_size, self.max_num_seqs,
                                  int(max_compiled_programs), kv_cache_dtype)
        self.programs = self._executor.programs
        self._launcher = Launcher(self._executor, self._batch, self.policy, self.counters, self._logprob_settings,
                                  prefill_chunk=self.prefill_chunk, prefill_width=self._prefill_width)
        _attach_host_tier(self._launcher, float(host_kv_cache_gb), bool(prefix_caching), shards)
        self._inflight: list[Launch] = []  # launched last iteration, read in the next (overlap)
        self._last_read = 0.0  # when the host last had a program's outputs
        self._requests: dict[str, ScheduledRequest] = {}
        self._aborted: list[RequestDelta] = []
        self._ids = itertools.count()
        self.grammars = GrammarCache(tokenizer, target.config.vocab_size) if tokenizer is not None else None

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, *, wait_for: str | None = None) -> str:
        """Validate and queue a request; returns its id. A max_tokens that does not fit in
        max_seq_len is cut to the room left, with a warning. `wait_for`: the id of a request of
        the same prompt queued before (the first of n choices); this one is admitted only once
        that one's prompt is prefilled, so with prefix caching it takes the prompt's full pages
        instead of computing them again (others queued behind it are admitted meanwhile).

        Raises ValueError for a bad prompt or sampling, a duplicate id, or a prompt that leaves no
        room within max_seq_len; CapacityError when it could never fit in the KV pages.
        """
        sampling = SamplingParams() if sampling is None else sampling
        ids = check_request(self.target.config.vocab_size, self.max_seq_len, prompt_ids, sampling,
                            decodes_text=self.tokenizer is not None, max_logprobs=self.max_logprobs)
        rid = self._queue(ids, sampling, request_id, wait_for, RequestGrammar.of(self.grammars, sampling.constraint))
        cut = cap_message(len(ids), sampling.max_tokens, self.max_seq_len)
        if cut:
            logger.warning("request %s: %s", rid, cut)
        return rid

    def _queue(self, ids: list[int], sampling: SamplingParams, request_id: str | None,
               wait_for: str | None = None, grammar: RequestGrammar | None = None) -> str:
        """Queue a checked prompt (check_request's ids) with its grammar state; returns its id."""
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        budget = token_budget(len(ids), sampling.max_tokens, self.max_seq_len)
        _check_capacity(len(ids), budget, self.lookahead + self._overshoot, self.page_size,
                        self._batch.pages.num_usable(len(ids) + budget))
        req = ScheduledRequest(id=rid, prompt=ids, sampling=sampling, budget=budget, prefill_ids=list(ids), grammar=grammar,
                               wait_for=None if wait_for is None else self._requests.get(str(wait_for)))
        if sampling.stop:
            req.text = TextStream(self.tokenizer, ids, sampling.stop, sampling.include_stop_str_in_output,
                                  sampling.min_tokens)
        self._requests[rid] = req
        self._batch.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request and free its pages; False if it is unknown or done.

        Its final delta (finish_reason "abort") comes from the next step().
        """
        req = self._requests.get(str(request_id))
        if req is None or req.state == DONE:
            return False
        self._batch.leave(req)
        self.counters.totals["num_requests_aborted"] += 1
        self._aborted.append(self._finish(req, "abort", time.perf_counter()))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._batch.waiting or self._batch.running or self._aborted or self._inflight)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once); outputs in prompt order. A max_tokens cut
        to fit max_seq_len is said in a warning."""
        sampling = normalize_sampling(sampling, len(prompts))
        checked, grammars = _checked_all(self, prompts, sampling)
        ids = [self._queue(p, sp, None, grammar=g) for p, sp, g in zip(checked, sampling, grammars)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for delta in self.step():
                if delta.finished:
                    done[delta.request_id] = delta.output
        outputs = [done[i] for i in ids]
        if self.tokenizer is not None:  # this front end decodes what the request layer did not
            for prompt, out in zip(checked, outputs):
                if out.text is None:
                    out.text = output_text(self.tokenizer, prompt, out.token_ids)
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget every cached page, the host tier's too (vLLM's reset_prefix_cache; benchmarks
        start cold with it). Pages running requests hold stay theirs."""
        self._batch.pages.reset_cache()

    def stats(self) -> dict:
        """Counters and gauges for monitoring (see serving's /metrics)."""
        b = self._batch
        return {"num_waiting": len(b.waiting), "num_running": len(b.running), **b.pages.counts(),
                "page_size": self.page_size, "kv_cache_dtype": self._executor.kv_cache_dtype,
                "num_compiled_grammars": len(self.grammars or ()),
                "num_constrained_requests": sum(r.grammar is not None for r in self._requests.values()),
                **self.counters.stats(), "launch_seconds_total": self.programs.launch_seconds, **self.policy.stats()}

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Admit, launch one prefill chunk batch and one decode step, and return the news.

        With `overlap` (the default) the news is that of the previous iteration's programs, read
        while this iteration's run on the device, so host work (admission, page growth, block
        tables, sampling arrays, detokenising callers) overlaps device work; without it, of this iteration's.
        """
        (deltas, self._aborted), start, launches = (self._aborted, []), time.perf_counter(), []
        self._batch.admit()
        prefill_rows = self._batch.prefill_rows(self.prefill_chunk)
        if prefill_rows:
            launches.append(self._launcher.prefill(prefill_rows))
        decode_rows = self._batch.grow_pages()
        if decode_rows and self._batch.table.constrained[self._batch.decoding_slots()].any():
            # A constrained row's masks follow from every token so far: read every launch first.
            early, waited = self._collect(self._inflight + launches)
            deltas += early
            self.counters.totals["host_seconds_total"] -= waited
            self._inflight, launches, decode_rows = [], [], self._batch.decoding()
        if decode_rows:
            launches.append(self._launcher.decode(decode_rows))
        ready, self._inflight = (self._inflight, launches) if self.overlap else (launches, [])
        time_steady_steps_only(ready, launches if self.overlap else [])
        news, waited = self._collect(ready)
        self.counters.totals["host_seconds_total"] += time.perf_counter() - start - waited
        self.counters.totals["num_iterations_total"] += 1
        return deltas + news

    # ---- multi-host serving ----------------------------------------------------------------------
    def lead(self) -> None:
        """Make this (process 0's) scheduler send every step to the followers (multi-host serving:
        only process 0 takes requests; see lockstep.py). Call `release_followers` when done."""
        self._launcher.leader = lockstep.Leader()

    def release_followers(self) -> None:
        """Leader: tell every follower's `follow` to return (idempotent)."""
        if self._launcher.leader is not None:
            self._launcher.leader.release()
            self._launcher.leader = None

    def follow(self) -> int:
        """Follower (process > 0): run the leader's step programs on this process's shards, in the
        leader's order, until it calls `release_followers`. Returns the number of steps run."""
        return lockstep.follow(self._executor)

    # ---- warm-up -------------------------------------------------------------------------------
    def warm_up(self, sampled: bool = True) -> WarmUp:
        """Compile the programs that bursts of requests of up to one prefill chunk run (warmup.py), for greedy
        batches and (`sampled`) batches with a sampled row, smallest first, within the program cache's bound and
        map budget, by running each once on padding rows: no request, counter or step time sees them. Call it idle."""
        return self.warm_up_queue(sampled).run(self.warm)

    def warm_up_queue(self, sampled: bool = True, progress: Callable[[str], None] | None = None) -> WarmUpQueue:
        """`warm_up`'s programs to compile one by one with `warm`, a lone greedy request's first."""
        wanted = warmup_programs(self.policy, sampled, max_num_seqs=self.max_num_seqs, prefill_chunk=self.prefill_chunk,
                                 prefill_width=self._prefill_width, max_pages_per_seq=self.max_pages_per_seq,
                                 data_shards=self._batch.shards)
        return WarmUpQueue(wanted, self.programs.capacity, self.page_size, self.lookahead + self._overshoot, progress,
                           out_of_room=self.programs.out_of_regions)

    def warm(self, program: WarmProgram) -> None:
        """Compile `program` by running it once on padding rows (no request running)."""
        if self.has_unfinished():
            raise RuntimeError("warm-up programs run before any request or between requests: this scheduler has "
                               "unfinished requests")
        outputs = run_on_padding(program, self._batch, self._launcher.run)
        self._launcher.reading(1)
        self._executor.read(outputs)

    # ---- results -------------------------------------------------------------------------------
    def _collect(self, launches: list[Launch]) -> tuple[list[RequestDelta], float]:
        """Read launched programs' outputs, in launch order -> (deltas, seconds spent waiting)."""
        self._launcher.reading(len(launches))
        deltas, waited = [], 0.0
        for launch in launches:
            start = time.perf_counter()
            outputs = launch.in_request_order(self._executor.read(launch.outputs))
            now = time.perf_counter()
            waited += now - start
            live = launch.live(self._batch.table)  # requests preempted, aborted or finished since: void
            if launch.kind == "prefill":
                seconds = launch.seconds(now, self._last_read, self.programs.num_compiles)
                self.policy.observe_prefill(launch.with_draft, launch.key, launch.tokens, seconds)
                deltas += self._collect_prefill(launch, live, outputs, now)
            else:
                deltas += self._collect_decode(launch, live, outputs, now)
            self._last_read = now
        return deltas, waited

    def _collect_prefill(self, launch: Launch, live: np.ndarray, outputs: list[np.ndarray],
                         now: float) -> list[RequestDelta]:
        """A prefill's first tokens for `live` rows whose prompt ended, and prompt logprobs of every
        live row that asks for them."""
        first, logprobs = outputs[0], outputs[1:] or None
        deltas = []
        for i in live.tolist():
            req, (start, n) = launch.requests[i], launch.chunks[i]
            if logprobs is not None and req.prompt_logprobs is not None:  # position j predicts token start + j + 1
                wanted = req.missing_prompt_logprobs(start + 1, n)
                req.prompt_logprobs += Logprob.rows(logprobs, i, [p - start - 1 for p in wanted],
                                                    req.sampling.prompt_logprobs)
            if launch.final[i]:
                lps = None if req.logprobs is None else Logprob.rows(logprobs, i, [n - 1], req.sampling.logprobs)
                deltas.append(self._emit(req, [int(first[i])], now, lps))
        return deltas

    def _collect_decode(self, launch: Launch, live: np.ndarray, outputs: list[np.ndarray],
                        now: float) -> list[RequestDelta]:
        """A decode step's tokens of its `live` rows: handed out, and their requests finished when done."""
        (out, count), logprobs, plan = outputs[:2], outputs[2:] or None, launch.plan
        rows = live.tolist()
        requests = launch.requests if len(rows) == len(launch.requests) else [launch.requests[i] for i in rows]
        counts = count[live]
        self.policy.observe(plan, launch.key, launch.seconds(now, self._last_read, self.programs.num_compiles), requests,
                            counts)
        self.counters.decode_step(counts, plan.depth)
        table, slots, out = self._batch.table, launch.slots[live], out[live]
        bulk = table.bulk_rows(slots, out, counts)  # (before the step log advances their lengths)
        full = table.log_steps(slots, counts, plan.depth, plan.draft_passes, now)
        # Most rows' tokens go out whole (`bulk`): their deltas and outputs in comprehensions; the
        # other rows' through `_emit`, one by one.
        news = [row[:k] for row, k in zip(out.tolist(), counts.tolist())]
        deltas = [RequestDelta(req.id, new, now, False, None, None) if whole else None
                  for req, new, whole in zip(requests, news, bulk)]
        for req, new in itertools.compress(zip(requests, news), bulk):
            req.take(new)
        self.counters.totals["generation_tokens_total"] += int(counts[bulk].sum())
        for j in [j for j, whole in enumerate(bulk) if not whole]:
            req, i = requests[j], rows[j]
            lps = None if req.logprobs is None else Logprob.rows(logprobs, i, range(len(news[j])), req.sampling.logprobs)
            deltas[j] = self._emit(req, news[j], now, lps, timed=False)
        for i in full.tolist():  # a full step log, taken by its request (one that finished took it leaving)
            if requests[i].slot is not None:
                requests[i].record_steps(*table.take_steps(requests[i].slot))
        return deltas

    def _emit(self, req: ScheduledRequest, tokens: list[int], now: float,
              logprobs: list[Logprob] | None = None, timed: bool = True) -> RequestDelta:
        """Hand out a step's tokens (up to a stop token or the budget) and their logprobs; finish the
        request if done. `timed`: as `Request.emit` (a decode step's times are in the step log)."""
        before, reason = len(req.output), req.emit(tokens, now, logprobs, timed)  # (in this order)
        self.counters.totals["generation_tokens_total"] += len(req.output) - before
        if reason is None:
            prompt_lps = req.prompt_logprobs if req.sent == 0 else None
            new, lps, text = req.unsent()
            return RequestDelta(req.id, new, now, False, None, None, lps, prompt_lps, text)
        self._batch.leave(req)
        self.counters.totals["num_requests_finished"] += 1
        return self._finish(req, reason, now)

    def _finish(self, req: ScheduledRequest, reason: str, now: float) -> RequestDelta:
        req.state, req.finish_reason, req.grammar = DONE, reason, None
        del self._requests[req.id]
        self.policy.finished(req.id, len(req.output))
        prompt_lps = req.prompt_logprobs if req.sent == 0 else None
        new, lps, text = req.unsent()
        rest = req.settle_text()  # may find a late stop string
        whole = None if req.text is None else req.text.output
        return RequestDelta(req.id, new, now, True, req.finish_reason, req.output_record(now, self.policy.max_accept, whole),
                            lps, prompt_lps, None if rest is None else text + rest)
