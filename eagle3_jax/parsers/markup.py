"""What every output parser shares: tool calls as OpenAI shapes them, and holding back text that
may still turn into a marker.

Parsers here read a model's whole output text so far and say what of it is settled; streaming
sends only what is new (parsers/output.py). A marker such as `</think>` can be cut by a delta in
the middle (`</thi`), so text that ends in a proper prefix of a marker is held back until the
next delta says what it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable, Mapping, Sequence

from ..text.stream import stop_prefix_len


class ParserError(ValueError):
    """An unknown parser name, or tools a parser cannot use; the message names the choices."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call the model made: its name and its arguments as JSON text (an object)."""

    name: str
    arguments: str
    id: str | None = None  # the markup's own id (Kimi's `functions.NAME:IDX`); else one is given per reply

    def openai(self, index: int, id_seed: str) -> dict[str, Any]:
        """The OpenAI `tool_calls` item, with this call's id or one made from `id_seed` and `index`."""
        return {"id": self.id or call_id(id_seed, index), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_id(seed: str, index: int) -> str:
    """A tool call id for the call at `index` of the reply `seed` names: the same for a reply's
    streamed and whole forms, different across replies."""
    return "call_" + hashlib.sha256(f"{seed}\0{index}".encode()).hexdigest()[:24]


def first_marker(text: str, markers: Sequence[str], at: int = 0) -> tuple[int, str] | None:
    """(where, which) of the first of `markers` in text[at:], or None."""
    found = [(i, m) for m in markers if (i := text.find(m, at)) >= 0]
    return min(found) if found else None


def settled(text: str, markers: Iterable[str], final: bool) -> str:
    """`text`, less a tail that may still become a marker unless the output is `final`."""
    if final:
        return text
    n = stop_prefix_len(text, tuple(markers))  # the longest end of `text` that begins a marker
    return text[: len(text) - n] if n else text


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]] | None:
    """{function name: its JSON-schema `parameters`} of OpenAI `tools`; None when no tools are given
    (then any function name is taken as is)."""
    if not tools:
        return None
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ParserError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}; got {tool!r}")
        params = function.get("parameters")
        out[function["name"]] = params if isinstance(params, Mapping) else {}
    return out


def known(name: str, schemas: Mapping[str, Any] | None) -> bool:
    """Whether `name` is a function of the request's tools (any name when it gave none)."""
    return schemas is None or name in schemas
