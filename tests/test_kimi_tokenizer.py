"""eagle3_jax.text.tokenizer on Kimi-K2.5's tokenizer layout (tiktoken.model + tokenizer_config.json, no
tokenizer.json), against a `tiktoken.Encoding` built directly from the same ranks, pattern and specials."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import tiktoken
from model_folders import KIMI_ADDED_TOKENS, kimi_folder, kimi_ranks

from eagle3_jax.bench.workloads import special_token_ids
from eagle3_jax.text import stream as text_stream
from eagle3_jax.text.chat_template import ChatTemplateError
from eagle3_jax.text.tiktoken_tokenizer import KIMI_PAT_STR, MAX_RUN_CHARS, split_long_runs
from eagle3_jax.text.tokenizer import TokenizerError, load_tokenizer

# `pat_str` of Moonshot's tokenization_kimi.py (Kimi-K2 / K2.5), as published: "|".join of its eight arms
PUBLISHED_PAT_STR = (
    r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&"""
    r"""[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")

TEXTS = [
    "",
    "Hello, world! HelloWorld camelCase XMLHttpRequest don't it's THEY'RE",
    "我们今天去公园散步。天气很好，中文English混合123",
    "Привет, мир! Как дела?",
    "Emoji 😀😃 👍🏽 ❤️ 🎉 and a lone 🚀",
    "Numbers 0 12 123 1234 12345 3.14159 2024-05-17",
    "def add(a, b):\n    return a + b\n\n\n\tif x:\r\n\t\tpass  # comment\n",
    "runs      of   spaces\n\n\n   \t\t  and trailing   ",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>hmm</think>ok"
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}"
    "<|tool_call_end|><|tool_calls_section_end|>[EOS]",
    "ünïcödé ñ ß Ελληνικά العربية हिन्दी 日本語のテキスト 한국어",
]


def _names(base: int) -> dict[str, int]:
    named = {base + off: name for off, name, _ in KIMI_ADDED_TOKENS}
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return kimi_folder(tmp_path_factory.mktemp("kimi"))


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def ref(tok):
    """tiktoken.Encoding made directly from the helper's ranks, Kimi's published pattern and specials."""
    ranks = kimi_ranks()
    return tiktoken.Encoding("ref", pat_str=PUBLISHED_PAT_STR, mergeable_ranks=ranks, special_tokens=_names(len(ranks)))


def test_pattern_is_kimis_published_pat_str():
    assert KIMI_PAT_STR == PUBLISHED_PAT_STR


def test_ids_and_stop_ids(tok):
    base = 1024
    assert tok.vocab_size == base + 256 and tok.bos_id == base
    assert base + 1 in tok.eos_ids and base + 2 in tok.eos_ids  # [EOS] and <|im_end|>
    assert tok.token_to_id("[EOS]") == base + 1 and tok.token_to_id("<|im_end|>") == base + 2
    assert tok.token_to_id("<|tool_calls_section_begin|>") == base + 11 and tok.token_to_id("</think>") == base + 23
    assert tok.token_to_id("no such token") is None


def test_real_ids(tmp_path):
    t = load_tokenizer(kimi_folder(tmp_path, real_ids=True))
    assert (t.vocab_size, t.bos_id) == (163840, 163584)
    assert set(t.eos_ids) == {163585, 163586}
    want = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587, "<|im_assistant|>": 163588,
            "<|im_system|>": 163594, "<|im_middle|>": 163601, "<|tool_calls_section_begin|>": 163595,
            "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597, "<|tool_call_argument_begin|>": 163598,
            "<|tool_call_end|>": 163599, "<think>": 163606, "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839,
            "<|reserved_token_163589|>": 163589}
    assert {k: t.token_to_id(k) for k in want} == want


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_tiktoken(tok, ref, text):
    ids = tok.encode(text, add_bos=False)
    assert ids == ref.encode(text, allowed_special="all")
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [tok.bos_id] + ids
    assert tok.encode(text) == ids  # Kimi's own tokenizer adds no BOS, and neither does the default


def test_bos_once(tok):
    assert not tok.adds_bos
    assert tok.encode("[BOS]hi", add_bos=True) == tok.encode("hi", add_bos=True)
    assert tok.encode("hi", add_bos=True).count(tok.bos_id) == 1


def test_skip_special_tokens_keeps_tool_and_think_markers(tok):
    text = TEXTS[8]
    ids = tok.encode(text, add_bos=True)
    kept = tok.decode(ids)
    for marker in ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                   "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"):
        assert marker in kept
    for dropped in ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_middle|>"):
        assert dropped not in kept
    assert kept.startswith("userhi")
    specials = special_token_ids(tok)
    assert {tok.bos_id, *tok.eos_ids} <= specials and tok.token_to_id("<|tool_call_begin|>") not in specials


def test_reserved_token_names(tok):
    rid = 1024 + 5  # a reserved id tokenizer_config.json does not name
    name = f"<|reserved_token_{rid}|>"
    assert tok.token_to_id(name) == rid and tok.encode(name, add_bos=False) == [rid]
    assert rid not in tok.special_ids and tok.decode([rid]) == name  # unnamed: not special, as with transformers


def test_long_runs_cut_as_kimi_cuts():
    def kimi_cuts(s, max_len):  # the published character loop of _split_whitespaces_or_nonwhitespaces
        pieces, run, space, start = [], 0, s[0].isspace() if s else False, 0
        for i, c in enumerate(s):
            if space ^ c.isspace():
                run, space = 1, c.isspace()
            else:
                run += 1
                if run > max_len:
                    pieces.append(s[start:i])
                    start, run = i, 1
        return pieces + [s[start:]]

    rng = random.Random(0)
    for _ in range(300):
        s = "".join(rng.choice("ab \n\u3000\x1c中") * rng.randint(1, 9) for _ in range(rng.randint(0, 12)))
        for max_len in (1, 2, 3, 7):
            assert list(split_long_runs(s, max_len)) == kimi_cuts(s, max_len)


def test_long_inputs(tok, ref):
    text = "".join(TEXTS) * 200  # ~100k characters, no run near the limits: one piece, as tiktoken encodes it
    assert tok.encode(text, add_bos=False) == ref.encode(text, allowed_special="all")
    long_run = "x" * (MAX_RUN_CHARS + 10)
    assert tok.encode(long_run, add_bos=False) == ref.encode("x" * MAX_RUN_CHARS) + ref.encode("x" * 10)
    for ch in "a中 😀":
        start = time.perf_counter()
        big = ch * (1 << 20)
        assert tok.decode(tok.encode(big, add_bos=False)) == big
        assert time.perf_counter() - start < 5


def test_partial_utf8_and_incremental_detokenizer(tok):
    """Split characters decode to U+FFFD (as `tokenizers` does), which the streaming detokenizer holds back."""
    assert tok.decode(tok.encode("😀", add_bos=False)[:1]) == "\ufffd"
    assert text_stream.byte_token_ids(tok) == frozenset() == tok.byte_fallback_ids
    text = "中文 😀 ok<|tool_call_begin|>x" * 30
    ids = tok.encode(text, add_bos=False)
    det = text_stream.IncrementalDetokenizer(tok, tok.encode("Say:"))
    pieces = [det.push([i]) for i in ids] + [det.push([], final=True)]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text


def test_chat_template_and_end_of_turn(tmp_path):
    d = kimi_folder(tmp_path / "k", chat_template=TEMPLATE)
    os.remove(os.path.join(d, "generation_config.json"))
    t = load_tokenizer(d)
    assert t.eos_ids == (1025, 1026)  # config.json's [EOS], then the template's <|im_end|>
    prompt = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert t.chat_template.source == TEMPLATE
    plain = load_tokenizer(kimi_folder(tmp_path / "plain"))
    with pytest.raises(ChatTemplateError):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def _one_line_error(path, match):
    with pytest.raises(TokenizerError, match=match) as e:
        load_tokenizer(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_errors(tmp_path):
    msg = _one_line_error(tmp_path, "no tokenizer.json .* nor tiktoken.model")
    assert "copy the tokenizer files" in msg
    d = kimi_folder(tmp_path / "missing")
    os.remove(os.path.join(d, "tiktoken.model"))  # tokenizer_config.json without its vocabulary
    _one_line_error(d, "nor tiktoken.model")
    d = kimi_folder(tmp_path / "bad")
    with open(os.path.join(d, "tiktoken.model"), "a") as f:
        f.write("not-base64!! 12 extra\n")
    _one_line_error(d, r"tiktoken.model line \d+ is not `base64\(token bytes\) rank`.*restore")
    with open(os.path.join(d, "tiktoken.model"), "w") as f:
        f.write("YQ== 0\nYg== 5\n")
    _one_line_error(d, "not 0..1")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"added_tokens_decoder": {"x": {"content": "[BOS]"}}}, f)
    with open(os.path.join(d, "tiktoken.model"), "w") as f:
        f.write("YQ== 0\n")
    _one_line_error(d, "added_tokens_decoder entry 'x'")


def test_vocab_file_named_in_config(tmp_path):
    d = kimi_folder(tmp_path)
    os.rename(os.path.join(d, "tiktoken.model"), os.path.join(d, "kimi.tiktoken"))
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "vocab_file": "kimi.tiktoken"}, f)
    assert load_tokenizer(d).vocab_size == 1024 + 256
    assert load_tokenizer(os.path.join(d, "kimi.tiktoken")).bos_id == 1024
