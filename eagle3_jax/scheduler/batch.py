"""The running batch: requests waiting and running, their state slots and KV pages.

Admission (first-come first-served while a slot is free and the prompt's pages fit), the next
prefill chunks, page growth before each decode step, preemption of the newest request when pages
run short, release, and a batch's state slots and block table. Block tables and sampling
settings and prompt lengths are kept per state slot (slot_table.py), so a batch's are one gather
by its slots.

With prefix caching (cache.pages.PrefixCache), a request admitted takes the cached pages of
its longest cached prefix and prefills only the rest (pages of it on the host tier, when there is
one, are copied into pages allocated for them: shard_pages.py). A page is cached only when its contents are
final and named by its key: a request's prompt pages once the prefill chunk that completes them
is launched (`cache_prefilled`: every later program runs after it), the rest of its committed
pages when it leaves the batch (`release`). A page's key covers the
token after it, because the draft's last slot of the page pairs the target's feature there with
that token; pages whose draft slots a request did not write (no draft, or pairs an adaptive
request has not caught up on) are cached target-only, for requests without the draft. A request
never writes below the length it was admitted with, so a shared page is never written; nothing a
step computed beyond its committed tokens (rejected draft tokens, tree scratch) is in a page
that gets cached. Requests with penalties or prompt logprobs read every prompt token, so they
compute their prompt whole (they still leave their pages to the cache).

On a mesh with a `data` axis of D shards (data-parallel attention), the pool's pages are split in
D equal shares and each request lives on one shard: its pages come from that shard's allocator
(and prefix cache), and in every batch its row lies in that shard's D-th of the rows
(`rows_batch` places them; `positions` says where each request's row is). A request joins the
shard with a free row where the longest prefix of it is cached, else the one with the most free
pages; a shard short of pages preempts its own newest request.

A request whose prompt + max tokens reaches `spread_len` tokens is spread over every shard instead
(context-parallel decode, cache/spread.py): its logical page j comes from shard j mod D, and in
every batch it has a row at the same place in each shard's part, all on its one state slot (rows
sharing a slot are the same request). It needs a free row and its pages' share on every shard;
it neither takes nor leaves prefix-cache pages; a shard short of pages may preempt it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Callable, Sequence

import numpy as np

from ..cache.pages import PageAllocator, page_keys, pages_for
from ..request import Request
from ..sampling.sampler import GREEDY_BATCH, BatchFeatures
from ..spec_decode.policy import SpeculationPolicy
from .metrics import SchedulerCounters
from .shard_pages import SPREAD, CachedPrefix, ShardPages
from .slot_table import BatchRows, SlotTable

logger = logging.getLogger(__name__)

MIN_PAGES_BUCKET = 4
# From this block-table width on (pages), widths also step through 1.5x each power of two: a decode
# step attends over every slot of its width, and at its widest row just past a power of two a
# doubling would make most of the step padding (at batch 64 the widest row nearly always is).
HALF_OCTAVE_WIDTHS_FROM = 16
MIN_CHUNK_BUCKET = 16
PREFILL_CHUNK = 256  # prompt tokens a step prefills by default (Scheduler, Engine)


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def buckets(lo: int, hi: int) -> list[int]:
    """Every value `bucket(n, lo, hi)` takes, ascending."""
    values, b = [], lo
    while b < hi:
        values.append(b)
        b *= 2
    return values + [hi]


def width_buckets(lo: int, hi: int) -> list[int]:
    """Every block-table width (pages) `width_bucket(n, lo, hi)` takes, ascending: the powers of two
    from `lo`, and from HALF_OCTAVE_WIDTHS_FROM on 1.5x each of them too, capped at `hi`."""
    values, b = [], lo
    while b < hi:
        values.append(b)
        if b >= HALF_OCTAVE_WIDTHS_FROM and b + b // 2 < hi:
            values.append(b + b // 2)
        b *= 2
    return values + [hi]


def width_bucket(n: int, lo: int, hi: int) -> int:
    """The block-table width (pages) of a batch whose widest row holds `n` pages (see width_buckets)."""
    return next((w for w in width_buckets(lo, hi) if w >= n), hi)


def chunk_cap(prefill_chunk: int) -> int:
    """The largest prefill chunk bucket (tokens per row)."""
    return max(prefill_chunk, MIN_CHUNK_BUCKET)


def prefill_fits(batch: int, chunk: int, prefill_chunk: int) -> bool:
    """Whether a prefill batch of these buckets (rows, tokens per row) may run: at most twice the
    step's token budget in positions, padding included, so short prompts batched beside a long one
    do not multiply the work (and the prefill shapes stay few enough to compile ahead)."""
    return batch == 1 or batch * chunk <= 2 * chunk_cap(prefill_chunk)


WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"


@dataclasses.dataclass(eq=False, slots=True)
class ScheduledRequest(Request):
    """A request and where it stands in the scheduler."""

    state: str = WAITING
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the next prefill computes
    computed: int = 0  # tokens of prefill_ids already in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    # State slot: last token and draft root on device; committed length, steps launched and not
    # read, step log on the host, in `table` (the running batch's slot table, set at admission).
    slot: int | None = None
    table: SlotTable | None = None
    gap: int = 0  # steps since the draft last saw this request's tokens (adaptive speculation)
    with_draft: bool = True  # the draft follows it (adaptive speculation may admit a request without)
    wait_for: "ScheduledRequest | None" = None  # admitted once this one's prompt is prefilled (n > 1 choices)
    seat: int = 0  # its place in admission order (the running batch's, from its latest admission)
    page_keys: list = dataclasses.field(default_factory=list)  # prefix-cache keys of its full pages so far
    shard: int = 0  # the data shard holding its pages (data-parallel attention), or SPREAD

    def keys(self, tokens: Sequence[int], page_size: int, num_pages: int) -> list:
        """The keys of its first `num_pages` full pages (`tokens`: its sequence, which only grows,
        so keys computed once stay valid)."""
        if len(self.page_keys) < num_pages:
            self.page_keys = page_keys(tokens, page_size, num_pages, self.page_keys)
        return self.page_keys[:num_pages]

    @property
    def length(self) -> int:
        """Committed cache slots (0 without a state slot)."""
        return 0 if self.slot is None else int(self.table.length[self.slot])

    @property
    def reads_whole_prompt(self) -> bool:
        """Penalties and prompt logprobs read every prompt token: no prefix may be skipped."""
        sp = self.sampling
        return (sp.prompt_logprobs is not None or sp.repetition_penalty != 1 or sp.frequency_penalty != 0
                or sp.presence_penalty != 0)


class RunningBatch:
    """Who holds a state slot and pages, who waits, and the per-slot tables (see the module doc)."""

    def __init__(self, policy: SpeculationPolicy, counters: SchedulerCounters, *, max_num_seqs: int,
                 page_size: int, num_pages: int, max_pages_per_seq: int, lookahead: int, prefix_caching: bool = False,
                 data_shards: int = 1, spread_len: int | None = None):
        self.policy, self.counters = policy, counters
        self.max_num_seqs, self.page_size, self.lookahead = max_num_seqs, page_size, lookahead
        self.max_pages_per_seq = max_pages_per_seq
        self.shards, self.rows_per_shard = data_shards, max_num_seqs // data_shards
        self.pages = ShardPages(num_pages, data_shards, prefix_caching, spread_len)
        self.allocs = self.pages.allocs
        if self.pages.spread_len is not None:
            logger.info("context-parallel decode: requests of %d tokens or more (prompt + max tokens) are spread over "
                     "the %d data shards", self.pages.spread_len, data_shards)
        scratch = max_num_seqs  # the state slot of padding rows
        self.free_slots = list(range(scratch - 1, -1, -1))
        self.table = SlotTable(scratch + 1, max_pages_per_seq)
        self.waiting: collections.deque[ScheduledRequest] = collections.deque()
        # Admission order: prefilling and decoding; and each of those apart, kept as requests
        # join, change state and leave, so that no step scans the batch to find them.
        self.running: dict[str, ScheduledRequest] = {}
        self.prefilling: dict[str, ScheduledRequest] = {}
        self.decoders: dict[str, ScheduledRequest] = {}
        self._decoding_slots: np.ndarray | None = None  # the decoders' state slots, until they change
        self._seats = itertools.count()
        self.last_decode_key: tuple | None = None  # (batch, width, features) of the last decode step's program

    def admit(self) -> None:
        """Admit waiting requests first-come first-served while a slot is free and their prompt's
        pages fit beside a page of growth for each decoding request (cached pages of their prefix
        taken, not allocated). A request waiting for another's prefill is passed over meanwhile."""
        if not self.waiting:
            return
        reserve = len(self.decoders)  # a page of growth each
        passed_over = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.wait_for is not None and req.wait_for.state in (WAITING, PREFILL):
                passed_over.append(self.waiting.popleft())
                continue
            # Judged with the draft's pages (fewer hits) before the policy says whether it gets the draft.
            placed = self._place(req, reserve)
            if placed is None:
                break
            req.shard, cached = placed
            if req.shard == SPREAD:
                logger.info("request %s (%d prompt tokens, up to %d new) is spread over the %d data shards", req.id,
                         len(req.prompt), req.budget, self.shards)
            req.wait_for = None
            rows = len(self.running) + 1
            # Target-only pages serve a request without the draft too: the policy weighs both hits.
            plain = (self._cached_prefix(req, False, req.shard) if self.policy.chooses_draft and req.shard != SPREAD
                     else cached)
            with_draft = self.policy.admit(self._key_at(rows), rows, len(req.prefill_ids), req.budget - len(req.output),
                                           (len(cached) * self.page_size, len(plain) * self.page_size))
            if not with_draft:
                cached = plain
            self._count_hits(req, cached)
            need = pages_for(len(req.prefill_ids) + self.lookahead, self.page_size) - len(cached)
            self.waiting.popleft()
            req.slot, req.table = self.free_slots.pop(), self.table
            if cached.on_device:
                self.allocs[req.shard].hold(cached.on_device)
            req.state, req.computed = PREFILL, len(cached) * self.page_size
            self.table.admit(req.slot, len(req.prompt), req.sampling, length=req.computed,
                             reserve=self.policy.reserve(with_draft), budget=req.budget,
                             reads_tokens=req.reads_tokens, constrained=req.grammar is not None, shard=req.shard)
            req.pages = self.pages.take_prefix(req.shard, cached, req.page_keys) if cached else []
            self.table.set_pages(req.slot, 0, req.pages)
            self._give_pages(req, need)
            req.with_draft = with_draft
            if req.admitted is None:
                req.admitted = time.perf_counter()
            req.seat = next(self._seats)
            self.running[req.id] = self.prefilling[req.id] = req
        self.waiting.extendleft(reversed(passed_over))

    def _place(self, req: ScheduledRequest, reserve: int) -> tuple[int, list[int]] | None:
        """(data shard, cached pages of its prefix there) for a waiting request: of the shards with
        a free row whose pages fit it beside `reserve` pages of growth (one per decoding request,
        spread over the shards), the one with the longest cached prefix, then the most free pages;
        None when none fits."""
        if self.shards == 1:
            cached = self._cached_prefix(req, self.policy.uses_draft, 0)
            return None if self._pages_short(req, cached, reserve, self.allocs[0]) else (0, cached)
        rows = self.pages.per_shard(r.shard for r in self.running.values())
        growth = self.pages.per_shard(r.shard for r in self.decoders.values())
        if self.pages.spreads(len(req.prompt) + req.budget):
            pages = pages_for(len(req.prefill_ids) + self.lookahead, self.page_size)
            fits = rows.max() < self.rows_per_shard and self.pages.fits_spread(pages, growth)
            return (SPREAD, CachedPrefix()) if fits else None
        best = None
        for d, alloc in enumerate(self.allocs):
            if rows[d] >= self.rows_per_shard:
                continue
            cached = self._cached_prefix(req, self.policy.uses_draft, d)
            if not self._pages_short(req, cached, int(growth[d]), alloc):
                score = (len(cached), alloc.num_free)
                if best is None or score > best[0]:
                    best = (score, d, cached)
        return None if best is None else best[1:]

    def _cached_prefix(self, req: ScheduledRequest, with_draft: bool, shard: int) -> CachedPrefix:
        """A request's longest cached prefix on `shard` (draft-valid pages `with_draft`), on the
        device or the host tier. At least the prompt's last token is left to compute (its logits
        give the first token), and each page's key needs the token after it."""
        if self.allocs[shard].cache is None or req.reads_whole_prompt:
            return CachedPrefix()
        full = (len(req.prefill_ids) - 1) // self.page_size
        return self.pages.lookup(shard, req.keys(req.prefill_ids, self.page_size, full), with_draft)

    def _pages_short(self, req: ScheduledRequest, cached: CachedPrefix, reserve: int, alloc: PageAllocator) -> bool:
        """Whether the pages a request needs beyond `cached`'s device pages (and the cached ones
        nobody holds, which count as free) exceed `alloc`'s free pages less `reserve`."""
        on_device = cached.on_device
        need = pages_for(len(req.prefill_ids) + self.lookahead, self.page_size) - len(on_device)
        return need + sum(alloc.refs(p) == 0 for p in on_device) + reserve > alloc.num_free

    def _count_hits(self, req: ScheduledRequest, cached: CachedPrefix) -> None:
        """The prefix cache's hit-rate counters (tokens and requests; the host tier's part), at admission."""
        if self.allocs[0].cache is None:
            return
        if not req.num_preemptions:  # as first admitted (a recomputation after preemption is not the client's)
            req.num_cached_tokens = len(cached) * self.page_size
        totals = self.counters.totals
        totals["prefix_cache_queries_total"] += len(req.prefill_ids)
        totals["prefix_cache_hits_total"] += len(cached) * self.page_size
        totals["prefix_cache_requests_total"] += 1
        totals["prefix_cache_hit_requests_total"] += bool(cached)
        totals["prefix_cache_host_hits_total"] += len(cached.host_slots) * self.page_size

    def cache_pages(self, req: ScheduledRequest, tokens: list[int], valid: int, draft_valid: int) -> None:
        """Cache `req`'s full pages whose slots below `valid` hold the final K/V of `tokens` (as
        many tokens as the pages hold, plus the one after), draft-valid below `draft_valid`."""
        cache = self.allocs[req.shard].cache
        if cache is None or req.shard == SPREAD:
            return
        full = min(valid, len(tokens) - 1, len(req.pages) * self.page_size) // self.page_size
        for i, key in enumerate(req.keys(tokens, self.page_size, full)):
            cache.register(key, req.pages[i], (i + 1) * self.page_size <= draft_valid)

    def cache_prefilled(self, req: ScheduledRequest, with_draft: bool) -> None:
        """A prefill chunk of `req` was launched (`with_draft`: by the draft's program): the pages
        it completes hold their final K/V once it runs, before any later program reads them. The
        draft's last slot of the prompt pairs with the first generated token, so the page holding
        it waits for `release` (`cache_pages` keeps to pages whose next token is known)."""
        self.cache_pages(req, req.prefill_ids, req.computed, req.computed if with_draft and req.with_draft else 0)

    def prefill_rows(self, prefill_chunk: int) -> list[tuple[ScheduledRequest, int]]:
        """(request, prompt tokens) of the next prefill batch: chunks of up to `prefill_chunk`
        tokens, in admission order, while the batch's budget of `prefill_chunk` tokens lasts and its
        padded shape fits (`prefill_fits`). With data shards each shard has its own budget and the
        shape is one shard's (each runs its rows, padded to the most any shard has): a shard whose
        next request does not fit takes no more this step, the others go on."""
        if self.shards > 1:
            return self._shard_prefill_rows(prefill_chunk)
        rows, budget, longest = [], prefill_chunk, 0
        for req in self.prefilling.values():
            n = min(len(req.prefill_ids) - req.computed, prefill_chunk)
            longest = max(longest, n)
            if rows and (n > budget or not prefill_fits(bucket(len(rows) + 1, 1, self.max_num_seqs),
                                                        bucket(longest, MIN_CHUNK_BUCKET, chunk_cap(prefill_chunk)),
                                                        prefill_chunk)):
                break
            rows.append((req, n))
            budget -= n
            if budget <= 0:
                break
        return rows

    def _shard_prefill_rows(self, prefill_chunk: int) -> list[tuple[ScheduledRequest, int]]:
        """`prefill_rows` over data shards: per shard, in admission order, while its budget lasts
        and every shard's padded shape (the most rows of any shard x the longest chunk) fits."""
        rows, longest = [], 0
        budget, count, closed = [prefill_chunk] * self.shards, np.zeros(self.shards, np.int64), set()
        for req in self.prefilling.values():
            ds = list(range(self.shards)) if req.shard == SPREAD else [req.shard]  # a spread row is on every shard
            if closed.intersection(ds):
                continue
            n = min(len(req.prefill_ids) - req.computed, prefill_chunk)
            shape = (bucket(max(int(count.max()), int(count[ds].max()) + 1), 1, self.rows_per_shard),
                     bucket(max(longest, n), MIN_CHUNK_BUCKET, chunk_cap(prefill_chunk)))
            if rows and (any(n > budget[d] for d in ds) or not prefill_fits(*shape, prefill_chunk)):
                closed.update(ds)
                continue
            rows.append((req, n))
            longest = max(longest, n)
            for d in ds:
                budget[d], count[d] = budget[d] - n, count[d] + 1
                if budget[d] <= 0:
                    closed.add(d)
        return rows

    def _give_pages(self, req: ScheduledRequest, n: int) -> None:
        pages = self.pages.allocate(req.shard, len(req.pages), n)
        self.table.set_pages(req.slot, len(req.pages), pages)
        req.pages += pages

    def decoding(self) -> list[ScheduledRequest]:
        """The running requests past their prefill, in admission order."""
        return list(self.decoders.values())

    def decoding_slots(self) -> np.ndarray:
        """The state slots of `decoding()`'s requests, in its order (read only: kept until they change)."""
        if self._decoding_slots is None:
            self._decoding_slots = np.fromiter((r.slot for r in self.decoders.values()), np.int32, len(self.decoders))
        return self._decoding_slots

    def start_decoding(self, req: ScheduledRequest) -> None:
        """A prefilling request's last prompt chunk was launched: it decodes from the next step on,
        in its place in admission order (mostly the last: a request admitted before the newest
        decoder that is still prefilling has a long prompt)."""
        req.state = DECODE
        del self.prefilling[req.id]
        newest = next(reversed(self.decoders.values()), None)
        self.decoders[req.id], self._decoding_slots = req, None
        if newest is not None and newest.seat > req.seat:
            self.decoders = {k: r for k, r in self.running.items() if r.state == DECODE}

    def leave(self, req: ScheduledRequest) -> None:
        """A request leaves the queue or the batch (finished, aborted or preempted); a running one's
        pages and slot are released."""
        if req.state == WAITING:
            self.waiting.remove(req)
            return
        del self.running[req.id]
        if req.state == DECODE:
            del self.decoders[req.id]
            self._decoding_slots = None
        else:
            del self.prefilling[req.id]
        self.release(req)

    def grow_pages(self) -> list[ScheduledRequest]:
        """Give every decoding request pages for its next step, preempting the newest when short;
        returns the decoding requests then, in admission order. Who needs pages is found for the
        whole batch at once from the slot table (most steps: nobody)."""
        short, ends = self.table.short_of_pages(self.decoding_slots(), self.page_size)
        rows = self.decoding() if short else None
        for i, end in zip(short, ends):
            req = rows[i]
            need = min(pages_for(end, self.page_size), self.max_pages_per_seq) - len(req.pages)
            while req.state == DECODE and (short := self.pages.short(req.shard, len(req.pages), need)) is not None:
                self.preempt(next(r for r in reversed(self.running.values()) if r.shard in (short, SPREAD)))
            if req.state == DECODE and need > 0:
                self._give_pages(req, need)
        return self.decoding()

    def preempt(self, req: ScheduledRequest) -> None:
        """Back to the front of the queue, to be recomputed from prompt + output when readmitted."""
        self.leave(req)
        req.state = WAITING
        req.prefill_ids = req.prompt + req.output
        req.num_preemptions += 1
        self.counters.totals["num_preemptions"] += 1
        self.waiting.appendleft(req)

    def release(self, req: ScheduledRequest) -> None:
        """Free a request's pages and slot, leaving its final full pages to the prefix cache. The
        slot's generation moves on: what programs launched before computed for the request is void.
        Those programs still write its pages (beyond the committed length only, so never a cached
        page), but every later program runs after them on the device, so the next owner sees its
        own data."""
        # Committed: req.length slots, draft pairs up to length - gap. (The cache is checked here
        # too, so that leaving without one builds no list of the whole sequence.)
        if req.state == DECODE and req.shard != SPREAD and self.allocs[req.shard].cache is not None:
            draft_valid = req.length - req.gap if req.with_draft and self.policy.uses_draft else 0
            self.cache_pages(req, req.prompt + req.output, req.length, draft_valid)
        self.pages.free(req.shard, req.pages)
        if req.slot is not None:
            req.record_steps(*self.table.take_steps(req.slot))
            self.table.clear(req.slot)
            self.free_slots.append(req.slot)
        req.pages, req.computed, req.slot, req.gap = [], 0, None, 0

    def _key_at(self, rows: int) -> Callable[[int], tuple] | None:
        """For admission: the program key of the batch a request joins, of `rows` rows, once that
        request's context holds a given number of tokens (the block table as wide as its row or the
        widest running one). None before any decode step (no batch features known yet). Judged
        at the request's own context, not the last step's: a request admitted after a long one
        finished starts at its prompt's width, whatever width the last batch ended at."""
        if self.last_decode_key is None:
            return None
        batch, features = bucket(rows, 1, self.max_num_seqs), self.last_decode_key[2:]
        widest = int(self.table.num_pages[self.decoding_slots()].max(initial=0))

        def key_at(tokens: int) -> tuple:
            pages = max(widest, pages_for(tokens + self.lookahead, self.page_size))
            return (batch, width_bucket(pages, MIN_PAGES_BUCKET, self.max_pages_per_seq), *features)
        return key_at

    def rows_batch(self, row_slots: Sequence[int] | np.ndarray,
                   min_width: int = MIN_PAGES_BUCKET) -> tuple[BatchRows, np.ndarray | None]:
        """The slot-table rows of the requests in `row_slots` (slots, prompt lengths, sampling
        settings, block tables), padded to the batch bucket with the scratch slot's (all scratch
        page); the block tables' width is at least `min_width`. With data shards each request's
        row lies in its shard's D-th of the batch, a spread request's in every shard's (first, at
        the same place): returns the rows and each request's row (`positions`: a spread
        request's first; None when they are the first rows, in order)."""
        row_slots = np.asarray(row_slots, np.int32)
        n, positions = len(row_slots), None
        if self.shards == 1:
            batch = bucket(n, 1, self.max_num_seqs)
        else:
            shard = self.table.shard[row_slots]
            spread = shard == SPREAD
            first = int(spread.sum())  # spread rows take the first places of every shard's part
            counts = np.bincount(shard[~spread], minlength=self.shards)
            per_shard = bucket(first + int(counts.max(initial=1)), 1, self.rows_per_shard)
            batch = self.shards * per_shard
            rank = np.empty(n, np.int64)
            rank[spread] = np.arange(first)
            own = np.flatnonzero(~spread)
            order = own[np.argsort(shard[own], kind="stable")]
            rank[order] = first + np.arange(len(own)) - (np.cumsum(counts) - counts)[shard[order]]  # among its shard's
            positions = np.where(spread, 0, shard) * per_shard + rank
        slots = np.full((batch,), self.max_num_seqs, np.int32)
        slots[positions if positions is not None else slice(0, n)] = row_slots
        if positions is not None and first:
            for d in range(1, self.shards):  # the spread rows' replicas
                slots[d * per_shard: d * per_shard + first] = row_slots[spread]
        width = width_bucket(max(int(self.table.num_pages[slots].max()), min_width), MIN_PAGES_BUCKET,
                             self.max_pages_per_seq)
        return self.table.rows(slots, width), positions

    def padding_batch(self, batch: int, width: int, features: BatchFeatures = GREEDY_BATCH) -> BatchRows:
        """`batch` padding rows only (programs compiled ahead, warm-up), for batches of `features`."""
        return self.table.rows(np.full((batch,), self.max_num_seqs, np.int32), width, features)
