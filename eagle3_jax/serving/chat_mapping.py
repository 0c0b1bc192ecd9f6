"""What the Messages and Responses mappings (anthropic_request.py, responses_request.py) share in
writing a chat completions body: a tool as chat's function, a call as chat's tool call, a named
tool choice, and the fields every mapped request gets (usage on streams, the thinking switch)."""

from __future__ import annotations

from typing import Any

from .errors import ApiError


def tool_list(tools: Any) -> list:
    """A request's `tools` (none: empty); 400 unless a list."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(f"'tools' must be a list; got {tools!r}", param="tools", code="invalid_type")
    return tools


def chat_function(name: str, description: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as chat's function, in chat's key order (templates may render the tools as JSON)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": {**function, "parameters": parameters}}


def chat_call(call_id: Any, name: str, arguments: str) -> dict[str, Any]:
    """A call the assistant made, as chat's `tool_calls` item (`arguments`: JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def named_choice(name: str) -> dict[str, Any]:
    """Chat's `tool_choice` for one named function."""
    return {"type": "function", "function": {"name": name}}


def add_common(chat: dict[str, Any], stream: bool, thinks: bool | None) -> None:
    """What every mapped request adds to its chat body: usage closing a stream (both APIs report
    it), and the chat template's thinking switch (`thinking` and `enable_thinking`, the kwargs the
    families' templates read) when the request sets it."""
    if stream:
        chat["stream_options"] = {"include_usage": True}
    if thinks is not None:
        chat["chat_template_kwargs"] = {"thinking": thinks, "enable_thinking": thinks}
