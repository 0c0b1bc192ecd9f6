"""The held-out share of a run's examples (drafts: regenerated responses; targets: corpus rows): how
many are held out, and which. Pure Python and NumPy, so the scripts check a run's sizes before
anything loads."""

from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def held_out_count(num_examples: int, eval_fraction: float, batch_size: int) -> int:
    """Examples held out for evaluation: `eval_fraction` of them, and at least one batch."""
    return max(int(num_examples * eval_fraction), batch_size)


def split_examples(examples: Sequence[T], eval_fraction: float, batch_size: int, seed: int) -> tuple[list[T], list[T]]:
    """(training, held-out) examples: a permutation by `seed`, its first `held_out_count` held out."""
    order = np.random.default_rng(seed).permutation(len(examples))
    n_eval = held_out_count(len(examples), eval_fraction, batch_size)
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]
