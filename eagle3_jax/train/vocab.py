"""Draft-vocabulary selection, as SpecForge and the published EAGLE-3 drafts do it.

An EAGLE-3 draft predicts over a reduced vocabulary: the `draft_vocab_size` target tokens that
occur most often in the training responses. The mapping is stored the HF way:

    target_id = draft_id + d2t[draft_id]        (d2t: int64 [Vd], offsets)
    t2d[target_id] = target_id is in the draft vocab   (bool [V])

`draft_ids` (the chosen target ids) is kept sorted ascending, so draft id order follows target id
order and `d2t = draft_ids - arange(Vd)` is non-decreasing and >= 0.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np


def count_tokens(sequences: Iterable[Sequence[int]] | np.ndarray, masks: Iterable[Sequence[bool]] | np.ndarray | None = None,
                 *, vocab_size: int) -> np.ndarray:
    """How often each target token occurs: int64 [vocab_size].

    `sequences` is a 2-D int array or an iterable of 1-D token sequences (ragged is fine). With
    `masks` (same shapes), only tokens whose mask is true are counted; pass the loss masks to count
    response tokens only, which is what the draft is trained to predict.
    """
    if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer; got {vocab_size!r}")
    counts = np.zeros((int(vocab_size),), np.int64)
    seqs = _rows(sequences)
    mask_list = [None] * len(seqs) if masks is None else _rows(masks)
    if len(mask_list) != len(seqs):
        raise ValueError(f"got {len(mask_list)} masks for {len(seqs)} sequences; give one mask per sequence")
    for i, (seq, mask) in enumerate(zip(seqs, mask_list)):
        ids = np.asarray(seq)
        if ids.size == 0:
            continue
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"sequence {i} must be a 1-D array of integer token ids; got shape {ids.shape}, dtype {ids.dtype}")
        if mask is not None:
            m = np.asarray(mask)
            if m.shape != ids.shape:
                raise ValueError(f"mask {i} has shape {m.shape} but sequence {i} has shape {ids.shape}")
            ids = ids[m.astype(bool)]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"sequence {i} has token ids outside [0, {vocab_size}): range [{ids.min()}, {ids.max()}]")
        counts += np.bincount(ids.astype(np.int64), minlength=vocab_size)
    return counts


def _rows(x) -> list:
    """A 2-D array (or 1-D: one row) or an iterable of rows -> list of rows."""
    if isinstance(x, np.ndarray):
        return [x] if x.ndim == 1 else list(x.reshape(-1, x.shape[-1]))
    return list(x)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    """A draft vocabulary: which target ids the draft predicts, and the HF d2t / t2d mappings."""

    draft_ids: np.ndarray  # int64 [Vd], target ids of the draft vocabulary, sorted ascending
    d2t: np.ndarray  # int64 [Vd], draft_ids - arange(Vd)
    t2d: np.ndarray  # bool [V], True where a target id is in the draft vocabulary
    covered_mass: float  # fraction of the counted tokens that fall inside the draft vocabulary

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.shape[0])

    def to_target(self, draft_ids) -> np.ndarray:
        """Draft ids -> target ids (`draft_id + d2t[draft_id]`)."""
        d = np.asarray(draft_ids, np.int64)
        return d + self.d2t[d]

    @classmethod
    def from_draft_ids(cls, draft_ids, vocab_size: int, covered_mass: float = float("nan")) -> "DraftVocab":
        """Build from the chosen target ids (any order; must be distinct and inside the vocabulary)."""
        ids = np.sort(np.asarray(draft_ids, np.int64).reshape(-1))
        if ids.size == 0:
            raise ValueError("a draft vocabulary needs at least one token id")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"draft ids must lie in [0, {vocab_size}); got range [{ids[0]}, {ids[-1]}]")
        if np.any(np.diff(ids) == 0):
            raise ValueError("draft ids must be distinct")
        t2d = np.zeros((int(vocab_size),), bool)
        t2d[ids] = True
        return cls(draft_ids=ids, d2t=ids - np.arange(ids.size, dtype=np.int64), t2d=t2d, covered_mass=float(covered_mass))

    @classmethod
    def from_d2t(cls, d2t, vocab_size: int) -> "DraftVocab":
        """Rebuild from a checkpoint's d2t offsets, keeping its draft-id order (covered_mass: NaN)."""
        d2t = np.asarray(d2t, np.int64).reshape(-1)
        ids = np.arange(d2t.size, dtype=np.int64) + d2t
        if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"d2t must map draft ids into [0, {vocab_size}); got {ids.size} entries")
        if np.unique(ids).size != ids.size:
            raise ValueError("d2t maps two draft ids to the same target id")
        t2d = np.zeros((int(vocab_size),), bool)
        t2d[ids] = True
        return cls(draft_ids=ids, d2t=d2t, t2d=t2d, covered_mass=float("nan"))


def select_draft_vocab(counts, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent target ids (ties -> lower id), sorted ascending.

    When fewer than `draft_vocab_size` distinct tokens were counted, the vocabulary is filled with
    the lowest ids that did not occur. `covered_mass` is 0.0 when nothing was counted.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.number):
        raise ValueError(f"counts must be a non-empty 1-D array of token counts [vocab_size]; got shape {counts.shape}")
    if np.any(counts < 0):
        raise ValueError("counts must be >= 0")
    v = counts.size
    if not isinstance(draft_vocab_size, (int, np.integer)) or not 1 <= draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be an integer in [1, vocab_size={v}]; got {draft_vocab_size!r}")
    ids = np.arange(v, dtype=np.int64)
    order = np.lexsort((ids, -counts))  # count descending, then id ascending
    chosen = order[: int(draft_vocab_size)]
    total = float(counts.sum())
    mass = float(counts[chosen].sum()) / total if total > 0 else 0.0
    return DraftVocab.from_draft_ids(chosen, v, covered_mass=mass)
