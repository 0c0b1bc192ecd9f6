"""MiniMax-M2 / M2.5 tool calls (vLLM's `minimax_m2`), XML-like, values as plain text:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Each value becomes the JSON type the tool's schema gives its parameter (integer, number, boolean,
object, array, null; a list of types is tried in order); without a schema, text that reads as a
JSON number, boolean, null, object or array is taken as such, anything else is a string.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

from ..markup import ToolCall, known, loads
from .base import Schemas, SectionParser, Terminal, json_rule, literal, sequence

_INVOKE = re.compile(r'\s*<invoke name="?(?P<name>[^">]+)"?\s*>(?P<body>.*?)</invoke>\s*', re.S)
_PARAMETER = re.compile(r'\s*<parameter name="?(?P<key>[^">]+)"?\s*>(?P<value>.*?)</parameter>\s*', re.S)


def _strip_newline(value: str) -> str:
    # the format puts values on their own lines at times: one newline around a value is markup
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _as_json(value: str) -> Any:
    try:
        return loads(value)
    except (ValueError, RecursionError):
        return value


def convert(value: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the JSON type its schema names."""
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kinds if isinstance(kinds, list) else [kinds] if isinstance(kinds, str) else []
    text = value.strip()
    for kind in kinds:
        if kind == "string":
            return value
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("integer", "number"):
            parsed = _as_json(text)
            if isinstance(parsed, float) and not math.isfinite(parsed):
                continue  # 1e999: no JSON number
            if isinstance(parsed, int) and not isinstance(parsed, bool) or \
                    isinstance(parsed, float) and (kind == "number" or parsed.is_integer()):
                return int(parsed) if kind == "integer" else parsed
        if kind in ("object", "array"):
            parsed = _as_json(text)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    if kinds:  # no type fits: the text as the model wrote it
        return value
    parsed = _as_json(text)
    return parsed if not isinstance(parsed, str) else value


def _is_text(schema: Any) -> bool:
    """Whether a parameter's value is written as plain text (a string, or no type named)."""
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return kinds[0] in ("string", None)


def _value_rule(schema: Any) -> str:
    """A Lark rule body of a parameter's value: text (one of its `enum` strings, or any text
    without `<`), else JSON of its schema."""
    if not _is_text(schema):
        return json_rule(schema)
    options = schema.get("enum") if isinstance(schema, Mapping) else None
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return " | ".join(literal(o) for o in options)
    return "/[^<]*/"


class MiniMaxM2(SectionParser):
    name = "minimax_m2"
    begins = ("<minimax:tool_call>",)
    ends = ("</minimax:tool_call>",)
    call = _INVOKE

    def call_of(self, match: re.Match[str], schemas: Schemas) -> ToolCall | None:
        name, body = match["name"].strip(), match["body"]
        params = [] if not body.strip() else sequence(_PARAMETER, body)
        if params is None or not known(name, schemas):
            return None
        properties = (schemas or {}).get(name, {}).get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        arguments = {p["key"].strip(): convert(_strip_newline(p["value"]), properties.get(p["key"].strip()))
                     for p in params}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def calls_grammar(self, schemas: Mapping[str, Mapping[str, Any]], single: bool, terminal: Terminal) -> str:
        # the section's markers on lines of their own, as the format writes them
        return super().calls_grammar(schemas, single, lambda text: terminal(text) + (
            f" {literal(chr(10))}" if text == self.begins[0] else ""))

    def call_rules(self, index: int, name: str, parameters: Mapping[str, Any], terminal: Terminal) -> list[str]:
        """Parameters in the schema's order, the required ones always written, the others optional."""
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        properties = properties if isinstance(properties, Mapping) else {}
        required = parameters.get("required") if isinstance(parameters, Mapping) else None
        required = set(required) if isinstance(required, list) else set()
        rules, parts = [], []
        for j, (key, schema) in enumerate(properties.items()):
            rules += [f"param_{index}_{j}: {literal(f'<parameter name={json.dumps(key)}>')} value_{index}_{j} "
                      f"{literal('</parameter>' + chr(10))}", f"value_{index}_{j}: {_value_rule(schema)}"]
            parts.append(f"param_{index}_{j}" + ("" if key in required else "?"))
        head = literal(f"<invoke name={json.dumps(name)}>" + chr(10))
        return [f"call_{index}: {head} {' '.join(parts)} {literal('</invoke>' + chr(10))}", *rules]
