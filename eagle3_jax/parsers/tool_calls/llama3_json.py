"""Llama-3.1 / 3.2 / 3.3 JSON tool calls (vLLM's `llama3_json`): JSON objects
`{"name": ..., "parameters": {...}}` (or `"arguments"`), one after another (`;`, blanks or lines
between them), after `<|python_tag|>` or not (a special token, gone when specials are skipped in
decoding), alone or with text around them.

A call is an object with a string `name` of one of the request's tools (any name without tools)
and object arguments (absent: none; as JSON text: decoded; almost JSON: as `arguments.object_text`
repairs it). Everything else is content: text around the calls, an object that is no call (code,
an example in prose). Text between calls that is only blanks and `;` is dropped, and so is such
text before the first call or after the last one. Streaming holds back only what may still turn
into a call: an object that has not closed (from its `{`, when a quoted key follows it) and a run of
blanks and `;`.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..arguments import arguments_text, loads, object_text
from ..markup import ToolCall, known, settled
from .base import Schemas, Terminal, ToolCallParser, json_rule

TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


def object_end(text: str, at: int) -> int | None:
    """Where the JSON object (or array) opened at `text[at]` ends (the index after its closer),
    strings skipped; None when it has not closed."""
    depth, quoted, escaped = 0, False, False
    for i in range(at, len(text)):
        c = text[i]
        if quoted:
            escaped, quoted = not escaped and c == "\\", quoted and (escaped or c != '"')
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_of(text: str, schemas: Schemas) -> ToolCall | None:
    """The call the object `text` writes, None when it is no call."""
    repaired = object_text(text)
    obj = loads(repaired) if repaired is not None else None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not known(obj["name"], schemas):
        return None
    arguments = arguments_text(obj.get("parameters", obj.get("arguments")) or {})
    return None if arguments is None else ToolCall(obj["name"], arguments)


def _blank(piece: str) -> bool:
    return not piece.strip(_SEPARATORS)


class Llama3Json(ToolCallParser):
    name = "llama3_json"

    @staticmethod
    def _opens(text: str, brace: int, final: bool) -> bool | None:
        """Whether the `{` at `brace` may open a call (a quoted key follows it); None while only
        blanks follow it and more text may come."""
        key = len(text) - len(text[brace + 1:].lstrip())
        if key == len(text):
            return None if not final else False
        return text[key] in "\"'"

    def _candidate(self, text: str, at: int, final: bool) -> tuple[int, int] | int | None:
        """The next place a call may start at or after `at`: (where, where its `{` is), or only
        where, when more text may still make it one; None when there is none."""
        while True:
            brace, tag = text.find("{", at), text.find(TAG, at)
            if tag >= 0 and (brace < 0 or tag < brace):  # the tag, blanks, then the call's `{`
                opened = len(text) - len(text[tag + len(TAG):].lstrip())
                opens = None if opened == len(text) and not final else \
                    opened < len(text) and text[opened] == "{" and self._opens(text, opened, final)
                if opens is None:
                    return tag
                if opens:
                    return tag, opened
                at = tag + len(TAG)
            elif brace >= 0:
                opens = self._opens(text, brace, final)
                if opens is None:
                    return brace
                if opens:
                    return brace, brace
                at = brace + 1
            else:
                return None

    def parse(self, text: str, final: bool, schemas: Schemas = None) -> tuple[str, list[ToolCall]]:
        pieces, calls, at, scan = [], [], 0, 0  # pieces[k]: the text before calls[k]; the last, after them
        while True:
            found = self._candidate(text, scan, final)
            if isinstance(found, int):  # may still be a call: the text before it only
                piece = text[at:found]
                pieces.append("" if _blank(piece) else piece)
                return "".join(pieces), calls
            if found is None:
                piece = text[at:]
                if not final:
                    piece = settled(piece, (TAG,), final)
                pieces.append("" if _blank(piece) else piece)
                return "".join(pieces), calls
            start, brace = found
            end = object_end(text, brace)
            if end is None and not final:
                piece = text[at:start]
                pieces.append("" if _blank(piece) else piece)
                return "".join(pieces), calls
            call = call_of(text[brace:end if end is not None else len(text)], schemas)
            if call is None:  # an object that is no call: content, read on after it
                scan = end if end is not None else len(text)
                continue
            piece = text[at:start]
            pieces.append("" if _blank(piece) else piece)
            calls.append(call)
            at = scan = end if end is not None else len(text)

    def calls_grammar(self, schemas: Mapping[str, Mapping[str, Any]], single: bool, terminal: Terminal) -> str:
        """`{"name": ..., "parameters": {...}}` objects, `; ` between them."""
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                            "parameters": dict(parameters) or {"type": "object"}},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, parameters in schemas.items()]}
        return "\n".join([f"start: call{'' if single else ' (' + json.dumps('; ') + ' call)*'}",
                          f"call: {json_rule(call)}"])
