"""MiniMax-M2 / M2.5 tool calls (vLLM's `minimax_m2`), XML-like, values as plain text:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Tags are read as XML writes them: the `name` attribute in double, single or no quotes, other
attributes ignored, stray text between parameters skipped. Each value becomes the JSON type the
tool's schema gives its parameter (its `type`, a list of them, the types of `anyOf` / `oneOf` /
`allOf` branches or of `enum` / `const` values, and the common aliases `int`, `float`, `bool`,
`dict`, `list`...), tried null, integer, number, boolean, object, array, then string; a value no
type fits, and every value the schema does not type (no tools, a parameter it lacks, no type
named), is kept as the text the model wrote.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

from ..arguments import loads
from ..markup import ToolCall, known
from .base import Schemas, SectionParser, Terminal, json_rule, literal

_PARAMETER = re.compile(r"<parameter\b(?P<attributes>[^>]*)>(?P<value>(?:(?!<parameter\b).)*?)</parameter>", re.S)
_NAME = re.compile(r"""(?:^|\s)name\s*=\s*(?:"(?P<double>[^"]*)"|'(?P<single>[^']*)'|(?P<bare>[^\s"'>]+))""")
_ALIASES = {"int": "integer", "long": "integer", "float": "number", "double": "number", "bool": "boolean",
            "str": "string", "text": "string", "dict": "object", "map": "object", "list": "array",
            "tuple": "array"}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_VALUE_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"),
                (list, "array"))


def attribute_name(attributes: str) -> str | None:
    """The `name` attribute of a tag's attribute text, None when it has none."""
    found = _NAME.search(attributes)
    if found is None:
        return None
    name = next(v for v in (found["double"], found["single"], found["bare"]) if v is not None).strip()
    return name or None


def _strip_newline(value: str) -> str:
    # the format puts values on their own lines at times: one newline around a value is markup
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _as_json(value: str) -> Any:
    try:
        return loads(value)
    except (ValueError, RecursionError):
        return value


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows, as `convert` reads them (empty: none named)."""
    if not isinstance(schema, Mapping):
        return set()
    named = schema.get("type")
    kinds = {_ALIASES.get(k.lower(), k.lower()) for k in (named if isinstance(named, list) else [named])
             if isinstance(k, str)}
    for branches in (schema.get(key) for key in ("anyOf", "oneOf", "allOf")):
        for branch in branches if isinstance(branches, list) else ():
            kinds |= schema_types(branch)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else []
    for value in values + ([schema["const"]] if "const" in schema else []):
        kinds.add("null" if value is None else next((k for t, k in _VALUE_TYPES if isinstance(value, t)), "string"))
    return kinds


def _typed(text: str, kind: str) -> tuple[bool, Any]:
    """(whether `text` reads as a `kind`, the value)."""
    if kind == "null":
        return text.lower() in ("null", "none"), None
    if kind == "boolean":
        lowered = text.lower()
        return lowered in ("true", "false", "1", "0"), lowered in ("true", "1")
    parsed = _as_json(text)
    if kind in ("integer", "number"):
        if isinstance(parsed, float) and not math.isfinite(parsed):
            return False, None  # 1e999: no JSON number
        if isinstance(parsed, int) and not isinstance(parsed, bool) or \
                isinstance(parsed, float) and (kind == "number" or parsed.is_integer()):
            return True, int(parsed) if kind == "integer" else parsed
        return False, None
    if kind in ("object", "array"):
        return isinstance(parsed, dict if kind == "object" else list), parsed
    return False, None


def convert(value: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the JSON type its schema names (the text when it names none or none fits)."""
    kinds = schema_types(schema)
    for kind in _ORDER:
        if kind == "string" and kind in kinds:
            return value
        if kind in kinds and (read := _typed(value.strip(), kind))[0]:
            return read[1]
    return value


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
    call_begin, call_end = "<invoke", "</invoke>"

    def call_of(self, body: str, schemas: Schemas) -> ToolCall | None:
        attributes, closed, params = body.partition(">")
        name = attribute_name(attributes) if closed and (not attributes or attributes[0].isspace()) else None
        if name is None or not known(name, schemas):
            return None
        properties = (schemas or {}).get(name, {}).get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        arguments = {}
        for param in _PARAMETER.finditer(params):
            key = attribute_name(param["attributes"])
            if key is not None:
                arguments[key] = convert(_strip_newline(param["value"]), properties.get(key))
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
