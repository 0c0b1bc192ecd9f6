"""The interface of tool-call parsers, and the common case: calls inside one delimited section.

A parser reads the text a model generated (after any reasoning) and gives back the content and
the calls (`parse`). Called on text that is still growing (`final=False`) it gives only what no
later text can change: content up to where a tool section may begin, and the calls of sections
already closed. Parsers read messy markup as a reader would (`SectionParser`, `arguments.py`);
markup no reader can take as a call — arguments that do not read as a JSON object, a function
the request's tools do not have, a section with no call in it — is given back as content.

`calls_grammar` is the other direction: a grammar (llguidance's Lark) of the family's markup for
calls to the request's tools, their arguments held to each tool's parameter schema, which
structured output applies when a request forces a call (`tool_choice` "required" or named).
"""

from __future__ import annotations

import abc
import json
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ...structured.constraints import with_json_layout
from ..arguments import loads
from ..markup import ToolCall, first_marker, settled

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
    """Calls written between a section's begin and end markers (Kimi, MiniMax, DeepSeek), each call
    between `call_begin` and `call_end`; text outside the sections is content.

    Read as a reader would: each call of a section on its own (`call_of`), a call that does not
    read given back as content (as written) while the others are taken, text between calls
    (stray words, blanks) dropped with the markers; a section that holds no call that reads is
    content, whole, and an empty one is dropped. A section the output ends inside gives the calls
    that ended in it. With `bare_calls`, a call written outside any section is read as a section
    of its own."""

    begins: ClassVar[tuple[str, ...]]
    ends: ClassVar[tuple[str, ...]]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    bare_calls: ClassVar[bool] = False

    @abc.abstractmethod
    def call_of(self, body: str, schemas: Schemas) -> ToolCall | None:
        """The call whose markup between `call_begin` and `call_end` is `body`; None when it does
        not read as one."""

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

    def _read_call(self, body: str, schemas: Schemas) -> ToolCall | None:
        try:
            return self.call_of(body, schemas)
        except (ValueError, OverflowError, RecursionError):  # a value no JSON type holds: not a call
            return None

    def read_section(self, inner: str, schemas: Schemas) -> tuple[list[ToolCall], str] | None:
        """(the calls, the text given back as content) of a section's inner text; None when no
        call in it reads (then the section is content)."""
        calls, kept, at = [], [], 0
        while (start := inner.find(self.call_begin, at)) >= 0:
            body_at = start + len(self.call_begin)
            end, following = inner.find(self.call_end, body_at), inner.find(self.call_begin, body_at)
            if end < 0 or 0 <= following < end:  # never ended: up to the next call is not a call
                at = following if following >= 0 else len(inner)
                kept.append(inner[start:at])
                continue
            at = end + len(self.call_end)
            call = self._read_call(inner[body_at:end], schemas)
            if call is None:
                kept.append(inner[start:at])
            else:
                calls.append(call)
        if not calls:
            return ([], "") if not inner.strip() else None
        return calls, "".join(kept)

    def _closer(self, marker: str) -> tuple[str, ...]:
        """The markers that end what `marker` begins: a section's ends, or a bare call's end."""
        return (self.call_end,) if marker == self.call_begin else self.ends

    def parse(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall]]:
        content, calls, _ = self.parse_settled(text, final, schemas)
        return content, calls

    def parse_settled(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall], int]:
        # Sections are found scanning forward, so text up to the end of what is settled (content
        # before an open section or a possible marker, closed sections) parses the same alone.
        openers = self.begins + ((self.call_begin,) if self.bare_calls else ())
        content, calls, at = [], [], 0
        while True:
            begin = first_marker(text, openers, at)
            if begin is None:
                tail = settled(text[at:], openers, final)
                content.append(tail)
                return "".join(content), calls, at + len(tail)
            start, begin_marker = begin
            content.append(text[at:start])
            bare = begin_marker == self.call_begin
            inner_at = start if bare else start + len(begin_marker)  # a bare call is its own section
            end = first_marker(text, self._closer(begin_marker), start + len(begin_marker))
            if end is None:  # open: settled once it closes; read as it stands when the output ends
                if not final:
                    return "".join(content), calls, start
                read = self.read_section(text[inner_at:], schemas)
                content.append(text[start:] if read is None else read[1])
                calls += [] if read is None else read[0]
                return "".join(content), calls, len(text)
            stop, end_marker = end
            read = self.read_section(text[inner_at:stop + len(end_marker)] if bare else text[inner_at:stop], schemas)
            content.append(text[start:stop + len(end_marker)] if read is None else read[1])
            calls += [] if read is None else read[0]
            at = stop + len(end_marker)
