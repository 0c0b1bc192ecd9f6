"""Model folders laid out as the real ones (tests/model_folders.py), end to end through the chat path:
load the folder, render a tool conversation with its chat template, then decode a held-out model
output in the family's markup token by token and parse it as the server does (IncrementalDetokenizer
deltas into StreamingParser), for Kimi-K2.5, MiniMax-M2.5, DeepSeek-V3.1, DeepSeek-V3 / R1 and
Llama-3.1.

Every family's markers but Llama's are added tokens the real tokenizer marks non-special, so they
survive `skip_special_tokens=True` decoding and the parsers find them in text. Llama's
`<|python_tag|>` is special: decoding drops it, and `llama3_json` relies on the text alone (an answer
that is JSON objects from its start is calls; text before the tag becomes content with the calls).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import pytest
from model_folders import deepseek_folder, kimi_folder, llama_folder, minimax_folder, read_chat_template

from eagle3_jax.parsers import OutputParsers, StreamingParser, parse_output, reasoning_parser, tool_call_parser
from eagle3_jax.parsers.defaults import default_reasoning_parser, default_tool_call_parser
from eagle3_jax.text.chat_template import ChatTemplate
from eagle3_jax.text.stream import IncrementalDetokenizer
from eagle3_jax.text.tokenizer import Tokenizer, load_tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time of a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}},
]

# As the server passes a conversation on (serving/messages.py): an assistant turn with calls has
# content "" (OpenAI clients send null), its reasoning as reasoning_content, OpenAI call ids.
CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the weather tool.",
     "tool_calls": [{"id": "call_abc", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21C"},
]
QUESTION = [CONVERSATION[0], {"role": "user", "content": "Weather in Lyon for two days, and the time in Paris?"}]

CALLS = [("get_weather", {"city": "Lyon", "days": 2}), ("get_time", {"timezone": "Europe/Paris"})]


@dataclasses.dataclass(frozen=True)
class Family:
    make: Callable[[str], str]
    tool_parser: str
    reasoning_parser: str | None
    end_of_turn: str  # the token the template writes after an assistant answer
    bos: str | None  # the token the real tokenizer starts an encoding with, or None
    markers: tuple[str, ...]  # tool / think markers: non-special added tokens, kept by decoding
    history: tuple[str, ...]  # what the rendered CONVERSATION must hold
    kwargs: dict[str, Any]  # chat-template kwargs the held-out output was produced under
    output: str  # a held-out model output, as the model writes it (ending in its end-of-turn token)
    reasoning: str | None
    content: str
    malformed: str  # an output whose markup does not parse: all of it after any reasoning is content
    malformed_content: str


KIMI_OUT = ("The user wants weather and time; call both tools.</think>Checking both now."
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
            "{\"city\": \"Lyon\", \"days\": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:2"
            "<|tool_call_argument_begin|>{\"timezone\": \"Europe/Paris\"}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|>")
KIMI_BAD = ("Hmm.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:1"
            "<|tool_call_argument_begin|>{\"city\": \"Ly<|tool_call_end|><|tool_calls_section_end|><|im_end|>")  # cut short
MINIMAX_OUT = ("The user asks two things, so two calls.\n</think>\n\nChecking both now.\n<minimax:tool_call>\n"
               "<invoke name=\"get_weather\">\n<parameter name=\"city\">Lyon</parameter>\n"
               "<parameter name=\"days\">2</parameter>\n</invoke>\n<invoke name=\"get_time\">\n"
               "<parameter name=\"timezone\">Europe/Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[")
MINIMAX_BAD = ("Book it.\n</think>\n\n<minimax:tool_call>\n<invoke name=\"book_flight\">\n"
               "<parameter name=\"to\">Lyon</parameter>\n</invoke>\n</minimax:tool_call>[e~[")  # not in the tools
DS31_OUT = ("The user asks two things.</think>Checking both now.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
            "<｜tool▁sep｜>{\"city\": \"Lyon\", \"days\": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
            "{\"timezone\": \"Europe/Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
DS31_BAD = ("Hmm.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": Lyon}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")  # arguments not JSON
DS3_OUT = ("The user asks two things.\n</think>\n\nChecking both now.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
           "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Lyon\", \"days\": 2}\n```<｜tool▁call▁end｜>\n"
           "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"timezone\": \"Europe/Paris\"}\n```"
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
DS3_BAD = ("Hmm.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           "{\"city\": \"Ly\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")  # the value cut short
LLAMA_CALLS = ("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Lyon\", \"days\": 2}}; "
               "{\"name\": \"get_time\", \"parameters\": {\"timezone\": \"Europe/Paris\"}}")
LLAMA_BAD = "{\"name\": \"get_weather\", \"parameters\": {\"city\": }}<|eot_id|>"  # not JSON

FAMILIES = {
    "kimi_k25": Family(
        make=lambda p: kimi_folder(p, chat_template=read_chat_template("kimi_k25")),
        tool_parser="kimi_k2", reasoning_parser="kimi_k2", end_of_turn="<|im_end|>", bos=None,
        markers=("</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>", "<|tool_calls_section_end|>"),
        history=("<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"",
                 "<|im_system|>system<|im_middle|>You are a weather bot.<|im_end|>",
                 "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>",
                 "<|im_assistant|>assistant<|im_middle|><think>Need the weather tool.</think>"
                 "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                 "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
                 "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21C<|im_end|>"),
        kwargs={}, output=KIMI_OUT, reasoning="The user wants weather and time; call both tools.",
        content="Checking both now.", malformed=KIMI_BAD,
        malformed_content=KIMI_BAD.split("</think>")[1].removesuffix("<|im_end|>")),
    "minimax_m2": Family(
        make=minimax_folder, tool_parser="minimax_m2", reasoning_parser="minimax_m2_append_think",
        end_of_turn="[e~[", bos=None, markers=("</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
        history=("]~!b[]~b]system\nYou are a weather bot.\n\n# Tools\n",
                 "<tools>\n<tool>{\"name\": \"get_weather\", \"description\": \"The weather of a city.\"",
                 "]~b]user\nWeather in Paris?[e~[\n",
                 "]~b]ai\n<think>\nNeed the weather tool.\n</think>\n\n\n<minimax:tool_call>\n"
                 "<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n</invoke>\n"
                 "</minimax:tool_call>[e~[\n",
                 "]~b]tool\n<response>sunny, 21C</response>[e~[\n"),
        # minimax_m2_append_think (the default for MiniMax, as MiniMax advises) keeps the reasoning in
        # the content with <think> put back; test_minimax_reasoning_split checks minimax_m2 too
        kwargs={}, output=MINIMAX_OUT, reasoning=None,
        content="<think>The user asks two things, so two calls.\n</think>\n\nChecking both now.\n",
        malformed=MINIMAX_BAD, malformed_content="<think>" + MINIMAX_BAD.removesuffix("[e~[")),
    "deepseek_v31": Family(
        make=deepseek_folder, tool_parser="deepseek_v31", reasoning_parser="deepseek_v3",
        end_of_turn="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
        markers=("</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁calls▁end｜>"),
        history=("<｜begin▁of▁sentence｜>You are a weather bot.<｜User｜>Weather in Paris?<｜Assistant｜></think>"
                 "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
                 "<｜tool▁output▁begin｜>sunny, 21C<｜tool▁output▁end｜>",),
        kwargs={"thinking": True}, output=DS31_OUT, reasoning="The user asks two things.",
        content="Checking both now.", malformed=DS31_BAD,
        malformed_content=DS31_BAD.split("</think>")[1].removesuffix("<｜end▁of▁sentence｜>")),
    "deepseek_v3": Family(
        make=lambda p: deepseek_folder(p, version="v3"), tool_parser="deepseek_v3", reasoning_parser="deepseek_r1",
        end_of_turn="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
        markers=("</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁calls▁end｜>"),
        history=("<｜begin▁of▁sentence｜>You are a weather bot.<｜User｜>Weather in Paris?<｜Assistant｜>"
                 "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                 "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
        kwargs={}, output=DS3_OUT, reasoning="The user asks two things.\n",
        content="\n\nChecking both now.", malformed=DS3_BAD,
        malformed_content=DS3_BAD.split("</think>")[1].removesuffix("<｜end▁of▁sentence｜>")),
    "llama31": Family(
        make=llama_folder, tool_parser="llama3_json", reasoning_parser=None, end_of_turn="<|eot_id|>",
        bos="<|begin_of_text|>", markers=(),
        history=("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                 "Cutting Knowledge Date: December 2023\n",
                 "You are a weather bot.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                 "Given the following functions",
                 "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\"",
                 "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                 "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>",
                 # a string result is "iterable" to jinja, so the real template writes it as JSON text
                 "<|start_header_id|>ipython<|end_header_id|>\n\n\"sunny, 21C\"<|eot_id|>"),
        kwargs={}, output="<|python_tag|>" + LLAMA_CALLS + "<|eom_id|>", reasoning=None, content="",
        malformed=LLAMA_BAD, malformed_content=LLAMA_BAD.removesuffix("<|eot_id|>")),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: fam.make(str(tmp_path_factory.mktemp(name))) for name, fam in FAMILIES.items()}


@pytest.fixture(scope="module")
def toks(folders):
    return {name: load_tokenizer(folder) for name, folder in folders.items()}


def family_parsers(name: str, **kwargs: Any) -> OutputParsers:
    fam = FAMILIES[name]
    reasoner = reasoning_parser(fam.reasoning_parser, kwargs) if fam.reasoning_parser else None
    return OutputParsers.of(reasoner, tool_call_parser(fam.tool_parser), TOOLS)


def render(tok: Tokenizer, name: str, messages, **kwargs) -> str:
    prepared = tool_call_parser(FAMILIES[name].tool_parser).prepare_messages(messages)
    return tok.apply_chat_template(prepared, tools=TOOLS, **kwargs)


# ---- the folder --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_folder_loads_with_its_stop_and_bos_ids(name, folders, toks):
    fam, tok = FAMILIES[name], toks[name]
    end = tok.token_to_id(fam.end_of_turn)
    assert end is not None and end in tok.eos_ids and end in tok.special_ids
    ids = tok.encode("hello world")
    if fam.bos is None:  # Kimi's tiktoken and MiniMax's GPT-2 tokenizer start with no BOS
        assert not tok.adds_bos and tok.encode("hello world", add_bos=False) == ids
    else:
        assert tok.adds_bos and ids[0] == tok.bos_id == tok.token_to_id(fam.bos) and ids.count(tok.bos_id) == 1
    for marker in fam.markers:
        assert tok.token_to_id(marker) is not None and tok.token_to_id(marker) not in tok.special_ids
    # the parsers the server picks for this folder (its config's model_type and its template)
    with open(os.path.join(folders[name], "config.json")) as f:
        model_type = json.load(f)["model_type"]
    source = ChatTemplate.from_dir(folders[name]).source
    assert default_tool_call_parser(model_type, source) == fam.tool_parser
    assert default_reasoning_parser(model_type, source) == fam.reasoning_parser


def test_where_each_folder_keeps_its_template(folders):
    assert os.path.isfile(os.path.join(folders["kimi_k25"], "chat_template.jinja"))
    assert os.path.isfile(os.path.join(folders["minimax_m2"], "chat_template.jinja"))
    for name in ("deepseek_v31", "deepseek_v3", "llama31"):
        assert not os.path.exists(os.path.join(folders[name], "chat_template.jinja"))
        with open(os.path.join(folders[name], "tokenizer_config.json")) as f:
            assert "{%" in json.load(f)["chat_template"]


def test_minimax_encodes_no_bos_as_its_gpt2_tokenizer(toks):
    """MiniMax's tokenizer_config.json has no add_bos_token and its tokenizer.json no BOS template: the
    prompt starts with the template's own ]~!b[, and a plain text with its first text token (a loader
    that added BOS by default put generation_config's ]~b] in front of both)."""
    tok = toks["minimax_m2"]
    ids = tok.encode(render(tok, "minimax_m2", QUESTION))
    assert ids[0] == tok.token_to_id("]~!b[") and ids[1] == tok.token_to_id("]~b]")
    assert tok.encode("hello") == tok.backend.encode("hello", add_special_tokens=False)


# ---- the chat template -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_tool_conversation_renders_the_family_markup(name, toks):
    fam, tok = FAMILIES[name], toks[name]
    prompt = render(tok, name, CONVERSATION)
    for piece in fam.history:
        assert piece in prompt, (piece, prompt)
    ids = tok.encode(prompt)
    if fam.bos is not None:  # the template writes BOS; encoding adds no second one
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_generation_prompts_and_thinking_switches(toks):
    def gen(name, **kwargs):
        return render(toks[name], name, QUESTION, **kwargs)

    # Kimi-K2.5: opens <think> unless thinking is false
    assert gen("kimi_k25").endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert gen("kimi_k25", thinking=False).endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    # MiniMax-M2.5: always thinks, no switch
    assert gen("minimax_m2").endswith("[e~[\n]~b]ai\n<think>\n") and gen("minimax_m2", thinking=False) == gen("minimax_m2")
    # DeepSeek-V3.1: `thinking` (or enable_thinking) opens <think>; off by default (</think>)
    assert gen("deepseek_v31").endswith("<｜Assistant｜></think>")
    assert gen("deepseek_v31", thinking=True).endswith("<｜Assistant｜><think>")
    assert gen("deepseek_v31", enable_thinking=True).endswith("<｜Assistant｜><think>")
    # DeepSeek-V3 / R1 style: always <think>\n
    assert gen("deepseek_v3").endswith("<｜Assistant｜><think>\n") and gen("deepseek_v3", thinking=False) == gen("deepseek_v3")
    # Llama-3.1: an empty assistant header
    assert gen("llama31").endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # after a tool result DeepSeek's templates add no generation prompt (the model goes on after it)
    assert render(toks["deepseek_v31"], "deepseek_v31", CONVERSATION).endswith("<｜tool▁output▁end｜>")
    assert render(toks["deepseek_v3"], "deepseek_v3", CONVERSATION).endswith("<｜tool▁outputs▁end｜>")


def test_history_reasoning_is_kept_where_the_template_keeps_it(toks):
    for name in FAMILIES:
        prompt = render(toks[name], name, CONVERSATION)
        assert ("Need the weather tool." in prompt) == (name in ("kimi_k25", "minimax_m2")), name


def test_kimi_history_ids_become_functions_name_idx(toks):
    two = [CONVERSATION[1], {**CONVERSATION[2], "tool_calls": CONVERSATION[2]["tool_calls"] + [
        {"id": "tool_xyz", "type": "function", "function": {"name": "get_time", "arguments": {"timezone": "UTC"}}}]},
        CONVERSATION[3], {"role": "tool", "tool_call_id": "tool_xyz", "content": "12:00"}]
    prompt = render(toks["kimi_k25"], "kimi_k25", two)
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}" in prompt
    assert "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"timezone\": \"UTC\"}" in prompt
    assert "## Return of functions.get_weather:0\nsunny" in prompt and "## Return of functions.get_time:1\n12:00" in prompt
    assert "call_abc" not in prompt and "tool_xyz" not in prompt


# ---- a model output, token by token ------------------------------------------------------------------------


def stream(tok: Tokenizer, prompt_ids, out_ids, parsers: OutputParsers, cuts) -> tuple[str, str, tuple]:
    """The output's deltas (split at `cuts`) through the detokenizer and the streaming parser, folded."""
    detok, parser = IncrementalDetokenizer(tok, prompt_ids), StreamingParser(parsers)
    content, reasoning, calls = "", "", []
    bounds = [0, *cuts, len(out_ids)]
    deltas = [parser.push(detok.push(out_ids[a:b])) for a, b in zip(bounds, bounds[1:]) if b > a]
    deltas.append(parser.push(detok.push([], final=True), final=True))
    for d in deltas:
        content, reasoning = content + d.content, reasoning + d.reasoning
        for index, call in d.tool_calls:
            assert index == len(calls)
            calls.append(call)
    return content, reasoning, tuple(calls)


def check_streams(tok: Tokenizer, name: str, output: str, parsers: OutputParsers, kwargs) -> tuple[str, Any]:
    """Decode `output`'s ids in deltas of k = 1..6 tokens from every offset; each fold must equal
    parse_output of the whole decoded text. Returns (decoded text, whole parse)."""
    prompt_ids = tok.encode(render(tok, name, QUESTION, **kwargs))
    out_ids = tok.encode(output, add_bos=False)
    decoded = tok.decode(out_ids)
    whole = parse_output(decoded, parsers)
    expected = (whole.content, whole.reasoning or "", whole.tool_calls)
    for k in range(1, 7):
        for start in range(k):
            cuts = list(range(start, len(out_ids), k)) if start else list(range(k, len(out_ids), k))
            assert stream(tok, prompt_ids, out_ids, parsers, cuts) == expected, (k, start)
    return decoded, whole


@pytest.mark.parametrize("name", FAMILIES)
def test_held_out_output_streams_to_the_whole_parse(name, toks):
    fam, tok = FAMILIES[name], toks[name]
    decoded, whole = check_streams(tok, name, fam.output, family_parsers(name, **fam.kwargs), fam.kwargs)
    assert fam.end_of_turn not in decoded  # special: skipped
    for marker in fam.markers:  # non-special: kept for the parsers
        assert marker in decoded
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == CALLS
    assert whole.reasoning == fam.reasoning and whole.content == fam.content
    if name == "kimi_k25":  # Kimi's calls keep their own ids
        assert [c.id for c in whole.tool_calls] == ["functions.get_weather:1", "functions.get_time:2"]


def test_minimax_reasoning_split(toks):
    """With vLLM's minimax_m2 reasoning parser instead of the append-think default."""
    parsers = OutputParsers.of(reasoning_parser("minimax_m2"), tool_call_parser("minimax_m2"), TOOLS)
    _, whole = check_streams(toks["minimax_m2"], "minimax_m2", MINIMAX_OUT, parsers, {})
    assert whole.reasoning == "The user asks two things, so two calls.\n"
    assert whole.content == "\n\nChecking both now.\n"
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == CALLS  # "days" an integer by its schema


def test_llama_python_tag_is_special_and_the_parser_reads_text(toks):
    """<|python_tag|> is a special token: decoding drops it, so the calls are found as JSON objects,
    tag or not, and text before the tag mid-answer is the content."""
    tok = toks["llama31"]
    assert tok.token_to_id("<|python_tag|>") in tok.special_ids
    parsers = family_parsers("llama31")
    plain, whole = check_streams(tok, "llama31", LLAMA_CALLS + "<|eot_id|>", parsers, {})
    assert "<|python_tag|>" not in tok.decode(tok.encode("<|python_tag|>" + LLAMA_CALLS, add_bos=False))
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == CALLS and whole.content == ""
    text, mixed = check_streams(tok, "llama31", "Let me check.<|python_tag|>" + LLAMA_CALLS + "<|eot_id|>", parsers, {})
    assert text == "Let me check." + LLAMA_CALLS and mixed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in mixed.tool_calls] == CALLS
    _, answer = check_streams(tok, "llama31", "It is sunny in Lyon.<|eot_id|>", parsers, {})
    assert answer.content == "It is sunny in Lyon." and answer.tool_calls == ()


@pytest.mark.parametrize("name", FAMILIES)
def test_malformed_output_comes_back_as_content(name, toks):
    fam, tok = FAMILIES[name], toks[name]
    decoded, whole = check_streams(tok, name, fam.malformed, family_parsers(name, **fam.kwargs), fam.kwargs)
    assert whole.tool_calls == () and whole.content == fam.malformed_content, (whole, decoded)
