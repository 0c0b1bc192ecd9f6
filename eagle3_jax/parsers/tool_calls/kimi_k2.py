"""Kimi-K2 / K2.5 tool calls (vLLM's `kimi_k2`):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|>...<|tool_calls_section_end|>

A call's id is its own `functions.NAME:IDX` (IDX counts the conversation's calls from 0), and the
template writes the ids of the history as given, so `prepare_messages` rewrites other ids (from
another provider, or made up by a client) to that form, in the tool results too. `NAME:IDX` is
read as well, and a bare counter `IDX` names the function when the request's tools leave one
choice (its only tool, or the only one whose parameters hold every argument).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from ..arguments import arguments_text, loads
from ..markup import ToolCall, known
from .base import Schemas, SectionParser, Terminal, json_rule, literal

_ARGUMENTS = "<|tool_call_argument_begin|>"
_ID = re.compile(r"(?:functions\.)?(?P<name>[^:\s]+):\d+")


def _properties(parameters: Any) -> set[str]:
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    return set(properties) if isinstance(properties, Mapping) else set()


def named_by_arguments(arguments: str, schemas: Schemas) -> str | None:
    """The function a call with a bare counter for an id calls: the request's only tool, or the
    one tool whose parameters hold every argument; None when that is not one tool."""
    if not schemas:
        return None
    if len(schemas) == 1:
        return next(iter(schemas))
    keys = set(loads(arguments))
    fits = [name for name, parameters in schemas.items() if keys <= _properties(parameters)]
    return fits[0] if len(fits) == 1 else None


class KimiK2(SectionParser):
    name = "kimi_k2"
    arguments_as = "text"  # its template writes string arguments as they are (the model's own JSON)
    # the singular spelling appears in some Kimi outputs; vLLM takes both
    begins = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    ends = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    call_begin, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"
    bare_calls = True  # a call the model wrote without its section is still a call

    def call_of(self, body: str, schemas: Schemas) -> ToolCall | None:
        ident, marker, arguments = body.partition(_ARGUMENTS)
        ident, arguments = ident.strip(), arguments_text(arguments)
        if not marker or arguments is None:
            return None
        if ident.isdigit():  # a bare counter: the function is the one the request's tools allow
            name = named_by_arguments(arguments, schemas)
            return None if name is None else ToolCall(name, arguments, id=f"functions.{name}:{ident}")
        named = _ID.fullmatch(ident)
        if named is None or not known(named["name"], schemas):
            return None
        return ToolCall(named["name"], arguments, id=ident)

    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        return [f"call_{index}: {terminal('<|tool_call_begin|>')} {literal(f'functions.{name}:')} /[0-9]{{1,4}}/ "
                f"{terminal('<|tool_call_argument_begin|>')} args_{index} {terminal('<|tool_call_end|>')}",
                f"args_{index}: {json_rule(parameters)}"]

    def prepare_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Ids of earlier calls as Kimi writes them (`functions.NAME:IDX`, IDX the call's number in
        the conversation), in the assistant's calls and in the tool results that answer them."""
        renamed: dict[str, str] = {}
        count, out = 0, []
        for message in super().prepare_messages(messages):
            calls = message.get("tool_calls")
            if message.get("role") == "assistant" and isinstance(calls, list):
                message["tool_calls"] = new_calls = []
                for call in calls:
                    call = dict(call) if isinstance(call, Mapping) else call
                    function = call.get("function") if isinstance(call, dict) else None
                    name = function.get("name") if isinstance(function, Mapping) else None
                    if isinstance(name, str):
                        old = call.get("id")
                        ident = old if isinstance(old, str) and _ID.fullmatch(old) else f"functions.{name}:{count}"
                        if isinstance(old, str):
                            renamed[old] = ident
                        call["id"] = ident
                        count += 1
                    new_calls.append(call)
            elif message.get("role") == "tool" and message.get("tool_call_id") in renamed:
                message["tool_call_id"] = renamed[message["tool_call_id"]]
            out.append(message)
        return out
