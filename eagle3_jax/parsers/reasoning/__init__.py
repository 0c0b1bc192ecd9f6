"""Reasoning parsers by the names vLLM gives them (`--reasoning_parser`), one file per family."""

from __future__ import annotations

from typing import Any, Mapping

from ..markup import ParserError
from .base import ReasoningParser
from .deepseek import DeepSeekR1, DeepSeekV3
from .kimi_k2 import KimiK2
from .minimax_m2 import MiniMaxM2, MiniMaxM2AppendThink

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (KimiK2, DeepSeekR1, DeepSeekV3, MiniMaxM2, MiniMaxM2AppendThink)}


def reasoning_parser(name: str, template_kwargs: Mapping[str, Any] | None = None) -> ReasoningParser | None:
    """The parser called `name`, or None when the request's chat-template kwargs turn thinking off
    for it; ParserError naming the choices for an unknown name."""
    if name not in REASONING_PARSERS:
        raise ParserError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    cls = REASONING_PARSERS[name]
    return cls() if cls.thinks(template_kwargs or {}) else None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "reasoning_parser"]
