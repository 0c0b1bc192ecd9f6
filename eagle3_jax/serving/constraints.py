"""What a request constrains its output to, read from its body: OpenAI's `response_format`
(`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
`"text"` constrains nothing), vLLM's `structured_outputs` (one of `json`, `regex`, `choice`,
`grammar`, `json_object`) and its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one of them per request; every mistake (two of them, a bad field, a
schema that is not an object) is a 400 naming the field. Whether the grammar compiles is known
when the engine compiles it (a 400 too, naming the field; delivery.py). Chat's forced tool
calls are the other source of constraints (protocol.py, parsers/forced.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..structured import Constraint, ConstraintError
from .errors import ApiError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED)


def _build(kind: str, value: Any, field: str) -> Constraint:
    """The constraint of vLLM's `kind` ("json", "regex", "choice", "grammar", "json_object")."""
    try:
        if kind == "json":
            return Constraint.json_schema(value)
        if kind == "json_object":
            if value is not True:
                raise ConstraintError(f"json_object must be true; got {value!r}")
            return Constraint.json_object()
        return {"regex": Constraint.regex, "choice": Constraint.choice, "grammar": Constraint.grammar}[kind](value)
    except ConstraintError as e:
        raise ApiError(f"'{field}': {e}", param=field, code="invalid_value") from e


def _response_format(fmt: Any) -> Constraint | None:
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                       f"\"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}; got {fmt!r}",
                       param="response_format", code="invalid_value")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint.json_object()
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
        raise ApiError("'response_format.json_schema' must be an object with a 'schema' object (and a 'name'); got "
                       f"{spec!r}", param="response_format", code="invalid_value")
    # OpenAI's `strict` false lets the model stray from the schema; this server keeps to it either way.
    return _build("json", dict(spec.get("schema") or {"type": "object"}), "response_format")


def _structured_outputs(spec: Any) -> Constraint:
    if not isinstance(spec, Mapping):
        raise ApiError(f"'structured_outputs' must be an object with one of {', '.join(STRUCTURED_KEYS)}; got {spec!r}",
                       param="structured_outputs", code="invalid_type")
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(k for k in given if k not in STRUCTURED_KEYS)
    if unknown:
        raise ApiError(f"'structured_outputs' has options this server does not support: {', '.join(unknown)}; give "
                       f"one of {', '.join(STRUCTURED_KEYS)}", param="structured_outputs", code="unsupported_parameter")
    if len(given) != 1:
        raise ApiError(f"'structured_outputs' must set exactly one of {', '.join(STRUCTURED_KEYS)}; got "
                       f"{sorted(given) or 'none'}", param="structured_outputs", code="invalid_value")
    (kind, value), = given.items()
    return _build(kind, value, "structured_outputs")


def parse_constraint(body: Mapping[str, Any]) -> tuple[Constraint | None, str | None]:
    """(the request's constraint, the field that set it), (None, None) for none."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        constraint = _response_format(fmt)
        if constraint is not None:
            found.append((constraint, "response_format"))
    if body.get("structured_outputs") is not None:
        found.append((_structured_outputs(body["structured_outputs"]), "structured_outputs"))
    for field, kind in GUIDED.items():
        if body.get(field) is not None:
            found.append((_build(kind, body[field], field), field))
    if len(found) > 1:
        raise ApiError(f"a request may constrain its output one way; this one sets {', '.join(f for _, f in found)}",
                       param=found[1][1], code="invalid_value")
    return found[0] if found else (None, None)
