"""One choice's output parsed into reasoning, content and tool calls, whole or as it streams.

The reasoning parser (if any) splits off the reasoning, the tool-call parser (if any) reads the
rest. `StreamingParser` takes a choice's text delta by delta and hands out only what is new:
under speculation a delta holds several tokens, so a marker can arrive glued to text or to the
next call, and parsing each delta alone would cut calls. Every parser gives, on a growing text,
only what later text cannot change, so the streamed deltas always fold to `parse_output` of the
whole text (one push of all of it). `OutputParsing` is a front end's choice of parsers by name,
and what a request makes of it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

from .markup import ToolCall, tool_schemas
from .reasoning import ReasoningParser, reasoning_parser
from .tool_calls import ToolCallParser, tool_call_parser

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    """An output's parts; `reasoning` is None without a reasoning parser."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def message_content(self) -> str | None:
        return message_content(self.content, self.reasoning, self.tool_calls)


def message_content(content: str, reasoning: str | None, calls) -> str | None:
    """An answer's `content` as OpenAI writes it: None when the answer is only reasoning and calls."""
    return content or (None if calls or reasoning else "")


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


@dataclasses.dataclass(frozen=True)
class OutputParsing:
    """A front end's parsers of chat outputs, by vLLM's names (None: off); ParserError for a name
    that is none of them."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_tools", tool_call_parser(self.tool_call_parser) if self.tool_call_parser else None)
        if self.reasoning_parser:
            reasoning_parser(self.reasoning_parser)  # the name checked now, the parser made per request

    @property
    def tool_calls(self) -> ToolCallParser | None:
        """The tool-call parser (None: off)."""
        return self._tools

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the family's template expects its tool-call history (as given
        without a tool-call parser)."""
        return self._tools.prepare_messages(messages) if self._tools else [dict(m) for m in messages]

    def parsers(self, tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any], *,
                parse_calls: bool = True, opens_answer: bool = True) -> OutputParsers:
        """What a request's output goes through: calls when `parse_calls`; reasoning when the
        prompt opens a new answer (`opens_answer`: not when the final message is continued or no
        generation prompt is added) and the template kwargs do not turn thinking off."""
        reasoner = reasoning_parser(self.reasoning_parser, template_kwargs) \
            if self.reasoning_parser and opens_answer else None
        return OutputParsers.of(reasoner, self._tools if parse_calls else None, tools)


def parse_output(text: str, parsers: OutputParsers, final: bool = True) -> ParsedOutput:
    """`text`'s reasoning, content and calls; unless `final`, only what later text cannot change."""
    stream = StreamingParser(parsers)
    stream.push(text, final)
    return stream.sent


class StreamingParser:
    """A choice's text, pushed delta by delta; each push returns what it adds (`OutputDelta`).

    Each push parses what can still change, not the whole text: while the reasoning goes on, its
    end is looked for only in the new text; once it ended, its split is kept, and the tool-call
    parser reads only the text after what it has settled (`ToolCallParser.parse_settled`). The
    result is `parse_output` of the whole text, at any split of it into deltas."""

    def __init__(self, parsers: OutputParsers):
        self.parsers = parsers
        self.text = ""
        self.sent = ParsedOutput("", "" if parsers.reasoning is not None else None)
        # once the reasoning ended: (reasoning, lead, start), the content being lead + text[start:]
        self._split: tuple[str | None, str, int] | None = None
        self._settled = (0, "", ())  # of the content: (length accounted for, content, calls)

    def _reasoned(self, final: bool, searched: int) -> tuple[str | None, str | None]:
        """(reasoning, content) as the reasoning parser splits the text so far."""
        if self._split is not None:
            reasoning, lead, start = self._split
            return reasoning, lead + self.text[start:]
        if self.parsers.reasoning is None:
            return None, self.text
        longest = max(map(len, self.parsers.reasoning.markers), default=0)
        reasoning, content = self.parsers.reasoning.split(self.text, final, max(0, searched - longest))
        if content is not None:  # ended: the split stays where it is
            if self.text.endswith(content):
                self._split = (reasoning, "", len(self.text) - len(content))
            elif content.endswith(self.text):
                self._split = (reasoning, content[: len(content) - len(self.text)], 0)
        return reasoning, content

    def _parse(self, final: bool, searched: int) -> ParsedOutput:
        reasoning, content = self._reasoned(final, searched)
        if content is not None and self.parsers.reasoning is not None:
            content = self.parsers.reasoning.tidy(content, final)
        if content is None:
            return ParsedOutput("", reasoning or "")
        if self.parsers.tool_calls is None:
            return ParsedOutput(content, reasoning)
        done, done_content, done_calls = self._settled
        if done > len(content):  # the split moved (a reasoning parser that does not keep it): start over
            done, done_content, done_calls = 0, "", ()
        more, calls, used = self.parsers.tool_calls.parse_settled(content[done:], final, self.parsers.schemas)
        if used:  # what it returned lies in the part it settled
            self._settled = (done + used, done_content + more, done_calls + tuple(calls))
        return ParsedOutput(done_content + more, reasoning, done_calls + tuple(calls))

    def push(self, text: str, final: bool = False) -> OutputDelta:
        searched = len(self.text)
        self.text += text
        if not text and not final:
            return OutputDelta()
        now = self._parse(final, searched)
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
