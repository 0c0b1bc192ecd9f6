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

from eagle3_jax.tiktoken_tokenizer import KIMI_PAT_STR

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
