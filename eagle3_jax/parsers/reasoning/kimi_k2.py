"""Kimi-K2 thinking / K2.5 reasoning (vLLM's `kimi_k2`): the prompt ends with `<think>` unless the
request sets the template kwarg `thinking` false; reasoning ends at `</think>`, or straight at a
tool-call section (or a call written without its section)."""

from __future__ import annotations

from .base import ThinkParser


class KimiK2(ThinkParser):
    name = "kimi_k2"
    ends_before = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", "<|tool_call_begin|>")
