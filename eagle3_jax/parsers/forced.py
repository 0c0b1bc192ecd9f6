"""Forced tool calls and constrained answers of reasoning models: the `Constraint` a request's
`tool_choice` ("required": one call or more to any of its tools; a named function: one call to
it) makes of the family's call markup (each parser's `calls_grammar`), and where a constraint
starts when the model reasons first (after its end-of-thinking token: the reasoning is free).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

from ..sampling.sampler import SamplingParams
from ..structured.constraints import Constraint
from ..text.tokenizer import Tokenizer
from .markup import ParserError, tool_schemas
from .reasoning.base import ReasoningParser
from .tool_calls.base import ToolCallParser, literal


def marker_terminal(tokenizer: Tokenizer):
    """A marker's Lark terminal: the token itself (`<[id]>`) where the vocabulary has the marker as
    one token (so the grammar asks for exactly the token the model writes), else its text."""

    def terminal(text: str) -> str:
        token = tokenizer.token_to_id(text)
        return f"<[{token}]>" if token is not None and tokenizer.decode([token], skip_special_tokens=False) == text \
            else literal(text)

    return terminal


def markup_markers(parser: ToolCallParser) -> list[str]:
    """The marker texts of `parser`'s call markup, as its grammar writes them (read off a grammar of
    calls to a placeholder tool)."""
    markers: list[str] = []

    def record(text: str) -> str:
        markers.append(text)
        return literal(text)

    parser.calls_grammar({"f": {"type": "object"}}, False, record)
    return list(dict.fromkeys(markers))


@functools.lru_cache(maxsize=8)
def unspellable_markers(parser: ToolCallParser, tokenizer: Tokenizer) -> tuple[str, ...]:
    """The markers of `parser`'s markup this tokenizer cannot write: neither one token of that text
    nor a text that its own encoding decodes back to (a vocabulary that reads DeepSeek's `▁` as its
    space marker writes a space there). A call in such markup can be parsed but not forced. Kept per
    (parser, tokenizer), which a server holds for its life: a forced request does not redo it."""
    terminal = marker_terminal(tokenizer)

    def spelled(text: str) -> bool:
        return terminal(text).startswith("<[") or \
            tokenizer.decode(tokenizer.encode(text, add_bos=False), skip_special_tokens=False) == text

    return tuple(m for m in markup_markers(parser) if not spelled(m))


def forced_calls(parser: ToolCallParser, tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any],
                 tokenizer: Tokenizer) -> Constraint:
    """The constraint of `tool_choice` `choice` ("required", or {"type": "function", "function":
    {"name": ...}}) over `tools` in `parser`'s markup; ParserError for a name the tools lack."""
    unspellable = unspellable_markers(parser, tokenizer)
    if unspellable:
        raise ParserError(f"tool_choice forces a call in {parser.name}'s markup, whose marker(s) "
                          f"{', '.join(map(repr, unspellable))} this model's tokenizer cannot write; send tool_choice "
                          "'auto' (calls the model writes are still parsed) or serve with the --tool_call_parser of "
                          "this model's family")
    schemas = tool_schemas(tools) or {}
    single = choice != "required"
    if single:
        name = choice["function"]["name"]
        if name not in schemas:
            raise ParserError(f"tool_choice names {name!r}, which is not among the request's tools "
                              f"({', '.join(schemas) or 'none'})")
        schemas = {name: schemas[name]}
    return Constraint.grammar(parser.calls_grammar(schemas, single, marker_terminal(tokenizer)))


def answer_start(reasoning: ReasoningParser | None, tokenizer: Tokenizer) -> int | None:
    """The token after which a reasoning model's answer starts (its end-of-thinking token), None
    without reasoning; ParserError when that marker is not one token (a constraint could not tell
    where the answer starts)."""
    if reasoning is None:
        return None
    marker = reasoning.answer_marker
    token = None if marker is None else tokenizer.token_to_id(marker)
    if token is None:
        raise ParserError(f"the {reasoning.name} reasoning ends at {marker!r}, which is not one token of this "
                          "vocabulary, so a constraint cannot start after it: turn thinking off for this request "
                          "(chat_template_kwargs) or serve without a reasoning parser")
    return token


def constrain_answer(sampling: SamplingParams, reasoning: ReasoningParser | None,
                     tokenizer: Tokenizer) -> SamplingParams:
    """`sampling` with its constraint starting where the answer does (after the reasoning, when a
    reasoning parser is on); as it is otherwise. ParserError as `answer_start`."""
    if sampling.constraint is None or reasoning is None:
        return sampling
    return dataclasses.replace(sampling, constraint=sampling.constraint.starting_after(answer_start(reasoning, tokenizer)))
