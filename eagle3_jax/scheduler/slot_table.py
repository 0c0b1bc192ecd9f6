"""Per state slot host tables, and a batch's rows of them: what a step program takes from the host.

Each state slot (one per running request, the last one scratch for padding rows) has a row of
int32 columns (the slot's own index, its prompt's length, its sampling settings' integers, its
block table) and a row of float32 columns (the settings' floats); sampling/sampler.py's packed layout.
A request's row is written when it is admitted and when it gains pages, and reset when it leaves,
so a batch's arguments are one gather by its slots: `BatchRows`, two arrays whatever the batch or
its settings. A jitted call pays per argument leaf (each host array is its own transfer), so two
beat the dozen a step had as separate arrays (block table, slots, prompt lengths, ten sampling
columns); the bytes are a few hundred per row. Each slot also keeps its page count (a batch's
block-table width) and a generation, bumped when its request leaves: a launched row whose slot's
generation has moved on since is void, checked for a whole batch in one compare.

The host's per-step bookkeeping of a request is kept per slot too, so a step updates a whole
batch in a few numpy calls instead of a few attribute updates per row: its committed cache length,
its decode steps launched and not read yet, what a step may write (the pages it needs next), and
its step log (tokens each decode step committed, draft tokens it proposed, when the tokens reached
the host, draft passes), which the request takes over when it leaves the slot or the log fills
(`take_steps`, for its metrics). So is what a step's hand-out asks of each row: whether its request
reads its tokens one by one (stop strings, a grammar, logprobs), its stop ids and where its budget
ends, from which `bulk_rows` finds the rows whose tokens are handed out whole (most rows of most
steps) for a whole batch at once, and whether it is constrained or wants logprobs (which
programs a batch of it runs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from ..cache import kv_cache
from ..sampling.sampler import (
    GREEDY_BATCH,
    GREEDY_FLOATS,
    GREEDY_INTS,
    PACKED_INTS,
    BatchFeatures,
    SamplingArrays,
    SamplingParams,
    packed_settings,
    unpack_settings,
)

SLOT, PROMPT_LEN = 0, 1
SETTINGS = slice(2, 2 + PACKED_INTS)  # the sampling settings' integer columns
PAGES = 2 + PACKED_INTS  # the block table's first column
LOGGED_STEPS = 64  # decode steps a slot's step log holds before its request takes them
BULK_STOP_IDS = 8  # stop ids a request may have and still be handed out in bulk
# Up to this many rows, a batch's bookkeeping is scalar updates row by row: each numpy call on an
# index array costs a few microseconds whatever its size, a scalar update a tenth of one.
FEW_ROWS = 8


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ints", "floats"], meta_fields=["features"])
@dataclasses.dataclass
class BatchRows:
    """A batch's rows of the slot tables: `ints` [B, PAGES + width] int32 and `floats` [B, F]
    float32, host arrays on the way in, traced inside a program. `features`: the sampling settings
    some row uses (static: a program computes only those, and branches on nothing the device
    computes; see sampling.BatchFeatures)."""

    ints: jax.Array
    floats: jax.Array
    features: BatchFeatures = GREEDY_BATCH

    @property
    def slots(self) -> jax.Array:
        """[B] each row's state slot (padding rows: the scratch slot)."""
        return self.ints[:, SLOT]

    @property
    def prompt_lens(self) -> jax.Array:
        return self.ints[:, PROMPT_LEN]

    @property
    def block_table(self) -> jax.Array:
        """[B, width] each row's KV pages."""
        return self.ints[:, PAGES:]

    @property
    def sampling(self) -> SamplingArrays:
        return unpack_settings(self.ints[:, SETTINGS], self.floats, self.features)

    @property
    def key(self) -> tuple:
        """What pins a program compiled for these rows: their shape and `features`."""
        return self.ints.shape, self.features


class SlotTable:
    """The host tables of `num_slots` state slots (the last one scratch: greedy, no prompt, every
    page the scratch page)."""

    def __init__(self, num_slots: int, max_pages_per_seq: int):
        self.ints = np.empty((num_slots, PAGES + max_pages_per_seq), np.int32)
        self.ints[:, SLOT] = np.arange(num_slots)
        self.ints[:, PROMPT_LEN] = 0
        self.ints[:, SETTINGS] = GREEDY_INTS
        self.ints[:, PAGES:] = kv_cache.SCRATCH_PAGE
        self.floats = np.tile(GREEDY_FLOATS, (num_slots, 1))
        self.features = np.zeros((num_slots,), np.int64)  # the settings' BatchFeatures bits: a batch's, their OR
        self.num_pages = np.zeros((num_slots,), np.int32)  # pages in each slot's block table
        # Bumped when a slot's request leaves: a launch's row whose slot's generation moved on
        # since is void (its request was preempted, aborted or finished), checked for a whole
        # batch at once.
        self.generation = np.zeros((num_slots,), np.int64)
        self.length = np.zeros((num_slots,), np.int64)  # committed cache slots of the slot's request
        self.pending = np.zeros((num_slots,), np.int64)  # its decode steps launched, not read yet
        # What one of its decode steps may write: slots committed, slots past them (its pages' need).
        self.step_tokens = np.zeros((num_slots,), np.int64)
        self.step_lookahead = np.zeros((num_slots,), np.int64)
        # The step log: per slot, its decode steps' committed tokens, proposed draft tokens and times
        # (the first `steps` of LOGGED_STEPS columns, taken by the request when full) and its draft
        # passes.
        self.steps = np.zeros((num_slots,), np.int64)
        self.accepted = np.zeros((num_slots, LOGGED_STEPS), np.int32)
        self.drafted = np.zeros((num_slots, LOGGED_STEPS), np.int32)
        self.times = np.zeros((num_slots, LOGGED_STEPS), np.float64)
        self.draft_passes = np.zeros((num_slots,), np.int64)
        # The hand-out: whether the request's tokens may go out whole (nothing reads them one by
        # one), its stop ids (-1 padded), the committed length at which its budget runs out; and
        # whether it is constrained (structured output) or wants logprobs.
        self.bulk = np.zeros((num_slots,), bool)
        self.stop_ids = np.full((num_slots, BULK_STOP_IDS), -1, np.int32)
        self.budget_end = np.zeros((num_slots,), np.int64)
        self.constrained = np.zeros((num_slots,), bool)
        self.wants_logprobs = np.zeros((num_slots,), bool)
        self.shard = np.zeros((num_slots,), np.int64)  # the data shard holding the request's pages

    def admit(self, slot: int, prompt_len: int, params: SamplingParams, *, length: int = 0,
              reserve: tuple[int, int] = (1, 1), budget: int = 0, reads_tokens: bool = True,
              constrained: bool = False, shard: int = 0) -> None:
        """A request takes `slot`: its prompt's length, sampling settings, committed length (the
        cached pages it starts from) and `reserve`, what one of its decode steps may write (slots
        committed, slots past them; the default: a step without speculation's); its pages follow.
        `budget`: the most tokens it may generate; `reads_tokens`: something reads its tokens one
        by one (stop strings, a grammar, logprobs), so none go out in bulk; `constrained`: it has
        a grammar; `shard`: the data shard its pages are on."""
        ints, floats = packed_settings(params)
        self.ints[slot, PROMPT_LEN] = prompt_len
        self.ints[slot, SETTINGS] = ints
        self.floats[slot] = floats
        self.features[slot] = BatchFeatures.bits_of(params)
        self.length[slot] = length
        self.step_tokens[slot], self.step_lookahead[slot] = reserve
        stops = params.stop_token_ids
        self.bulk[slot] = not reads_tokens and len(stops) <= BULK_STOP_IDS
        self.stop_ids[slot] = -1
        if self.bulk[slot]:
            self.stop_ids[slot, : len(stops)] = stops
        # Its output holds (committed length - prompt length + 1) tokens once its first is out
        # (every token but the last is in the cache), so its budget runs out at this length.
        self.budget_end[slot] = prompt_len + budget - 1
        self.constrained[slot], self.wants_logprobs[slot] = constrained, params.logprobs is not None
        self.shard[slot] = shard

    def set_pages(self, slot: int, start: int, pages: list[int]) -> None:
        """The slot's block table from column `start` on."""
        self.ints[slot, PAGES + start: PAGES + start + len(pages)] = pages
        self.num_pages[slot] = max(self.num_pages[slot], start + len(pages))

    def clear(self, slot: int) -> None:
        """Back to the scratch row's contents (its request left; its step log taken first)."""
        self.ints[slot, PROMPT_LEN:] = self.ints[-1, PROMPT_LEN:]  # the scratch slot's: never written
        self.floats[slot] = GREEDY_FLOATS
        self.features[slot] = 0
        self.num_pages[slot] = self.length[slot] = self.pending[slot] = self.steps[slot] = self.draft_passes[slot] = 0
        self.bulk[slot] = self.constrained[slot] = self.wants_logprobs[slot] = False
        self.generation[slot] += 1

    def bulk_rows(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> list[bool]:
        """Of a decode step's rows (`slots`; each row's first `counts` of `tokens` [B, K] are new,
        its committed length not advanced yet), those whose new tokens go out whole: their request
        reads no token one by one, none of them is a stop id, and they leave room in its budget
        (most rows of most steps). The other rows' tokens are emitted one by one."""
        if len(slots) <= FEW_ROWS:
            rows = []
            for slot, row, count in zip(slots.tolist(), tokens.tolist(), counts.tolist()):
                stops = self.stop_ids[slot].tolist() if self.bulk[slot] else None
                rows.append(stops is not None and bool(self.length[slot] + count < self.budget_end[slot])
                            and not any(t in stops for t in row[:count]))
            return rows
        new = np.arange(tokens.shape[1])[None, :] < counts[:, None]
        stopped = ((tokens[:, :, None] == self.stop_ids[slots][:, None, :]).any(axis=2) & new).any(axis=1)
        return (self.bulk[slots] & (self.length[slots] + counts < self.budget_end[slots]) & ~stopped).tolist()

    def log_steps(self, slots: np.ndarray, counts: np.ndarray, depth: int, draft_passes: int, now: float) -> np.ndarray:
        """A decode step of `slots` (each once) committed `counts` tokens each, after proposing
        `depth` draft tokens in `draft_passes` draft passes; they reached the host at `now`: their
        lengths and step logs advance. Returns the positions in `slots` whose log is now full: take
        theirs (`take_steps`) before their next step."""
        if len(slots) <= FEW_ROWS:
            full = []
            for i, (slot, count) in enumerate(zip(slots.tolist(), counts.tolist())):
                self.pending[slot] -= 1
                self.length[slot] += count
                column = int(self.steps[slot])
                self.accepted[slot, column], self.drafted[slot, column], self.times[slot, column] = count, depth, now
                self.steps[slot] = column + 1
                self.draft_passes[slot] += draft_passes
                if column + 1 == LOGGED_STEPS:
                    full.append(i)
            return np.asarray(full, np.int64)
        self.pending[slots] -= 1
        self.length[slots] += counts
        column = self.steps[slots]
        self.accepted[slots, column] = counts
        self.drafted[slots, column] = depth
        self.times[slots, column] = now
        self.steps[slots] = column + 1
        self.draft_passes[slots] += draft_passes
        return np.flatnonzero(column + 1 == LOGGED_STEPS)

    def short_of_pages(self, slots: np.ndarray, page_size: int) -> tuple[list[int], list[int]]:
        """Of `slots`' requests, those whose pages do not cover their next step (its launched and
        unread steps each committing up to `step_tokens`, then `step_lookahead` slots past them):
        (their positions in `slots`, the cache slots each needs covered)."""
        if len(slots) <= FEW_ROWS:
            slots = np.asarray(slots).tolist()
            ends = [int(self.length[s] + self.pending[s] * self.step_tokens[s] + self.step_lookahead[s]) for s in slots]
            short = [i for i, (s, end) in enumerate(zip(slots, ends)) if end > self.num_pages[s] * page_size]
            return short, [ends[i] for i in short]
        index = np.asarray(slots, np.int64)
        ends = self.length[index] + self.pending[index] * self.step_tokens[index] + self.step_lookahead[index]
        short = np.flatnonzero(ends > self.num_pages[index] * page_size)
        return short.tolist(), ends[short].tolist()

    def take_steps(self, slot: int) -> tuple[list[int], list[int], list[float], int]:
        """The slot's step log since its request took the slot or last took the log: (tokens each
        step committed, draft tokens each proposed, when each step's tokens reached the host, draft
        passes); the log starts afresh."""
        n = self.steps[slot]
        log = (self.accepted[slot, :n].tolist(), self.drafted[slot, :n].tolist(), self.times[slot, :n].tolist(),
               int(self.draft_passes[slot]))
        self.steps[slot] = self.draft_passes[slot] = 0
        return log

    def rows(self, slots: np.ndarray, width: int, features: BatchFeatures | None = None) -> BatchRows:
        """`slots`' rows with block tables `width` pages wide, and the features their settings use
        (`features`: these instead, a superset of theirs)."""
        if features is None:
            features = BatchFeatures.from_bits(int(np.bitwise_or.reduce(self.features[slots])))
        return BatchRows(self.ints[slots, : PAGES + width], self.floats[slots], features)


# A prefill's per-row arrays as one int32 array [B, T + CHUNK_FIELDS]: the chunk's T tokens
# (right-padded), then the cache length it starts at, its valid tokens, the prompt token after it
# (-1: the prompt ends here) and the tokens the row generated before (a recomputed output's
# sampling counter).
CHUNK_FIELDS = 4


def prefill_chunks(batch: int, chunk: int) -> np.ndarray:
    """The packed prefill arrays of `batch` padding rows of `chunk` tokens (one valid token each,
    ending their prompt)."""
    packed = np.zeros((batch, chunk + CHUNK_FIELDS), np.int32)
    packed[:, chunk + 1] = 1
    packed[:, chunk + 2] = -1
    return packed


def chunk_columns(packed) -> tuple:
    """(tokens [B, T], cache lengths, valid tokens, following token, output counts) of packed
    prefill arrays (host or traced)."""
    t = packed.shape[1] - CHUNK_FIELDS
    return packed[:, :t], packed[:, t], packed[:, t + 1], packed[:, t + 2], packed[:, t + 3]
