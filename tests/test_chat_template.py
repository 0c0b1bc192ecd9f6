"""Chat templates: where a folder's template is read from, the flag's choices and their errors,
rendering (tools, generation prompt, continuing the final message, template kwargs, the helpers
Hub templates call) and the sandbox; and the same prompts as transformers' apply_chat_template."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil

import pytest

from eagle3_jax.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    compile_template,
    render_prompt,
    render_prompts,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIMI = os.path.join(ROOT, "checkpoints", "kimi-mini")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
SIMPLE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL_USE = "TOOLS {{ tools | map(attribute='function.name') | join(',') }}|{% for m in messages %}{{ m.content }}{% endfor %}"

# A ChatML template in the shape Qwen-style models ship: tools as JSON in the system turn, tool
# calls and tool results, an optional thinking block, and a generation prompt.
CHATML_TOOLS = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content is defined %}{{- '<think>' + message.reasoning_content + '</think>\\n' }}{%- endif %}
{%- if message.content is defined %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>' }}{{- call.function | tojson }}{{- '</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role in ('user', 'tool') %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- else %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# A Llama-3-style template: BOS, a dated system header, documents, headers with trimmed contents.
LLAMA3_STYLE = """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '\\n' }}
{%- if documents %}{%- for d in documents %}{{- '[' + d.title + '] ' + d.text + '\\n' }}{%- endfor %}{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def folder(tmp_path, name: str = "tok", config: dict | None = None, files: dict | None = None):
    """A tokenizer folder: kimi-mini's tokenizer.json plus the given config and files."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(os.path.join(KIMI, "tokenizer.json"), d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **(config or {})}))
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


# ---- reading ------------------------------------------------------------------------------------------------


def test_template_string_and_special_tokens(tmp_path):
    d = folder(tmp_path, config={"chat_template": SIMPLE, "bos_token": {"content": "<s>", "lstrip": False},
                                 "unk_token": "<unk>", "pad_token": None})
    t = ChatTemplate.from_dir(d)
    assert t.source == SIMPLE and t.available and not t.named
    specials = dict(t.special_tokens)
    assert specials["bos_token"] == "<s>" and specials["eos_token"] == "</s>" and specials["unk_token"] == "<unk>"
    assert specials["pad_token"] == ""  # missing ones render as nothing
    assert t.render(MESSAGES) == "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


def test_named_templates(tmp_path):
    d = folder(tmp_path, config={"chat_template": [{"name": "default", "template": SIMPLE},
                                                   {"name": "tool_use", "template": TOOL_USE}]})
    t = ChatTemplate.from_dir(d)
    assert t.source == SIMPLE and t.named == (("tool_use", TOOL_USE),)
    assert t.render(MESSAGES).startswith("<s><|system|>")
    assert t.render(MESSAGES, tools=TOOLS) == "TOOLS get_weather|Be brief.Hi"  # tools: the tool_use template
    chosen = ChatTemplate.from_dir(d, name="default")  # a template chosen by name stays chosen
    assert chosen.render(MESSAGES, tools=TOOLS).startswith("<s><|system|>")
    assert ChatTemplate.from_dir(d, name="tool_use").source == TOOL_USE
    with pytest.raises(ChatTemplateError, match="no chat template named 'rag'.*'default', 'tool_use'"):
        ChatTemplate.from_dir(d, name="rag")
    assert ChatTemplate.from_flag("tool_use", d).source == TOOL_USE  # the flag takes a name too

    no_default = folder(tmp_path, "nodefault", config={"chat_template": [{"name": "tool_use", "template": TOOL_USE}]})
    t = ChatTemplate.from_dir(no_default)
    assert t.source is None and not t.available and t.named == (("tool_use", TOOL_USE),)
    with pytest.raises(ChatTemplateError, match="named 'tool_use' and none is 'default'.*--chat_template=<name>"):
        t.render(MESSAGES)
    assert t.render(MESSAGES, tools=TOOLS).startswith("TOOLS")
    with pytest.raises(ChatTemplateError, match="named 'tool_use'"):
        render_prompt("x", no_default)
    bad = folder(tmp_path, "bad", config={"chat_template": [{"name": "default"}]})
    with pytest.raises(ChatTemplateError, match="name.*template"):
        ChatTemplate.from_dir(bad)


def test_template_files(tmp_path):
    # chat_template.jinja wins over the config (as transformers reads a folder); extra named ones
    d = folder(tmp_path, config={"chat_template": "ignored"},
               files={"chat_template.jinja": SIMPLE, "additional_chat_templates/tool_use.jinja": TOOL_USE})
    t = ChatTemplate.from_dir(d)
    assert t.source == SIMPLE and t.named == (("tool_use", TOOL_USE),)
    j = folder(tmp_path, "json", files={"chat_template.json": json.dumps({"chat_template": SIMPLE})})
    assert ChatTemplate.from_dir(j).source == SIMPLE
    both = folder(tmp_path, "both", config={"chat_template": SIMPLE},
                  files={"chat_template.json": json.dumps({"chat_template": "processor's"})})
    assert ChatTemplate.from_dir(both).source == SIMPLE  # the tokenizer's own before the processor's file
    none = folder(tmp_path, "none")
    assert ChatTemplate.from_dir(none).source is None and not ChatTemplate.from_dir(none).available
    assert ChatTemplate.from_dir(None) == ChatTemplate() == ChatTemplate.from_dir(tmp_path / "missing")


def test_broken_folders(tmp_path):
    d = folder(tmp_path, config={"chat_template": "{% for m in messages %}"})
    with pytest.raises(ChatTemplateError, match="chat template 'default' is not a valid jinja template"):
        ChatTemplate.from_dir(d)
    bad_json = tmp_path / "badjson"
    bad_json.mkdir()
    (bad_json / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json is not valid JSON"):
        ChatTemplate.from_dir(bad_json)


def test_flag_choices_and_errors(tmp_path):
    d = folder(tmp_path, config={"chat_template": SIMPLE})
    assert ChatTemplate.from_flag(None, d).source == SIMPLE
    assert ChatTemplate.from_flag("join", d) == ChatTemplate(join=True)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>{{ eos_token }}")
    t = ChatTemplate.from_flag(str(jinja), d)
    assert t.render(MESSAGES) == "<system>Be brief.<user>Hi<assistant></s>"  # the folder's special tokens
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps({"chat_template": SIMPLE}))
    assert ChatTemplate.from_flag(str(as_json), d).source == SIMPLE
    assert ChatTemplate.from_flag(str(jinja), None).special_tokens[0] == ("bos_token", "")

    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "broken.jinja").write_text("{% if x %}")
    (tmp_path / "latin1.jinja").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "other.json").write_text(json.dumps({"template": SIMPLE}))
    cases = [("/no/such.jinja", "neither a file, nor 'join'"), (str(tmp_path / "empty.jinja"), "is empty"),
             (str(tmp_path / "broken.jinja"), "is not a valid jinja template"),
             (str(tmp_path / "latin1.jinja"), "is not UTF-8 text (byte offset 3)"),
             (str(tmp_path / "other.json"), 'holds no "chat_template" string')]
    for value, words in cases:
        with pytest.raises(ChatTemplateError, match=re.escape(words)) as info:
            ChatTemplate.from_flag(value, d)
        assert "\n" not in str(info.value)


# ---- rendering --------------------------------------------------------------------------------------------


def test_join_and_no_template():
    assert ChatTemplate(join=True).render(MESSAGES) == "Be brief.\nHi"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ChatTemplate(join=True).render(parts) == "ab"
    with pytest.raises(ChatTemplateError, match="no chat template.*--chat_template=<file.jinja>.*--chat_template=join"):
        ChatTemplate().render(MESSAGES)


def test_generation_prompt_and_continuing_the_final_message():
    t = ChatTemplate(SIMPLE, (("bos_token", "<s>"),))
    assert t.render(MESSAGES, add_generation_prompt=False) == "<s><|system|>Be brief.\n<|user|>Hi\n"
    partial = [*MESSAGES, {"role": "assistant", "content": "Hello, I am"}]
    assert t.render(partial, add_generation_prompt=False, continue_final_message=True) == \
        "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello, I am"
    assert partial[-1]["content"] == "Hello, I am"  # the caller's messages are left as they were
    trimmed = ChatTemplate("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}")
    assert trimmed.render([{"role": "assistant", "content": "Sure, "}], add_generation_prompt=False,
                          continue_final_message=True) == "[Sure,"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]}]
    assert ChatTemplate("{% for p in messages[0].content %}({{ p.text }}){% endfor %}").render(
        parts, add_generation_prompt=False, continue_final_message=True) == "(One)(Two"
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        t.render(partial, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="conversation is empty"):
        t.render([], add_generation_prompt=False, continue_final_message=True)
    dropping = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="no place to continue it from"):
        dropping.render(partial, add_generation_prompt=False, continue_final_message=True)


def test_tools_kwargs_and_tojson():
    t = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}"
                     "|{{ {'a': 'é'} | tojson(ensure_ascii=True) }}|{{ [1, 2] | tojson(separators=(',', ':')) }}"
                     "|{{ '<&>' | tojson }}|{{ enable_thinking }}|{{ bos_token }}|{{ documents }}")
    out = t.render(MESSAGES, tools=TOOLS, enable_thinking=False, bos_token="<B>")
    compact, indented, ordered, ascii_, separated, html, thinking, bos, docs = out.split("|")
    assert json.loads(compact) == TOOLS and "°C" in compact  # not escaped to ASCII by default
    assert indented == json.dumps(TOOLS, indent=2, ensure_ascii=False)
    assert ordered == '{"a": "é", "b": 1}' and ascii_ == '{"a": "\\u00e9"}' and separated == "[1,2]"
    assert html == '"<&>"'  # jinja's own tojson would write \u003c... for HTML
    assert (thinking, bos, docs) == ("False", "<B>", "None")  # kwargs over the special tokens
    assert t.render(MESSAGES).split("|")[0] == "null"  # no tools: None, as transformers passes it


def test_helpers_and_rejections():
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with "
                          "a user turn') }}{% endif %}ok")
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="rejected these messages: Conversations must start with a user turn"):
        strict.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="rejected these messages"):
        ChatTemplate("{{ messages[5].content }}").render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="not a valid jinja template"):
        ChatTemplate("{% for %}").render(MESSAGES)
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    day = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render(MESSAGES)
    assert day in (before, datetime.datetime.now().strftime("%Y-%m-%d"))
    loops = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                         "{% endfor %}")  # the loopcontrols extension
    assert loops.render(MESSAGES) == "Be brief."
    trimmed = ChatTemplate("{% for m in messages %}\n  {{ m.content }}\n{% endfor %}")  # trim_blocks, lstrip_blocks
    assert trimmed.render(MESSAGES) == "  Be brief.\n  Hi\n"


def test_sandbox_and_plain_data():
    with pytest.raises(ChatTemplateError, match="rejected these messages"):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="rejected these messages"):
        ChatTemplate("{{ messages.append(1) }}").render(MESSAGES)  # the immutable sandbox
    seen = ChatTemplate("{% for m in messages %}{{ m.content is defined }}/{{ m.reasoning_content }}/"
                        "{{ m.thinking }};{% endfor %}")
    out = seen.render([{"role": "assistant", "content": None, "reasoning": "hmm"},
                       {"role": "user", "content": "x", "obj": object()}])
    assert out == "False/hmm/hmm;True//;"  # None dropped; reasoning under the names templates read
    assert ChatTemplate("{{ messages[0].obj }}").render([{"role": "user", "obj": object()}]) == "<object>"
    assert compile_template(SIMPLE) is compile_template(SIMPLE)  # compiled once


def test_render_prompt(tmp_path):
    plain = folder(tmp_path, "plain")
    assert render_prompt("Hello", plain) == "Hello"
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    chat = folder(tmp_path, "chat", config={"chat_template": template, "bos_token": {"content": "<s>"}})
    assert render_prompt("Hello", chat) == "<s><|user|>\nHello</s>\n<|assistant|>\n"
    assert render_prompts(["a", "b"], chat) == [render_prompt("a", chat), render_prompt("b", chat)]
    assert render_prompt("Once", KIMI) == "Once"  # the bundled base model's template: the text itself
    with pytest.raises(FileNotFoundError):
        render_prompt("x", tmp_path / "nope")


# ---- the same as transformers -------------------------------------------------------------------------------


CONVERSATIONS = [
    MESSAGES,
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "21"},
     {"role": "user", "content": "  And Lyon?  "}],
]


@pytest.mark.parametrize("template", [CHATML_TOOLS, LLAMA3_STYLE], ids=["chatml_tools", "llama3_style"])
@pytest.mark.parametrize("layout", ["config", "jinja_file", "named"])
def test_matches_transformers(tmp_path, template, layout):
    transformers = pytest.importorskip("transformers")
    if layout == "config":
        d = folder(tmp_path, config={"chat_template": template})
    elif layout == "jinja_file":
        d = folder(tmp_path, files={"chat_template.jinja": template})
    else:
        d = folder(tmp_path, config={"chat_template": [{"name": "default", "template": SIMPLE},
                                                       {"name": "tool_use", "template": template}]})
    ours = ChatTemplate.from_dir(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    date = {"date_string": "26 Jul 2024"} if template is LLAMA3_STYLE else {}
    for messages in CONVERSATIONS:
        cases = [dict(tools=TOOLS, add_generation_prompt=True),
                 dict(tools=TOOLS, add_generation_prompt=True, enable_thinking=False),
                 dict(tools=TOOLS, add_generation_prompt=False, documents=[{"title": "Doc", "text": "Body"}]),
                 dict(tools=TOOLS, add_generation_prompt=False, continue_final_message=True)]
        if layout != "named":  # without tools a named folder renders its default, checked below
            cases.append(dict(add_generation_prompt=True))
        for kwargs in cases:
            kwargs = {**kwargs, **date}
            expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
            assert ours.render(messages, **kwargs) == expected, kwargs
    if layout == "named":
        assert ours.render(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
