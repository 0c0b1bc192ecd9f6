"""One choice's output parsed into reasoning, content and tool calls, whole or as it streams.

`parse_output` reads a whole text: the reasoning parser (if any) splits off the reasoning, the
tool-call parser (if any) reads the rest. `StreamingParser` re-parses a choice's whole text at
each delta and hands out only what is new: under speculation a delta holds several tokens, so a
marker can arrive glued to text or to the next call, and parsing each delta alone would cut
calls. Every parser gives, on a growing text, only what later text cannot change, so the streamed
deltas always fold to `parse_output` of the whole text.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

from .markup import ToolCall, tool_schemas
from .reasoning import ReasoningParser
from .tool_calls import ToolCallParser

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    """An output's parts; `reasoning` is None without a reasoning parser."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclasses.dataclass(frozen=True)
class OutputDelta:
    """What one delta adds: reasoning and content text, and the calls completed (with their index)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[tuple[int, ToolCall], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclasses.dataclass(frozen=True)
class OutputParsers:
    """The parsers a request's output goes through (either may be None) and its tools' schemas."""

    reasoning: ReasoningParser | None = None
    tool_calls: ToolCallParser | None = None
    schemas: Mapping[str, Mapping[str, Any]] | None = None

    @staticmethod
    def of(reasoning: ReasoningParser | None, tool_calls: ToolCallParser | None,
           tools: Sequence[Mapping[str, Any]] | None = None) -> "OutputParsers":
        return OutputParsers(reasoning, tool_calls, tool_schemas(tools))

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_calls is not None


def parse_output(text: str, parsers: OutputParsers, final: bool = True) -> ParsedOutput:
    """`text`'s reasoning, content and calls; unless `final`, only what later text cannot change."""
    reasoning, rest = None, text
    if parsers.reasoning is not None:
        reasoning, rest = parsers.reasoning.split(text, final)
        if rest is None:
            return ParsedOutput("", reasoning or "")
    if parsers.tool_calls is None:
        return ParsedOutput(rest, reasoning)
    content, calls = parsers.tool_calls.parse(rest, final, parsers.schemas)
    return ParsedOutput(content, reasoning, tuple(calls))


class StreamingParser:
    """A choice's text, pushed delta by delta; each push returns what it adds (`OutputDelta`)."""

    def __init__(self, parsers: OutputParsers):
        self.parsers = parsers
        self.text = ""
        self.sent = ParsedOutput("", "" if parsers.reasoning is not None else None)

    def push(self, text: str, final: bool = False) -> OutputDelta:
        self.text += text
        if not text and not final:
            return OutputDelta()
        now = parse_output(self.text, self.parsers, final)
        sent = self.sent
        reasoning_sent = sent.reasoning or ""
        if not (now.content.startswith(sent.content) and (now.reasoning or "").startswith(reasoning_sent)
                and now.tool_calls[:len(sent.tool_calls)] == sent.tool_calls):
            # every parser settles only what later text keeps; should one not, say so, never resend
            logger.error("the %s output parser took back what it had settled; the streamed reply may differ from "
                         "the whole one", self.parsers)
            return OutputDelta()
        self.sent = now
        new_calls = tuple(enumerate(now.tool_calls))[len(sent.tool_calls):]
        return OutputDelta(now.content[len(sent.content):], (now.reasoning or "")[len(reasoning_sent):], new_calls)
