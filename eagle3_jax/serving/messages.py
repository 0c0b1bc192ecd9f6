"""Chat messages and tools, checked: what a chat request's `messages`, `tools` and `tool_choice`
may hold, each mistake a 400 naming the field.

Messages keep what chat templates read: `role`, `content` (a string, or text parts joined),
`name`, an assistant's `tool_calls` and `reasoning_content` (or `reasoning`), a tool result's
`tool_call_id`. This server takes text only: image, audio and video parts are refused (the vision
tower of a multimodal checkpoint such as Kimi-K2.5 is not loaded). `tool_choice` may be "auto"
(the default with tools: the model decides, its calls are parsed), "none" (the tools are still
shown to the template, nothing is parsed), "required" (one call or more, the output constrained
to the family's call markup) or a named function (`{"type": "function", "function": {"name":
...}}`: one call to it).
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
_MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "video", "file")


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise ApiError(f"{where}.content has a {kind!r} part; this server serves the text model only (images, "
                               "audio and video are not supported: a multimodal checkpoint's vision tower is not "
                               "loaded)", param=f"{where}.content", code="unsupported_value")
            if not (kind == "text" and isinstance(part.get("text"), str)):
                raise ApiError(f"{where}.content parts must all be {{'type': 'text', 'text': ...}}; got {part!r}",
                               param=f"{where}.content", code="invalid_type")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(f"{where}.content must be a string or a list of text parts; got {content!r}",
                       param=f"{where}.content", code="invalid_type")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ApiError(f"{where}.tool_calls must be a list; got {calls!r}", param=f"{where}.tool_calls",
                       code="invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", "{}"), (str, dict))):
            raise ApiError(f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., 'arguments': "
                           f"...}}}}; got {call!r}", param=at, code="invalid_type")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}})
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation as templates read it (module docstring); 400 for anything malformed."""
    if messages is None:
        raise ApiError("'messages' is missing", param="messages", code="invalid_type")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {role, content} objects", param="messages",
                       code="invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object with 'role' and 'content'", param=where, code="invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role",
                           code="invalid_value")
        message: dict[str, Any] = {"role": role,
                                   "content": "" if content is None and role == "assistant" else
                                   _text_content(content, where)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        if role == "assistant":
            if m.get("tool_calls") is not None:
                message["tool_calls"] = _tool_calls(m["tool_calls"], where)
            reasoning = next((m[k] for k in ("reasoning_content", "reasoning") if isinstance(m.get(k), str)), None)
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if role == "tool":
            ident = m.get("tool_call_id")
            if ident is not None and not isinstance(ident, str):
                raise ApiError(f"{where}.tool_call_id must be a string; got {ident!r}", param=f"{where}.tool_call_id",
                               code="invalid_type")
            if ident is not None:
                message["tool_call_id"] = ident
        out.append(message)
    return out


def parse_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """OpenAI `tools`: function definitions, each with a name (and optionally a description and
    JSON-schema parameters)."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ApiError(f"'tools' must be a list of function tools; got {tools!r}", param="tools", code="invalid_type")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]
                and isinstance(function.get("parameters", {}), dict)):
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"{{...}}}}}}; got {tool!r}", param=f"tools[{i}]", code="invalid_type")
    return tuple(tools)


def parse_tool_choice(choice: Any, tools: tuple[Mapping[str, Any], ...]) -> str | dict[str, Any]:
    """"auto", "none" (the default: "auto" with tools, "none" without), "required" or a named
    function {"type": "function", "function": {"name": ...}} among the tools; 400 otherwise."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none"):
        return choice
    if choice == "required" or isinstance(choice, dict):
        names = [t["function"]["name"] for t in tools]
        if not tools:
            raise ApiError(f"tool_choice {choice!r} forces a call, but the request has no tools", param="tool_choice",
                           code="invalid_value")
        if choice == "required":
            return choice
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(f"a named tool_choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got "
                           f"{choice!r}", param="tool_choice", code="invalid_value")
        if name not in names:
            raise ApiError(f"tool_choice names {name!r}, which is not among the request's tools ({', '.join(names)})",
                           param="tool_choice", code="invalid_value")
        return {"type": "function", "function": {"name": name}}
    raise ApiError(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function; got {choice!r}",
                   param="tool_choice", code="invalid_value")
