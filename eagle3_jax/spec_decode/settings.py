"""Speculation settings: what a user asks to run, and its one written form.

`SpecConfig` is one shape (a chain or a dynamic tree); `AutoSpec` a menu of shapes adaptive
speculation picks from per step (spec_decode/adaptive.py runs it). Every setting has one written form
everywhere (scripts, tables, logs): `none`, `chain:num_steps:topk:num_draft_tokens` (e.g.
`chain:3:1:4`), `tree:num_steps:topk:num_draft_tokens` (e.g. `tree:5:4:16`) or `auto[:K]`;
`SpecConfig.parse` reads it and `.name` writes it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence


NO_SPEC = "none"
AUTO = "auto"  # adaptive speculation: `auto` or `auto:max_chain_steps` (spec_decode/adaptive.py)
DEFAULT_AUTO_STEPS = 3
# The grammar of a written setting, in one place: a keyword, then its integer fields.
SPEC_KINDS: dict[str, tuple[str, ...]] = {
    "chain": ("num_steps", "topk", "num_draft_tokens"),
    "tree": ("num_steps", "topk", "num_draft_tokens"),
}
SPEC_SYNTAX = ("none, chain:num_steps:topk:num_draft_tokens (e.g. chain:3:1:4), "
               "tree:num_steps:topk:num_draft_tokens (e.g. tree:5:4:16) or auto[:max_chain_steps] (adaptive)")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """EAGLE speculation shape.

    num_steps: draft levels per step (the tree's maximum depth).
    topk: children expanded per node (1 = chain).
    num_draft_tokens: tree nodes verified per step, root included (a chain has num_steps + 1).
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("num_steps", "topk", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SpecConfig.{name} must be an integer >= 1; got {v!r}")
        if self.num_draft_tokens < 2:
            raise ValueError("SpecConfig.num_draft_tokens must be >= 2 (the root plus at least one draft token)")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"a chain (topk=1) verifies num_steps + 1 tokens: use num_draft_tokens={self.num_steps + 1} "
                f"for num_steps={self.num_steps} (got {self.num_draft_tokens})"
            )
        if self.num_draft_tokens - 1 > self.pool_size:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} exceeds the {self.pool_size} candidates that "
                f"num_steps={self.num_steps}, topk={self.topk} produce (+1 root); lower it or raise topk/num_steps"
            )

    @classmethod
    def auto(cls, num_steps: int = DEFAULT_AUTO_STEPS, trees: "tuple[SpecConfig, ...]" = (), **options):
        """Adaptive speculation (an `AutoSpec`, run by the Scheduler): each decode step picks no
        speculation, a chain of 1..num_steps draft tokens or one of `trees`, whichever promises the
        most output tokens per second (see spec_decode/adaptive.py; `options` tune it)."""
        return AutoSpec.chains(num_steps, trees, **options)

    @functools.cached_property  # read several times before every adaptive decode step
    def name(self) -> str:
        """The canonical written form, `chain:3:1:4` or `tree:5:4:16` (a tree with topk=1 is a chain)."""
        kind = "chain" if self.topk == 1 else "tree"
        return f"{kind}:{self.num_steps}:{self.topk}:{self.num_draft_tokens}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str):
        """A written setting -> its SpecConfig, an AutoSpec for `auto` / `auto:K` (no speculation
        or chains of up to K draft tokens, chosen per step), or None for `none` (plain decoding).

        Raises ValueError naming the expected syntax (SPEC_SYNTAX) on bad input.
        """
        keyword, *fields = text.strip().lower().split(":")
        if keyword == NO_SPEC and not fields:
            return None
        if keyword == AUTO and len(fields) <= 1:
            try:
                return cls.auto(int(fields[0]) if fields else DEFAULT_AUTO_STEPS)
            except ValueError:
                raise ValueError(f"speculation setting {text!r}: auto takes the longest chain to try, an "
                                 f"integer >= 1 (e.g. auto:3); expected {SPEC_SYNTAX}") from None
        if keyword not in SPEC_KINDS:
            raise ValueError(f"unknown speculation setting {text!r}; expected {SPEC_SYNTAX}")
        names = SPEC_KINDS[keyword]
        if len(fields) != len(names):
            raise ValueError(f"speculation setting {text!r} needs {len(names)} numbers after '{keyword}:' "
                             f"({':'.join(names)}); expected {SPEC_SYNTAX}")
        try:
            values = dict(zip(names, (int(f) for f in fields)))
        except ValueError:
            raise ValueError(f"speculation setting {text!r} has a non-integer field; expected {SPEC_SYNTAX}") from None
        if keyword == "chain" and values["topk"] != 1:
            raise ValueError(f"a chain has topk=1; got {text!r}. Use tree:{':'.join(fields)} for a tree")
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"speculation setting {text!r}: {e}") from None

    @property
    def pool_size(self) -> int:
        """Candidates the draft proposes: topk at depth 1, topk * topk at each later depth."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def max_accept(self) -> int:
        """Most draft tokens one step can accept (the tree depth, at most num_steps)."""
        return min(self.num_steps, self.num_draft_tokens - 1)


# Shapes are menu entries; None is "no speculation". Names are the speculation notation.
Shape = SpecConfig | None


def shape_name(shape: Shape) -> str:
    return NO_SPEC if shape is None else shape.name


def shape_depth(shape: Shape) -> int:
    """Most draft tokens a step of this shape can accept (0 without speculation)."""
    return 0 if shape is None else shape.max_accept


def is_chain(shape: Shape) -> bool:
    return shape is not None and shape.topk == 1


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """Adaptive speculation over a menu of step shapes (`SpecConfig.auto(...)` builds one).

    menu: the shapes a step may run; None (no speculation) is always among them.
    hysteresis: speculation must promise this much more throughput than no speculation to replace
        it in a step (and the reverse), and this much more than plain decoding for admissions to
        start giving new requests the draft (they stop once it promises nothing).
        Step times leave out what speculation costs between steps (the draft's prefill,
        catch-ups), and on a busy host their medians wander by several percent: at 5% a CPU
        server near break-even drafted requests it then could not speculate for.
    shape_margin: another speculative shape must promise this much more throughput to replace
        the current speculative one. Smaller than `hysteresis`: trading one compiled speculative
        program for another costs nothing (no catch-up, no draft to start or stop), so a wide band
        only keeps a worse shape; this one keeps two shapes whose rates differ by less than their
        timings' noise from trading places every step.
    prior_weight: how many steps of a request's own acceptance weigh as much as the global rate
        (a request's first steps often accept less than its later ones: at 2, three bad first
        steps kept a request from speculating for the rest of its 64 tokens).
    request_decay: per-decode-step decay of a request's own acceptance counts (recent steps count
        most; steps without speculation fade them too, so a request judged on a few bad steps is
        judged by the global rates again and speculates again if they promise a gain).
    max_gap: steps a request may go without draft work before a step catches its draft up (one
        draft pass over the stored tokens; a buffer of max_gap x 3 x target hidden per sequence).
    probe_every: after this many steps in a row without speculation, `probe_steps` speculative
        steps in a row measure acceptance again (in a row, so a request is measured past its first
        speculative step, which may accept least: on random prompts it accepted a seventh of the
        steady rate, and probes of single steps kept confirming that speculation does not pay).
    probe_steps: speculative steps in a row per probe (see probe_every).
    refresh_every: every this many steps at a program key (once explored), the shape other than
        the current one timed there longest ago, of those within `skip_margin` of the best rate, is
        timed again, so a step time measured once (cold, or in a slow second of a shared host)
        cannot keep a close contender out for good.
    skip_margin: a shape predicted (from other keys) below (1 - skip_margin) x the best is not tried.
    resample_every: after this many decode steps in which no running request had the draft, the
        requests admitted next get it whatever the prediction, until a step runs with every row
        drafted (only such a batch speculates and measures acceptance).
    """

    menu: tuple[Shape, ...]
    hysteresis: float = 0.10
    shape_margin: float = 0.03
    prior_weight: float = 8.0
    request_decay: float = 0.95
    max_gap: int = 16
    probe_every: int = 64
    probe_steps: int = 4
    skip_margin: float = 0.25
    resample_every: int = 4096
    refresh_every: int = 128

    def __post_init__(self) -> None:
        menu = tuple(dict.fromkeys(self.menu))  # drop repeats, keep order
        if any(s is not None and not isinstance(s, SpecConfig) for s in menu):
            raise ValueError("AutoSpec.menu holds SpecConfig shapes (or None for no speculation)")
        if None not in menu:
            menu = (None, *menu)
        if len(menu) < 2:
            raise ValueError("AutoSpec.menu needs at least one speculative shape")
        object.__setattr__(self, "menu", menu)
        for name in ("hysteresis", "shape_margin"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"AutoSpec.{name} must be in [0, 1); got {getattr(self, name)!r}")
        if not self.prior_weight > 0:
            raise ValueError(f"AutoSpec.prior_weight must be > 0; got {self.prior_weight!r}")
        if not 0 < self.request_decay <= 1:
            raise ValueError(f"AutoSpec.request_decay must be in (0, 1]; got {self.request_decay!r}")
        for name in ("max_gap", "probe_every", "probe_steps", "resample_every", "refresh_every"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"AutoSpec.{name} must be an integer >= 1; got {value!r}")
        if not 0 <= self.skip_margin < 1:
            raise ValueError(f"AutoSpec.skip_margin must be in [0, 1); got {self.skip_margin!r}")

    @classmethod
    def chains(cls, num_steps: int = 3, trees: Sequence[SpecConfig] = (), **options) -> "AutoSpec":
        """No speculation, chains of 1..num_steps draft tokens, and the given trees."""
        if not (isinstance(num_steps, int) and num_steps >= 1):
            raise ValueError(f"num_steps must be an integer >= 1; got {num_steps!r}")
        chains = [SpecConfig(k, 1, k + 1) for k in range(1, num_steps + 1)]
        return cls(menu=(None, *chains, *trees), **options)

    @property
    def shapes(self) -> tuple[SpecConfig, ...]:
        """The speculative shapes of the menu."""
        return tuple(s for s in self.menu if s is not None)

    @property
    def max_accept(self) -> int:
        return max(s.max_accept for s in self.shapes)

    @property
    def name(self) -> str:
        """`auto:K` for the menu `SpecConfig.auto(K)` builds, else the menu written out."""
        chains = [s for s in self.shapes if is_chain(s)]
        k = len(chains)
        if self.menu == (None, *(SpecConfig(i, 1, i + 1) for i in range(1, k + 1))):
            return f"{AUTO}:{k}"
        return f"{AUTO}({', '.join(shape_name(s) for s in self.menu)})"

    def __str__(self) -> str:
        return self.name
