"""What a request constrains its output to, and its grammar in llguidance's form.

A `Constraint` is a kind and a canonical text (a JSON schema as sorted JSON, so equal schemas
share one compiled grammar): `json_schema(schema)`, `json_object()` (any JSON object),
`regex(pattern)`, `choice(options)` (exactly one of the strings), `grammar(text)` (Lark, or
llama.cpp's GBNF). `Constraint.grammar_text()` gives llguidance's grammar, or a ConstraintError
naming what is wrong with it (an invalid schema, regex or grammar is the request's mistake).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: the schema, regex or grammar, and why."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str  # canonical: schema JSON (sorted keys), the regex, the choices as a JSON list, the grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; choose one of {', '.join(KINDS)}")

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"a JSON schema must be an object; got {type(schema).__name__}")
        return Constraint("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False))

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
        try:
            return llguidance.grammar_from(form, self.text)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConstraintError(f"the {self.kind.replace('_', ' ')} cannot be compiled: {e}") from None
