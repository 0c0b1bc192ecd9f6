"""Model folders laid out as real ones ship their tokenizer, on small synthetic vocabularies.

`kimi_folder(path)` writes the files Kimi-K2.5's folder has for its tokenizer, which ships no
tokenizer.json:

- `tiktoken.model`: byte-level BPE ranks, one `base64(token bytes) rank` line each. Ranks 0..255
  are the single bytes; the next are merges learned by `train_bpe` from `CORPUS` (English, Han,
  Cyrillic, emoji, digits, code, whitespace runs; about 700 ranks before its pairs run out), split
  first with Kimi's pattern as tiktoken splits text; the rest, up to `num_base_tokens`, are tokens
  no UTF-8 text can reach (bytes 0xF8..0xFF only). `real_ids=True` pads to Kimi-K2.5's 163,584,
  so every special token has its real id.
- `tokenizer_config.json`: `added_tokens_decoder` with the names and offsets from the base of
  Kimi-K2.5's table (`KIMI_ADDED_TOKENS`: base+0 `[BOS]`, base+1 `[EOS]`, base+2 `<|im_end|>`, ...,
  base+11 `<|tool_calls_section_begin|>`, ..., base+23 `</think>`, base+254 `[UNK]`, base+255
  `[PAD]`), the tool-call and think markers marked `"special": false`; `bos_token` `[BOS]`,
  `eos_token` `[EOS]`, `additional_special_tokens` and the remote-code `auto_map`.
- `config.json` (model_type `kimi_k25`, BOS / EOS / PAD ids at the top and in `text_config`) and
  `generation_config.json` (`eos_token_id` `<|im_end|>`).
- The chat template: none unless `chat_template` is given (see CHAT TEMPLATE below).

Building a folder with the default base of 1,024 ranks takes well under a second.
"""

from __future__ import annotations

import base64
import collections
import json
import os

import regex

from eagle3_jax.text.tiktoken_tokenizer import KIMI_PAT_STR

KIMI_NUM_BASE = 163_584  # len(tiktoken.model) of Kimi-K2 / K2.5
DEFAULT_NUM_BASE = 1_024

# Kimi-K2.5's named special tokens: (offset from the base, name, "special" in added_tokens_decoder).
# Offsets and names as in its tokenizer_config.json ([BOS] 163584 ... </think> 163607, [UNK] 163838,
# [PAD] 163839); the tool-call and think markers are added tokens that decoding keeps.
KIMI_ADDED_TOKENS = (
    (0, "[BOS]", True), (1, "[EOS]", True), (2, "<|im_end|>", True), (3, "<|im_user|>", True),
    (4, "<|im_assistant|>", True), (6, "<|start_header_id|>", True), (7, "<|end_header_id|>", True),
    (9, "[EOT]", True), (10, "<|im_system|>", True),
    (11, "<|tool_calls_section_begin|>", False), (12, "<|tool_calls_section_end|>", False),
    (13, "<|tool_call_begin|>", False), (14, "<|tool_call_argument_begin|>", False), (15, "<|tool_call_end|>", False),
    (17, "<|im_middle|>", True), (18, "<|media_begin|>", True), (19, "<|media_content|>", True),
    (20, "<|media_end|>", True), (21, "<|media_pad|>", True), (22, "<think>", False), (23, "</think>", False),
    (254, "[UNK]", True), (255, "[PAD]", True),
)
ADDITIONAL_SPECIAL_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]

CORPUS = """\
Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog.
The quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX doesn't stop, it's fast.
HelloWorld camelCase snake_case CONSTANT_VALUE XMLHttpRequest
我们今天去公园散步。天气很好，我们很高兴。中文分词测试：人工智能与机器学习。
Привет, мир! Как дела? Сегодня хорошая погода, и мы идём гулять в парк.
Emoji: 😀😃😄 🚀🔥 👍🏽 ❤️ 🎉
Numbers: 0 1 2 3 12 123 1234 12345 3.14159 2024-05-17 +1 (555) 010-9999 100% $42.00
def add(a, b):
    return a + b


for i in range(10):
\tif i % 2 == 0:
\t\tprint(f"{i} is even")  # comment
{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}
    indented    by    runs   of     spaces\r\n\n\n\t\t
"""


def _pretokens(text: str) -> collections.Counter:
    """Pre-token byte strings of `text` and their counts, split with Kimi's pattern (the V1 flag
    makes Python's `regex` read `&&` as class intersection, as tiktoken's Rust regex does)."""
    return collections.Counter(m.encode("utf-8") for m in regex.findall(KIMI_PAT_STR, text, flags=regex.V1))


def train_bpe(text: str, num_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes (rank = byte value), then merges of the most frequent
    adjacent pair within pre-tokens (ties: the smallest pair), until `num_ranks` or no pair is left."""
    ranks = {bytes([b]): b for b in range(256)}
    words = {tuple(bytes([b]) for b in w): n for w, n in _pretokens(text).items()}
    while len(ranks) < num_ranks:
        pairs: collections.Counter = collections.Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        if merged not in ranks:
            ranks[merged] = len(ranks)
        new_words = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + n
        words = new_words
    return ranks


def _pad_unreachable(ranks: dict[bytes, int], num_ranks: int) -> None:
    """Add tokens of bytes 0xF8..0xFF (which UTF-8 never uses, so no text reaches them) up to num_ranks."""
    n, width = 0, 1
    while len(ranks) < num_ranks:
        digits, k = [], n
        for _ in range(width):
            digits.append(0xF8 + k % 8)
            k //= 8
        token = bytes(digits)
        if token not in ranks:
            ranks[token] = len(ranks)
        n += 1
        if n == 8 ** width:
            n, width = 0, width + 1


def write_ranks(path: str, ranks: dict[bytes, int]) -> None:
    """`ranks` as a tiktoken file: `base64(token) rank` lines, by rank."""
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))


def kimi_ranks(num_base_tokens: int = DEFAULT_NUM_BASE, real_ids: bool = False) -> dict[bytes, int]:
    """The base ranks `kimi_folder` writes: BPE learned from CORPUS, padded with unreachable tokens
    (`_pad_unreachable`) to `num_base_tokens`, or to Kimi's 163,584 with `real_ids`."""
    num_ranks = KIMI_NUM_BASE if real_ids else num_base_tokens
    ranks = train_bpe(CORPUS, num_ranks)
    _pad_unreachable(ranks, num_ranks)
    return ranks


def kimi_tokenizer_config(base: int) -> dict:
    decoder = {str(base + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": special}
               for off, name, special in KIMI_ADDED_TOKENS}
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ADDITIONAL_SPECIAL_TOKENS,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def kimi_folder(path: str | os.PathLike, num_base_tokens: int = DEFAULT_NUM_BASE, real_ids: bool = False,
                chat_template: str | None = None) -> str:
    """Write a Kimi-K2.5 tokenizer folder (module docstring) at `path` (created if missing); returns it.

    `num_base_tokens` is the number of base ranks (at least 256), so the special tokens start at
    that id; `real_ids=True` makes it Kimi's 163,584. `chat_template`, when given, is written as
    chat_template.jinja.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if num_base_tokens < 256:
        raise ValueError(f"num_base_tokens must be at least 256 (the single bytes); got {num_base_tokens}")
    ranks = kimi_ranks(num_base_tokens, real_ids)
    base = len(ranks)
    write_ranks(os.path.join(path, "tiktoken.model"), ranks)
    files = {
        "tokenizer_config.json": kimi_tokenizer_config(base),
        "config.json": {
            "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "bos_token_id": base, "eos_token_id": base + 1, "pad_token_id": base + 255,
            "media_placeholder_token_id": base + 21,
            "text_config": {"model_type": "kimi_k2", "vocab_size": base + 256, "bos_token_id": base,
                            "eos_token_id": base + 1, "pad_token_id": base + 255},
        },
        "generation_config.json": {"max_length": 262144, "eos_token_id": base + 2},
    }
    for name, data in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f, indent=2)
    # ---- CHAT TEMPLATE ----------------------------------------------------------------------------------
    # Kimi-K2.5 ships chat_template.jinja beside these files. None is written here unless asked for;
    # a test that needs Kimi's real template passes it as `chat_template`.
    if chat_template is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(chat_template)
    return path


# ==== tokenizer.json families: MiniMax-M2.5, DeepSeek-V3 / V3.1 (R1), Llama-3.1 ==========================
#
# Each `*_folder(path)` writes the files the published folder has for its tokenizer: tokenizer.json (a
# small byte-level BPE trained here with the `tokenizers` library on BPE_CORPUS, then the family's added
# tokens under their real names and `special` flags, as one contiguous block after the BPE vocabulary
# as in the real files: real id = real base + offset, here id = len(BPE vocabulary) + offset; DeepSeek's
# BOS / EOS / PAD sit at ids 0, 1, 2 as in its real vocabulary), tokenizer_config.json, config.json,
# generation_config.json and the chat template (a structural mirror in tests/data/chat_templates/, put
# where the real folder has it). Where each fact comes from is said beside it; "assumed" marks the ones
# not found in public material.

CHAT_TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat_templates")

# The BPE training text: CORPUS plus chat-like text (JSON, tool names, markup words), so common pieces
# are single tokens. The tests' model outputs are not in it.
BPE_CORPUS = CORPUS + """\
The weather in Paris is sunny today. What time is it in Tokyo? Let me check the weather and the time.
{"city": "Berlin", "unit": "celsius", "days": 5} {"timezone": "Asia/Tokyo"} {"name": "lookup", "parameters": {}}
get_weather get_time search_web function parameters arguments properties required string integer
<invoke name="lookup"> <parameter name="query">value</parameter> </invoke> ```json
The user wants to know something, so I should call a tool first and then answer briefly.
"""

# Llama 3's pre-tokenizer pattern (as published in Meta's tokenizer.json / tiktoken pat_str). The
# MiniMax and DeepSeek folders use it too: their own patterns differ (assumed irrelevant here: no test
# depends on how text splits, only on what round-trips).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")


def bpe_tokenizer(leading_specials: tuple[str, ...] = (), vocab_size: int = 1024):
    """A byte-level BPE `tokenizers.Tokenizer` trained on BPE_CORPUS (Llama 3 split, then ByteLevel),
    `leading_specials` first (ids 0, 1, ...: DeepSeek's BOS / EOS / PAD), with the ByteLevel decoder."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(leading_specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([BPE_CORPUS], trainer)
    return tok


def write_tokenizer_json(path: str, tok, added: tuple[tuple[str, bool], ...], bos: str | None) -> int:
    """Append `added` ((name, special), in id order) after `tok`'s vocabulary and write tokenizer.json;
    with `bos`, a post-processor that starts every encoding with it (as Llama's and DeepSeek's
    tokenizer.json do), else ByteLevel's. Returns the id of the first added token."""
    from tokenizers import AddedToken, processors

    base = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(name, special=special, normalized=False) for name, special in added])
    assert [tok.token_to_id(name) for name, _ in added] == list(range(base, base + len(added)))
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(os.path.join(path, "tokenizer.json"))
    return base


def _write_json(path: str, files: dict) -> None:
    for name, data in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)


def read_chat_template(name: str) -> str:
    """tests/data/chat_templates/<name>.jinja."""
    with open(os.path.join(CHAT_TEMPLATES, f"{name}.jinja")) as f:
        return f.read()


# ---- MiniMax-M2.5 --------------------------------------------------------------------------------------
# Names and offsets from 200000: the MiniMax-M2 family's 54 added tokens as listed with their ids in
# public tokenizer ports (e.g. a Rust BPE crate's `minimax_m2()` table: "]!p~[" 200000, "]~b]" 200019,
# "[e~[" 200020, "]!d~[" 200021, "]~!b[" 200034, "<think>" 200050, "</think>" 200051,
# "<minimax:tool_call>" 200052, "</minimax:tool_call>" 200053; the tokenizer is the same across
# M2 / M2.1 / M2.5). `special`: the role and format tokens are special; <think>, </think> and the
# tool-call tags are not: vLLM's minimax_m2 parsers read them in text decoded with the default
# skip_special_tokens=True, and vLLM issues #34625 / #38212 show "<think>" and "</think>" in returned
# content. (Inferred from that behaviour, not read from the file itself.)
MINIMAX_ADDED_TOKENS = tuple((name, name not in ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"))
                             for name in (
    "]!p~[", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>", "<filename>", "<gh_stars>",
    "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
    "<jupyter_output>", "<empty_output>", "<commit_before>", "<commit_msg>", "<commit_after>", "]~b]", "[e~[",
    "]!d~[", "<function_call>", "<code_interpreter>", "]<]speech[>[", "]<]image[>[", "]<]video[>[",
    "]<]start of speech[>[", "]<]end of speech[>[", "]<]start of image[>[", "]<]end of image[>[",
    "]<]start of video[>[", "]<]end of video[>[", "]<]vision pad[>[", "]~!b[", "<jupyter_error>", "<add_file>",
    "<delete_file>", "<rename_file>", "<edit_file>", "<commit_message>", "<empty_source_file>", "<repo_struct>",
    "<code_context>", "<file_content>", "<source_files>", "<pr_start>", "<review_comment>", "<filepath>",
    "<file_sep>", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"))


def minimax_folder(path: str | os.PathLike, chat_template: str | None = None) -> str:
    """A MiniMax-M2.5 tokenizer folder at `path`: tokenizer.json (MINIMAX_ADDED_TOKENS after the BPE, no
    BOS post-processor: a GPT2Tokenizer adds none), tokenizer_config.json (GPT2Tokenizer, bos "]~!b[",
    eos "[e~[", unk "]!d~["; no add_bos_token key, assumed as in third-party copies), config.json
    (model_type minimax_m2, as tests/data/minimax-m2.5.config.json: no token ids),
    generation_config.json (bos 200019 "]~b]" and eos 200020 "[e~[", as third-party copies give them;
    assumed) and chat_template.jinja (the real folder ships one; default: the mirror
    tests/data/chat_templates/minimax_m2.jinja)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    base = write_tokenizer_json(path, bpe_tokenizer(), MINIMAX_ADDED_TOKENS, bos=None)
    ids = {name: base + i for i, (name, _) in enumerate(MINIMAX_ADDED_TOKENS)}
    _write_json(path, {
        "tokenizer_config.json": {
            "add_prefix_space": False, "bos_token": "]~!b[", "eos_token": "[e~[", "unk_token": "]!d~[",
            "clean_up_tokenization_spaces": False, "model_max_length": 40960000, "tokenizer_class": "GPT2Tokenizer",
        },
        "config.json": {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
                        "vocab_size": base + len(MINIMAX_ADDED_TOKENS)},
        "generation_config.json": {"bos_token_id": ids["]~b]"], "eos_token_id": ids["[e~["], "do_sample": True,
                                   "temperature": 1.0, "top_p": 0.95, "top_k": 40},
    })
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(read_chat_template("minimax_m2") if chat_template is None else chat_template)
    return path


# ---- DeepSeek-V3 / V3.1 ----------------------------------------------------------------------------------
# Ids 0, 1, 2: <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, <｜▁pad▁｜> (special), as config.json's
# bos_token_id 0 / eos_token_id 1 (tests/data/deepseek-v3.config.json). From 128000 (offset 0):
# <｜place▁holder▁no▁N｜> fillers (special; assumed), and from 128796 the named tokens: ids as public
# parser tests give them (<think> 128798, </think> 128799, <｜User｜> 128803, <｜Assistant｜> 128804,
# <|EOT|> 128805, <｜tool▁calls▁begin｜> 128806 ... <｜tool▁call▁end｜> 128809, <｜tool▁sep｜> 128814;
# the outputs tokens 128810..128813 and the fim / search ones fill in between, assumed). `special`:
# false for all named tokens, as DeepSeek's own R1-Distill tokenizer.json marks its copies of
# <｜User｜>, <｜Assistant｜>, <|EOT|>, <think>, </think> (the tool markers and fim / search tokens
# likewise, assumed: vLLM's deepseek_v3 / v31 parsers read the markers in decoded text).
DEEPSEEK_LEADING = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
DEEPSEEK_NAMED = (
    (796, "<｜search▁begin｜>"), (797, "<｜search▁end｜>"), (798, "<think>"), (799, "</think>"), (800, "<｜fim▁hole｜>"),
    (801, "<｜fim▁begin｜>"), (802, "<｜fim▁end｜>"), (803, "<｜User｜>"), (804, "<｜Assistant｜>"), (805, "<|EOT|>"),
    (806, "<｜tool▁calls▁begin｜>"), (807, "<｜tool▁calls▁end｜>"), (808, "<｜tool▁call▁begin｜>"),
    (809, "<｜tool▁call▁end｜>"), (810, "<｜tool▁outputs▁begin｜>"), (811, "<｜tool▁outputs▁end｜>"),
    (812, "<｜tool▁output▁begin｜>"), (813, "<｜tool▁output▁end｜>"), (814, "<｜tool▁sep｜>"))


def deepseek_added_tokens() -> tuple[tuple[str, bool], ...]:
    named = dict(DEEPSEEK_NAMED)
    return tuple((named[i], False) if i in named else (f"<｜place▁holder▁no▁{i}｜>", True) for i in range(815))


def deepseek_folder(path: str | os.PathLike, version: str = "v3.1", chat_template: str | None = None) -> str:
    """A DeepSeek tokenizer folder at `path`: "v3.1" (DeepSeek-V3.1: `thinking` switch, V3.1 call markup)
    or "v3" (the R1-style layout of DeepSeek-V3 / R1 / R1-0528: generation prompt always opens <think>,
    calls in fenced JSON). tokenizer.json (DEEPSEEK_LEADING at ids 0..2, the BPE, the 128000+ block with
    a BOS post-processor), tokenizer_config.json (LlamaTokenizerFast, add_bos_token true,
    add_eos_token false, bos / eos as AddedToken objects, and the chat template: DeepSeek's folders
    keep it there; default: the mirror tests/data/chat_templates/deepseek_v31.jinja or deepseek_r1.jinja),
    config.json (model_type deepseek_v3, bos 0, eos 1) and generation_config.json (bos 0, eos 1)."""
    if version not in ("v3", "v3.1"):
        raise ValueError(f"version must be 'v3' (R1-style) or 'v3.1'; got {version!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    base = write_tokenizer_json(path, bpe_tokenizer(DEEPSEEK_LEADING), deepseek_added_tokens(), bos=DEEPSEEK_LEADING[0])
    if chat_template is None:
        chat_template = read_chat_template("deepseek_v31" if version == "v3.1" else "deepseek_r1")

    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
                "single_word": False}

    _write_json(path, {
        "tokenizer_config.json": {
            "add_bos_token": True, "add_eos_token": False, "bos_token": added(DEEPSEEK_LEADING[0]),
            "clean_up_tokenization_spaces": False, "eos_token": added(DEEPSEEK_LEADING[1]), "legacy": True,
            "model_max_length": 131072, "pad_token": added(DEEPSEEK_LEADING[1]), "sp_model_kwargs": {},
            "unk_token": None, "tokenizer_class": "LlamaTokenizerFast", "chat_template": chat_template,
        },
        "config.json": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "bos_token_id": 0,
                        "eos_token_id": 1, "vocab_size": base + 815},
        "generation_config.json": {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1,
                                   "do_sample": True, "temperature": 0.6, "top_p": 0.95},
    })
    return path


# ---- Llama-3.1-Instruct --------------------------------------------------------------------------------
# 256 added tokens from 128000, all special (Meta's tokenizer.json): <|begin_of_text|> 128000,
# <|end_of_text|> 128001, <|reserved_special_token_0|> / _1 128002-3, <|finetune_right_pad_id|> 128004,
# <|reserved_special_token_2|> 128005, <|start_header_id|> 128006, <|end_header_id|> 128007,
# <|eom_id|> 128008, <|eot_id|> 128009, <|python_tag|> 128010, then <|reserved_special_token_3..247|>.
# config.json / generation_config.json: bos 128000, eos [128001, 128008, 128009]
# (tests/data/llama-3.1-8b-instruct.config.json); tokenizer_config.json: bos <|begin_of_text|>, eos
# <|eot_id|>, no add_bos_token (the tokenizer.json post-processor adds BOS), PreTrainedTokenizerFast, and
# the chat template.
LLAMA_NAMED = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
               "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
LLAMA_ADDED_TOKENS = tuple((name, True) for name in
                           LLAMA_NAMED + tuple(f"<|reserved_special_token_{i}|>" for i in range(3, 248)))


def llama_folder(path: str | os.PathLike, chat_template: str | None = None) -> str:
    """A Llama-3.1-Instruct tokenizer folder at `path` (see LLAMA_ADDED_TOKENS above); the chat template
    in tokenizer_config.json (default: the mirror tests/data/chat_templates/llama31.jinja)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    base = write_tokenizer_json(path, bpe_tokenizer(), LLAMA_ADDED_TOKENS, bos="<|begin_of_text|>")
    eos = [base + 1, base + 8, base + 9]
    _write_json(path, {
        "tokenizer_config.json": {
            "bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": read_chat_template("llama31") if chat_template is None else chat_template,
        },
        "config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": base,
                        "eos_token_id": eos, "vocab_size": base + 256},
        "generation_config.json": {"bos_token_id": base, "do_sample": True, "eos_token_id": eos, "temperature": 0.6,
                                   "top_p": 0.9},
    })
    return path
