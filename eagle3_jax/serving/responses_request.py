"""An OpenAI Responses request body (stateless) as the chat completions body that asks for the
same conversation: the mapping that lets a Responses request take the chat request path.

`chat_body` maps:
- `instructions` to the first, system message; `input` as a string (one user message) or items:
  messages (`role` user / system / developer / assistant, `content` a string or input_text /
  output_text parts), `function_call` items (consecutive ones one assistant turn's `tool_calls`),
  `function_call_output` items (`tool` messages) and `reasoning` items (the next assistant turn's
  `reasoning_content`);
- `tools` of type function (`name`, `description`, `parameters`) to chat's functions; `tool_choice`
  auto / none / required / {type: function, name} to chat's;
- `reasoning.effort` to the chat template's thinking switch (`thinking`, `enable_thinking`: "none"
  and "minimal" off, low / medium / high on);
- `text.format` json_schema / json_object to `response_format`; `max_output_tokens`, `temperature`,
  `top_p` and `stream` keep their meaning; `metadata`, `user`, `parallel_tool_calls`, `truncation`
  ("disabled"), `include` and `store: false` are accepted; token logprobs (`include`
  "message.output_text.logprobs", `top_logprobs`) are a 400 pointing to chat completions, which
  serves them.
This server keeps no responses: `store: true`, `previous_response_id` and `background: true` are
400s saying so. A field the API does not define is ignored and told (`warnings`).
"""

from __future__ import annotations

from typing import Any

from .chat_mapping import add_common, chat_call, chat_function, named_choice, tool_list
from .errors import ApiError

_KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "reasoning", "text", "max_output_tokens",
          "temperature", "top_p", "stream", "store", "previous_response_id", "background", "metadata", "user",
          "parallel_tool_calls", "truncation", "include", "service_tier", "prompt_cache_key", "safety_identifier",
          "stream_options", "top_logprobs", "max_tool_calls", "conversation", "prompt"}
_EFFORT_THINKS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


def chat_body(body: Any) -> tuple[dict[str, Any], list[str]]:
    """(the chat completions body asking for `body`'s conversation, what was ignored)."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object; got {type(body).__name__}", code="invalid_type")
    _refuse_state(body)
    _refuse_logprobs(body)
    warnings = [f"'{key}' is not supported and was ignored" for key in body if key not in _KNOWN]
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise ApiError(f"'{key}' refers to state kept by OpenAI's platform, which this server does not have; "
                           "send the whole conversation as 'input'", param=key, code="unsupported_value")
    messages = ([{"role": "system", "content": _string(body["instructions"], "instructions")}]
                if body.get("instructions") is not None else []) + _conversation(body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    for source, target in (("model", "model"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                           ("top_p", "top_p"), ("stream", "stream")):
        if body.get(source) is not None:
            chat[target] = body[source]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None and tools:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    add_common(chat, bool(body.get("stream")), _thinking(body.get("reasoning")))
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text") or {}, dict) else None
    response_format = None if fmt is None else _response_format(fmt)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, warnings


def _refuse_state(body: dict) -> None:
    if body.get("store"):
        raise ApiError("this server keeps no responses: send \"store\": false (and the whole conversation as "
                       "'input' in each request)", param="store", code="unsupported_value")
    if body.get("previous_response_id") is not None:
        raise ApiError("this server keeps no responses, so 'previous_response_id' names nothing: send the whole "
                       "conversation as 'input'", param="previous_response_id", code="unsupported_value")
    if body.get("background"):
        raise ApiError("background responses are not supported: send the request without 'background' (stream it "
                       "to see its progress)", param="background", code="unsupported_value")


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _refuse_logprobs(body: dict) -> None:
    """Token logprobs are served by chat completions only: a Responses request asking for them (by
    `include` or `top_logprobs`) is a 400 saying where they are, never a reply quietly without them."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise ApiError(f"'include' must be a list of strings; got {include!r}", param="include", code="invalid_type")
    included, top = LOGPROBS_INCLUDE in (include or ()), body.get("top_logprobs")
    if included or (top is not None and top != 0):
        raise ApiError(f"token logprobs ('include': [{LOGPROBS_INCLUDE!r}], 'top_logprobs') are not served by "
                       "/v1/responses here; ask /v1/chat/completions with 'logprobs': true and 'top_logprobs'",
                       param="include" if included else "top_logprobs", code="unsupported_value")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ApiError(f"'{where}' must be a string; got {value!r}", param=where, code="invalid_type")
    return value


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where}.content must be a string or a list of text parts; got {content!r}",
                       param=f"{where}.content", code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(f"{where}.content[{j}] is an {kind!r} part; this server serves the text model only",
                           param=f"{where}.content[{j}]", code="unsupported_value")
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(f"{where}.content[{j}] must be {{'type': 'input_text', 'text': ...}}; got {part!r}",
                           param=f"{where}.content[{j}]", code="invalid_type")
        texts.append(part["text"])
    return "".join(texts)


def _conversation(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError("'input' must be a string or a non-empty list of items", param="input",
                       code="missing_required_parameter" if items is None else "invalid_type")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where} must be an object; got {item!r}", param=where, code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(f"{where}.role must be 'user', 'system', 'developer' or 'assistant'; got {role!r}",
                               param=f"{where}.role", code="invalid_value")
            message = {"role": role, "content": _content(item.get("content"), where)}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            out.append(message)
        elif kind == "function_call":
            if not (isinstance(item.get("name"), str) and isinstance(item.get("arguments"), str)):
                raise ApiError(f"{where} must be {{'type': 'function_call', 'call_id': ..., 'name': ..., 'arguments': "
                               f"'<JSON>'}}; got {item!r}", param=where, code="invalid_type")
            call = chat_call(item.get("call_id"), item["name"], item["arguments"])
            previous = out[-1] if out else None
            if previous is not None and previous["role"] == "assistant" and "tool_calls" in previous:
                previous["tool_calls"].append(call)
            elif previous is not None and previous["role"] == "assistant" and not reasoning:
                previous["tool_calls"] = [call]  # the text the turn said before its calls
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = "".join(reasoning), []
                out.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise ApiError(f"{where} must be {{'type': 'function_call_output', 'call_id': ..., 'output': ...}}; got "
                               f"{item!r}", param=where, code="invalid_type")
            text = output if isinstance(output, str) else _content(output, where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []  # the full text, else its summary
            reasoning += [p.get("text", "") for p in parts if isinstance(p, dict)]
        else:
            raise ApiError(f"{where} is a {kind!r} item; this server takes message, function_call, "
                           "function_call_output and reasoning items", param=where, code="unsupported_value")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tool_list(tools)):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ApiError(f"{at} is a {kind!r} tool; this server serves function tools (built-in tools such as "
                           "web search run on OpenAI's platform)", param=f"{at}.type", code="unsupported_value")
        if not isinstance(tool.get("name"), str):
            raise ApiError(f"{at} needs a 'name'", param=f"{at}.name", code="missing_required_parameter")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append(chat_function(tool["name"], tool.get("description"), parameters))
    return out


def _tool_choice(choice: Any) -> str | dict[str, Any]:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return named_choice(choice["name"])
    raise ApiError(f"'tool_choice' must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}; got "
                   f"{choice!r}", param="tool_choice", code="invalid_value")


def _thinking(reasoning: Any) -> bool | None:
    if reasoning is None:
        return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else reasoning
    if effort is None:
        return None
    if effort not in _EFFORT_THINKS:
        raise ApiError(f"reasoning.effort must be one of {', '.join(_EFFORT_THINKS)}; got {effort!r}",
                       param="reasoning.effort", code="invalid_value")
    return _EFFORT_THINKS[effort]


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """Chat's `response_format` for `text.format` (None: plain text)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                       **({"strict": fmt["strict"]} if "strict" in fmt else {})}}
    raise ApiError(f"text.format must be {{'type': 'text' | 'json_object'}} or {{'type': 'json_schema', 'name': ..., "
                   f"'schema': {{...}}}}; got {fmt!r}", param="text.format", code="invalid_value")

