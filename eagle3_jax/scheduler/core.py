"""Continuous batching over a paged KV cache: admission, pages, preemption, launches, results.

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
   (spec/policy.py): an EAGLE-3 step with a draft (draft expand, verify, accept, commit, draft
   extend, see spec/step.py), one token without, and hands back each request's new tokens.

Target and draft K/V live in page pools shared by all requests; a request owns a list of pages
(its block table) that indexes both, and a state slot that keeps, on device, its last token and
(with a draft) the draft's hidden state from which the next step proposes (programs.py). Batch
size, chunk length and block-table width are bucketed to powers of two, so a few compiled
programs serve every mix of requests. A request's chunk boundaries depend only on its own length,
and prefill always uses the same attention form, so a request's greedy tokens do not depend on
what runs beside it. Host bookkeeping per step is per-slot numpy tables (block tables, sampling
settings) indexed by the batch's slots, so it grows with the rows that change, not the batch.

Multi-host: every process must launch the same programs. Either every process drives an
identical request stream (the steps depend only on the requests), or process 0 alone takes
requests and calls `lead()`, sending each step's inputs to the other processes, which sit in
`follow()` and run the same programs on their devices (lockstep.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Sequence

import numpy as np

from .. import kv_cache
from ..draft import Draft, with_target_kernels
from ..page_allocator import PageAllocator, pages_for
from ..request import Request, RequestOutput, cap_message, check_request, normalize_sampling, token_budget
from ..sampling import SamplingParams, SamplingTable
from ..spec.settings import AutoSpec
from ..spec.policy import StepPlan, check_speculation, policy_for
from ..spec.settings import SpecConfig
from ..target import Target
from . import lockstep
from .metrics import SchedulerCounters
from .programs import Executor

logger = logging.getLogger(__name__)

MIN_CHUNK_BUCKET = 16
MIN_PAGES_BUCKET = 4


class CapacityError(ValueError):
    """A request that can never fit in the KV cache, however long it waits."""


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


@dataclasses.dataclass
class RequestDelta:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new since this request's previous delta
    time: float  # time.perf_counter() when they reached the host
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    output: RequestOutput | None  # the whole output and metrics, once finished


_WAITING, _PREFILL, _DECODE, _DONE = "waiting", "prefill", "decode", "done"


@dataclasses.dataclass(eq=False)
class _Sequence(Request):
    """A request and where it stands in the scheduler."""

    state: str = _WAITING
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the next prefill computes
    computed: int = 0  # tokens of prefill_ids already in the cache
    length: int = 0  # committed cache slots
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None  # state slot: last token and draft root, on device
    pending: int = 0  # decode steps launched but not read yet
    gap: int = 0  # steps since the draft last saw this request's tokens (adaptive speculation)
    with_draft: bool = True  # the draft follows it (adaptive speculation may admit a request without)
    epoch: int = 0  # bumped when the request leaves the running batch: results launched before are void


@dataclasses.dataclass
class _Launch:
    """A step program launched on the device, its outputs not read yet."""

    kind: str  # "prefill" | "decode"
    rows: list  # (sequence, its epoch at launch, prefill: whether the chunk ends its prompt)
    outputs: list  # device arrays
    plan: StepPlan | None = None  # decode: what ran
    key: tuple = ()
    launched: float = 0.0
    untimed: bool = False  # after a catch-up, whose end the host does not see: not timed
    compiles: int = 0  # programs compiled before it was launched
    with_draft: bool = False  # prefill: the draft's program
    tokens: int = 0  # prefill: prompt tokens computed


class Scheduler:
    """Continuous-batching generation over a target, with an optional EAGLE-3 draft.

    Not thread-safe: one thread calls its methods (see serving.AsyncEngine for asyncio use).
    """

    def __init__(self, target: Target, draft: Draft | None = None, spec: SpecConfig | AutoSpec | None = None, *,
                 max_num_seqs: int = 64, max_seq_len: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, prefill_chunk: int = 256, max_compiled_programs: int = 48,
                 overlap: bool = True):
        for name, value, low in (("max_num_seqs", max_num_seqs, 1), ("max_seq_len", max_seq_len, 2),
                                 ("page_size", page_size, 1), ("prefill_chunk", prefill_chunk, 1),
                                 ("max_compiled_programs", max_compiled_programs, 2)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        self.target = target
        self.spec = check_speculation(target, draft, spec)
        self.policy = policy_for(self.spec)
        self.draft = None if draft is None else with_target_kernels(draft, target)
        self.max_num_seqs, self.max_seq_len = int(max_num_seqs), int(max_seq_len)
        self.page_size, self.prefill_chunk = int(page_size), int(prefill_chunk)
        self.lookahead = self.policy.lookahead
        self.overlap = bool(overlap)
        # With overlap a step launches before the previous one is read, so pages must cover one
        # more step than the host has seen.
        self._overshoot = self.policy.reserve(True)[0] if self.overlap else 0
        self.max_pages_per_seq = pages_for(self.max_seq_len + self.lookahead + self._overshoot, self.page_size)
        if num_pages is None:
            num_pages = self.max_num_seqs * self.max_pages_per_seq + 1
        if not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is reserved); got {num_pages!r}")
        self._alloc = PageAllocator(int(num_pages))
        self._executor = Executor(target, self.draft, self.policy, int(num_pages), self.page_size, self.max_num_seqs,
                                  int(max_compiled_programs))
        self.programs = self._executor.programs
        scratch = self.max_num_seqs  # the state slot of padding rows
        self._free_slots = list(range(scratch - 1, -1, -1))
        # Per state slot, for batches built by indexing: block table and sampling settings.
        self._tables = np.full((scratch + 1, self.max_pages_per_seq), kv_cache.SCRATCH_PAGE, np.int32)
        self._sampling = SamplingTable(scratch + 1)
        self._leader: lockstep.Leader | None = None
        self._inflight: list[_Launch] = []  # launched last iteration, read in the next (overlap)
        self._last_read = 0.0  # when the host last had a program's outputs
        self._last_decode_key: tuple[int, int] | None = None  # (batch, width) buckets of the last decode step
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: dict[str, _Sequence] = {}  # admission order: prefilling and decoding
        self._requests: dict[str, _Sequence] = {}
        self._aborted: list[RequestDelta] = []
        self._ids = itertools.count()
        self.counters = SchedulerCounters(self.policy.max_accept)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. A max_tokens that does not fit in
        max_seq_len is cut to the room left, with a warning.

        Raises ValueError for a bad prompt or sampling, a duplicate id, or a prompt that leaves no
        room within max_seq_len; CapacityError when it could never fit in the KV pages.
        """
        rid = self._queue(prompt_ids, SamplingParams() if sampling is None else sampling, request_id)
        req = self._requests[rid]
        cut = cap_message(len(req.prompt), req.sampling.max_tokens, self.max_seq_len)
        if cut:
            logger.warning("request %s: %s", rid, cut)
        return rid

    def _queue(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str | None) -> str:
        ids = check_request(self.target.config.vocab_size, self.max_seq_len, prompt_ids, sampling)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        budget = token_budget(len(ids), sampling.max_tokens, self.max_seq_len)
        need = pages_for(len(ids) + budget + self.lookahead + self._overshoot, self.page_size)
        if need > self._alloc.num_usable:
            raise CapacityError(
                f"a request of {len(ids)} prompt tokens + {budget} new tokens needs {need} KV pages of "
                f"{self.page_size} slots, but the cache has only {self._alloc.num_usable}; lower max_tokens, "
                f"shorten the prompt or raise num_pages"
            )
        req = _Sequence(id=rid, prompt=ids, sampling=sampling, budget=budget, prefill_ids=list(ids))
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request and free its pages; False if it is unknown or done.

        Its final delta (finish_reason "abort") comes from the next step().
        """
        req = self._requests.get(str(request_id))
        if req is None or req.state == _DONE:
            return False
        if req.state == _WAITING:
            self._waiting.remove(req)
        else:
            del self._running[req.id]
        self._release(req)
        self.counters.totals["num_requests_aborted"] += 1
        self._aborted.append(self._finish(req, "abort", time.perf_counter()))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted or self._inflight)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once); outputs in prompt order. A max_tokens
        cut to fit max_seq_len is said in a warning (the first three, then a count)."""
        sampling = normalize_sampling(sampling, len(prompts))
        checked = [check_request(self.target.config.vocab_size, self.max_seq_len, p, sp, index=i)
                   for i, (p, sp) in enumerate(zip(prompts, sampling))]  # all checked before any is queued
        cuts = [(i, m) for i, (p, sp) in enumerate(zip(checked, sampling))
                if (m := cap_message(len(p), sp.max_tokens, self.max_seq_len))]
        for i, message in cuts[:3]:
            logger.warning("prompt %d: %s", i, message)
        if len(cuts) > 3:
            logger.warning("... and for %d more prompts", len(cuts) - 3)
        ids = [self._queue(p, sp, None) for p, sp in zip(checked, sampling)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for delta in self.step():
                if delta.finished:
                    done[delta.request_id] = delta.output
        return [done[i] for i in ids]

    def stats(self) -> dict:
        """Counters and gauges for monitoring (see serving's /metrics)."""
        return {"num_waiting": len(self._waiting), "num_running": len(self._running),
                "num_pages": self._alloc.num_usable, "num_free_pages": self._alloc.num_free,
                "page_size": self.page_size, **self.counters.stats(), **self.policy.stats()}

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Admit, launch one prefill chunk batch and one decode step, and return the news.

        With `overlap` (the default) the news is that of the previous iteration's programs, read
        while this iteration's run on the device, so host work (admission, page growth, block
        tables, sampling arrays, detokenising callers) overlaps device work; without it, of this
        iteration's.
        """
        deltas, self._aborted = self._aborted, []
        start = time.perf_counter()
        self._admit()
        launches = []
        prefill_rows = self._prefill_rows()
        if prefill_rows:
            launches.append(self._launch_prefill(prefill_rows))
        self._grow_pages()
        decode_rows = [r for r in self._running.values() if r.state == _DECODE]
        if decode_rows:
            launches.append(self._launch_decode(decode_rows))
        ready, self._inflight = (self._inflight, launches) if self.overlap else (launches, [])
        news, waited = self._collect(ready)
        self.counters.totals["host_seconds_total"] += time.perf_counter() - start - waited
        self.counters.totals["num_iterations_total"] += 1
        return deltas + news

    def _admit(self) -> None:
        reserve = sum(r.state == _DECODE for r in self._running.values())  # a page of growth each
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            need = pages_for(len(req.prefill_ids) + self.lookahead, self.page_size)
            if need + reserve > self._alloc.num_free:
                return
            self._waiting.popleft()
            req.slot = self._free_slots.pop()
            self._give_pages(req, need)
            req.state, req.computed, req.length = _PREFILL, 0, 0
            rows = len(self._running) + 1  # judged at the batch it joins, at the last decode width
            key = None if self._last_decode_key is None else (bucket(rows, 1, self.max_num_seqs), self._last_decode_key[1])
            req.with_draft = self.policy.admit(key, rows, len(req.prefill_ids), req.budget - len(req.output))
            self._sampling.set_row(req.slot, req.sampling)
            if req.admitted is None:
                req.admitted = time.perf_counter()
            self._running[req.id] = req

    def _prefill_rows(self) -> list[tuple[_Sequence, int]]:
        rows, budget = [], self.prefill_chunk
        for req in self._running.values():
            if req.state != _PREFILL:
                continue
            n = min(len(req.prefill_ids) - req.computed, self.prefill_chunk)
            if rows and n > budget:
                break
            rows.append((req, n))
            budget -= n
            if budget <= 0:
                break
        return rows

    def _give_pages(self, req: _Sequence, n: int) -> None:
        pages = self._alloc.allocate(n)
        self._tables[req.slot, len(req.pages): len(req.pages) + n] = pages
        req.pages += pages

    def _grow_pages(self) -> None:
        """Give every decoding request pages for its next step, preempting the newest when short."""
        for req in list(self._running.values()):
            if req.state != _DECODE:
                continue
            step_tokens, lookahead = self.policy.reserve(req.with_draft)
            unread = req.pending * step_tokens  # committed by launched steps not read yet
            need = min(pages_for(req.length + unread + lookahead, self.page_size),
                       self.max_pages_per_seq) - len(req.pages)
            while need > self._alloc.num_free and req.state == _DECODE:
                self._preempt(next(reversed(self._running.values())))
            if req.state == _DECODE and need > 0:
                self._give_pages(req, need)

    def _preempt(self, req: _Sequence) -> None:
        del self._running[req.id]
        self._release(req)
        req.state = _WAITING
        req.prefill_ids = req.prompt + req.output
        req.num_preemptions += 1
        self.counters.totals["num_preemptions"] += 1
        self._waiting.appendleft(req)

    def _release(self, req: _Sequence) -> None:
        """Free a request's pages and slot. Programs launched before still write them, but every
        later program runs after those on the device, so the next owner sees its own data."""
        self._alloc.free(req.pages)
        if req.slot is not None:
            self._tables[req.slot] = kv_cache.SCRATCH_PAGE
            self._free_slots.append(req.slot)
        req.pages, req.computed, req.length, req.slot, req.pending, req.gap = [], 0, 0, None, 0, 0
        req.epoch += 1

    def _batch(self, rows: Sequence[_Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """(state slots [batch], block table [batch, width]) of `rows`, padded to the batch bucket
        with the scratch slot (whose table is all scratch page)."""
        batch = bucket(len(rows), 1, self.max_num_seqs)
        slots = np.full((batch,), self.max_num_seqs, np.int32)
        slots[: len(rows)] = [r.slot for r in rows]
        width = bucket(max(len(r.pages) for r in rows), MIN_PAGES_BUCKET, self.max_pages_per_seq)
        return slots, self._tables[slots, :width]

    def _launch(self, kind: str, plan_shape, block_table: np.ndarray, *args):
        """Launch a program (first telling the followers of a multi-host leader)."""
        if self._leader is not None:
            self._leader.launched(kind, plan_shape, block_table, args)
        return self._executor.execute(kind, plan_shape, block_table, *args)

    # ---- multi-host serving ----------------------------------------------------------------------
    def lead(self) -> None:
        """Make this (process 0's) scheduler send every step to the followers (multi-host serving:
        only process 0 takes requests; see lockstep.py). Call `release_followers` when done."""
        self._leader = lockstep.Leader()

    def release_followers(self) -> None:
        """Leader: tell every follower's `follow` to return (idempotent)."""
        if self._leader is not None:
            self._leader.release()
            self._leader = None

    def follow(self) -> int:
        """Follower (process > 0): run the leader's step programs on this process's shards, in the
        leader's order, until it calls `release_followers`. Returns the number of steps run."""
        return lockstep.follow(self._executor)

    # ---- launches ------------------------------------------------------------------------------
    def _launch_prefill(self, rows: list[tuple[_Sequence, int]]) -> _Launch:
        """Launch the next prompt chunks; a request whose prompt ends here decodes from now on."""
        slots, block_table = self._batch([r for r, _ in rows])
        batch = len(slots)
        t = bucket(max(n for _, n in rows), MIN_CHUNK_BUCKET, max(self.prefill_chunk, MIN_CHUNK_BUCKET))
        tokens = np.zeros((batch, t), np.int32)
        n_valid = np.ones((batch,), np.int32)
        following = np.full((batch,), -1, np.int32)
        lengths = np.zeros((batch,), np.int32)
        counter = np.zeros((batch,), np.int32)
        sp = self._sampling.rows(slots)
        for i, (req, n) in enumerate(rows):
            c = req.computed
            tokens[i, :n] = req.prefill_ids[c: c + n]
            n_valid[i], lengths[i], counter[i] = n, c, len(req.output)
            if c + n < len(req.prefill_ids):  # not the prompt's last chunk: its first token is not kept
                following[i] = req.prefill_ids[c + n]
                slots[i] = self.max_num_seqs
        launched_rows = [(req, req.epoch, following[i] < 0) for i, (req, _) in enumerate(rows)]
        # With the draft when any row has it (a row without it then has a draft cache it never uses).
        with_draft = any(r.with_draft for r, _ in rows)
        compiles, launched = self.programs.num_compiles, time.perf_counter()
        outputs = self._launch("prefill" if with_draft else "plain_prefill", None, block_table, tokens, lengths,
                               n_valid, following, slots, sp, counter)
        for req, n in rows:
            req.computed += n
            req.length = req.computed
            if req.computed == len(req.prefill_ids):
                req.state = _DECODE
        self.counters.totals["prompt_tokens_total"] += int(n_valid[: len(rows)].sum())
        return _Launch("prefill", launched_rows, outputs, key=(batch, t), launched=launched, compiles=compiles,
                       with_draft=with_draft, tokens=int(n_valid[: len(rows)].sum()))

    def _launch_decode(self, rows: list[_Sequence]) -> _Launch:
        slots, block_table = self._batch(rows)
        self._last_decode_key = block_table.shape
        plan = self.policy.plan(rows, block_table.shape)
        if plan.catch_up:
            self._launch("catch_up", None, block_table, slots)
        for req in rows:
            req.pending += 1
        prompt_lens = np.zeros((len(slots),), np.int32)
        prompt_lens[: len(rows)] = [len(r.prompt) for r in rows]
        compiles, launched = self.programs.num_compiles, time.perf_counter()
        outputs = self._launch(plan.program, plan.shape, block_table, slots, prompt_lens, self._sampling.rows(slots))
        # A step after a catch-up starts when the catch-up ends, which the host does not see.
        return _Launch("decode", [(r, r.epoch, True) for r in rows], outputs, plan, block_table.shape, launched,
                       plan.catch_up, compiles)

    # ---- results -------------------------------------------------------------------------------
    def _collect(self, launches: list[_Launch]) -> tuple[list[RequestDelta], float]:
        """Read launched programs' outputs, in launch order -> (deltas, seconds spent waiting)."""
        if self._leader is not None and launches:
            self._leader.reading(len(launches))
        deltas, waited = [], 0.0
        for launch in launches:
            start = time.perf_counter()
            outputs = self._executor.read(launch.outputs)
            now = time.perf_counter()
            waited += now - start
            # Results of requests preempted, aborted or finished since the launch are void.
            rows = [(i, req) for i, (req, epoch, final) in enumerate(launch.rows) if final and req.epoch == epoch]
            if launch.kind == "prefill":
                self.policy.observe_prefill(launch.with_draft, launch.key, launch.tokens, self._step_seconds(launch, now))
                deltas += [self._emit(req, outputs[0][i: i + 1], now) for i, req in rows]
            else:
                deltas += self._collect_decode(launch, rows, *outputs, now)
            self._last_read = now
        return deltas, waited

    def _step_seconds(self, launch: _Launch, now: float) -> float | None:
        """What a program cost the serving loop: the wall time since the previous program's
        outputs were read (the previous step's, or a prefill's of the same iteration), or since
        its launch if later (an idle loop), so host work the device did not hide counts too. None
        when a program compiled meanwhile (the host was busy compiling) or after a catch-up."""
        if launch.untimed or self.programs.num_compiles != launch.compiles:
            return None
        return now - max(launch.launched, self._last_read)

    def _collect_decode(self, launch: _Launch, rows: list[tuple[int, _Sequence]], out: np.ndarray,
                        count: np.ndarray, now: float) -> list[RequestDelta]:
        plan = launch.plan
        index = np.fromiter((i for i, _ in rows), np.int64, len(rows))
        counts = count[index]
        self.policy.observe(plan, launch.key, self._step_seconds(launch, now),
                            {req.id: int(k) - 1 for (_, req), k in zip(rows, counts) if req.with_draft})
        self.counters.decode_step(counts, plan.depth)
        deltas = []
        for (i, req), k in zip(rows, counts.tolist()):
            req.pending -= 1
            req.length += k
            req.record_step(k, plan.depth, plan.draft_passes)
            deltas.append(self._emit(req, out[i, :k], now))
        return deltas

    def _emit(self, req: _Sequence, tokens: np.ndarray, now: float) -> RequestDelta:
        """Hand out a step's tokens (up to a stop token or the budget); finish the request if done."""
        before = len(req.output)
        reason = req.emit(tokens.tolist(), now)
        self.counters.totals["generation_tokens_total"] += len(req.output) - before
        if reason is None:
            return RequestDelta(req.id, req.unsent(), now, False, None, None)
        del self._running[req.id]
        self._release(req)
        self.counters.totals["num_requests_finished"] += 1
        return self._finish(req, reason, now)

    def _finish(self, req: _Sequence, reason: str, now: float) -> RequestDelta:
        req.state, req.finish_reason = _DONE, reason
        del self._requests[req.id]
        self.policy.finished(req.id, len(req.output))
        return RequestDelta(req.id, req.unsent(), now, True, reason, req.output_record(now, self.policy.max_accept))
