"""Speculation policy: what each decode step runs, decided in one place.

The scheduler asks its policy what the next decode step runs (`plan`) and tells it what happened
(`observe`, `observe_prefill`, `finished`); it never looks at the kind of speculation itself. Three
policies, made by `policy_for` from what the user passed:

- `PlainDecoding` (no draft): every step is one target token per row.
- `FixedSpeculation` (a SpecConfig): every step runs that chain or tree.
- `AdaptivePolicy` (an AutoSpec): per step no speculation, a chain or a tree, chosen from measured
  step times and acceptance (adaptive.py); a request may be admitted without the draft.

"No draft" and "no speculation this step" are different answers: a `StepPlan` names the program
("plain_decode": no draft arrays at all; "store_decode": one target token per row, the pairs kept
for the draft to catch up on; "decode": speculation of `shape`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import numpy as np

from ..config.draft import check_fits_target
from ..models.draft import Draft
from .adaptive import AdaptiveSpeculation, Key
from .settings import AutoSpec, SpecConfig, shape_depth

PLAIN_DECODE, STORE_DECODE, DECODE = "plain_decode", "store_decode", "decode"


def step_lookahead(shape: SpecConfig | None) -> int:
    """Cache slots past the committed length that one step of `shape` may write (tree nodes,
    draft extend and scratch); 1 for a step without speculation."""
    if shape is None:
        return 1
    return max(shape.num_draft_tokens, shape.max_accept + 1 + max(shape.num_steps - 1, 1) * shape.topk)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one decode step runs."""

    program: str  # PLAIN_DECODE | STORE_DECODE | DECODE
    shape: SpecConfig | None = None  # DECODE: the chain or tree
    catch_up: bool = False  # the draft first runs over its stored pairs (adaptive)

    @property
    def depth(self) -> int:
        """Most draft tokens the step can accept."""
        return shape_depth(self.shape)

    @property
    def draft_passes(self) -> int:
        return self.shape.num_steps if self.shape is not None else 0


class Row(Protocol):
    """What a policy reads (and, for `gap`, writes) of a running request."""

    id: str
    with_draft: bool
    gap: int


class SpeculationPolicy:
    """The interface; see the module doc. Defaults are plain decoding's."""

    uses_draft = False  # the programs carry the draft's caches and state
    chooses_draft = False  # `admit` decides per request whether it gets the draft
    stores_pairs = False  # the device state keeps (feature, token) pairs for draft catch-ups
    max_accept = 0  # most draft tokens one step may accept
    max_gap = 0  # stores_pairs: pairs a request may hold before a catch-up
    spec: SpecConfig | AutoSpec | None = None  # what the user asked for
    prefill_programs: tuple[str, ...] = ("plain_prefill",)  # the prefill programs it may run
    # The compiled programs a scheduler keeps by default (`Scheduler(max_compiled_programs=None)`):
    # a prefill and a decode program per key, for the keys a serving mix visits.
    program_cache_size = 48

    def reserve(self, with_draft: bool) -> tuple[int, int]:
        """(slots one step may commit, slots past them it may write) for a request with or without
        the draft: the pages a decoding request needs for its next step."""
        return 1, step_lookahead(None)

    @property
    def lookahead(self) -> int:
        """The most slots past the committed length any step may write."""
        return max(self.reserve(True)[1], self.reserve(False)[1])

    def admit(self, key_at: Callable[[int], Key] | None, rows: int, prompt_len: int, max_tokens: int,
              cached: tuple[int, int] = (0, 0)) -> bool:
        """Whether a request admitted now decodes with the draft. `key_at(tokens)`: the program key
        of the batch it joins (`rows` rows) once its context holds `tokens` tokens (None before any
        decode step); `cached`: its prompt tokens the prefix cache holds with the draft's KV and
        without (the second only where `chooses_draft`; else the first)."""
        return self.uses_draft

    def plan(self, rows: Sequence[Row], key: Key) -> StepPlan:
        """The next decode step of `rows` at program key `key` (batch bucket, block-table width)."""
        return StepPlan(PLAIN_DECODE)

    def decode_plans(self) -> list[StepPlan]:
        """Every distinct program `plan` may return (what a warm-up compiles)."""
        return [StepPlan(PLAIN_DECODE)]

    def observe_prefill(self, with_draft: bool, key: Key, tokens: int, seconds: float | None) -> None:
        """A prefill batch finished (seconds None: not timed)."""

    def observe(self, plan: StepPlan, key: Key, seconds: float | None, rows: Sequence[Row],
                counts: np.ndarray) -> None:
        """A decode step finished: its time (None: not timed) and the tokens each of its `rows`
        (requests read from it) committed, `counts` (accepted draft tokens + 1)."""

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        """A request left the scheduler."""

    def stats(self) -> dict:
        return {}


class PlainDecoding(SpeculationPolicy):
    pass


class FixedSpeculation(SpeculationPolicy):
    uses_draft = True
    prefill_programs = ("prefill",)

    def __init__(self, shape: SpecConfig):
        self.spec = self.shape = shape
        self.max_accept = shape.max_accept

    def reserve(self, with_draft: bool) -> tuple[int, int]:
        return (self.shape.max_accept + 1, step_lookahead(self.shape)) if with_draft else super().reserve(False)

    def plan(self, rows: Sequence[Row], key: Key) -> StepPlan:
        return StepPlan(DECODE, self.shape)

    def decode_plans(self) -> list[StepPlan]:
        return [StepPlan(DECODE, self.shape)]


class AdaptivePolicy(SpeculationPolicy):
    """Adaptive speculation (adaptive.py) behind the policy interface, with the bookkeeping of the
    pairs a request's draft has not seen (`Row.gap`)."""

    uses_draft = stores_pairs = chooses_draft = True
    prefill_programs = ("prefill", "plain_prefill")
    # Where it explores, a key holds two prefill programs and up to a decode program per menu
    # shape, the storing one, the catch-up and the plain one: on the agent trace its working set
    # was 53 programs, and an LRU bound just under it recompiles one or two programs each pass.
    program_cache_size = 96

    def __init__(self, auto: AutoSpec):
        self.spec = auto
        self.adaptive = AdaptiveSpeculation(auto, settle_steps=4)  # see AdaptiveSpeculation._stands
        self.max_accept = auto.max_accept
        self.max_gap = auto.max_gap

    def reserve(self, with_draft: bool) -> tuple[int, int]:
        if not with_draft:
            return super().reserve(False)
        # A catch-up's writes past the stored pairs need no room (see the catch-up program).
        return self.max_accept + 1, max(step_lookahead(s) for s in self.spec.shapes)

    def admit(self, key_at: Callable[[int], Key] | None, rows: int, prompt_len: int, max_tokens: int,
              cached: tuple[int, int] = (0, 0)) -> bool:
        # Judged at the key of the request's mid-life (its prompt and half its expected output):
        # step costs grow with the context, so its start would flatter speculation and its end not.
        key = None if key_at is None else key_at(round(prompt_len + self.adaptive.expected_output_len(max_tokens) / 2))
        return self.adaptive.wants_draft(key, rows=rows, prompt_len=prompt_len, max_tokens=max_tokens, cached=cached)

    def plan(self, rows: Sequence[Row], key: Key) -> StepPlan:
        with_draft = sum(r.with_draft for r in rows)
        if with_draft < len(rows):  # a row without the draft has pages for one token a step
            self.adaptive.no_choice(any_with_draft=with_draft > 0)
            shape = None
        else:
            shape = self.adaptive.choose([r.id for r in rows], key)
        if not with_draft:
            return StepPlan(PLAIN_DECODE)
        # The draft catches up before it proposes, and when a row has no room left to store a pair.
        catch_up = any(r.gap >= self.max_gap or (shape is not None and r.gap) for r in rows)
        for r in rows:
            r.gap = 0 if shape is not None else (0 if catch_up else r.gap) + 1
        return StepPlan(DECODE if shape is not None else STORE_DECODE, shape, catch_up)

    def decode_plans(self) -> list[StepPlan]:
        # A catch-up runs before a speculative step as before a stored one: once is enough.
        return [*(StepPlan(DECODE, s) for s in self.spec.shapes), StepPlan(STORE_DECODE, catch_up=True),
                StepPlan(PLAIN_DECODE)]

    def observe_prefill(self, with_draft: bool, key: Key, tokens: int, seconds: float | None) -> None:
        self.adaptive.observe_prefill(with_draft, key, tokens, seconds)

    def observe(self, plan: StepPlan, key: Key, seconds: float | None, rows: Sequence[Row],
                counts: np.ndarray) -> None:
        plain = plan.program == PLAIN_DECODE
        accepted = {} if plain else {req.id: k - 1 for req, k in zip(rows, counts.tolist()) if req.with_draft}
        self.adaptive.observe(plan.shape, key, seconds, accepted, plain=plain)

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        self.adaptive.finished(request_id, num_output_tokens)

    def stats(self) -> dict:
        return {"adaptive": self.adaptive.stats()}


def check_speculation(target, draft: Draft | None,
                      spec: SpecConfig | AutoSpec | None) -> SpecConfig | AutoSpec | None:
    """The speculation a (target, draft) pair runs with (default SpecConfig() with a draft);
    raises on a mismatch."""
    if spec is not None and draft is None:
        raise ValueError("a SpecConfig needs a draft: pass draft=e3.load_draft(...), or drop spec for plain decoding")
    if draft is None:
        return None
    if not isinstance(draft, Draft):
        raise TypeError(f"draft must be an eagle3_jax Draft (from e3.load_draft); got {type(draft).__name__}")
    spec = spec or SpecConfig()
    if not isinstance(spec, (SpecConfig, AutoSpec)):
        raise TypeError(f"spec must be an e3.SpecConfig or e3.SpecConfig.auto(...); got {type(spec).__name__}")
    shapes = spec.shapes if isinstance(spec, AutoSpec) else (spec,)
    topk = max(s.topk for s in shapes)
    if topk > draft.config.draft_vocab_size:
        raise ValueError(f"SpecConfig.topk={topk} exceeds the draft vocabulary ({draft.config.draft_vocab_size})")
    windows = [w for w in draft.config.layer_windows or () if w is not None]
    depth = max(s.num_steps for s in shapes)
    if windows and min(windows) <= depth:  # a tree node must see all its ancestors (they are not position-indexed)
        raise ValueError(f"SpecConfig.num_steps={depth} is not below the draft's sliding_window={min(windows)}; use "
                         f"fewer draft steps")
    check_fits_target(draft.config, target.config)  # a draft loaded for another target
    target.capturing(draft.aux_layer_ids)  # raises when the target lacks a layer the draft reads
    return spec


def policy_for(spec: SpecConfig | AutoSpec | None) -> SpeculationPolicy:
    """The policy of a checked speculation setting (None: plain decoding)."""
    if spec is None:
        return PlainDecoding()
    if isinstance(spec, AutoSpec):
        return AdaptivePolicy(spec)
    return FixedSpeculation(spec)
