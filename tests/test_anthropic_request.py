"""Anthropic Messages bodies as chat completions bodies (serving/anthropic_request.py): the
conversation, tools, tool choice, thinking switch and output format carried over; mistakes are
400s naming the field."""

import json

import pytest

pytest.importorskip("aiohttp")

from eagle3_jax.serving.anthropic_request import chat_body  # noqa: E402
from eagle3_jax.serving.errors import ApiError  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_tool_round_trip_becomes_chat_messages():
    body = {
        "model": "m", "max_tokens": 64,
        "system": [{"type": "text", "text": "You are terse. ", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"},
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 4, "stream": True,
    }
    chat, warnings = chat_body(body)
    assert warnings == []
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse. Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                               "description": "Weather of a city"}}]
    assert (chat["tool_choice"], chat["stop"], chat["temperature"], chat["top_k"], chat["max_tokens"]) == (
        "auto", ["END"], 0.5, 4, 64)
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}  # usage closes every stream
    assert "metadata" not in chat and "chat_template_kwargs" not in chat


@pytest.mark.parametrize("choice, want", [({"type": "any"}, "required"), ({"type": "none"}, "none"),
                                          ({"type": "tool", "name": "get_weather"},
                                           {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice_maps_to_chats(choice, want):
    chat, _ = chat_body({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                         "tool_choice": choice})
    assert chat["tool_choice"] == want


def test_thinking_and_effort_set_the_templates_switch():
    base = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    chat, warnings = chat_body({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert chat["chat_template_kwargs"] == {"thinking": True, "enable_thinking": True}
    assert warnings == ["thinking.budget_tokens is not enforced: max_tokens caps thinking and answer together"]
    chat, _ = chat_body({**base, "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}})
    assert chat["chat_template_kwargs"] == {"thinking": False, "enable_thinking": False}  # thinking wins
    chat, _ = chat_body({**base, "output_config": {"effort": "low"}})
    assert chat["chat_template_kwargs"] == {"thinking": False, "enable_thinking": False}
    chat, _ = chat_body({**base, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}
    assert "chat_template_kwargs" not in chat


def test_error_results_and_unknown_fields_are_said():
    chat, warnings = chat_body({"max_tokens": 8, "top_a": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no such city",
                                      "is_error": True}]}]})
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "Error: no such city"}]
    assert warnings == ["'top_a' is not supported and was ignored"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                                  "name": "web_search"}]},
     "tools[0].type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "on"}}, "thinking"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "END"}, "stop_sequences"),
])
def test_mistakes_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        chat_body(body)
    assert e.value.status == 400 and e.value.param == param
