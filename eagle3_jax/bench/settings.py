"""Speculation settings of a benchmark run, as written on the command line.

A setting is `none` (plain decoding), `chain:num_steps:topk:num_draft_tokens` (topk must be 1)
or `tree:num_steps:topk:num_draft_tokens` (an EAGLE-2 dynamic tree), for example
`none,chain:3:1:4,tree:5:4:16`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..spec import SpecConfig

NO_SPEC = "none"
_SYNTAX = "none, chain:num_steps:topk:num_draft_tokens or tree:num_steps:topk:num_draft_tokens"


@dataclasses.dataclass(frozen=True)
class SpecSetting:
    """One speculation setting: its canonical name (`none`, `chain:3:1:4`, ...) and its SpecConfig."""

    name: str
    spec: SpecConfig | None

    @property
    def label(self) -> str:
        """Display name for tables and plots: `no-spec` or `EAGLE-3 chain 3:1:4`."""
        if self.spec is None:
            return "no-spec"
        kind, _, shape = self.name.partition(":")
        return f"EAGLE-3 {kind} {shape}"


def parse_spec(text: str) -> SpecSetting:
    """Parse one setting; raises ValueError naming the expected syntax on bad input."""
    s = text.strip().lower()
    if s == NO_SPEC:
        return SpecSetting(NO_SPEC, None)
    parts = s.split(":")
    if parts[0] not in ("chain", "tree"):
        raise ValueError(f"unknown speculation setting {text!r}; expected {_SYNTAX}")
    if len(parts) != 4:
        raise ValueError(f"speculation setting {text!r} needs 3 numbers after '{parts[0]}:'; expected {_SYNTAX}")
    try:
        steps, topk, tokens = (int(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"speculation setting {text!r} has a non-integer field; expected {_SYNTAX}") from None
    if parts[0] == "chain" and topk != 1:
        raise ValueError(f"a chain has topk=1; got {text!r}. Use tree:{steps}:{topk}:{tokens} for a tree")
    try:
        spec = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=tokens)
    except ValueError as e:
        raise ValueError(f"speculation setting {text!r}: {e}") from None
    return SpecSetting(f"{parts[0]}:{steps}:{topk}:{tokens}", spec)


def parse_specs(texts: Sequence[str]) -> list[SpecSetting]:
    """Parse a list of settings (a comma-split flag); rejects an empty list and duplicates."""
    settings = [parse_spec(t) for t in texts if t.strip()]
    if not settings:
        raise ValueError(f"give at least one speculation setting ({_SYNTAX})")
    names = [s.name for s in settings]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"speculation settings listed more than once: {', '.join(dups)}")
    return settings
