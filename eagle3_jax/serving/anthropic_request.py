"""An Anthropic Messages request body as the chat completions body that asks for the same
conversation: the mapping that lets a Messages request take the chat request path (the same
prompt, hence the same tokens).

`chat_body` maps a Messages body onto a chat body:
- `system` (a string or text blocks; `cache_control` on any block is accepted and ignored: the
  prefix cache needs no marks) becomes the first, system message;
- a user turn's `tool_result` blocks become `tool` messages (answering the calls by `tool_use_id`,
  in their order, ahead of the turn's text; a result's text blocks joined by newlines); `is_error`
  results are marked in their text, as the model reads them; an assistant turn's `tool_use` blocks
  become its `tool_calls` (`input` as JSON arguments), its `thinking` blocks its `reasoning_content`
  (`redacted_thinking` is dropped: there is nothing to read);
- `tools` (`name`, `description`, `input_schema`) become functions; `tool_choice` auto / any /
  tool / none becomes chat's "auto" / "required" / a named function / "none";
- `thinking` {type: enabled | disabled} turns the chat template's thinking switch on or off
  (`thinking` and `enable_thinking`, the kwargs the families' templates read); without it,
  `output_config.effort` "low" turns it off and "medium" / "high" on; `budget_tokens` is not
  enforced (`max_tokens` caps thinking and answer together, as Anthropic's does): told in
  `warnings`;
- `output_config.format` (json_schema) becomes `response_format`; `stop_sequences` `stop`;
  `max_tokens` (required), `temperature` (0-1, Anthropic's range), `top_p`, `top_k` and `stream` keep
  their meaning;
  `metadata` is accepted and ignored.
A field Messages does not define is ignored and told (`warnings`), as chat's unknown fields are.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .chat_mapping import add_common, chat_call, chat_function, named_choice, tool_list
from .errors import ApiError

_KNOWN = {"model", "max_tokens", "system", "messages", "tools", "tool_choice", "thinking", "output_config",
          "stop_sequences", "temperature", "top_p", "top_k", "metadata", "stream", "service_tier", "container",
          "mcp_servers", "context_management"}
_PASSED = ("temperature", "top_p", "top_k", "stream")
_EFFORT_THINKS = {"low": False, "medium": True, "high": True}


def chat_body(body: Any) -> tuple[dict[str, Any], list[str]]:
    """(the chat completions body asking for `body`'s conversation, what was ignored or not enforced)."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object; got {type(body).__name__}", code="invalid_type")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise ApiError("'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(f"'max_tokens' must be an integer >= 1; got {max_tokens!r}", param="max_tokens",
                       code="invalid_value")
    warnings = [f"'{key}' is not supported and was ignored" for key in body if key not in _KNOWN]
    messages = _system(body.get("system")) + _conversation(body.get("messages"))
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    chat.update({key: body[key] for key in _PASSED if body.get(key) is not None})
    _check_temperature(body.get("temperature"))
    if body.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(body["stop_sequences"])
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"), bool(tools))
    if choice is not None:
        chat["tool_choice"] = choice
    output = body.get("output_config") or {}
    if not isinstance(output, dict):
        raise ApiError(f"'output_config' must be an object; got {output!r}", param="output_config", code="invalid_type")
    add_common(chat, bool(body.get("stream")), _thinking(body.get("thinking"), output.get("effort"), warnings))
    if output.get("format") is not None:
        chat["response_format"] = _response_format(output["format"])
    return chat, warnings


def _check_temperature(temperature: Any) -> None:
    """Messages' temperature lies in 0-1 (Anthropic's range; 1 is its default): a value past it is
    a 400, not a hotter sample than the client could ask of Anthropic."""
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise ApiError(f"'temperature' must be between 0 and 1 for the Messages API; got {temperature}",
                       param="temperature", code="invalid_value")


def _text_blocks(content: Any, where: str, joiner: str = "") -> str:
    """A string, or text blocks joined by `joiner` (their `cache_control` and `citations` ignored)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of text blocks; got {content!r}", param=where,
                       code="invalid_type")
    texts = []
    for i, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise ApiError(f"{where}[{i}] must be a text block {{'type': 'text', 'text': ...}}; got {block!r}",
                           param=f"{where}[{i}]", code="invalid_type")
        texts.append(block["text"])
    return joiner.join(texts)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _conversation(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {'role': 'user' | 'assistant', 'content': ...}",
                       param="messages", code="invalid_type" if not isinstance(messages, list) else "invalid_value")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(f"{where}.role must be 'user' or 'assistant' (the system prompt is the top-level "
                           f"'system'); got {role!r}", param=f"{where}.role", code="invalid_value")
        if "content" not in message:
            raise ApiError(f"{where}.content is required", param=f"{where}.content", code="missing_required_parameter")
        blocks = message["content"]
        if isinstance(blocks, str):
            out.append({"role": role, "content": blocks})
            continue
        if not isinstance(blocks, list):
            raise ApiError(f"{where}.content must be a string or a list of content blocks; got {blocks!r}",
                           param=f"{where}.content", code="invalid_type")
        out += (_user_turn if role == "user" else _assistant_turn)(blocks, where)
    return out


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise ApiError(f"{where} must be a content block with a 'type'; got {block!r}", param=where, code="invalid_type")
    if kind in ("image", "document", "search_result", "container_upload"):
        raise ApiError(f"{where} is a {kind!r} block; this server serves the text model only (a multimodal "
                       "checkpoint's vision tower is not loaded)", param=where, code="unsupported_value")
    return kind


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results (as `tool` messages, in order), then its text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_blocks([block], at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise ApiError(f"{at}.tool_use_id must be the id of the tool_use it answers; got {call_id!r}",
                               param=f"{at}.tool_use_id", code="invalid_type")
            content = block.get("content", "")
            # A tool's output in several blocks reads as lines, as vLLM joins them (a turn's own text
            # blocks are one text cut in pieces, joined as they are).
            text = _text_blocks(content, f"{at}.content", "\n") if content is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}" if text else "Error"
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise ApiError(f"{at} is a {kind!r} block; a user turn holds text and tool_result blocks", param=at,
                           code="invalid_value")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """An assistant turn: its text, its thinking as reasoning, its tool_use blocks as calls."""
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_blocks([block], at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise ApiError(f"{at}.thinking must be a string", param=f"{at}.thinking", code="invalid_type")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted elsewhere: nothing a template could show
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise ApiError(f"{at} must be {{'type': 'tool_use', 'id': ..., 'name': ..., 'input': {{...}}}}; got "
                               f"{block!r}", param=at, code="invalid_type")
            calls.append(chat_call(block.get("id"), name, json.dumps(arguments, ensure_ascii=False)))
        else:
            raise ApiError(f"{at} is a {kind!r} block; an assistant turn holds text, thinking and tool_use blocks",
                           param=at, code="invalid_value")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _stop_sequences(stops: Any) -> list[str]:
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(f"'stop_sequences' must be a list of non-empty strings; got {stops!r}", param="stop_sequences",
                       code="invalid_type")
    return stops


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tool_list(tools)):
        at = f"tools[{i}]"
        if not (isinstance(tool, dict) and isinstance(tool.get("name"), str)):
            raise ApiError(f"{at} must be {{'name': ..., 'description': ..., 'input_schema': {{...}}}}; got {tool!r}",
                           param=at, code="invalid_type")
        if tool.get("type") not in (None, "custom"):
            raise ApiError(f"{at} is a {tool['type']!r} tool, which runs on Anthropic's side; this server serves "
                           "custom tools (name, description, input_schema)", param=f"{at}.type", code="unsupported_value")
        schema = tool.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise ApiError(f"{at}.input_schema must be a JSON schema object", param=f"{at}.input_schema",
                           code="invalid_type")
        out.append(chat_function(tool["name"], tool.get("description"), schema))
    return out


def _tool_choice(choice: Any, has_tools: bool) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError("tool_choice {'type': 'tool'} needs the tool's 'name'", param="tool_choice.name",
                           code="missing_required_parameter")
        return named_choice(choice["name"])
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise ApiError(f"'tool_choice' must be {{'type': 'auto' | 'any' | 'tool' | 'none'}}; got {choice!r}",
                       param="tool_choice", code="invalid_value")
    if mapped == "required" and not has_tools:
        raise ApiError("tool_choice {'type': 'any'} needs 'tools'", param="tool_choice", code="invalid_value")
    return mapped if has_tools else None


def _thinking(thinking: Any, effort: Any, warnings: list[str]) -> bool | None:
    """The template's thinking switch: `thinking` first, else `output_config.effort`, else the template's default."""
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise ApiError(f"'thinking' must be {{'type': 'enabled', 'budget_tokens': ...}} or {{'type': 'disabled'}}; "
                           f"got {thinking!r}", param="thinking", code="invalid_value")
        if kind != "disabled" and thinking.get("budget_tokens") is not None:
            warnings.append("thinking.budget_tokens is not enforced: max_tokens caps thinking and answer together")
        return kind != "disabled"
    if effort is None:
        return None
    if effort not in _EFFORT_THINKS:
        raise ApiError(f"output_config.effort must be 'low', 'medium' or 'high'; got {effort!r}",
                       param="output_config.effort", code="invalid_value")
    return _EFFORT_THINKS[effort]


def _response_format(fmt: Any) -> Mapping[str, Any]:
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise ApiError(f"output_config.format must be {{'type': 'json_schema', 'schema': {{...}}}}; got {fmt!r}",
                       param="output_config.format", code="invalid_value")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
