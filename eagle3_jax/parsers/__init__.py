"""Parsers of model outputs: tool calls and reasoning, in each family's markup.

Tool-call parsers (`tool_calls/`, vLLM's names): `kimi_k2`, `minimax_m2`, `deepseek_v3`,
`deepseek_v31`, `llama3_json`. Reasoning parsers (`reasoning/`): `kimi_k2`, `deepseek_r1`,
`deepseek_v3`, `minimax_m2`, `minimax_m2_append_think`. `output.py` runs both over one choice's
text, whole or streaming (the server's chat route and `Engine.chat` use it). For offline use:

    content, tool_calls = parse_tool_calls(text, "kimi_k2", tools=None)   # OpenAI-shaped dicts
    reasoning, content = parse_reasoning(text, "kimi_k2")
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .markup import ParserError, ToolCall, tool_schemas
from .output import OutputDelta, OutputParsers, OutputParsing, ParsedOutput, StreamingParser, message_content, parse_output
from .reasoning import REASONING_PARSERS, ReasoningParser, reasoning_parser
from .tool_calls import TOOL_CALL_PARSERS, ToolCallParser, tool_call_parser


def parse_tool_calls(text: str, parser: str, tools: Sequence[Mapping[str, Any]] | None = None
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a model's answer in `parser`'s markup: the calls as OpenAI's
    `tool_calls` items (arguments a JSON string), the text around them as content (None when it
    is empty and there are calls). With `tools`, a call of a function they lack is not a call.
    Messy markup is read as a reader would; markup no reader can take as a call is content."""
    content, calls = tool_call_parser(parser).parse(text, True, tool_schemas(tools))
    return message_content(content, None, calls), [c.openai(i, text) for i, c in enumerate(calls)]


def parse_reasoning(text: str, parser: str, **template_kwargs: Any) -> tuple[str | None, str | None]:
    """(reasoning, content) of a model's answer, as vLLM's parsers give them: content None when
    nothing follows the reasoning (or it never ended); reasoning None when the parser splits none
    off. `template_kwargs` as the prompt was rendered with (`thinking=False`: no reasoning)."""
    reasoner = reasoning_parser(parser, template_kwargs)
    if reasoner is None:
        return None, text
    reasoning, content = reasoner.split(text, True)
    return reasoning, reasoner.tidy(content, True) if content else None


__all__ = [
    "OutputDelta",
    "OutputParsers",
    "OutputParsing",
    "ParsedOutput",
    "ParserError",
    "REASONING_PARSERS",
    "ReasoningParser",
    "StreamingParser",
    "TOOL_CALL_PARSERS",
    "ToolCall",
    "ToolCallParser",
    "message_content",
    "parse_output",
    "parse_reasoning",
    "parse_tool_calls",
    "reasoning_parser",
    "tool_call_parser",
]
