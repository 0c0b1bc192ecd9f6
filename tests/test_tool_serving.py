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

import eagle3_jax as e3
from eagle3_jax.scheduler import Scheduler
from eagle3_jax.serving import AsyncEngine, make_app
from eagle3_jax.serving.protocol import ChatRequest, Limits, OutputParsing
from model_folders import kimi_folder
from scripted_models import write_scripted_pair
from server_fixtures import ServerThread

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
RESULT = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"}
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


def _body(kwargs: dict) -> dict:
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    return {**body, **kwargs.get("extra_body", {})}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(tokenizer folder, tokenizer, target dir, draft dir): the scripted answers keyed by the very
    prompts the server builds from each turn's request."""
    root = tmp_path_factory.mktemp("kimi-scripted")
    with open(TEMPLATE) as f:
        tok_dir = kimi_folder(root / "tokenizer", chat_template=f.read())
    tok = e3.load_tokenizer(tok_dir)
    limits = Limits(max_seq_len=1024, max_logprobs=0, eos_token_ids=tok.eos_ids)
    prompts, scripts = [], []
    for request, answer, _ in TURNS.values():
        prompts.append(ChatRequest.from_body(_body(request), limits, tok, tok.chat_template, PARSING).prompt_ids)
        scripts.append(tok.encode(answer, add_bos=False) + [tok.token_to_id("<|im_end|>")])
    target_dir, draft_dir = write_scripted_pair(str(root / "model"), tok.vocab_size, prompts, scripts,
                                                eos_token_id=list(tok.eos_ids), bos_token_id=tok.bos_id,
                                                tokenizer_dir=tok_dir)
    return tok_dir, tok, target_dir, draft_dir


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
    scheduler = Scheduler(target, draft, spec, max_num_seqs=4, max_seq_len=1024, tokenizer=tok)
    engine = AsyncEngine(scheduler, tokenizer=tok).start()
    server = ServerThread(make_app(engine, "kimi", tool_call_parser="kimi_k2", reasoning_parser="kimi_k2"))
    yield request.param, openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
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


def test_tool_choice_none_and_forced_calls(served):
    _, client = served
    request, answer, _ = TURNS["call"]
    r = client.chat.completions.create(model="kimi", temperature=0, max_tokens=200, tool_choice="none", **request)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == answer.split("</think>", 1)[1]  # the markup, unparsed
    for forced in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError, match="constrain"):
            client.chat.completions.create(model="kimi", max_tokens=8, tool_choice=forced, **request)


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


def _readme_kimi_command() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("### Serving a real model", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [c for c in section.replace("\\\n", " ").splitlines() if "scripts/serve.py" in c]
    kimi_line = next(c for c in commands if "Kimi-K2.5" in c)
    return shlex.split(kimi_line.split("#", 1)[0])


def test_readme_kimi_command_serves_the_tool_round_trip(kimi):
    """The README's Kimi-K2.5 command, its model paths, mesh and sizes swapped for the scripted
    folders (every other flag as written: spec, dtype, parsers, served name)."""
    tok_dir, _, target_dir, draft_dir = kimi
    args = _readme_kimi_command()
    assert args[:2] == ["python", "scripts/serve.py"]
    assert "--tool_call_parser=kimi_k2" in args and "--reasoning_parser=kimi_k2" in args
    swapped = {"--target": target_dir, "--draft": draft_dir, "--max_num_seqs": "2", "--max_seq_len": "1024"}
    flags = []
    for arg in args[2:]:
        name = arg.split("=", 1)[0]
        if name == "--mesh":
            continue  # 8 devices of a GPU node; the scripted model runs on one
        flags.append(f"{name}={swapped[name]}" if name in swapped else arg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = next(a.split("=", 1)[1] for a in flags if a.startswith("--served_model_name="))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "serve.py"), *flags, f"--port={port}",
                             "--nowarmup"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + 240
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
                time.sleep(0.5)
        for turn in ("call", "answer"):
            request, _, expected = TURNS[turn]
            common = dict(model=name, temperature=0, max_tokens=200, **request)
            r = client.chat.completions.create(**common)
            m = r.choices[0].message
            calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
            assert ((m.model_extra or {}).get("reasoning_content"), m.content, calls, r.choices[0].finish_reason) \
                == expected
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert re.search(r"serving .* as 'kimi-k2.5' \(EAGLE-3 chain", out), out  # the draft speculated
    assert "(auto, for model_type" not in out  # the parsers were set by the flags, not chosen for the user
