"""What a server compiles before its first requests: the programs the first bursts run.

A burst of short requests (prompts of up to one prefill chunk) runs prefill batches of every
(rows, tokens per row) bucket the batch rule allows (`batch.prefill_fits`) and decode steps of
every batch bucket, at block-table widths up to that of one chunk. Each in three forms: for batches
whose rows are all greedy, for batches with a sampled row (temperature alone), and for batches with
a sampled row that keeps only its top-k or top-p tokens (a program computes only the sampling
settings its batch uses: sampling.BatchFeatures; penalties and min_tokens compile their forms on
first use). `warmup_programs` lists them, smallest batches first, so that a program cache
too small for all of them keeps what the first (smaller) bursts need; `Scheduler.warm_up` compiles
them by running each once on padding rows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

from ..sampling.sampler import GREEDY_BATCH, SAMPLED_BATCH, TRUNCATED_BATCH, BatchFeatures
from ..spec_decode.policy import SpeculationPolicy, StepPlan
from .batch import MIN_CHUNK_BUCKET, MIN_PAGES_BUCKET, RunningBatch, buckets, chunk_cap, prefill_fits, width_buckets
from .slot_table import prefill_chunks

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmProgram:
    """One program to compile: a prefill (`kind`, `chunk` tokens per row) or a decode step (`plan`)."""

    kind: str  # "prefill" | "plain_prefill" | "decode"
    batch: int
    width: int  # block-table width in pages
    chunk: int = 0  # prefill: tokens per row
    plan: StepPlan | None = None  # decode: what the step runs
    features: BatchFeatures = GREEDY_BATCH  # the sampling settings its batches use


def warmup_programs(policy: SpeculationPolicy, sampled: bool = True, *, max_num_seqs: int, prefill_chunk: int,
                    prefill_width: int, max_pages_per_seq: int, data_shards: int = 1) -> list[WarmProgram]:
    """The prefill and decode programs of bursts of requests that fit one chunk, by batch bucket
    (with data shards: every shard's rows bucketed alike); each for greedy batches and, when
    `sampled`, for batches with a sampled row, with and without top-k / top-p."""
    programs = []
    widths = [w for w in width_buckets(MIN_PAGES_BUCKET, max_pages_per_seq) if w <= prefill_width]
    for batch in (data_shards * rows for rows in buckets(1, max_num_seqs // data_shards)):
        for features in (GREEDY_BATCH, SAMPLED_BATCH, TRUNCATED_BATCH) if sampled else (GREEDY_BATCH,):
            for chunk in buckets(MIN_CHUNK_BUCKET, chunk_cap(prefill_chunk)):
                if prefill_fits(batch, chunk, prefill_chunk):
                    programs += [WarmProgram(kind, batch, prefill_width, chunk, features=features)
                                 for kind in policy.prefill_programs]
            programs += [WarmProgram("decode", batch, w, plan=plan, features=features)
                         for w in widths for plan in policy.decode_plans()]
    return programs


def run_on_padding(program: WarmProgram, batch: RunningBatch, launch: Callable[..., list]) -> list:
    """Launch `program` on padding rows only (greedy, whatever the features it compiles for),
    through `launch(kind, shape, rows, *args)` (the scheduler's); returns its outputs."""
    rows = batch.padding_batch(program.batch, program.width, program.features)
    if program.plan is None:
        return launch(program.kind, None, rows, prefill_chunks(program.batch, program.chunk))
    if program.plan.catch_up:
        launch("catch_up", None, rows)
    return launch(program.plan.program, program.plan.shape, rows)


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What `Scheduler.warm_up` compiled."""

    programs: int  # run (each compiled unless it already was)
    wanted: int  # listed by warmup_programs; those past the program cache's bound were left out
    capacity: int  # the program cache's bound
    max_batch: int  # the largest batch bucket whose programs all ran (0: none)
    max_tokens: int  # the longest sequence (prompt + output) the decode programs that ran cover
    seconds: float
    held: bool = False  # stopped where the host's memory-map limit left no room for another program

    @staticmethod
    def of(wanted: Sequence[WarmProgram], ran: Sequence[WarmProgram], capacity: int, page_size: int,
           reserved: int, seconds: float, held: bool = False) -> "WarmUp":
        """The report of running `ran`, the first of `wanted` (`reserved`: cache slots a step may
        write past a sequence, so not covered by the widths that ran; `held`: stopped by the map limit)."""
        left = wanted[len(ran):]
        max_batch = (left[0].batch // 2 if left else max(p.batch for p in wanted)) if ran else 0
        covered = max((p.width for p in ran if p.plan is not None), default=0) * page_size
        return WarmUp(len(ran), len(wanted), capacity, max_batch, max(0, covered - reserved), seconds, held)

    def __str__(self) -> str:
        batches = "a lone request" if self.max_batch == 1 else f"batches of up to {self.max_batch} requests"
        covered = (f"{batches}, sequences of up to {self.max_tokens} tokens" if self.max_batch
                   else "not all of a lone request's")
        text = f"compiled {self.programs} programs ({covered}) in {self.seconds:.1f} s"
        if self.held:
            text += (f"; {self.wanted - self.programs} more, for larger batches, compile on first use (the host's "
                     f"memory-map limit holds the program cache to about {self.programs})")
        elif self.programs < self.wanted:
            text += (f"; {self.wanted - self.programs} more, for larger batches, compile on first use (the program "
                     f"cache holds {self.capacity})")
        return text


class WarmUpQueue:
    """A warm-up a server runs while it serves (`AsyncEngine.warm_up(background=True)`): the programs
    still to compile, one at a time on the engine thread whenever no request is running, the lone
    greedy request's first (`first`: the server is ready once they are compiled), then the rest.
    A request that comes meanwhile is served at once, compiling on first use what it needs."""

    def __init__(self, wanted: Sequence[WarmProgram], capacity: int, page_size: int, reserved: int,
                 progress: Callable[[str], None] | None = None, every_s: float = 10.0,
                 out_of_room: Callable[[], bool] = lambda: False):
        chosen = wanted[:capacity]  # what the program cache holds, smallest batches first
        # A lone greedy request's programs lead: the first requests, and a health check's readiness.
        first = [p for p in chosen if p.batch == chosen[0].batch and p.features == GREEDY_BATCH] if chosen else []
        self._order = first + [p for p in chosen if p not in first]
        self.first = len(first)
        self._wanted, self._capacity, self._page_size, self._reserved = wanted, capacity, page_size, reserved
        self._progress, self._every_s = progress, every_s
        self.compiled = 0
        self.failed = False  # a program failed to compile: the rest are left to compile on first use
        # The program cache has no room for another without dropping one (the host's map budget,
        # program_cache.py): the rest are left to compile on first use.
        self._out_of_room = out_of_room
        self.held = False
        self.start = time.perf_counter()
        self._said = self.start

    @property
    def total(self) -> int:
        return len(self._order)

    @property
    def ready(self) -> bool:
        """The lone greedy request's programs are compiled."""
        return self.compiled >= self.first

    @property
    def finished(self) -> bool:
        return self.failed or self.held or self.compiled >= len(self._order)

    def run(self, warm: Callable[[WarmProgram], None]) -> WarmUp:
        """Compile every program left with `warm` (a program's failure raises) -> the report."""
        while not self.finished and not self._hold():
            warm(self._order[self.compiled])
            self._done()
        return self.report()

    def compile_next(self, warm: Callable[[WarmProgram], None]) -> None:
        """Compile the next program with `warm`. One that fails ends the warm-up, not its caller:
        it is logged, and what is left compiles on first use."""
        if self._hold():
            return
        try:
            warm(self._order[self.compiled])
        except Exception:
            logger.exception("the warm-up stopped at %d of %d programs; the rest compile on first use", self.compiled,
                             self.total)
            self.failed = True
            return
        self._done()

    def _hold(self) -> bool:
        """Stop here if the program cache has no room for the next program: compiling it would
        drop one this warm-up compiled."""
        if not self.held and self._out_of_room():
            self.held = True
            self._say(f"warm-up {self.report()} (not counted in /metrics)")
        return self.held

    def _done(self) -> None:
        """The next program is compiled: count it, and say how far the warm-up is now and then."""
        self.compiled += 1
        now = time.perf_counter()
        if self.compiled == self.first:
            self._say(f"ready: a lone request's programs compiled ({self.first} of {self.total}) in "
                      f"{now - self.start:.1f} s; the rest compile while no request runs")
        elif self.finished:
            self._say(f"warm-up {self.report()} (not counted in /metrics)")
        elif now - self._said >= self._every_s:
            self._say(f"warm-up: {self.compiled} of {self.total} programs compiled")

    def _say(self, line: str) -> None:
        self._said = time.perf_counter()
        if self._progress is not None:
            self._progress(line)

    def report(self) -> WarmUp:
        return WarmUp.of(self._wanted, self._order[: self.compiled], self._capacity, self._page_size, self._reserved,
                         time.perf_counter() - self.start, self.held)
