"""Launching the step programs: a batch's rows -> the device arrays of one prefill chunk batch or
one decode step, launched (and, for a multi-host leader, announced to the followers first).

A `Launch` is a program on the device whose outputs the scheduler has not read yet; with overlap
it is read in the next iteration, while that iteration's programs run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from ..sampling.logprobs import LogprobSettings
from ..spec_decode.policy import SpeculationPolicy, StepPlan
from ..structured import batch_masks, batch_tree_masks, mask_words
from . import lockstep
from .batch import MIN_CHUNK_BUCKET, RunningBatch, ScheduledRequest, bucket, chunk_cap
from .metrics import SchedulerCounters
from .programs import Executor
from .shard_pages import SPREAD
from .slot_table import BatchRows, SlotTable, chunk_columns, prefill_chunks


@dataclasses.dataclass
class Launch:
    """A step program launched on the device, its outputs not read yet."""

    kind: str  # "prefill" | "decode"
    requests: list  # the batch's requests, one per row (padding rows not included)
    outputs: list  # device arrays
    plan: StepPlan | None = None  # decode: what ran
    key: tuple = ()
    launched: float = 0.0
    untimed: bool = False  # not timed: after a catch-up (whose end the host does not see), or before a switch
    compiles: int = 0  # programs compiled before it was launched
    with_draft: bool = False  # prefill: the draft's program
    tokens: int = 0  # prefill: prompt tokens computed
    chunks: list = dataclasses.field(default_factory=list)  # prefill: each row's (chunk start, chunk length)
    final: list = dataclasses.field(default_factory=list)  # prefill: each row's chunk ends its prompt
    slots: np.ndarray | None = None  # the requests' state slots
    generations: np.ndarray | None = None  # those slots' generations at launch (SlotTable.generation)
    positions: np.ndarray | None = None  # each request's row (data shards), None: the first rows in order

    def in_request_order(self, outputs: list[np.ndarray]) -> list[np.ndarray]:
        """The outputs' rows of the requests, in `requests` order (every output is per row)."""
        return outputs if self.positions is None else [o[self.positions] for o in outputs]

    def live(self, table: SlotTable) -> np.ndarray:
        """The rows whose request is still where it was at launch (not preempted, aborted or
        finished since): its slot's generation unchanged, for the whole batch in one compare."""
        return np.flatnonzero(table.generation[self.slots] == self.generations)

    def seconds(self, now: float, last_read: float, compiles: int) -> float | None:
        """What it cost the serving loop, read at `now`: the wall time since the previous program's
        outputs were read (`last_read`: the previous step's, or a prefill's of the same iteration),
        or since its launch if later (an idle loop), so host work the device did not hide counts
        too. None when a program compiled meanwhile (`compiles`, the count now: the host was busy
        compiling) or after a catch-up."""
        if self.untimed or compiles != self.compiles:
            return None
        return now - max(self.launched, last_read)


def time_steady_steps_only(ready: list[Launch], launched: list[Launch]) -> None:
    """Leave untimed a decode step read after a different one was launched (another program or
    shape, or a catch-up first). A step's time runs from the previous read to its own, and the host
    launches the next step before that read: when the device finishes first, the host's work for
    the next launch is in the step's time. That is the step's true cost while the same step repeats
    (what the adaptive policy's step costs predict), but before a switch it is the cost of neither
    (a plain step read after launching a catch-up and a speculative step measured up to twice its
    steady time)."""
    step = next((launch for launch in ready if launch.kind == "decode"), None)
    following = next((launch for launch in launched if launch.kind == "decode"), None)
    if step is None or following is None:
        return
    same = following.plan.program == step.plan.program and following.plan.shape == step.plan.shape
    if following.plan.catch_up or not same:
        step.untimed = True


def at_rows(items: list, slots: Sequence[int], rows: BatchRows) -> list:
    """Per-request `items` (of the requests on state slots `slots`) laid out by row: each row its
    slot's item (a spread request's at every one of its rows), None on padding rows."""
    by_slot = dict(zip(slots, items))
    return [by_slot.get(slot) for slot in np.asarray(rows.slots).tolist()]


class Launcher:
    """Launches a running batch's programs on the executor's devices."""

    def __init__(self, executor: Executor, batch: RunningBatch, policy: SpeculationPolicy, counters: SchedulerCounters,
                 logprob_settings: LogprobSettings, *, prefill_chunk: int, prefill_width: int):
        self.executor, self.batch, self.policy, self.counters = executor, batch, policy, counters
        self.logprob_settings = logprob_settings
        self.prefill_chunk, self.prefill_width = prefill_chunk, prefill_width
        self.leader: lockstep.Leader | None = None  # multi-host: process 0 announces every launch

    def run(self, kind: str, plan_shape, rows: BatchRows, *args, logprobs: bool = False,
            masks: np.ndarray | None = None):
        """Launch a program, the variant returning logprobs when asked, with token bitmasks when
        given (first telling the followers of a multi-host leader)."""
        settings = self.logprob_settings if logprobs else None
        if self.leader is not None:
            self.leader.launched(kind, plan_shape, rows, args, settings, masks)
        return self.executor.execute(kind, plan_shape, rows, *args, logprobs=settings, masks=masks)

    def save_pages(self, pages: list[int], slots: list[int]) -> None:
        """Copy device `pages` to the host tier's `slots` (prefix-cache pages evicted)."""
        if self.leader is not None:
            self.leader.moved("save_pages", pages, slots)
        self.executor.save_pages(pages, slots)
        self.counters.totals["host_kv_pages_saved_total"] += len(pages)
        self.counters.totals["host_kv_bytes_saved_total"] += len(pages) * self.executor.host_pages.bytes_per_page

    def restore_pages(self, slots: list[int], pages: list[int]) -> None:
        """Copy the host tier's `slots` into device `pages` (a prefix found on the host), timing
        the host's part: reading the slots and launching the copy."""
        start = time.perf_counter()
        if self.leader is not None:
            self.leader.moved("restore_pages", slots, pages)
        self.executor.restore_pages(slots, pages)
        totals = self.counters.totals
        totals["host_kv_pages_restored_total"] += len(pages)
        totals["host_kv_bytes_restored_total"] += len(pages) * self.executor.host_pages.bytes_per_page
        totals["host_kv_restore_seconds_total"] += time.perf_counter() - start

    @property
    def mask_words(self) -> int:
        return mask_words(self.executor.target.config.vocab_size)

    def reading(self, count: int) -> None:
        """The host is about to read the outputs of its `count` oldest launches (a multi-host leader
        tells the followers, which read theirs alike)."""
        if self.leader is not None and count:
            self.leader.reading(count)

    def _slots_at_launch(self, batch_rows: BatchRows, count: int, positions: np.ndarray | None) -> dict:
        """A launch's `slots` and their `generations` now, of its `count` requests' rows (the
        first rows, or those at `positions`), and the positions."""
        slots = batch_rows.slots[:count] if positions is None else batch_rows.slots[positions]
        return {"slots": slots, "generations": self.batch.table.generation[slots], "positions": positions}

    def prefill(self, rows: list[tuple[ScheduledRequest, int]]) -> Launch:
        """Launch the next prompt chunks; a request whose prompt ends here decodes from now on."""
        owners, positions = self.batch.rows_batch([r.slot for r, _ in rows], self.prefill_width)  # their own slots
        batch = len(owners.ints)
        t = bucket(max(n for _, n in rows), MIN_CHUNK_BUCKET, chunk_cap(self.prefill_chunk))
        packed = prefill_chunks(batch, t)
        tokens, lengths, n_valid, following, counter = chunk_columns(packed)  # views: written through
        at = range(len(rows)) if positions is None else positions.tolist()
        for i, (req, n) in zip(at, rows):
            c = req.computed
            tokens[i, :n] = req.prefill_ids[c: c + n]
            n_valid[i], lengths[i], counter[i] = n, c, len(req.output)
            if c + n < len(req.prefill_ids):  # not the prompt's last chunk: its first token is not kept
                following[i] = req.prefill_ids[c + n]
            if req.shard == SPREAD:  # its replicas: the same chunk on every shard
                packed[owners.slots == req.slot] = packed[i]
        requests, final = [req for req, _ in rows], (following[list(at)] < 0).tolist()
        # With the draft when any row has it (a row without it then has a draft cache it never uses).
        with_draft = any(r.with_draft for r, _ in rows)
        logprobs = any(r.logprobs is not None or r.wants_prompt_logprobs for r, _ in rows)
        chunks = [(req.computed, n) for req, n in rows]
        # Structured output: the first token of a row whose prompt ends here follows its grammar.
        grammars = [req.grammar if last else None for req, last in zip(requests, final)]
        masks = (batch_masks(at_rows(grammars, [r.slot for r in requests], owners), batch, self.mask_words)
                 if any(g is not None for g in grammars) else None)
        compiles, launched = self.executor.programs.num_compiles, time.perf_counter()
        outputs = self.run("prefill" if with_draft else "plain_prefill", None, owners, packed, logprobs=logprobs,
                           masks=masks)
        self.executor.prefetch(outputs)
        for req, n in rows:
            req.computed += n
            self.batch.table.length[req.slot] = req.computed
            self.batch.cache_prefilled(req, with_draft)
            if req.computed == len(req.prefill_ids):
                self.batch.start_decoding(req)
        tokens_computed = sum(n for _, n in rows)
        self.counters.totals["prompt_tokens_total"] += tokens_computed
        return Launch("prefill", requests, outputs, key=(batch, t), launched=launched, compiles=compiles,
                      with_draft=with_draft, tokens=tokens_computed, chunks=chunks, final=final,
                      **self._slots_at_launch(owners, len(rows), positions))

    def decode(self, rows: list[ScheduledRequest]) -> Launch:
        """Launch one decode step over `rows`, the batch's decoding requests (`RunningBatch.decoding()`),
        as the speculation policy plans it (a catch-up first when planned)."""
        table, slots = self.batch.table, self.batch.decoding_slots()
        batch_rows, positions = self.batch.rows_batch(slots)
        key = self.batch.last_decode_key = (*batch_rows.block_table.shape, batch_rows.features)
        plan = self.policy.plan(rows, key)
        if plan.catch_up:
            self.run("catch_up", None, batch_rows)
        table.pending[slots] += 1
        compiles, launched = self.executor.programs.num_compiles, time.perf_counter()
        logprobs = bool(table.wants_logprobs[slots].any())
        if table.constrained[slots].any():
            outputs = self._constrained(rows, plan, batch_rows, logprobs, positions)
        else:
            outputs = self.run(plan.program, plan.shape, batch_rows, logprobs=logprobs)
        self.executor.prefetch(outputs)
        # A step after a catch-up starts when the catch-up ends, which the host does not see. A
        # constrained step's time holds the host's mask work beside its programs: its true cost,
        # which the adaptive policy weighs.
        return Launch("decode", rows, outputs, plan, key, launched, plan.catch_up, compiles,
                      **self._slots_at_launch(batch_rows, len(rows), positions))

    def _constrained(self, rows: list[ScheduledRequest], plan: StepPlan, batch_rows: BatchRows, logprobs: bool,
                     positions: np.ndarray | None) -> list:
        """A decode step under the rows' grammars (each row's every earlier token read): one token
        ("one_forward", the target's pass, during which the host fills each row's next mask, then
        "one_sample" / "store_sample" with them), or a speculative step: "propose" (the tree, its
        first level under the next masks), "forward" (the target's pass), during which the host
        reads the tree and computes each node's mask, then "accept" with those masks. A
        multi-host leader runs each step's single-program form (its followers hold their own
        device arrays)."""
        batch = len(batch_rows.ints)
        grammars = at_rows([r.grammar for r in rows], [r.slot for r in rows], batch_rows)  # each row's
        settings = self.logprob_settings if logprobs else None
        if plan.program != "decode" and self.leader is not None:
            return self.run(plan.program, plan.shape, batch_rows, logprobs=logprobs,
                            masks=batch_masks(grammars, batch, self.mask_words))
        if plan.program != "decode":  # one token: the masks filled during the target's pass
            passed = self.executor.execute("one_forward", None, batch_rows)
            masks = batch_masks(grammars, batch, self.mask_words)
            sample = "store_sample" if plan.program == "store_decode" else "one_sample"
            return self.executor.execute(sample, None, batch_rows, *passed, logprobs=settings, masks=masks)
        tree = self.run("propose", plan.shape, batch_rows, masks=batch_masks(grammars, batch, self.mask_words))
        if self.leader is None:
            passed = self.executor.execute("forward", plan.shape, batch_rows, *tree)
        self.reading(1)
        tokens, parents = self.executor.read(tree)  # waits for the proposal only
        node_masks = batch_tree_masks(grammars, tokens, parents, self.mask_words)
        if self.leader is not None:  # followers cannot take this process's device arrays: one program
            return self.run("verify", plan.shape, batch_rows, tokens, parents, logprobs=logprobs, masks=node_masks)
        return self.executor.execute("accept", plan.shape, batch_rows, *tree, *passed, logprobs=settings,
                                     masks=node_masks)
