"""Tool-call parsers by the names vLLM gives them (`--tool_call_parser`), one file per format."""

from __future__ import annotations

from ..markup import ParserError
from .base import ToolCallParser
from .deepseek_v3 import DeepSeekV3
from .deepseek_v31 import DeepSeekV31
from .kimi_k2 import KimiK2
from .llama3_json import Llama3Json
from .minimax_m2 import MiniMaxM2

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (KimiK2, MiniMaxM2, DeepSeekV3, DeepSeekV31, Llama3Json)}


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser called `name`; ParserError naming the choices otherwise."""
    if name not in TOOL_CALL_PARSERS:
        raise ParserError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


__all__ = ["TOOL_CALL_PARSERS", "ToolCallParser", "tool_call_parser"]
