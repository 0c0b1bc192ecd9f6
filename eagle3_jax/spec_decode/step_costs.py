"""Measured step and prefill times of adaptive speculation (adaptive.py), by program key.

A program key is what pins a compiled program: its batch bucket, its block-table width bucket
and, for a decode program, what else picks it. Times are medians of recent samples (a shared
host's hiccups land in single samples), and a shape not timed at a key is predicted from the
ratio of its times to a reference shape's at the keys where both ran.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Sequence

from .settings import NO_SPEC, Shape, shape_name

# (batch bucket, block-table width bucket) of a program, then for a decode program what else
# picks it (the batch's sampling.BatchFeatures): programs that differ there are timed apart.
Key = tuple


def key_distance(a: Key, b: Key) -> float:
    """How far apart two program keys are: octaves of batch plus octaves of block-table width, plus
    one where the rest differs (another program form: the nearest key of the same form is
    nearer than the same shape of another form, up to an octave)."""
    return abs(math.log2(a[0] / b[0])) + abs(math.log2(a[1] / b[1])) + (a[2:] != b[2:])


# StepCosts also times this program, which is not a menu shape: a step without speculation in which
# no row has the draft (no pairs stored), the alternative to keeping the draft for a new request.
PLAIN = "plain"


def _cost_name(shape: Shape | str) -> str:
    return shape if isinstance(shape, str) else shape_name(shape)


class StepCosts:
    """Measured wall time of each (shape, batch, width) program: the median of its last `window`
    samples (a shared host's hiccups and collections land in single samples; a median ignores them),
    once it has `min_samples`. The first `skip_first` samples of each are dropped: a program's
    first runs after its compile touch fresh buffers and cold caches (on a CPU they ran up to
    twice as long as later ones), and a shape timed only while it explores would keep that
    verdict. Medians are taken when read, and retaken only every `retake_every` new samples of
    an entry (a median of 31 moves little with one more), so estimates derived from them can be
    kept until `version` changes: the choice before every decode step reads them all."""

    def __init__(self, window: int = 31, min_samples: int = 5, skip_first: int = 2, retake_every: int = 4):
        self.window, self.min_samples, self.skip_first = window, min_samples, skip_first
        self.retake_every = retake_every
        self._clock = 0  # samples observed
        self._last: dict[tuple[str, Key], int] = {}  # (name, key) -> _clock at its last sample
        self._skipped: collections.Counter = collections.Counter()
        self._samples: dict[tuple[str, Key], collections.deque] = {}
        self._new: collections.Counter = collections.Counter()  # samples added since the last median
        self._stale: set[tuple[str, Key]] = set()  # entries whose median is due
        self._medians: dict[str, dict[Key, float]] = collections.defaultdict(dict)  # shape name -> key -> s
        self._version = 0  # changes whenever a median does

    def observe(self, shape: Shape | str, key: Key, seconds: float) -> None:
        entry = (_cost_name(shape), key)
        if self._skipped[entry] < self.skip_first:
            self._skipped[entry] += 1
            return
        samples = self._samples.get(entry)
        if samples is None:
            samples = self._samples[entry] = collections.deque(maxlen=self.window)
        samples.append(seconds)
        self._new[entry] += 1
        if len(samples) == self.min_samples or self._new[entry] >= self.retake_every:
            self._stale.add(entry)
        self._clock += 1
        self._last[entry] = self._clock

    def last_timed(self, shape: Shape | str, key: Key) -> int:
        """When `shape` was last timed at `key`, in samples observed (any program): 0 if never."""
        return self._last.get((_cost_name(shape), key), 0)

    @property
    def _seconds(self) -> dict[str, dict[Key, float]]:
        """Shape name -> key -> median seconds, for entries with `min_samples` (fewer: still being measured)."""
        for name, key in self._stale:
            samples = self._samples[name, key]
            if len(samples) >= self.min_samples:
                median = statistics.median(samples)
                self._version += median != self._medians[name].get(key)
                self._medians[name][key] = median
                self._new[name, key] = 0
        self._stale.clear()
        return self._medians

    @property
    def version(self) -> int:
        """A number that changes whenever a median does (medians due are taken first)."""
        self._seconds  # noqa: B018 (takes the medians due)
        return self._version

    def forget(self, shape: Shape | str, key: Key) -> None:
        """Drop a program's samples at `key`: it counts as not timed there until timed again."""
        entry = (_cost_name(shape), key)
        self._samples.pop(entry, None)
        self._stale.discard(entry)
        self._new.pop(entry, None)
        if self._medians[entry[0]].pop(key, None) is not None:
            self._version += 1

    def measured(self, shape: Shape | str, key: Key) -> float | None:
        return self._seconds[_cost_name(shape)].get(key)

    def predicted(self, shape: Shape | str, key: Key, references: Sequence[Shape | str]) -> float | None:
        """An estimate for an untimed (shape, key) from the nearest key where it and one of the
        reference programs were timed, scaled by that reference's time here; None when nothing
        supports one."""
        best, best_distance = None, math.inf
        timed = self._seconds[_cost_name(shape)]
        for ref in references:
            ref_times = self._reference_times(ref)
            here = ref_times.get(key)
            if ref == shape or here is None:
                continue
            for other, seconds in timed.items():
                ref_there = ref_times.get(other)
                if other == key or ref_there is None:
                    continue
                distance = key_distance(other, key)
                if distance < best_distance:
                    best, best_distance = here * seconds / ref_there, distance
        return best

    def estimated(self, shape: Shape | str, key: Key, references: Sequence[Shape | str]) -> float | None:
        """The measured time at `key`, else the prediction from other keys (see `predicted`)."""
        seconds = self.measured(shape, key)
        return seconds if seconds is not None else self.predicted(shape, key, references)

    def _reference_times(self, ref: Shape | str) -> dict[Key, float]:
        """`ref`'s times by key, where steps without speculation stand in for each other (the plain
        program and the one storing pairs for the draft differ by a few stores)."""
        name, seconds = _cost_name(ref), self._seconds
        if name not in (NO_SPEC, PLAIN):
            return seconds[name]
        return {**seconds[PLAIN if name == NO_SPEC else NO_SPEC], **seconds[name]}


# Prefill program names in PrefillCosts.
PREFILL, PLAIN_PREFILL = "prefill", "plain_prefill"


class PrefillCosts:
    """Prefill seconds per prompt token with the draft and without, by program key (batch bucket,
    chunk bucket): the median of each (kind, key)'s last samples (a chunk batch's wall time over
    its prompt tokens). Read at the key of the last prefill: a kind not timed there is predicted
    from the nearest key where both ran, so the draft's share compares like with like (per-token
    times depend on how full a chunk batch is)."""

    def __init__(self, window: int = 15, min_samples: int = 3, skip_first: int = 1):
        self._costs = StepCosts(window, min_samples, skip_first)
        self._last_key: Key | None = None

    def observe(self, with_draft: bool, key: Key, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._costs.observe(PREFILL if with_draft else PLAIN_PREFILL, key, seconds / tokens)
            self._last_key = key

    def per_token(self, with_draft: bool) -> float | None:
        if self._last_key is None:
            return None
        name, other = (PREFILL, PLAIN_PREFILL) if with_draft else (PLAIN_PREFILL, PREFILL)
        return self._costs.estimated(name, self._last_key, (other,))
