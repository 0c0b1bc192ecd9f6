"""Continuous batching over a paged KV cache: the serving scheduler.

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
4. runs one decode program over every decoding request: an EAGLE-3 step with a draft (draft
   expand, verify, accept, commit, draft extend, see spec/step.py), one token without, and hands
   back each request's new tokens. With adaptive speculation (`SpecConfig.auto`) the step's shape
   (no speculation, a chain of some length, a tree) is chosen per step from measured step times
   and running acceptance rates (spec/adaptive.py); a request admitted while speculation does not
   pay decodes without the draft, and a batch of such requests runs the plain programs.

Target and draft K/V live in page pools shared by all requests; a request owns a list of pages
(its block table) that indexes both, and a state slot that keeps, on device, its last token and
(with a draft) the draft's hidden state from which the next step proposes. Batch size, chunk length and block-table width are bucketed
to powers of two, so a few compiled programs serve every mix of requests; the scheduler keeps the
`max_compiled_programs` most recently used ones. A request's chunk
boundaries depend only on its own length, and prefill always uses the same attention form, so a
request's greedy tokens do not depend on what runs beside it.

Multi-host: every process must launch the same programs. Either every process drives an
identical request stream (the steps depend only on the requests), or process 0 alone takes
requests and calls `lead()`, sending each step's inputs to the other processes, which sit in
`follow()` and run the same programs on their devices (serving/lockstep.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import kv_cache
from .config import ModelConfig
from .draft import Draft, DraftConfig, with_target_kernels
from .engine import RequestOutput, bucket, check_request, check_speculation
from .page_allocator import PageAllocator, pages_for
from .sampling import SamplingArrays, SamplingParams, sample
from .sharding import mesh_context, replicate, to_host
from .spec.adaptive import AdaptiveSpeculation, AutoSpec, Shape, shape_depth, shape_name
from .spec.propose import DraftRoot, draft_extend
from .spec.step import spec_prefill, spec_step
from .spec.tree import SpecConfig
from .target import Target, forward

MIN_CHUNK_BUCKET = 16
MIN_PAGES_BUCKET = 4
DONATED = 2  # position of the DeviceState among a step program's dynamic arguments


class CapacityError(ValueError):
    """A request that can never fit in the KV cache, however long it waits."""


@dataclasses.dataclass
class RequestDelta:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new since this request's previous delta
    time: float  # time.perf_counter() when they reached the host
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    output: RequestOutput | None  # the whole output and metrics, once finished


def step_lookahead(spec: SpecConfig | AutoSpec | None) -> int:
    """Slots past the committed length that one step may write (tree nodes, draft extend + scratch)."""
    if spec is None:
        return 1
    if isinstance(spec, AutoSpec):  # a catch-up's writes past the stored pairs need no room (see _catch_up_program)
        return max(step_lookahead(s) for s in spec.shapes)
    return max(spec.num_draft_tokens, spec.max_accept + 1 + max(spec.num_steps - 1, 1) * spec.topk)


# ---- device programs -------------------------------------------------------------------------------


@struct.dataclass
class DeviceState:
    """What the step programs carry from step to step, on device (donated to each program).

    KV page pools of the target and the draft, and per state slot (one per running request, the
    last one scratch for padding rows): the committed cache length, the last emitted token (the
    next step's root) and, with a draft, the draft's output hidden from which the next step
    proposes. Keeping them on device lets the host launch a step before reading the previous one.
    """

    tk: jax.Array
    tv: jax.Array
    dk: jax.Array | None
    dv: jax.Array | None
    length: jax.Array  # [S + 1] int32
    last_token: jax.Array  # [S + 1] int32
    draft_hidden: jax.Array | None  # [S + 1, H]
    # Adaptive speculation: (target feature, next token) pairs of steps that did not speculate,
    # which the draft has not seen yet (spec/adaptive.py).
    gap: jax.Array | None = None  # [S + 1] int32
    gap_features: jax.Array | None = None  # [S + 1, max_gap, 3 * target hidden]
    gap_tokens: jax.Array | None = None  # [S + 1, max_gap] int32

    def target_cache(self, block_table, lengths) -> kv_cache.KVCache:
        return kv_cache.paged_view(self.tk, self.tv, block_table, lengths)

    def draft_cache(self, block_table, lengths) -> kv_cache.KVCache:
        return kv_cache.paged_view(self.dk, self.dv, block_table, lengths)


def _prefill_program(tcfg: ModelConfig, dcfg: DraftConfig | None, tparams: dict, dparams: dict | None,
                     state: DeviceState, block_table, tokens, lengths, n_valid, following, slots,
                     sp: SamplingArrays, counter):
    """One prompt chunk per row after its cached prefix (`lengths`) -> (first token, state).

    Rows whose chunk ends the prompt store their length, first token (and draft root) in state
    slot `slots[i]`; the others pass the scratch slot. Prefill always uses the expanded MLA form,
    whatever the chunk length, so numerics do not depend on the batch's bucket.
    """
    tcache = state.target_cache(block_table, lengths)
    length = state.length.at[slots].set(lengths + n_valid)
    if state.gap is not None:  # the prefill extends the draft over the whole prompt
        state = state.replace(gap=state.gap.at[slots].set(0))
    if dcfg is None:
        t = tokens.shape[1]
        positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        logits, _, tcache = forward(tparams, tcfg, tokens, positions, tcache, absorb=False)
        last = jnp.take_along_axis(logits, (n_valid - 1)[:, None, None], axis=1)[:, 0]
        first = sample(last, sp, counter)
        return first, state.replace(tk=tcache.k, tv=tcache.v, length=length, last_token=state.last_token.at[slots].set(first))
    first, tcache, dcache, root = spec_prefill(tparams, tcfg, dparams, dcfg, tcache, state.draft_cache(block_table, lengths),
                                               tokens, n_valid, sp, counter, following, absorb=False)
    return first, state.replace(tk=tcache.k, tv=tcache.v, dk=dcache.k, dv=dcache.v, length=length,
                                last_token=state.last_token.at[slots].set(root.token),
                                draft_hidden=state.draft_hidden.at[slots].set(root.hidden))


def _decode_program(tcfg: ModelConfig, dcfg: DraftConfig | None, shape: Shape, tparams: dict,
                    dparams: dict | None, state: DeviceState, block_table, slots, prompt_lens, sp: SamplingArrays):
    """One decode step per row from its state slot -> (tokens [B, D+1] (-1 padded), counts [B], state).

    `shape` is the step's speculation. None with a draft (adaptive speculation): one token per row
    and no draft work; the row's (feature, next token) pair is stored for the draft (whose stored
    pairs `_catch_up_program` runs through before the next speculative step, or when a buffer is
    full). A row's sampling counter (tokens generated so far) is its committed length - prompt
    length + 1.
    """
    live = slots < state.length.shape[0] - 1  # padding rows use the scratch slot
    lengths = jnp.where(live, state.length[slots], 0)
    counter = jnp.where(live, lengths - prompt_lens + 1, 0)
    tcache = state.target_cache(block_table, lengths)
    if dcfg is None:
        logits, _, tcache = forward(tparams, tcfg, state.last_token[slots][:, None], lengths[:, None], tcache)
        nxt = sample(logits[:, 0], sp, counter)
        count = jnp.ones_like(nxt)
        return nxt[:, None], count, state.replace(tk=tcache.k, tv=tcache.v, length=state.length.at[slots].set(lengths + count),
                                                  last_token=state.last_token.at[slots].set(nxt))
    if shape is None:
        return _store_for_draft(tparams, tcfg, state, tcache, slots, lengths, sp, counter)
    root = DraftRoot(token=state.last_token[slots], hidden=state.draft_hidden[slots])
    dcache = state.draft_cache(block_table, lengths)
    out, count, tcache, dcache, root, _ = spec_step(tparams, tcfg, dparams, dcfg, shape, tcache, dcache, root, sp,
                                                    counter)
    return out, count, state.replace(tk=tcache.k, tv=tcache.v, dk=dcache.k, dv=dcache.v,
                                     length=state.length.at[slots].set(lengths + count),
                                     last_token=state.last_token.at[slots].set(root.token),
                                     draft_hidden=state.draft_hidden.at[slots].set(root.hidden))


def _store_for_draft(tparams: dict, tcfg: ModelConfig, state: DeviceState, tcache: kv_cache.KVCache, slots, lengths,
                     sp: SamplingArrays, counter):
    """A step without speculation or draft work: one target token per row; the pair (its target
    feature, the sampled next token) waits in the row's gap buffer for `_catch_up_program`."""
    logits, aux, tcache = forward(tparams, tcfg, state.last_token[slots][:, None], lengths[:, None], tcache)
    nxt = sample(logits[:, 0], sp, counter)
    gap = state.gap[slots]  # < max_gap: the host has a full buffer caught up first
    count = jnp.ones_like(nxt)
    return nxt[:, None], count, state.replace(
        tk=tcache.k, tv=tcache.v, length=state.length.at[slots].set(lengths + count),
        last_token=state.last_token.at[slots].set(nxt), gap=state.gap.at[slots].set(gap + 1),
        gap_features=state.gap_features.at[slots, gap].set(aux[:, 0].astype(state.gap_features.dtype)),
        gap_tokens=state.gap_tokens.at[slots, gap].set(nxt))


def _catch_up_program(tcfg: ModelConfig, dcfg: DraftConfig, tparams: dict, dparams: dict, state: DeviceState,
                      block_table, slots) -> tuple[DeviceState]:
    """Extend the draft over each row's stored (feature, token) pairs: from its cache at length -
    gap, in one draft pass; rows without pairs keep their draft hidden. Slots written past a row's
    pairs lie beyond its committed length (in its own pages, the scratch page, or past the table,
    where writes are dropped), so they need no room reserved."""
    live = slots < state.length.shape[0] - 1
    lengths = jnp.where(live, state.length[slots], 0)
    gap = jnp.where(live, state.gap[slots], 0)
    _, hidden, dcache = draft_extend(dparams, dcfg, state.draft_cache(block_table, lengths - gap),
                                     state.gap_features[slots], state.gap_tokens[slots], gap)
    hidden = jnp.where((gap > 0)[:, None], hidden, state.draft_hidden[slots])
    return (state.replace(dk=dcache.k, dv=dcache.v, draft_hidden=state.draft_hidden.at[slots].set(hidden),
                          gap=state.gap.at[slots].set(0)),)


# "plain_" programs run without the draft (for requests adaptive speculation admitted without it), on
# the state without these arrays (the gap counts stay: a plain prefill zeroes its slot's).
_DRAFT_STATE = ("dk", "dv", "draft_hidden", "gap_features", "gap_tokens")
_PROGRAMS = {"prefill": _prefill_program, "decode": _decode_program, "catch_up": _catch_up_program,
             "plain_prefill": _prefill_program, "plain_decode": _decode_program}


class ProgramCache:
    """Compiled step programs by shape key; beyond `capacity` the least recently used is dropped.

    Why bounded: an XLA:CPU executable maps a few memory regions per kernel (hundreds per step
    program) and a Linux process may hold about 65k (vm.max_map_count), so keeping every bucket's
    program of a long-lived server forever can crash it. Each program is traced through its own
    wrapper function, so JAX's tracing and compilation caches (keyed weakly on the function) let
    go of it once it is dropped here, and its mappings are freed.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self.num_compiles = 0

    def __len__(self) -> int:
        return len(self._programs)

    def run(self, fn, static: tuple, key: tuple, *args):
        """fn(*static, *args) jitted with args[DONATED] donated, compiled once per key.

        Keys must pin every argument's shape.
        """
        program = self._programs.get(key)
        if program is None:
            program = jax.jit(functools.partial(fn, *static), donate_argnums=(DONATED,))
            self.num_compiles += 1
            self._programs[key] = program
            while len(self._programs) > self.capacity:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        return program(*args)


# ---- host-side request state -----------------------------------------------------------------------

_WAITING, _PREFILL, _DECODE, _DONE = "waiting", "prefill", "decode", "done"


@dataclasses.dataclass
class _Launch:
    """A step program launched on the device, its outputs not read yet."""

    kind: str  # "prefill" | "decode"
    rows: list  # (request, its epoch at launch, prefill: whether the chunk ends its prompt)
    outputs: list  # device arrays
    shape: Shape = None
    key: tuple = ()
    launched: float = 0.0
    untimed: bool = False  # after a catch-up, whose end the host does not see: not timed
    compiles: int = 0  # programs compiled before it was launched
    plain: bool = False  # a program without the draft (no row had it)
    tokens: int = 0  # prefill: prompt tokens computed


@dataclasses.dataclass
class _Request:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    budget: int  # most tokens it may generate
    arrival: float
    state: str = _WAITING
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the next prefill computes
    computed: int = 0  # tokens of prefill_ids already in the cache
    length: int = 0  # committed cache slots
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None  # state slot: last token and draft root, on device
    output: list[int] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    accept_lengths: list[int] = dataclasses.field(default_factory=list)  # tokens emitted per decode step
    step_depths: list[int] = dataclasses.field(default_factory=list)  # draft depth of each decode step's shape
    draft_passes: int = 0
    pending: int = 0  # decode steps launched but not read yet
    gap: int = 0  # steps since the draft last saw this request's tokens (adaptive speculation)
    with_draft: bool = True  # the draft follows it (adaptive speculation may admit a request without)
    epoch: int = 0  # bumped when the request leaves the running batch: results launched before are void
    sent: int = 0  # tokens already handed out in deltas
    admitted: float | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None


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
        self.draft = None if draft is None else with_target_kernels(draft, target)
        self.max_num_seqs = int(max_num_seqs)
        self.max_seq_len = int(max_seq_len)
        self.page_size = int(page_size)
        self.prefill_chunk = int(prefill_chunk)
        self.lookahead = step_lookahead(self.spec)
        self.overlap = bool(overlap)
        # Cache slots one step may commit; with overlap a step launches before the previous one
        # is read, so pages must cover one more step than the host has seen.
        self._step_tokens = self.spec.max_accept + 1 if self.spec else 1
        self._overshoot = self._step_tokens if self.overlap else 0
        # (slots one step commits, lookahead) by whether a request has the draft: one without it
        # (adaptive speculation) never speculates.
        self._reserve = {True: (self._step_tokens, self.lookahead), False: (1, step_lookahead(None))}
        self.max_pages_per_seq = pages_for(self.max_seq_len + self.lookahead + self._overshoot, self.page_size)
        if num_pages is None:
            num_pages = self.max_num_seqs * self.max_pages_per_seq + 1
        if not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is reserved); got {num_pages!r}")
        self._alloc = PageAllocator(int(num_pages))
        self._state = self._init_state(int(num_pages))
        self._free_slots = list(range(self.max_num_seqs - 1, -1, -1))  # slot max_num_seqs: scratch for padding rows
        self._adaptive = AdaptiveSpeculation(self.spec) if isinstance(self.spec, AutoSpec) else None
        self.programs = ProgramCache(int(max_compiled_programs))
        self._channel = None  # set by lead(): multi-host leader
        self._inflight: list[_Launch] = []  # launched last iteration, read in the next (overlap)
        self._last_read = 0.0  # when the host last had a program's outputs
        self._last_decode_key: tuple[int, int] | None = None  # (batch, width) buckets of the last decode step

        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # admission order: prefilling and decoding
        self._requests: dict[str, _Request] = {}
        self._aborted: list[RequestDelta] = []
        self._ids = itertools.count()
        self._counters = collections.Counter()
        depth = self.spec.max_accept if self.spec else 0
        self._per_position = np.zeros((depth,), np.int64)  # decode-step rows that accepted >= d draft tokens
        self._per_position_drafted = np.zeros((depth,), np.int64)  # ... whose shape drafted d tokens

    def _init_state(self, num_pages: int) -> DeviceState:
        """KV page pools (target, draft) and the state slots, placed on the target's mesh."""
        tcfg = self.target.config
        tk, tv = kv_cache.init_pages(tcfg, num_pages, self.page_size, self.target.dtype)
        dk = dv = hidden = None
        slots = self.max_num_seqs + 1
        if self.draft is not None:
            dk, dv = kv_cache.init_pages(self.draft.config.layers, num_pages, self.page_size, self.draft.dtype)
            hidden = np.zeros((slots, self.draft.config.hidden_size), self.draft.dtype)
        per_slot = (np.zeros((slots,), np.int32), np.zeros((slots,), np.int32), hidden)
        if self.target.mesh is not None:
            from .sharding import shard_pages

            tk, tv = shard_pages(tk, tv, tcfg, self.target.mesh)
            if dk is not None:
                dk, dv = shard_pages(dk, dv, self.draft.config.layers, self.target.mesh)
            per_slot = replicate(per_slot, self.target.mesh)
        else:
            per_slot = jax.tree.map(jnp.asarray, per_slot)
        length, last_token, hidden = per_slot
        gaps = {}
        if isinstance(self.spec, AutoSpec):
            width = len(tcfg.aux_layer_ids) * tcfg.hidden_size
            gaps = {"gap": np.zeros((slots,), np.int32),
                    "gap_features": np.zeros((slots, self.spec.max_gap, width), self.target.dtype),
                    "gap_tokens": np.zeros((slots, self.spec.max_gap), np.int32)}
            gaps = replicate(gaps, self.target.mesh) if self.target.mesh is not None else jax.tree.map(jnp.asarray, gaps)
        return DeviceState(tk=tk, tv=tv, dk=dk, dv=dv, length=length, last_token=last_token, draft_hidden=hidden, **gaps)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id.

        Raises ValueError for a bad prompt or sampling, a duplicate id, or a prompt that leaves no
        room within max_seq_len; CapacityError when it could never fit in the KV pages.
        """
        sampling = SamplingParams() if sampling is None else sampling
        ids = check_request(self.target.config.vocab_size, self.max_seq_len, prompt_ids, sampling)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        budget = min(sampling.max_tokens, self.max_seq_len - len(ids))
        need = pages_for(len(ids) + budget + self.lookahead + self._overshoot, self.page_size)
        if need > self._alloc.num_usable:
            raise CapacityError(
                f"a request of {len(ids)} prompt tokens + {budget} new tokens needs {need} KV pages of "
                f"{self.page_size} slots, but the cache has only {self._alloc.num_usable}; lower max_tokens, "
                f"shorten the prompt or raise num_pages"
            )
        req = _Request(id=rid, prompt=ids, sampling=sampling, budget=budget, arrival=time.perf_counter(),
                       prefill_ids=list(ids))
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
            self._running.remove(req)
        self._release(req)
        self._counters["num_requests_aborted"] += 1
        self._aborted.append(self._finish(req, "abort", time.perf_counter()))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted or self._inflight)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once); outputs in prompt order."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        for i, (p, sp) in enumerate(zip(prompts, sampling)):  # validate all before queueing any
            check_request(self.target.config.vocab_size, self.max_seq_len, p, sp, index=i)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for delta in self.step():
                if delta.finished:
                    done[delta.request_id] = delta.output
        return [done[i] for i in ids]

    def stats(self) -> dict:
        """Counters and gauges for monitoring (see serving's /metrics)."""
        c = self._counters
        steps = c["num_decode_steps_total"]
        adaptive = {"adaptive": self._adaptive.stats()} if self._adaptive is not None else {}
        return {
            "num_waiting": len(self._waiting),
            "num_running": len(self._running),
            "num_pages": self._alloc.num_usable,
            "num_free_pages": self._alloc.num_free,
            "page_size": self.page_size,
            "num_preemptions": c["num_preemptions"],
            "num_requests_finished": c["num_requests_finished"],
            "num_requests_aborted": c["num_requests_aborted"],
            "prompt_tokens_total": c["prompt_tokens_total"],
            "generation_tokens_total": c["generation_tokens_total"],
            "num_decode_steps_total": steps,
            "accepted_tokens_total": c["accepted_tokens_total"],
            "mean_accept_length": c["accepted_tokens_total"] / steps if steps else 1.0,
            "per_position_accepted_total": [int(x) for x in self._per_position],
            "per_position_drafted_total": [int(x) for x in self._per_position_drafted],
            "num_iterations_total": c["num_iterations_total"],
            "host_seconds_total": c["host_seconds_total"],  # step() time not spent waiting for the device
            **adaptive,
        }

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
        decode_rows = [r for r in self._running if r.state == _DECODE]
        if decode_rows:
            launches.append(self._launch_decode(decode_rows))
        ready, self._inflight = (self._inflight, launches) if self.overlap else (launches, [])
        news, waited = self._collect(ready)
        self._counters["host_seconds_total"] += time.perf_counter() - start - waited
        self._counters["num_iterations_total"] += 1
        return deltas + news

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            need = pages_for(len(req.prefill_ids) + self.lookahead, self.page_size)
            reserve = sum(r.state == _DECODE for r in self._running)
            if need + reserve > self._alloc.num_free:
                return
            self._waiting.popleft()
            req.pages = self._alloc.allocate(need)
            req.slot = self._free_slots.pop()
            req.state, req.computed, req.length = _PREFILL, 0, 0
            if self._adaptive is not None:
                req.with_draft = self._wants_draft(req)
            if req.admitted is None:
                req.admitted = time.perf_counter()
            self._running.append(req)

    def _wants_draft(self, req: _Request) -> bool:
        """Adaptive speculation's verdict on a request being admitted, judged at the batch it joins:
        every running request and it (a wave admitted at once after a quiet spell must not be
        judged by the last step's small batch), at the last decode step's block-table width."""
        rows = len(self._running) + 1
        key = None if self._last_decode_key is None else (bucket(rows, 1, self.max_num_seqs), self._last_decode_key[1])
        return self._adaptive.wants_draft(key, rows=rows, prompt_len=len(req.prefill_ids),
                                          max_tokens=req.budget - len(req.output))

    def _prefill_rows(self) -> list[tuple[_Request, int]]:
        rows, budget = [], self.prefill_chunk
        for req in self._running:
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

    def _grow_pages(self) -> None:
        """Give every decoding request pages for its next step, preempting the newest when short."""
        for req in list(self._running):
            if req.state != _DECODE:
                continue
            step_tokens, lookahead = self._reserve[req.with_draft]
            unread = req.pending * step_tokens  # committed by launched steps not read yet
            need = min(pages_for(req.length + unread + lookahead, self.page_size),
                       self.max_pages_per_seq) - len(req.pages)
            while need > self._alloc.num_free and req.state == _DECODE:
                self._preempt(self._running[-1])
            if req.state == _DECODE and need > 0:
                req.pages += self._alloc.allocate(need)

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self._release(req)
        req.state = _WAITING
        req.prefill_ids = req.prompt + req.output
        req.num_preemptions += 1
        self._counters["num_preemptions"] += 1
        self._waiting.appendleft(req)

    def _release(self, req: _Request) -> None:
        """Free a request's pages and slot. Programs launched before still write them, but every
        later program runs after those on the device, so the next owner sees its own data."""
        self._alloc.free(req.pages)
        if req.slot is not None:
            self._free_slots.append(req.slot)
        req.pages, req.computed, req.length, req.slot, req.pending, req.gap = [], 0, 0, None, 0, 0
        req.epoch += 1

    def _block_table(self, rows: Sequence[_Request], batch: int) -> np.ndarray:
        width = bucket(max(len(r.pages) for r in rows), MIN_PAGES_BUCKET, self.max_pages_per_seq)
        table = np.full((batch, width), kv_cache.SCRATCH_PAGE, np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r.pages)] = r.pages
        return table

    def _launch(self, kind: str, shape: Shape, block_table: np.ndarray, *args) -> list[jax.Array]:
        """Launch a step program on the device state (first sending its inputs to the followers of
        a multi-host leader); returns its outputs as device arrays, not waited for."""
        if self._channel is not None:
            self._channel.send((kind, shape, block_table, jax.tree.map(np.asarray, args)))
        return self._execute(kind, shape, block_table, *args)

    def _execute(self, kind: str, shape: Shape, block_table: np.ndarray, *args) -> list[jax.Array]:
        """Launch the `kind` step program (for decode, of speculation `shape`); the cache key is
        the kind, the shape and the bucketed array shapes."""
        with_draft = self.draft is not None and not kind.startswith("plain_")
        dcfg = self.draft.config if with_draft else None
        dparams = self.draft.params if with_draft else None
        static = (self.target.config, dcfg) if not kind.endswith("decode") else (self.target.config, dcfg, shape)
        key = (kind, shape, block_table.shape, np.shape(args[0]))
        state, held = self._state, {}
        if self.draft is not None and not with_draft:  # a plain program gets no draft arrays: fewer to dispatch
            held = {name: getattr(state, name) for name in _DRAFT_STATE}
            state = state.replace(**dict.fromkeys(_DRAFT_STATE))
        with mesh_context(self.target.mesh):
            *outs, state = self.programs.run(_PROGRAMS[kind], static, key, self.target.params, dparams, state,
                                             block_table, *args)
        self._state = state.replace(**held)
        return outs

    def _read(self, outputs: list[jax.Array]) -> list[np.ndarray]:
        # Every output is read, in order, on every process: reading a batch split over a
        # multi-host `data` axis is a collective (sharding.to_host).
        with mesh_context(self.target.mesh):
            return [to_host(o) for o in outputs]

    # ---- multi-host serving ----------------------------------------------------------------------
    def lead(self) -> None:
        """Make this (process 0's) scheduler send every step to the followers (multi-host serving:
        only process 0 takes requests; see serving/lockstep.py). Call `release_followers` when done."""
        from .serving.lockstep import StepChannel

        channel = StepChannel()
        if not channel.is_leader:
            raise RuntimeError("lead() is for process 0; the other processes call follow()")
        self._channel = channel

    def release_followers(self) -> None:
        """Leader: tell every follower's `follow` to return (idempotent)."""
        if self._channel is not None:
            self._channel.send(None)
            self._channel = None

    def follow(self) -> int:
        """Follower (process > 0): run the leader's step programs on this process's shards, in the
        leader's order, until it calls `release_followers`. Returns the number of steps run."""
        from .serving.lockstep import StepChannel

        channel, steps = StepChannel(), 0
        if channel.is_leader:
            raise RuntimeError("process 0 leads (lead()); follow() is for the other processes")
        unread: collections.deque[list[jax.Array]] = collections.deque()
        while (message := channel.receive()) is not None:
            if message[0] == "read":  # the leader reads the outputs of its oldest launches now
                for _ in range(message[1]):
                    self._read(unread.popleft())
                continue
            kind, shape, block_table, args = message
            outputs = self._execute(kind, shape, block_table, *args)
            if outputs:  # a catch-up returns nothing to read
                unread.append(outputs)
            steps += 1
        return steps

    def _launch_prefill(self, rows: list[tuple[_Request, int]]) -> _Launch:
        """Launch the next prompt chunks; a request whose prompt ends here decodes from now on."""
        batch = bucket(len(rows), 1, self.max_num_seqs)
        t = bucket(max(n for _, n in rows), MIN_CHUNK_BUCKET, max(self.prefill_chunk, MIN_CHUNK_BUCKET))
        tokens = np.zeros((batch, t), np.int32)
        n_valid = np.ones((batch,), np.int32)
        following = np.full((batch,), -1, np.int32)
        lengths = np.zeros((batch,), np.int32)
        counter = np.zeros((batch,), np.int32)
        slots = np.full((batch,), self.max_num_seqs, np.int32)  # scratch slot unless the prompt ends here
        launched_rows = []
        for i, (req, n) in enumerate(rows):
            c = req.computed
            tokens[i, :n] = req.prefill_ids[c: c + n]
            n_valid[i], lengths[i], counter[i] = n, c, len(req.output)
            final = c + n == len(req.prefill_ids)
            if final:
                slots[i] = req.slot
            else:
                following[i] = req.prefill_ids[c + n]
            launched_rows.append((req, req.epoch, final))
        sp = SamplingArrays.from_params([r.sampling for r, _ in rows], batch)
        # With the draft when any row has it (a row without it then has a draft cache it never uses).
        kind = "prefill" if any(r.with_draft for r, _ in rows) else "plain_prefill"
        compiles, launched = self.programs.num_compiles, time.perf_counter()
        outputs = self._launch(kind, None, self._block_table([r for r, _ in rows], batch), tokens, lengths,
                               n_valid, following, slots, sp, counter)
        for req, n in rows:
            req.computed += n
            req.length = req.computed
            self._counters["prompt_tokens_total"] += n
            if req.computed == len(req.prefill_ids):
                req.state = _DECODE
        return _Launch("prefill", launched_rows, outputs, key=(batch, t), launched=launched, compiles=compiles,
                       plain=kind == "plain_prefill", tokens=int(n_valid[: len(rows)].sum()))

    def _launch_decode(self, rows: list[_Request]) -> _Launch:
        batch = bucket(len(rows), 1, self.max_num_seqs)
        block_table = self._block_table(rows, batch)
        self._last_decode_key = block_table.shape
        with_draft = sum(r.with_draft for r in rows)
        # Adaptive speculation with no row followed by the draft: the plain program, nothing stored.
        plain = self._adaptive is not None and not with_draft
        shape = self._shape_for(rows, block_table.shape, with_draft)
        slots = np.full((batch,), self.max_num_seqs, np.int32)
        prompt_lens = np.zeros((batch,), np.int32)
        for i, req in enumerate(rows):
            slots[i], prompt_lens[i] = req.slot, len(req.prompt)
        # The draft catches up before it proposes, and when a row has no room left to store a pair.
        catch_up = self._adaptive is not None and not plain and any(
            r.gap >= self.spec.max_gap or (shape is not None and r.gap) for r in rows)
        if catch_up:
            self._launch("catch_up", None, block_table, slots)
        for req in rows:
            req.pending += 1
            if self._adaptive is not None and not plain:
                req.gap = 0 if shape is not None else (0 if catch_up else req.gap) + 1  # pairs stored
        sp = SamplingArrays.from_params([r.sampling for r in rows], batch)
        compiles, launched = self.programs.num_compiles, time.perf_counter()
        outputs = self._launch("plain_decode" if plain else "decode", shape, block_table, slots, prompt_lens, sp)
        # A step after a catch-up starts when the catch-up ends, which the host does not see.
        return _Launch("decode", [(r, r.epoch, True) for r in rows], outputs, shape, block_table.shape, launched,
                       catch_up, compiles, plain)

    def _collect(self, launches: list[_Launch]) -> tuple[list[RequestDelta], float]:
        """Read launched programs' outputs, in launch order -> (deltas, seconds spent waiting)."""
        if self._channel is not None and launches:
            self._channel.send(("read", len(launches)))
        deltas, waited = [], 0.0
        for launch in launches:
            start = time.perf_counter()
            outputs = self._read(launch.outputs)
            now = time.perf_counter()
            waited += now - start
            # Results of requests preempted, aborted or finished since the launch are void.
            rows = [(i, req) for i, (req, epoch, final) in enumerate(launch.rows) if final and req.epoch == epoch]
            if launch.kind == "prefill":
                if self._adaptive is not None:
                    self._adaptive.observe_prefill(not launch.plain, launch.key, launch.tokens,
                                                   self._step_seconds(launch, now))
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

    def _collect_decode(self, launch: _Launch, rows: list[tuple[int, _Request]], out: np.ndarray, count: np.ndarray,
                        now: float) -> list[RequestDelta]:
        depth = shape_depth(launch.shape)
        if self._adaptive is not None:
            accepted = {} if launch.plain else {req.id: int(count[i]) - 1 for i, req in rows if req.with_draft}
            self._adaptive.observe(launch.shape, launch.key, self._step_seconds(launch, now), accepted,
                                   plain=launch.plain)
        deltas = []
        for i, req in rows:
            k = int(count[i])
            req.pending -= 1
            req.length += k
            req.accept_lengths.append(k)
            req.step_depths.append(depth)
            req.draft_passes += launch.shape.num_steps if launch.shape is not None else 0
            self._counters["num_decode_steps_total"] += 1
            self._counters["accepted_tokens_total"] += k
            self._per_position[: k - 1] += 1
            self._per_position_drafted[:depth] += 1
            deltas.append(self._emit(req, out[i, :k], now))
        return deltas

    def _shape_for(self, rows: Sequence[_Request], key: tuple[int, int], with_draft: int) -> Shape:
        """The speculation shape of the next decode step: the fixed one, or the adaptive choice
        for these requests (`with_draft` of them followed by the draft) at this program key
        (batch bucket, block-table width)."""
        if self._adaptive is None:
            return self.spec
        if with_draft < len(rows):  # a row without the draft has pages for one token a step
            self._adaptive.no_choice(any_with_draft=with_draft > 0)
            return None
        return self._adaptive.choose([r.id for r in rows], key)

    # ---- output --------------------------------------------------------------------------------
    def _emit(self, req: _Request, tokens: np.ndarray, now: float) -> RequestDelta:
        """Append a step's tokens (up to a stop token or the budget); finish the request if done."""
        reason = None
        for tok in tokens:
            req.output.append(int(tok))
            req.token_times.append(now)
            self._counters["generation_tokens_total"] += 1
            if int(tok) in req.sampling.stop_token_ids:
                reason = "stop"
            elif len(req.output) >= req.budget:
                reason = "length"
            if reason:
                break
        if reason is None:
            new, req.sent = req.output[req.sent:], len(req.output)
            return RequestDelta(req.id, new, now, False, None, None)
        self._running.remove(req)
        self._release(req)
        self._counters["num_requests_finished"] += 1
        return self._finish(req, reason, now)

    def _finish(self, req: _Request, reason: str, now: float) -> RequestDelta:
        req.state, req.finish_reason = _DONE, reason
        del self._requests[req.id]
        if self._adaptive is not None:
            self._adaptive.finished(req.id, len(req.output))
        new, req.sent = req.output[req.sent:], len(req.output)
        return RequestDelta(req.id, new, now, True, reason, RequestOutput(req.output, reason, self._metrics(req, now)))

    def _metrics(self, req: _Request, now: float) -> dict:
        steps = len(req.accept_lengths)
        depth = self.spec.max_accept if self.spec else 0
        acc, drafted = np.asarray(req.accept_lengths), np.asarray(req.step_depths)
        times = req.token_times
        per_position = [float(np.mean(acc[drafted >= d] - 1 >= d)) if np.any(drafted >= d) else 0.0
                        for d in range(1, depth + 1)]
        return {
            "mean_accept_length": float(acc.mean()) if steps else 1.0,
            "accept_lengths": [int(a) for a in acc],
            "per_position_acceptance": per_position,
            "num_target_passes": steps + (1 if times else 0),
            "num_draft_passes": req.draft_passes,
            "num_output_tokens": len(req.output),
            "num_preemptions": req.num_preemptions,
            "queue_s": (req.admitted - req.arrival) if req.admitted is not None else now - req.arrival,
            "ttft_s": times[0] - req.arrival if times else None,
            "itl_s": [float(x) for x in np.diff(times)],
            "e2e_latency_s": now - req.arrival,
        }
