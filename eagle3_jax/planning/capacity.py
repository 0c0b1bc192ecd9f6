"""Capacity: the most sequences of a given context that fit one device, from the compiled plans.

A step's need per device is close to linear in the batch: the weights are held once, and the KV
cache and the step's temporaries grow with each sequence (the temporaries not with its context:
models/blockwise.py). A few plans find the largest batch that fits (`max_sequences`). Batches are
multiples of the mesh's data axis, each data shard running its share.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .memory import Device, MemoryPlan

MAX_SEQUENCES = 65536  # the search's ceiling (a plan of more sequences than this is not tried)
MAX_PLANS = 6  # plans one search compiles at the most
CLOSE_ENOUGH = 0.03  # stop once the largest batch that fits is within 3 % of the smallest that does not


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The most sequences found to fit (0: not one batch of `step`), the plan at that batch, and
    the smallest batch found not to fit (None: none was tried)."""

    sequences: int
    plan: MemoryPlan | None
    plans_compiled: int
    over: int | None = None


def max_sequences(plan_at: Callable[[int], MemoryPlan], device: Device, step: int = 1) -> Capacity:
    """The most sequences, a multiple of `step`, whose plan (`plan_at(batch)`) fits `device`.

    A secant search on the plans' need against the batch, kept inside the bracket of the largest
    batch that fits and the smallest that does not (bisecting when the line leaves it): the need is
    close to linear in the batch except at small batches, where the MoE's form changes with the
    tokens a step routes. It starts from half what the first plan's KV per sequence allows."""
    hbm = device.hbm_bytes
    first = plan_at(step)
    if first.total_bytes > hbm:
        return Capacity(0, None, 1)
    fits, over = first, None
    guess = step + (hbm - first.total_bytes) / max(first.kv_bytes / step, 1.0) / 2
    previous, compiled = first, 1
    while compiled < MAX_PLANS:
        top = MAX_SEQUENCES if over is None else over.batch - step
        batch = min(max(int(guess) // step * step, fits.batch + step), top)
        if batch <= fits.batch:
            break
        plan = plan_at(batch)
        compiled += 1
        if plan.total_bytes <= hbm:
            fits = plan
        else:
            over = plan
        if over is not None and over.batch - fits.batch <= max(step, CLOSE_ENOUGH * fits.batch):
            break
        slope = (plan.total_bytes - previous.total_bytes) / (plan.batch - previous.batch)
        guess = plan.batch + (hbm - plan.total_bytes) / slope if slope > 0 else 2 * plan.batch
        if over is not None and not fits.batch < guess < over.batch:
            guess = (fits.batch + over.batch) / 2
        previous = plan
    return Capacity(fits.batch, fits, compiled, None if over is None else over.batch)
