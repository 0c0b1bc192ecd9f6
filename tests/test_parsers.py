"""Tool-call and reasoning parsers: held-out outputs of each family parsed whole, malformed markup
given back as content, and streaming that folds to the whole parse over every split."""

from __future__ import annotations

import json
import random

import pytest

import eagle3_jax.parsers as parsers
from eagle3_jax.parsers import (OutputParsers, ParserError, StreamingParser, parse_output, parse_reasoning,
                                parse_tool_calls, reasoning_parser, tool_call_parser)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"},
                                     "detail": {"type": ["null", "object"]}, "ratio": {"type": "number"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

KIMI_CALLS = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
              '{"city": "北京", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
              "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
MINIMAX_CALLS = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">San Francisco</parameter>\n'
                 '<parameter name="days">3</parameter>\n<parameter name="metric">false</parameter>\n'
                 '<parameter name="hours">[1, 2]</parameter>\n<parameter name="detail">null</parameter>\n'
                 '<parameter name="ratio">0.5</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
                 '</minimax:tool_call>')
DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                  '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                  "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK31_CALLS = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
LLAMA_CALLS = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "get_time", "parameters": {}}'

# (parser, output, expected content, expected [(name, arguments as an object)])
CASES = [
    ("kimi_k2", "I'll look that up." + KIMI_CALLS, "I'll look that up.",
     [("get_weather", {"city": "北京", "days": 3}), ("get_time", {})]),
    ("kimi_k2", KIMI_CALLS, None, [("get_weather", {"city": "北京", "days": 3}), ("get_time", {})]),
    ("kimi_k2", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("minimax_m2", "Checking.\n" + MINIMAX_CALLS, "Checking.\n",
     [("get_weather", {"city": "San Francisco", "days": 3, "metric": False, "hours": [1, 2], "detail": None,
                       "ratio": 0.5}), ("get_time", {})]),
    ("deepseek_v3", "Sure." + DEEPSEEK_CALLS, "Sure.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("deepseek_v31", DEEPSEEK31_CALLS, None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("llama3_json", LLAMA_CALLS, None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("llama3_json", "<|python_tag|>" + LLAMA_CALLS, None, [("get_weather", {"city": "Paris", "days": 3}),
                                                           ("get_time", {})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
]


def _calls(tool_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_family_parses_its_markup(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, parser, tools=TOOLS)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c["type"] == "function" and c["id"] for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def test_kimi_ids_are_its_own_and_history_ids_are_normalised():
    _, calls = parse_tool_calls(KIMI_CALLS, "kimi_k2")
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                   {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
               {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "x", "content": "1pm"}]
    out = tool_call_parser("kimi_k2").prepare_messages(history)
    assert [c["id"] for c in out[1]["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    assert [out[2]["tool_call_id"], out[3]["tool_call_id"]] == ["functions.get_weather:0", "functions.get_time:1"]
    assert out[4]["tool_calls"][0]["id"] == out[5]["tool_call_id"] == "functions.get_time:2"
    assert history[1]["tool_calls"][0]["id"] == "call_abc"  # the caller's messages are not edited


KIMI_ONE = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
DEEPSEEK_ONE = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')

# Markup no reader can take as a call: given back as content, whole.
MALFORMED = [
    ("kimi_k2", KIMI_CALLS.replace("get_time", "rm_rf").replace("get_weather", "rm_rf")),  # functions the tools lack
    ("kimi_k2", KIMI_ONE.replace('"Paris"}', '"Par')),  # the value cut short
    ("kimi_k2", KIMI_ONE.replace('{"city": "Paris"}', "[1, 2]")),  # arguments that are no object
    ("kimi_k2", KIMI_ONE.replace('"Paris"', "Infinity")),  # no JSON number
    ("kimi_k2", KIMI_ONE.replace('"Paris"', "Paris")),  # a bare word: a string or a name?
    ("kimi_k2", KIMI_ONE.replace("functions.get_weather:0", "get weather")),  # no function in the id
    ("kimi_k2", KIMI_ONE.replace("functions.get_weather:0", "0").replace('{"city": "Paris"}', "{}")),  # either tool
    ("kimi_k2", "<|tool_calls_section_begin|>just words<|tool_calls_section_end|>"),
    ("minimax_m2", MINIMAX_CALLS.replace("get_time", "rm_rf").replace("get_weather", "rm_rf")),
    ("minimax_m2", "<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>"),  # no name
    ("deepseek_v3", DEEPSEEK_ONE.replace('"Paris"}', '"Par')),
    ("deepseek_v3", DEEPSEEK_ONE.replace("<｜tool▁call▁begin｜>", "")),  # no call in the section
    ("llama3_json", '{"name": "rm_rf", "parameters": {}}'),
    ("llama3_json", '{"parameters": {}}'),
    ("llama3_json", '{"name": "get_time", "parameters": {"at": NaN}}'),  # not JSON as clients parse it
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
]


@pytest.mark.parametrize("parser,text", MALFORMED, ids=[f"{c[0]}-{i}" for i, c in enumerate(MALFORMED)])
def test_malformed_markup_is_content(parser, text):
    assert parse_tool_calls(text, parser, tools=TOOLS) == (text, [])


WEATHER_CALL, TIME_CALL = ("get_weather", {"city": "北京", "days": 3}), ("get_time", {})
KIMI_BAD_CALL = "<|tool_call_begin|>functions.rm_rf:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
# Messy output a reader still takes calls from, as vLLM's parsers do (where this project differs from
# them, docs/serving.md says so): (parser, output, content, calls).
RECOVERED = [
    ("kimi_k2", "Hi" + KIMI_CALLS.removesuffix("<|tool_calls_section_end|>"), "Hi", [WEATHER_CALL, TIME_CALL]),
    ("kimi_k2", KIMI_CALLS.replace('"days": 3}', '"days": 3'), None, [WEATHER_CALL, TIME_CALL]),  # its } left out
    ("kimi_k2", KIMI_CALLS.replace('{"city": "北京", "days": 3}', "{'city': '北京', 'days': 3,}"), None,
     [WEATHER_CALL, TIME_CALL]),  # Python's literals, a trailing comma
    ("kimi_k2", KIMI_CALLS.replace("functions.get_time:1", "functions.rm_rf:1"), KIMI_BAD_CALL, [WEATHER_CALL]),
    ("kimi_k2", KIMI_CALLS.replace("<|tool_call_begin|>", " noise <|tool_call_begin|>\n"), None,
     [WEATHER_CALL, TIME_CALL]),  # text between the markers
    ("kimi_k2", KIMI_ONE.replace("functions.get_weather:0", "0"), None, [("get_weather", {"city": "Paris"})]),
    ("kimi_k2", KIMI_ONE.replace("functions.get_weather:0", "get_weather:0 "), None, [("get_weather", {"city": "Paris"})]),
    ("kimi_k2", "Sure.<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>", "Sure.",
     [TIME_CALL]),  # a call without its section
    ("kimi_k2", "A<|tool_calls_section_begin|> <|tool_calls_section_end|>B", "AB", []),  # an empty section
    ("minimax_m2", "<minimax:tool_call>\n<invoke id='7' name='get_weather' kind=\"x\">\n<parameter name=\"city\" "
     "type=\"string\">Paris</parameter>\nnoise\n<parameter name=days>3</parameter>\n</invoke>\n</minimax:tool_call>",
     None, [("get_weather", {"city": "Paris", "days": 3})]),  # attributes in any order, quotes or none, noise
    ("minimax_m2", "Checking.\n" + MINIMAX_CALLS.removesuffix("</minimax:tool_call>"), "Checking.\n",
     [("get_weather", {"city": "San Francisco", "days": 3, "metric": False, "hours": [1, 2], "detail": None,
                       "ratio": 0.5}), ("get_time", {})]),  # the block never closed
    ("deepseek_v3", DEEPSEEK_ONE.replace("```json\n", "").replace("\n```", ""), None,
     [("get_weather", {"city": "Paris"})]),  # no fence
    ("deepseek_v3", DEEPSEEK_ONE.replace('{"city": "Paris"}', '{\n  "city": "Paris"\n}'), None,
     [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", "Sure." + DEEPSEEK_CALLS.removesuffix("<｜tool▁calls▁end｜>"), "Sure.",
     [("get_weather", {"city": "Paris", "days": 3}), TIME_CALL]),
    ("deepseek_v31", DEEPSEEK31_CALLS.replace('"days": 3}', '"days": }'),
     '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": }<｜tool▁call▁end｜>', [TIME_CALL]),
    ("llama3_json", 'Here: {"name": "get_time", "parameters": {}} Anything else?', "Here:  Anything else?", [TIME_CALL]),
    ("llama3_json", LLAMA_CALLS.replace("; ", "\n"), None, [("get_weather", {"city": "Paris", "days": 3}), TIME_CALL]),
    ("llama3_json", 'Calling.\n<|python_tag|>{"name": "get_time", "arguments": {}} I used {get_time} here.',
     "Calling.\n I used {get_time} here.", [TIME_CALL]),
    ("llama3_json", "{'name': 'get_time', 'parameters': {}}", None, [TIME_CALL]),
    ("llama3_json", '{"name": "get_time"}', None, [TIME_CALL]),  # no parameters: none
]


@pytest.mark.parametrize("parser,text,content,calls", RECOVERED, ids=[f"{c[0]}-{i}" for i, c in enumerate(RECOVERED)])
def test_messy_markup_gives_every_call_a_reader_can_take(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, parser, tools=TOOLS)
    assert (got_content, _calls(got_calls)) == (content, calls)
    for call in got_calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    ps = _parsers(parser, None, {})  # streamed, split anywhere: the same reply
    whole = parse_output(text, ps)
    for parts in _splits(text, random.Random(text), runs=8):
        streamed_content, _, streamed_calls = _streamed(parts, ps)
        assert (streamed_content, tuple(streamed_calls)) == (whole.content, whole.tool_calls), parts


def test_kimi_calls_named_by_a_bare_counter_take_the_only_tool_that_fits():
    bare = KIMI_ONE.replace("functions.get_weather:0", "3")
    assert _calls(parse_tool_calls(bare, "kimi_k2", tools=TOOLS)[1]) == [("get_weather", {"city": "Paris"})]
    assert parse_tool_calls(bare, "kimi_k2", tools=TOOLS)[1][0]["id"] == "functions.get_weather:3"
    assert parse_tool_calls(bare, "kimi_k2", tools=[TIME])[1][0]["function"]["name"] == "get_time"  # the only one
    assert parse_tool_calls(bare, "kimi_k2")[1] == []  # no tools: no name to give it


def test_without_tools_any_function_name_is_a_call():
    _, calls = parse_tool_calls(KIMI_CALLS.replace("get_time", "rm_rf"), "kimi_k2")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "rm_rf"]


def test_minimax_numbers_beyond_floats_stay_exact_or_text():
    text = ('<minimax:tool_call><invoke name="get_weather"><parameter name="days">' + "9" * 40 + '</parameter>'
            '<parameter name="ratio">1e999</parameter></invoke></minimax:tool_call>')
    _, calls = parse_tool_calls(text, "minimax_m2", tools=TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"days": int("9" * 40), "ratio": "1e999"}


def test_minimax_values_follow_the_schema_or_stay_text():
    text = ('<minimax:tool_call><invoke name="get_weather"><parameter name="city">007</parameter>'
            '<parameter name="days">3.0</parameter><parameter name="extra">{"a": 1}</parameter>'
            '<parameter name="note">not json</parameter></invoke></minimax:tool_call>')
    _, calls = parse_tool_calls(text, "minimax_m2", tools=TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "007", "days": 3, "extra": '{"a": 1}',
                                                           "note": "not json"}
    _, calls = parse_tool_calls(text, "minimax_m2")  # no tools: nothing types a value
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "007", "days": "3.0", "extra": '{"a": 1}',
                                                           "note": "not json"}


@pytest.mark.parametrize("schema,text,value", [
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "5", "5"),
    ({"type": ["string", "null"]}, "null", None),  # null before string, whatever the list's order
    ({"type": "boolean"}, "1", True),
    ({"type": "int"}, "7", 7),  # the common aliases
    ({"type": "float"}, "2.5", 2.5),
    ({"enum": [1, 2, 3]}, "2", 2),  # typed by the enum's values
    ({"oneOf": [{"type": "object"}, {"type": "array"}]}, "[1]", [1]),
    ({"type": "integer"}, "many", "many"),  # no type fits: the text
    ({}, "5", "5"),  # no type named
])
def test_minimax_values_take_every_type_a_schema_names(schema, text, value):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}}
    markup = f'<minimax:tool_call><invoke name="f"><parameter name="x">{text}</parameter></invoke></minimax:tool_call>'
    assert json.loads(parse_tool_calls(markup, "minimax_m2", tools=[tool])[1][0]["function"]["arguments"]) == {"x": value}


REASONING = [
    ("kimi_k2", {}, "Let me think.\nOK.</think>The answer is 4.", "Let me think.\nOK.", "The answer is 4."),
    ("kimi_k2", {}, "<think>Need weather.</think>" + KIMI_CALLS, "Need weather.", KIMI_CALLS),
    ("kimi_k2", {}, "Need weather." + KIMI_CALLS, "Need weather.", KIMI_CALLS),  # ends straight at the calls
    ("kimi_k2", {}, "Still thinking when the tokens ran out", "Still thinking when the tokens ran out", None),
    ("kimi_k2", {"thinking": False}, "The answer is 4.", None, "The answer is 4."),
    ("deepseek_r1", {}, "only reasoning</think>", "only reasoning", None),  # nothing after it: None, as vLLM
    ("deepseek_r1", {}, "<think>\nhmm\n</think>\n\n4", "\nhmm\n", "\n\n4"),
    ("deepseek_v3", {}, "4</think>x", None, "4</think>x"),  # V3.1 thinks only when asked
    ("deepseek_v3", {"thinking": True}, "hmm</think>4", "hmm", "4"),
    ("minimax_m2", {"enable_thinking": False}, "plan\n</think>\n\nDone.", "plan\n", "\n\nDone."),
    ("minimax_m2_append_think", {}, "plan\n</think>\n\nDone.", None, "<think>plan\n</think>\n\nDone."),
    ("deepseek_r1", {}, "\n<think>hmm</think>\n4", "hmm", "\n4"),  # blanks before the model's own <think>
    ("minimax_m2", {}, "plan</think>A</think>B", "plan", "AB"),  # a second </think> dropped
    ("kimi_k2", {}, "plan" + KIMI_BAD_CALL, "plan", KIMI_BAD_CALL),  # ends at a call without its section
]


@pytest.mark.parametrize("parser,kwargs,text,reasoning,content", REASONING,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(REASONING)])
def test_reasoning_parsers(parser, kwargs, text, reasoning, content):
    assert parse_reasoning(text, parser, **kwargs) == (reasoning, content)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ParserError, match="kimi_k2, minimax_m2"):
        tool_call_parser("hermes")
    with pytest.raises(ParserError, match="deepseek_r1"):
        reasoning_parser("qwen3")
    assert set(parsers.TOOL_CALL_PARSERS) == {"kimi_k2", "minimax_m2", "deepseek_v3", "deepseek_v31", "llama3_json"}
    assert set(parsers.REASONING_PARSERS) == {"kimi_k2", "deepseek_r1", "deepseek_v3", "minimax_m2",
                                              "minimax_m2_append_think"}


# ---- streaming == whole -------------------------------------------------------------------------------------

STREAMED = [
    ("kimi_k2", "kimi_k2", {}, "Plan: check the weather.</think>Looking it up." + KIMI_CALLS + " done"),
    ("kimi_k2", "kimi_k2", {}, "Short." + KIMI_CALLS),
    ("kimi_k2", "kimi_k2", {}, "A</think>B" + KIMI_CALLS + "C<|tool_calls_section_begin|>bad<|tool_calls_section_end|>D"
     + KIMI_CALLS.replace(":0", ":2").replace(":1", ":3") + "E<|tool_calls_sec"),  # sections after settled ones
    ("kimi_k2", "kimi_k2", {}, "Unclosed." + KIMI_CALLS[:-len("<|tool_calls_section_end|>")]),
    ("kimi_k2", "kimi_k2", {"thinking": False}, "</thi" + KIMI_CALLS.replace("get_time", "nope")),
    ("minimax_m2", "minimax_m2", {}, "I should call it.\n</think>\n\n" + MINIMAX_CALLS),
    ("minimax_m2", "minimax_m2_append_think", {}, "I should call it.\n</think>\n\n" + MINIMAX_CALLS),
    ("deepseek_v3", "deepseek_r1", {}, "<think>call</think>Sure. " + DEEPSEEK_CALLS),
    ("deepseek_v31", "deepseek_v3", {"thinking": True}, "call it</think>" + DEEPSEEK31_CALLS + "<｜tool▁calls"),
    ("llama3_json", None, {}, " " + LLAMA_CALLS),
    ("llama3_json", None, {}, "Text first <|python_tag|>" + LLAMA_CALLS),
    ("llama3_json", None, {}, "<|python_tag|>{broken"),
    ("llama3_json", None, {}, "Plain answer with a < sign and <|python_"),
]


def _parsers(tool, reasoning, kwargs) -> OutputParsers:
    return OutputParsers.of(reasoning_parser(reasoning, kwargs) if reasoning else None,
                            tool_call_parser(tool) if tool else None, TOOLS)


def _streamed(parts, ps: OutputParsers):
    stream = StreamingParser(ps)
    content, reasoning, calls = "", "", []
    for i, part in enumerate(parts):
        delta = stream.push(part, final=i == len(parts) - 1)
        content, reasoning = content + delta.content, reasoning + delta.reasoning
        calls += [call for _, call in delta.tool_calls]
    return content, reasoning, calls


def _splits(text: str, rng: random.Random, runs: int = 30):
    yield [text]
    yield list(text) + [""]  # a character per delta, then the final empty one
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]  # every split point
    for _ in range(runs):  # runs of 1..k characters
        parts, at = [], 0
        while at < len(text):
            n = rng.randint(1, 12)
            parts.append(text[at:at + n])
            at += n
        yield parts


@pytest.mark.parametrize("tool,reasoning,kwargs,text", STREAMED, ids=[f"{c[0]}-{i}" for i, c in enumerate(STREAMED)])
def test_streaming_folds_to_the_whole_reply_over_every_split(tool, reasoning, kwargs, text):
    ps = _parsers(tool, reasoning, kwargs)
    whole = parse_output(text, ps)
    rng = random.Random(0)
    for parts in _splits(text, rng):
        content, reasoning_text, calls = _streamed(parts, ps)
        assert (content, reasoning_text, tuple(calls)) == (whole.content, whole.reasoning or "", whole.tool_calls), parts


def test_streaming_sends_reasoning_and_content_as_they_settle():
    stream = StreamingParser(_parsers("kimi_k2", "kimi_k2", {}))
    assert stream.push("Let me").reasoning == "Let me"
    assert stream.push(" see</th") == parsers.OutputDelta(reasoning=" see")  # "</th" may be </think>
    delta = stream.push("ink>It is")
    assert (delta.reasoning, delta.content) == ("", "It is")
    assert not stream.push(KIMI_CALLS[:40])  # an open section settles nothing
    delta = stream.push(KIMI_CALLS[40:])
    assert [(i, c.name) for i, c in delta.tool_calls] == [(0, "get_weather"), (1, "get_time")]


@pytest.mark.parametrize("tool,reasoning", [("kimi_k2", "kimi_k2"), ("minimax_m2", "minimax_m2_append_think"),
                                            ("deepseek_v3", "deepseek_r1"), ("deepseek_v31", None),
                                            ("llama3_json", None), (None, "minimax_m2")])
def test_streaming_folds_to_the_whole_parse_on_random_markup(tool, reasoning):
    """Texts made of the families' markers, cut short, glued and mixed with words, over random splits."""
    pieces = ["<think>", "</think>", "</thi", "Hi ", "{", "}", '"a": 1', ";", "\n", "<|python_tag|>", KIMI_CALLS,
              KIMI_CALLS[:50], "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", MINIMAX_CALLS,
              MINIMAX_CALLS[:30], "<minimax:tool_call>", "</minimax:tool_call>", DEEPSEEK_CALLS, DEEPSEEK31_CALLS,
              "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", LLAMA_CALLS, LLAMA_CALLS[:20]]
    rng = random.Random(f"{tool}-{reasoning}")  # str seeds are stable across runs
    ps = _parsers(tool, reasoning, {})
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        whole = parse_output(text, ps)
        for _ in range(4):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
            parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            content, reasoning_text, calls = _streamed(parts, ps)
            assert (content, reasoning_text, tuple(calls)) == (whole.content, whole.reasoning or "", whole.tool_calls), \
                (text, parts)
