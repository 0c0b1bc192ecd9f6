"""The interface of tool-call parsers, and the common case: calls inside one delimited section.

A parser reads the text a model generated (after any reasoning) and gives back the content and
the calls (`parse`). Called on text that is still growing (`final=False`) it gives only what no
later text can change: content up to where a tool section may begin, and the calls of sections
already closed. Markup that does not parse — a section never closed, arguments that are not a
JSON object, a function the request's tools do not have — is given back as content, whole.

`calls_grammar` is the other direction: a grammar (llguidance's Lark) of the family's markup for
calls to the request's tools, their arguments held to each tool's parameter schema, which
structured output applies when a request forces a call (`tool_choice` "required" or named).
"""

from __future__ import annotations

import abc
import json
import re
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ...structured.constraints import with_json_layout
from ..markup import ToolCall, first_marker, loads, settled

Schemas = Mapping[str, Mapping[str, Any]] | None  # markup.tool_schemas: {name: parameters}, None = any name
# A marker's Lark terminal: its token (`<[id]>`) when the tokenizer has it as one, else its text.
Terminal = Callable[[str], str]


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: Mapping[str, Any] | None) -> str:
    """A Lark rule body for a JSON value of `schema` (an object without one), laid out as
    structured output writes JSON (constraints.JSON_LAYOUT)."""
    schema = schema if isinstance(schema, Mapping) and schema else {"type": "object"}
    return "%json " + json.dumps(with_json_layout(schema), ensure_ascii=False)


class ToolCallParser(abc.ABC):
    """A model family's tool-call markup -> (content, calls)."""

    name: ClassVar[str]  # as vLLM names it (`--tool_call_parser`)
    # How the family's chat template reads the `arguments` of earlier calls: "object" (a mapping, the
    # transformers convention: templates iterate or `tojson` it) or "text" (JSON text written as is).
    arguments_as: ClassVar[str] = "object"

    @abc.abstractmethod
    def parse(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall]]:
        """(content, calls) of `text`; unless `final`, only what later text cannot change."""

    def parse_settled(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall], int]:
        """`parse`, and how much of `text` its content and calls account for whatever follows: a
        streaming caller parses only the text after that next time, and adds the results. 0 (the
        default): the whole text is parsed again each time."""
        content, calls = self.parse(text, final, schemas)
        return content, calls, 0

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as this family's chat template expects its tool-call history: each
        earlier call's arguments as `arguments_as` says (OpenAI clients send JSON text)."""
        return [_with_arguments_as(m, self.arguments_as) for m in messages]

    @abc.abstractmethod
    def calls_grammar(self, schemas: Mapping[str, Mapping[str, Any]], single: bool, terminal: Terminal) -> str:
        """A Lark grammar of this family's markup for one call (`single`) or one or more calls,
        each to one of the tools `schemas` ({name: parameters schema}) with arguments its schema
        allows; `terminal` writes a marker."""


def _arguments(value: Any, form: str) -> Any:
    if form == "text" and isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    if form == "object" and isinstance(value, str):
        try:
            parsed = loads(value)
        except (ValueError, RecursionError):
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _with_arguments_as(message: Mapping[str, Any], form: str) -> dict[str, Any]:
    """A copy of `message` whose tool calls' arguments are in `form` (other fields as given)."""
    message = dict(message)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call["function"].get("arguments"), form)}}
            if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping) else call for call in calls]
    return message


class SectionParser(ToolCallParser):
    """Calls written between a begin and an end marker (Kimi, MiniMax, DeepSeek): text outside the
    sections is content; a closed section must hold only back-to-back matches of `call`, each of
    which `call_of` turns into a call, else the whole section is content."""

    begins: ClassVar[tuple[str, ...]]
    ends: ClassVar[tuple[str, ...]]
    call: ClassVar[re.Pattern[str]]

    @abc.abstractmethod
    def call_of(self, match: re.Match[str], schemas: Schemas) -> ToolCall | None:
        """The call one match of `call` writes; None when it is malformed."""

    @abc.abstractmethod
    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        """Lark rules, `call_{index}` first, of one call to `name` in this family's markup."""

    def calls_grammar(self, schemas: Mapping[str, Mapping[str, Any]], single: bool, terminal: Terminal) -> str:
        """The section markers around one call or more (`ToolCallParser.calls_grammar`)."""
        # a blank line may come first (templates put one after the reasoning)
        rules = [f"start: lead? {terminal(self.begins[0])} {'call' if single else 'call+'} {terminal(self.ends[0])}",
                 "lead: /\\n{1,2}/",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
        for i, (name, parameters) in enumerate(schemas.items()):
            rules += self.call_rules(i, name, parameters, terminal)
        return "\n".join(rules)

    def calls_in(self, inner: str, schemas: Schemas) -> list[ToolCall] | None:
        """The calls of a section's inner text; None when it is malformed."""
        matches = sequence(self.call, inner)
        try:
            calls = [self.call_of(m, schemas) for m in matches or ()]
        except (ValueError, OverflowError, RecursionError):  # a value no JSON type holds: not a call
            return None
        return None if not calls or None in calls else calls

    def parse(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall]]:
        content, calls, _ = self.parse_settled(text, final, schemas)
        return content, calls

    def parse_settled(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall], int]:
        # Sections are found scanning forward, so text up to the end of what is settled (content
        # before an open section or a possible marker, closed sections) parses the same alone.
        content, calls, at = [], [], 0
        while True:
            begin = first_marker(text, self.begins, at)
            if begin is None:
                tail = settled(text[at:], self.begins, final)
                content.append(tail)
                return "".join(content), calls, at + len(tail)
            start, begin_marker = begin
            content.append(text[at:start])
            end = first_marker(text, self.ends, start + len(begin_marker))
            if end is None:  # open: settled only once it closes, or as content when the output ends
                if final:
                    content.append(text[start:])
                    start = len(text)
                return "".join(content), calls, start
            stop, end_marker = end
            found = self.calls_in(text[start + len(begin_marker):stop], schemas)
            if found is None:
                content.append(text[start:stop + len(end_marker)])
            else:
                calls += found
            at = stop + len(end_marker)


def sequence(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """`text` as back-to-back matches of `pattern` (whitespace around them allowed), or None when
    anything else is in it or nothing matched."""
    matches, at = [], 0
    while at < len(text) and not text[at:].isspace():
        m = pattern.match(text, at)
        if m is None or m.end() == at:
            return None
        matches.append(m)
        at = m.end()
    return matches or None
