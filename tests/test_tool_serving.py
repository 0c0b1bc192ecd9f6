"""Kimi-K2.5 as its users serve it, end to end: a Kimi-layout folder (tiktoken vocabulary, its chat
template) over a scripted target whose greedy answers are given token scripts, served plainly and
with an EAGLE-3 draft delivering several tokens per step, through the `openai` client: a tool round
trip (call -> tool result -> answer), reasoning split off, thinking turned off, streamed and whole
replies equal; `Engine.chat` answers the same; and the README's serve.py command runs as written
(with the scripted folders and a small mesh put in)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest
from model_folders import kimi_folder, minimax_folder
from scripted_models import write_scripted_pair
from server_fixtures import ServerThread

import eagle3_jax as e3
from eagle3_jax.scheduler import Scheduler
from eagle3_jax.serving import AsyncEngine, make_app
from eagle3_jax.serving.protocol import ChatRequest, Limits, OutputParsing

openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "tests", "data", "chat_templates", "kimi_k25.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"role": "assistant", "content": "Let me check.", "tool_calls": [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny\n21 C"}
NO_THINKING = [{"role": "user", "content": "Name the capital of France."}]
# (request, what the model answers, the parsed reply: reasoning, content, calls, finish_reason)
TURNS = {
    "call": (dict(messages=ASK, tools=TOOLS),
             "The user wants the weather in Paris, so I call the tool.</think>Let me check.<|tool_calls_section_begin|>"
             '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
             "<|tool_calls_section_end|>",
             ("The user wants the weather in Paris, so I call the tool.", "Let me check.",
              [("functions.get_weather:0", "get_weather", {"city": "Paris"})], "tool_calls")),
    "answer": (dict(messages=ASK + [CALL, RESULT], tools=TOOLS),
               "The tool says sunny and 21 C.</think>It is sunny in Paris, 21 °C.",
               ("The tool says sunny and 21 C.", "It is sunny in Paris, 21 °C.", [], "stop")),
    "no_thinking": (dict(messages=NO_THINKING, extra_body={"chat_template_kwargs": {"thinking": False}}),
                    "Paris is the capital of France.",
                    (None, "Paris is the capital of France.", [], "stop")),
}
PARSING = OutputParsing("kimi_k2", "kimi_k2")
# MiniMax-M2.5 with minimax_m2_append_think: the reasoning stays in the content, <think> put back
MM_CALL = {"role": "assistant", "content": "<think>I need the weather tool.\n</think>\n\n", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
MM_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
MM_TURNS = {
    "call": (dict(messages=ASK, tools=TOOLS),
             'I need the weather tool.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
             '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>',
             (None, MM_CALL["content"], [("get_weather", {"city": "Paris"})], "tool_calls")),
    "answer": (dict(messages=ASK + [MM_CALL, MM_RESULT], tools=TOOLS),
               "The tool says sunny.\n</think>\n\nIt is sunny in Paris.",
               (None, "<think>The tool says sunny.\n</think>\n\nIt is sunny in Paris.", [], "stop")),
}


def _body(kwargs: dict) -> dict:
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    return {**body, **kwargs.get("extra_body", {})}


def _scripted(root, tok_dir: str, turns: dict, parsing: OutputParsing, end_of_turn: str, family: str):
    """(tokenizer folder, tokenizer, target dir, draft dir): the scripted answers keyed by the very
    prompts the server builds from each turn's request."""
    tok = e3.load_tokenizer(tok_dir)
    limits = Limits(max_seq_len=1024, max_logprobs=0, eos_token_ids=tok.eos_ids)
    prompts, scripts = [], []
    for request, answer, _ in turns.values():
        prompts.append(ChatRequest.from_body(_body(request), limits, tok, tok.chat_template, parsing).prompt_ids)
        scripts.append(tok.encode(answer, add_bos=False) + [tok.token_to_id(end_of_turn)])
    target_dir, draft_dir = write_scripted_pair(str(root / "model"), tok.vocab_size, prompts, scripts, family=family,
                                                eos_token_id=list(tok.eos_ids), bos_token_id=tok.bos_id,
                                                tokenizer_dir=tok_dir)
    return tok_dir, tok, target_dir, draft_dir


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-scripted")
    with open(TEMPLATE) as f:
        tok_dir = kimi_folder(root / "tokenizer", chat_template=f.read())
    return _scripted(root, tok_dir, TURNS, PARSING, "<|im_end|>", "kimi_k25")


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """A MiniMax-M2.5 tokenizer folder over a scripted target (Llama layout: the parsers and the
    template are what is under test, not the architecture)."""
    root = tmp_path_factory.mktemp("minimax-scripted")
    tok_dir = minimax_folder(root / "tokenizer")
    return _scripted(root, tok_dir, MM_TURNS, OutputParsing("minimax_m2", "minimax_m2_append_think"), "[e~[",
                     "llama")


def _reply(client, request: dict, stream: bool):
    """(reasoning, content, calls, finish_reason, usage) of one chat request, whole or streamed."""
    common = dict(model="kimi", temperature=0, max_tokens=200)
    if not stream:
        r = client.chat.completions.create(**common, **request)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        extra = m.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        return extra.get("reasoning_content"), m.content, calls, r.choices[0].finish_reason, r.usage
    reasoning, content, calls, finish, usage = None, None, {}, None, None
    for chunk in client.chat.completions.create(**common, **request, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta, extra = choice.delta, choice.delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning = (reasoning or "") + extra["reasoning_content"]
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            if call.id is not None:  # the header: index, id, type and name, once
                assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                calls[call.index] = [call.id, call.function.name, ""]
            else:
                calls[call.index][2] += call.function.arguments
        finish = choice.finish_reason or finish
    calls = [(i, name, json.loads(args)) for i, name, args in (calls[k] for k in sorted(calls))]
    return reasoning, content, calls, finish, usage


@pytest.fixture(scope="module", params=["plain", "chain:3:1:4"])
def served(request, kimi):
    tok_dir, tok, target_dir, draft_dir = kimi
    target = e3.load_target(target_dir, dtype="float32")
    draft = None if request.param == "plain" else e3.load_draft(draft_dir, target=target, dtype="float32")
    spec = None if draft is None else e3.SpecConfig.parse(request.param)
    scheduler = Scheduler(target, draft, spec, max_num_seqs=4, max_seq_len=2048, tokenizer=tok, prefix_caching=True)
    engine = AsyncEngine(scheduler, tokenizer=tok).start()
    server = ServerThread(make_app(engine, "kimi", tool_call_parser="kimi_k2", reasoning_parser="kimi_k2"))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    client.e3_engine = engine  # for tests that serve the same engine another way
    yield request.param, client
    server.stop()
    engine.shutdown(timeout=10)


@pytest.mark.parametrize("turn", list(TURNS))
def test_tool_round_trip_whole_and_streamed(served, turn):
    mode, client = served
    request, _, expected = TURNS[turn]
    for stream in (False, True):
        *got, usage = _reply(client, request, stream)
        assert tuple(got) == expected, (mode, stream)
        if mode != "plain":  # several tokens per step: markers arrive glued to text and to each other
            assert (usage.model_extra or {})["spec_decode"]["mean_accept_length"] > 2


def test_tool_choice_none(served):
    _, client = served
    request, answer, _ = TURNS["call"]
    r = client.chat.completions.create(model="kimi", temperature=0, max_tokens=200, tool_choice="none", **request)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == answer.split("</think>", 1)[1]  # the markup, unparsed


# A tool whose every argument the schema bounds: a forced call to it is valid whatever the model
# would have said (the scripted model has no script for these prompts).
ENUM_TOOLS = [{"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 3}},
    "required": ["mode", "level"], "additionalProperties": False}}}] + TOOLS


def _forced_call(client, model: str, request: dict, choice, stream: bool):
    """The (name, arguments) of a forced call's reply, which must hold exactly one valid call."""
    *_, calls, finish, _ = _reply(client, {**request, "tool_choice": choice}, stream) if model == "kimi" else \
        (*_whole(client, model, {**request, "tool_choice": choice}), None)
    assert finish == "tool_calls" and len(calls) == 1, (calls, finish)
    return calls[0][-2:]


def _check_set_mode(arguments: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(arguments, ENUM_TOOLS[0]["function"]["parameters"])


def test_forced_calls_are_valid_calls(served):
    """tool_choice "required" on the scripted call turn gives its call; a named function off any
    script gives a call to it whose arguments keep to its schema, streamed and whole alike."""
    _, client = served
    request, _, expected = TURNS["call"]
    for stream in (False, True):
        assert _forced_call(client, "kimi", request, "required", stream) == expected[2][0][-2:]
    named = {"type": "function", "function": {"name": "set_mode"}}
    off = {"chat_template_kwargs": {"thinking": False}}  # off any script the model would never end a reasoning
    replies = [_forced_call(client, "kimi", dict(messages=ASK, tools=ENUM_TOOLS, extra_body=off), named, stream)
               for stream in (False, True)]
    assert replies[0] == replies[1] and replies[0][0] == "set_mode"
    _check_set_mode(replies[0][1])


def test_forced_calls_on_the_minimax_layout(minimax):
    tok_dir, tok, target_dir, _ = minimax
    target = e3.load_target(target_dir, dtype="float32")
    scheduler = Scheduler(target, None, None, max_num_seqs=2, max_seq_len=1024, tokenizer=tok)
    engine = AsyncEngine(scheduler, tokenizer=tok).start()
    server = ServerThread(make_app(engine, "mm", tool_call_parser="minimax_m2",
                                   reasoning_parser="minimax_m2_append_think"))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    try:
        # MiniMax always reasons first, so its scripted turn (which ends its reasoning) is asked.
        request, _, expected = MM_TURNS["call"]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            assert _forced_call(client, "mm", request, choice, False) == expected[2][0]
    finally:
        server.stop()
        engine.shutdown(timeout=10)


def test_response_format_is_kept_whole_and_streamed(served):
    _, client = served
    schema = ENUM_TOOLS[0]["function"]["parameters"]
    request = dict(messages=NO_THINKING, extra_body={"chat_template_kwargs": {"thinking": False}},
                   response_format={"type": "json_schema", "json_schema": {"name": "mode", "schema": schema}})
    whole = _reply(client, request, False)
    streamed = _reply(client, request, True)
    assert whole[:4] == streamed[:4] and whole[3] == "stop"
    _check_set_mode(json.loads(whole[1]))
    with pytest.raises(openai.BadRequestError, match="cannot") as e:
        client.chat.completions.create(model="kimi", max_tokens=8, messages=NO_THINKING, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "no-such-type"}}}}})
    assert e.value.body["param"] == "response_format"


# ---- Anthropic's Messages API (Claude Code's) on the same path ---------------------------------------------

A_TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}]
A_CALL = {"role": "assistant", "content": [
    {"type": "text", "text": "Let me check."},
    {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather", "input": {"city": "Paris"}}]}
# A tool's output in two text blocks reads as two lines, as vLLM joins them (the scripted answer
# follows only the prompt whose tool message is "sunny\n21 C").
A_RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.get_weather:0",
                                         "content": [{"type": "text", "text": "sunny"},
                                                     {"type": "text", "text": "21 C"}]}]}
GREEDY = {"temperature": 0}  # in the body: today's anthropic SDK no longer types temperature, top_p, top_k
A_TURNS = {"call": dict(messages=ASK, tools=A_TOOLS), "answer": dict(messages=ASK + [A_CALL, A_RESULT], tools=A_TOOLS),
           "no_thinking": dict(messages=NO_THINKING, thinking={"type": "disabled"})}


def _anthropic(client):
    anthropic = pytest.importorskip("anthropic")
    return anthropic, anthropic.Anthropic(base_url=str(client.base_url).rsplit("/v1", 1)[0], api_key="none",
                                          max_retries=0)


def _message_parts(message):
    """(thinking, text, calls as (name, input), stop_reason) of an Anthropic message."""
    kinds = [b.type for b in message.content]
    assert kinds == sorted(kinds, key=["thinking", "text", "tool_use"].index), kinds  # in the order written
    thinking = "".join(b.thinking for b in message.content if b.type == "thinking") or None
    text = "".join(b.text for b in message.content if b.type == "text") or None
    calls = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
    return thinking, text, calls, message.stop_reason


@pytest.mark.parametrize("turn", list(TURNS))
def test_anthropic_messages_answer_as_chat_completions(served, turn):
    """The `anthropic` client's messages.create and messages.stream: the chat reply's reasoning,
    content and calls as thinking, text and tool_use blocks, the same tokens counted; count_tokens
    counts the chat prompt's."""
    mode, client = served
    _, claude = _anthropic(client)
    reasoning, content, calls, finish = TURNS[turn][2]
    *_, chat_usage = _reply(client, TURNS[turn][0], False)
    want = (reasoning, content, calls,
            {"tool_calls": "tool_use", "stop": "end_turn"}[finish])
    request = dict(model="kimi", max_tokens=200, extra_body=GREEDY, **A_TURNS[turn])
    whole = claude.messages.create(**request)
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert _message_parts(message) == want, mode
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == chat_usage.prompt_tokens
        assert usage.output_tokens == chat_usage.completion_tokens
    assert streamed.usage.cache_read_input_tokens > 0  # the whole reply's prompt pages served the stream's
    assert claude.messages.count_tokens(**{k: v for k, v in request.items() if k not in ("max_tokens", "extra_body")}
                                          ).input_tokens == chat_usage.prompt_tokens


def test_anthropic_forced_tool_use_stop_sequences_and_errors(served):
    """tool_choice any: one valid tool_use; a stop sequence ends the text and is named; mistakes are
    Anthropic error objects with the matching status."""
    _, client = served
    anthropic, claude = _anthropic(client)
    forced = claude.messages.create(model="kimi", max_tokens=200, extra_body=GREEDY, messages=ASK, tools=A_TOOLS,
                                      tool_choice={"type": "any"})
    assert forced.stop_reason == "tool_use" and [(b.name, b.input) for b in forced.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Paris"})]
    cut = claude.messages.create(model="kimi", max_tokens=200, extra_body=GREEDY, messages=NO_THINKING,
                                   thinking={"type": "disabled"}, stop_sequences=["capital"])
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", "capital", "Paris is the ")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.post("/v1/messages", body={"model": "kimi", "messages": ASK}, cast_to=object)
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "'max_tokens' is required"}}
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="other", max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    for temperature in (1.5, -0.1):  # Anthropic's range is 0-1
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="kimi", max_tokens=8, messages=ASK, extra_body={"temperature": temperature})
        assert "'temperature' must be between 0 and 1" in e.value.body["error"]["message"]
    assert claude.messages.create(model="kimi", max_tokens=200, messages=NO_THINKING, thinking={"type": "disabled"},
                                  extra_body={"temperature": 1.0}).stop_reason == "end_turn"


def _claude_code_tools() -> list[dict]:
    """Tools shaped as Claude Code sends them (a few of its dozen, to fit the served 2,048
    positions): draft-07 schemas, nested arrays of objects, enums, no extra properties,
    `cache_control` on the last one."""
    def schema(properties: dict, required: list) -> dict:
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#"}
    text = {"type": "string"}
    tools = [
        {"name": "Bash", "description": "Run a shell command.",
         "input_schema": schema({"command": text, "timeout": {"type": "number"}, "description": text}, ["command"])},
        {"name": "TodoWrite", "description": "Update the task list.",
         "input_schema": schema({"todos": {"type": "array", "items": schema(
             {"content": {"type": "string", "minLength": 1},
              "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}},
             ["content", "status"])}}, ["todos"])},
    ]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    return tools


def test_a_claude_code_shaped_request_is_served(served):
    """What Claude Code sends: system blocks with cache_control, its tool set, thinking with a
    budget, an earlier turn with a signed thinking block and a tool call, tool results as block
    lists (one an error), metadata and beta headers, streamed: accepted, answered in Anthropic's
    event stream, what is not enforced said in the warnings header; count_tokens takes it too."""
    _, client = served
    _, claude = _anthropic(client)
    system = [{"type": "text", "text": "You are Claude Code, a CLI for software engineering."},
              {"type": "text", "text": "Working directory: /repo. Be concise.", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Context.</system-reminder>"},
                                     {"type": "text", "text": "Fix the failing test.",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Run the tests first.", "signature": "c2lnbmVk"},
            {"type": "text", "text": "Running the tests."},
            {"type": "tool_use", "id": "toolu_01A", "name": "Bash", "input": {"command": "pytest -q"}},
            {"type": "tool_use", "id": "toolu_01B", "name": "Read", "input": {"file_path": "/repo/a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "is_error": True,
             "content": [{"type": "text", "text": "1 failed"}]},
            {"type": "tool_result", "tool_use_id": "toolu_01B", "content": "def f(): return 1"},
            {"type": "text", "text": "Go on."}]}]
    request = dict(model="kimi", max_tokens=8, system=system, messages=messages, tools=_claude_code_tools(),
                   tool_choice={"type": "auto"}, thinking={"type": "enabled", "budget_tokens": 1024},
                   metadata={"user_id": "user_abc_session_1"},
                   extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14,fine-grained-tool-streaming"},
                   extra_body=GREEDY)
    with claude.messages.with_streaming_response.create(**request, stream=True) as raw:
        assert raw.status_code == 200 and "budget_tokens" in raw.headers.get("x-eagle3-warnings", ""), raw.headers
        events = [line.split(": ", 1)[1] for line in raw.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], events
    with claude.messages.stream(**request) as stream:
        message = stream.get_final_message()
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(**{k: v for k, v in request.items()
                                              if k not in ("max_tokens", "extra_body", "metadata")})
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 300


# ---- OpenAI's Responses API (the Agents SDK's) on the same path ---------------------------------------------

R_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
R_TURNS = {"call": dict(input=ASK, tools=R_TOOLS),
           "answer": dict(input=ASK + [{"role": "assistant", "content": "Let me check."},
                                       {"type": "function_call", "call_id": "functions.get_weather:0",
                                        "name": "get_weather", "arguments": '{"city": "Paris"}'},
                                       {"type": "function_call_output", "call_id": "functions.get_weather:0",
                                        "output": "sunny\n21 C"}], tools=R_TOOLS),
           "no_thinking": dict(input="Name the capital of France.", reasoning={"effort": "none"})}


def _response_parts(response):
    """(reasoning, text, calls as (call_id, name, arguments), status) of a Responses API response."""
    kinds = [item.type for item in response.output]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index), kinds
    reasoning = "".join(part.text for item in response.output if item.type == "reasoning"
                        for part in item.content) or None
    text = "".join(part.text for item in response.output if item.type == "message" for part in item.content) or None
    calls = [(item.call_id, item.name, json.loads(item.arguments)) for item in response.output
             if item.type == "function_call"]
    return reasoning, text, calls, response.status


@pytest.mark.parametrize("turn", list(TURNS))
def test_responses_answer_as_chat_completions(served, turn):
    """The `openai` client's responses.create, whole and streamed: the chat reply's reasoning,
    content and calls as reasoning, message and function_call items, the same tokens counted; the
    stream's deltas add up to its completed response."""
    mode, client = served
    reasoning, content, calls, _ = TURNS[turn][2]
    *_, chat_usage = _reply(client, TURNS[turn][0], False)
    request = dict(model="kimi", max_output_tokens=200, temperature=0, **R_TURNS[turn])
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed = events[-1].response
    deltas = {kind: "".join(e.delta for e in events if e.type == f"response.{kind}.delta")
              for kind in ("reasoning_text", "output_text")}
    assert (deltas["reasoning_text"] or None, deltas["output_text"] or None) == (reasoning, content)
    for response in (whole, streamed):
        assert _response_parts(response) == (reasoning, content, calls, "completed"), mode
        assert response.usage.input_tokens == chat_usage.prompt_tokens
        assert response.usage.output_tokens == chat_usage.completion_tokens
    assert streamed.usage.input_tokens_details.cached_tokens > 0


def test_responses_cut_forced_and_refused(served):
    _, client = served
    cut = client.responses.create(model="kimi", max_output_tokens=3, temperature=0, **R_TURNS["no_thinking"])
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    forced = client.responses.create(model="kimi", max_output_tokens=200, temperature=0, input=ASK, tools=R_TOOLS,
                                     tool_choice="required")
    assert [(i.name, json.loads(i.arguments)) for i in forced.output if i.type == "function_call"] == [
        ("get_weather", {"city": "Paris"})]
    for extra, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"background": True}, "background"), ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                         ({"include": ["message.output_text.logprobs"], "top_logprobs": 2}, "include"),
                         ({"top_logprobs": 2}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="kimi", input="hi", **extra)
        assert e.value.body["param"] == param


def test_an_api_key_is_taken_as_a_bearer_or_an_x_api_key(served):
    _, client = served
    anthropic, _ = _anthropic(client)
    server = ServerThread(make_app(client.e3_engine, "kimi", tool_call_parser="kimi_k2", reasoning_parser="kimi_k2",
                                   api_key="s3cret"))
    try:
        request = dict(model="kimi", max_tokens=200, extra_body=GREEDY, **A_TURNS["no_thinking"])
        keyed = anthropic.Anthropic(base_url=server.base_url, api_key="s3cret", max_retries=0)  # x-api-key
        assert keyed.messages.create(**request).content[0].text == TURNS["no_thinking"][2][1]
        bearer = openai.OpenAI(base_url=server.base_url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in bearer.models.list()] == ["kimi"]
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(**request)
        assert e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
    finally:
        server.stop()


def test_engine_chat_answers_as_the_server(kimi):
    _, tok, target_dir, draft_dir = kimi
    target = e3.load_target(target_dir, dtype="float32")
    engine = e3.Engine(target, e3.load_draft(draft_dir, target=target, dtype="float32"), max_seq_len=1024,
                       tokenizer=tok)
    sampling = e3.SamplingParams(temperature=0.0, max_tokens=200)
    answers = engine.chat([ASK, ASK + [CALL, RESULT]], sampling, tools=TOOLS, tool_call_parser="kimi_k2",
                          reasoning_parser="kimi_k2")
    for answer, turn in zip(answers, ("call", "answer")):
        reasoning, content, calls, _ = TURNS[turn][2]
        assert (answer.reasoning, answer.content) == (reasoning, content)
        assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in answer.tool_calls] == calls
        assert answer.output.finish_reason == "stop"
    plain, = engine.chat(NO_THINKING, sampling, chat_template_kwargs={"thinking": False}, reasoning_parser="kimi_k2")
    assert (plain.reasoning, plain.content, plain.tool_calls) == TURNS["no_thinking"][2][:3]


def _readme_command(model: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("### Serving a real model", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [c for c in section.replace("\\\n", " ").splitlines() if "scripts/serve.py" in c]
    return shlex.split(next(c for c in commands if model in c).split("#", 1)[0])


def _serve(args: list[str], target_dir: str, draft_dir: str):
    """serve.py with `args` (as a README line gives them: `python scripts/serve.py ...`), its model
    paths, mesh and sizes swapped for the scripted folders; (process, port, served name)."""
    assert args[:2] == ["python", "scripts/serve.py"]
    swapped = {"--target": target_dir, "--draft": draft_dir, "--max_num_seqs": "2", "--max_seq_len": "1024"}
    flags = [f"{name}={swapped[name]}" if (name := a.split("=", 1)[0]) in swapped else a
             for a in args[2:] if not a.startswith("--mesh=")]  # 8 GPUs' mesh; the scripted model runs on one
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    name = next((a.split("=", 1)[1] for a in flags if a.startswith("--served_model_name=")),
                os.path.basename(os.path.normpath(target_dir)))  # serve.py's default
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "serve.py"), *flags, f"--port={port}",
                             "--nowarmup"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.time() + 240
    while True:
        try:
            client.models.list()
            return proc, client, name
        except openai.APIConnectionError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"serve.py did not start: {proc.communicate()[0]}")
            time.sleep(0.5)


def _stop(proc) -> str:
    proc.terminate()
    return proc.communicate(timeout=30)[0]


def _whole(client, name: str, request: dict):
    r = client.chat.completions.create(model=name, temperature=0, max_tokens=200, **request)
    m = r.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    return (m.model_extra or {}).get("reasoning_content"), m.content, calls, r.choices[0].finish_reason


@pytest.mark.parametrize("model", ["Kimi-K2.5", "MiniMax-M2.5"])
def test_readme_commands_serve_the_tool_round_trip(model, request):
    """The README's serve.py commands, model paths, mesh and sizes swapped for scripted folders
    (every other flag as written: spec, dtype, parsers, served name)."""
    tok_dir, _, target_dir, draft_dir = request.getfixturevalue("kimi" if model == "Kimi-K2.5" else "minimax")
    turns = TURNS if model == "Kimi-K2.5" else MM_TURNS
    args = _readme_command(model)
    assert any(a.startswith("--tool_call_parser=") for a in args) and any(a.startswith("--reasoning_parser=")
                                                                          for a in args)
    proc, client, name = _serve(args, target_dir, draft_dir)
    try:
        for turn in ("call", "answer"):
            reasoning, content, calls, finish = turns[turn][2]
            expected = (reasoning, content, [c[-2:] for c in calls], finish)
            assert _whole(client, name, turns[turn][0]) == expected, turn
    finally:
        out = _stop(proc)
    assert re.search(rf"serving .* as '{name}' \(EAGLE-3 chain", out), out  # the draft speculated
    assert "(auto, for model_type" not in out  # the parsers were set by the flags, not chosen for the user


def test_serve_chooses_the_familys_parsers_and_says_so(kimi):
    _, _, target_dir, _ = kimi
    proc, client, name = _serve(["python", "scripts/serve.py", "--target=x"], target_dir, "")
    try:
        assert _whole(client, name, TURNS["call"][0]) == (
            TURNS["call"][2][0], TURNS["call"][2][1], [c[-2:] for c in TURNS["call"][2][2]], "tool_calls")
    finally:
        out = _stop(proc)
    assert "--tool_call_parser=kimi_k2 (auto, for model_type kimi_k25" in out, out
    assert "--reasoning_parser=kimi_k2 (auto, for model_type kimi_k25" in out, out


def test_reasoning_is_parsed_only_where_the_prompt_opens_an_answer(kimi):
    _, tok, _, _ = kimi
    limits = Limits(max_seq_len=1024, max_logprobs=0, eos_token_ids=tok.eos_ids)
    fresh = ChatRequest.from_body({"messages": ASK}, limits, tok, tok.chat_template, PARSING)
    assert fresh.parsers is not None and fresh.parsers.reasoning is not None and fresh.parsers.tool_calls is None
    continued = ChatRequest.from_body({"messages": ASK + [{"role": "assistant", "content": "Paris is"}],
                                       "add_generation_prompt": False, "continue_final_message": True},
                                      limits, tok, tok.chat_template, PARSING)
    assert continued.parsers is None  # the model continues the given text: nothing to split off
    off = ChatRequest.from_body({"messages": ASK, "chat_template_kwargs": {"thinking": False}, "tools": TOOLS},
                                limits, tok, tok.chat_template, PARSING)
    assert off.parsers.reasoning is None and off.parsers.tool_calls is not None


@pytest.mark.parametrize("field,value,kind", [
    ("guided_json", {"type": "object"}, "json_schema"), ("guided_regex", "[0-9]+", "regex"),
    ("guided_choice", ["yes", "no"], "choice"), ("guided_grammar", 'start: "a"+', "grammar"),
    ("structured_outputs", {"regex": "a+"}, "regex"), ("structured_outputs", {"json_object": True}, "json_object"),
    ("response_format", {"type": "json_object"}, "json_object"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
     "json_schema")])
def test_constraint_fields_constrain_the_answer_after_the_reasoning(kimi, field, value, kind):
    _, tok, _, _ = kimi
    limits = Limits(max_seq_len=1024, max_logprobs=0, eos_token_ids=tok.eos_ids)
    thinking = ChatRequest.from_body({"messages": ASK, field: value}, limits, tok, tok.chat_template, PARSING)
    assert thinking.sampling.constraint.kind == kind and thinking.constraint_field == field
    assert thinking.sampling.constraint.after_token == tok.token_to_id("</think>")  # the reasoning is free
    off = ChatRequest.from_body({"messages": ASK, field: value, "chat_template_kwargs": {"thinking": False}}, limits,
                                tok, tok.chat_template, PARSING)
    assert off.sampling.constraint.after_token is None


@pytest.mark.parametrize("body,param,match", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one way"),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag", "structural tags are not implemented"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"guided_choice": "yes"}, "guided_choice", "list"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "send one of them"),
    ({"tool_choice": "required"}, "tool_choice", "no tools")])
def test_constraints_the_server_cannot_honour_are_400s(kimi, body, param, match):
    from eagle3_jax.serving.errors import ApiError

    _, tok, _, _ = kimi
    limits = Limits(max_seq_len=1024, max_logprobs=0, eos_token_ids=tok.eos_ids)
    with pytest.raises(ApiError, match=match) as e:
        ChatRequest.from_body({"messages": ASK, **body}, limits, tok, tok.chat_template, PARSING)
    assert e.value.param == param and e.value.status == 400


def test_a_template_refusing_the_conversation_is_a_400_with_its_message(kimi):
    from eagle3_jax.serving.errors import ApiError
    from eagle3_jax.text.chat_template import ChatTemplate

    _, tok, _, _ = kimi
    strict = ChatTemplate("{% for m in messages %}{% if m.role == 'tool' and not m.tool_call_id is defined %}"
                          "{{ raise_exception('a tool result needs its tool_call_id') }}{% endif %}{% endfor %}ok")
    limits = Limits(max_seq_len=1024, max_logprobs=0, eos_token_ids=tok.eos_ids)
    body = {"messages": ASK + [CALL, {"role": "tool", "content": "sunny"}], "tools": TOOLS}
    with pytest.raises(ApiError, match="a tool result needs its tool_call_id") as e:
        ChatRequest.from_body(body, limits, tok, strict, PARSING)
    assert e.value.status == 400 and e.value.param == "messages"


def test_a_call_the_tokenizer_cannot_spell_is_refused_not_forced(caplog):
    """DeepSeek's markup (`<｜tool▁calls▁begin｜>`) through a vocabulary that reads `▁` as its space
    marker (the bundled kimi-mini's): the start-up says so in one line, and a forced call through
    either SDK is a 400 naming the marker, never a 200 carrying broken markup; an unforced request
    is still answered."""
    anthropic = pytest.importorskip("anthropic")
    folder = os.path.join(ROOT, "checkpoints", "kimi-mini")
    tok = e3.load_tokenizer(folder)
    scheduler = Scheduler(e3.load_target(folder, dtype="float32"), max_num_seqs=2, max_seq_len=512, tokenizer=tok)
    engine = AsyncEngine(scheduler, tokenizer=tok).start()
    with caplog.at_level("WARNING", logger="eagle3_jax.serving.app"):
        server = ServerThread(make_app(engine, "mini", tool_call_parser="deepseek_v3"))
    try:
        [line] = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
        assert line.startswith("--tool_call_parser=deepseek_v3") and "tool▁calls▁begin" in line
        gpt = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            with pytest.raises(openai.BadRequestError) as e:
                gpt.chat.completions.create(model="mini", max_tokens=16, messages=ASK, tools=TOOLS,
                                            tool_choice=choice)
            assert "cannot write" in e.value.body["message"] and e.value.body["param"] == "tool_choice"
        claude = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="mini", max_tokens=16, messages=ASK, tools=A_TOOLS, tool_choice={"type": "any"})
        assert "tool▁calls▁begin" in e.value.body["error"]["message"]
        free = gpt.chat.completions.create(model="mini", max_tokens=4, messages=ASK, tools=TOOLS, temperature=0)
        assert free.choices[0].finish_reason == "length"
    finally:
        server.stop()
        engine.shutdown(timeout=10)
