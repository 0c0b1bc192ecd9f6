"""Acceptance measured as serving measures it: the draft being trained speculates for its target through
the Engine on held-out prompts (greedy, chain 3:1:4 by default), and tau and per-position acceptance
are pooled over every verify step, as a benchmark reports them.

The simulated tau the training-time test reports walks the teacher's own sequences; this one runs the
draft on what it proposes, in the dtype and programs serving runs, so it is the number users see
(the bundled demo draft simulates 3.84 and measures 3.27).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..config.draft import DraftConfig
from ..engine import Engine
from ..models.draft import Draft
from ..models.target import Target
from ..request import pooled_acceptance
from ..sampling.sampler import SamplingParams
from ..spec_decode.settings import SpecConfig
from .draft_model import assembled_params


@dataclasses.dataclass(frozen=True)
class Measurement:
    """How a run measures its draft: `prompts` (token ids, held out from training) each answered with
    up to `max_tokens` tokens under `spec`, `batch_size` at a time; every `every` steps (0: at each
    epoch's end only)."""

    prompts: tuple[tuple[int, ...], ...]
    every: int = 0
    max_tokens: int = 64
    spec: SpecConfig = SpecConfig(3, 1, 4)
    batch_size: int = 16

    def __post_init__(self) -> None:
        if not self.prompts or self.every < 0 or self.max_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"a measurement needs prompts, every >= 0, max_tokens >= 1 and batch_size >= 1; got {self}")


def serving_draft(cfg: DraftConfig, trainable: dict, frozen: dict, target: Target) -> Draft:
    """The draft under training as `load_draft` would load its export: the target's dtype, whole on
    every device of the target's mesh."""
    params = assembled_params(trainable, frozen, dtype=target.dtype)
    if target.mesh is not None:
        whole = NamedSharding(target.mesh, PartitionSpec())
        params = jax.jit(lambda p: p, out_shardings=jax.tree.map(lambda _: whole, params))(params)
    return Draft(config=cfg, params=params, dtype=target.dtype, target=target)


def measured_acceptance(target: Target, draft: Draft, measurement: Measurement) -> dict:
    """tau, per-position acceptance and verify steps of `draft` speculating for `target` on the
    measurement's prompts (greedy: the same outputs whatever the draft proposes)."""
    prompts: Sequence[Sequence[int]] = [list(p) for p in measurement.prompts]
    engine = Engine(target, draft, spec=measurement.spec, max_batch_size=min(measurement.batch_size, len(prompts)),
                    max_seq_len=max(len(p) for p in prompts) + measurement.max_tokens)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=measurement.max_tokens))
    return pooled_acceptance([o.metrics["accept_lengths"] for o in outputs], measurement.spec.max_accept)
