"""OpenAI Responses bodies as chat completions bodies (serving/responses_request.py): items to
messages, tools, tool choice, reasoning effort and text format carried over; stored state and
mistakes are 400s naming the field."""

import pytest

pytest.importorskip("aiohttp")

from eagle3_jax.serving.errors import ApiError  # noqa: E402
from eagle3_jax.serving.responses_request import chat_body  # noqa: E402

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_items_become_chat_messages():
    chat, warnings = chat_body({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 64, "temperature": 0.3, "stream": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris"},
                                         {"type": "input_text", "text": "?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
             "content": [{"type": "reasoning_text", "text": "I should call the tool."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
        ],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "metadata": {"a": "b"},
        "store": False, "reasoning": {"effort": "low"}, "text": {"format": {"type": "json_schema", "name": "w",
                                                                           "schema": {"type": "object"}}}})
    assert warnings == []
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should call the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20 C"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                               "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["max_tokens"], chat["temperature"], chat["stream"], chat["stream_options"]) == (
        64, 0.3, True, {"include_usage": True})
    assert chat["chat_template_kwargs"] == {"thinking": True, "enable_thinking": True}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


def test_a_string_input_a_call_without_text_and_plain_text_format():
    chat, warnings = chat_body({"input": "hi", "text": {"format": {"type": "text"}}, "reasoning": {"effort": "none"},
                                "frequency_penalty": 1})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "response_format" not in chat
    assert chat["chat_template_kwargs"] == {"thinking": False, "enable_thinking": False}
    assert warnings == ["'frequency_penalty' is not supported and was ignored"]
    chat, _ = chat_body({"input": [{"role": "user", "content": "go"},
                                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})
    assert chat["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": "any"}, "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_mistakes_and_stored_state_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        chat_body(body)
    assert e.value.status == 400 and e.value.param == param
