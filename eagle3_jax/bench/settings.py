"""Speculation settings of a benchmark run, as written on the command line.

A setting is written as `SpecConfig.parse` reads it: `none` (plain decoding),
`chain:num_steps:topk:num_draft_tokens` or `tree:num_steps:topk:num_draft_tokens` (an EAGLE-2
dynamic tree), for example `none,chain:3:1:4,tree:5:4:16`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..spec_decode import SpecConfig
from ..spec_decode.settings import NO_SPEC, SPEC_SYNTAX


@dataclasses.dataclass(frozen=True)
class SpecSetting:
    """One speculation setting: its canonical name (`none`, `chain:3:1:4`, ...) and its SpecConfig."""

    name: str
    spec: SpecConfig | None

    @property
    def label(self) -> str:
        """Display name for tables and plots: `no-spec` or `EAGLE-3 chain:3:1:4`."""
        return "no-spec" if self.spec is None else f"EAGLE-3 {self.name}"


def parse_spec(text: str) -> SpecSetting:
    """Parse one setting; raises ValueError naming the expected syntax on bad input."""
    spec = SpecConfig.parse(text)
    return SpecSetting(NO_SPEC if spec is None else spec.name, spec)


def parse_specs(texts: Sequence[str]) -> list[SpecSetting]:
    """Parse a list of settings (a comma-split flag); rejects an empty list and duplicates."""
    settings = [parse_spec(t) for t in texts if t.strip()]
    if not settings:
        raise ValueError(f"give at least one speculation setting ({SPEC_SYNTAX})")
    names = [s.name for s in settings]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"speculation settings listed more than once: {', '.join(dups)}")
    return settings
