"""What a request constrains its output to, and its grammar in llguidance's form.

A `Constraint` is a kind and a canonical text (a JSON schema as compact JSON, so equal schemas
share one compiled grammar; key order kept: properties are written in the schema's order): `json_schema(schema)`, `json_object()` (any JSON object),
`regex(pattern)`, `choice(options)` (exactly one of the strings), `grammar(text)` (Lark, or
llama.cpp's GBNF). `Constraint.grammar_text()` gives llguidance's grammar, or a ConstraintError
naming what is wrong with it (an invalid schema, regex or grammar is the request's mistake).

`after_token`: the constraint starts after the first output token of that id (a reasoning
model's end-of-thinking token: the reasoning is free, the answer constrained); None, from the
first output token.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON is written as json.dumps writes it: ", " and ": " between items, no other whitespace. A
# grammar that lets whitespace run anywhere lets a model fill max_tokens with it (small models and
# quantized ones do); a schema's own "x-guidance" options win.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def with_json_layout(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with JSON_LAYOUT's options unless it sets its own (llguidance's "x-guidance")."""
    return {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: the schema, regex or grammar, and why."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str  # canonical: schema JSON (keys in the schema's order: properties are written in it), the regex, the choices as a JSON list, the grammar
    after_token: int | None = None  # starts after this output token (the end of reasoning); None: at once

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.after_token is not None and not (isinstance(self.after_token, int) and self.after_token >= 0):
            raise ConstraintError(f"after_token must be a token id >= 0 or None; got {self.after_token!r}")

    @property
    def key(self) -> tuple[str, str]:
        """What its compiled grammar depends on (not where it starts)."""
        return self.kind, self.text

    def starting_after(self, token_id: int | None) -> "Constraint":
        """This constraint, starting after the first output token `token_id` (None: at once)."""
        return dataclasses.replace(self, after_token=token_id)

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"a JSON schema must be an object; got {type(schema).__name__}")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))

    @staticmethod
    def json_object() -> "Constraint":
        return Constraint("json_object", json.dumps({"type": "object"}))

    @staticmethod
    def regex(pattern: str) -> "Constraint":
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"a regex must be a non-empty string; got {pattern!r}")
        return Constraint("regex", pattern)

    @staticmethod
    def choice(options: Sequence[str]) -> "Constraint":
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(f"a choice must be a non-empty list of non-empty strings; got {options!r}")
        return Constraint("choice", json.dumps(list(options), ensure_ascii=False))

    @staticmethod
    def grammar(text: str) -> "Constraint":
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(f"a grammar must be a non-empty Lark or GBNF text; got {text!r}")
        return Constraint("grammar", text)

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint; ConstraintError when it cannot be built."""
        form = {"json_schema": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[self.kind]
        text = self.text
        if form == "json_schema":
            text = json.dumps(with_json_layout(json.loads(text)), ensure_ascii=False)
        try:
            return llguidance.grammar_from(form, text)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConstraintError(f"the {self.kind.replace('_', ' ')} cannot be compiled: {e}") from None
