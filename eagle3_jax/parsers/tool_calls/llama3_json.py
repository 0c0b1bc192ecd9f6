"""Llama-3.1 / 3.2 / 3.3 JSON tool calls (vLLM's `llama3_json`): the answer is one or more JSON
objects `{"name": ..., "parameters": {...}}` (or `"arguments"`), separated by `;`, optionally
after `<|python_tag|>` (a special token, gone when specials are skipped in decoding).

An answer that starts with `{` (or the tag) may be a call, so it is held back until the output
ends; text before a tag mid-answer is content.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..markup import STRICT_JSON, ToolCall, json_object_text, known, settled
from .base import Schemas, Terminal, ToolCallParser, json_rule

TAG = "<|python_tag|>"


def _objects(text: str) -> list[Any] | None:
    """The JSON values of `text` separated by `;` and whitespace, or None when it is not that."""
    out, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return out or None
        try:
            value, at = STRICT_JSON.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        out.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
        if at < len(text):
            if text[at] != ";":
                return None
            at += 1


def _calls(text: str, schemas: Schemas) -> list[ToolCall] | None:
    objects = _objects(text)
    if objects is None:
        return None
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = json_object_text(obj.get("parameters", obj.get("arguments", {})))
        if arguments is None or not known(obj["name"], schemas):
            return None
        calls.append(ToolCall(obj["name"], arguments))
    return calls


class Llama3Json(ToolCallParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall]]:
        stripped = text.lstrip()
        whole = stripped.startswith("{") or stripped.startswith(TAG)
        if not final and (whole or TAG.startswith(stripped)):
            return "", []  # may be a call: nothing is settled before the output ends
        if whole:
            calls = _calls(stripped.removeprefix(TAG), schemas)
            return ("", calls) if calls is not None else (text, [])
        at = text.find(TAG)
        if at < 0:
            return settled(text, (TAG,), final), []
        if not final:
            return text[:at], []
        calls = _calls(text[at + len(TAG):], schemas)
        return (text[:at], calls) if calls is not None else (text, [])

    def calls_grammar(self, schemas: Mapping[str, Mapping[str, Any]], single: bool, terminal: Terminal) -> str:
        """`{"name": ..., "parameters": {...}}` objects, `; ` between them."""
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                            "parameters": dict(parameters) or {"type": "object"}},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, parameters in schemas.items()]}
        return "\n".join([f"start: call{'' if single else ' (' + json.dumps('; ') + ' call)*'}",
                          f"call: {json_rule(call)}"])
