"""Kimi's tokenizer layout: `tiktoken.model` plus `tokenizer_config.json`, read without remote code.

Moonshot's Kimi-K2 / K2.5 folders ship no tokenizer.json. Their tokenizer (the remote-code
`tokenization_kimi.py`, class `TikTokenTokenizer`) is a `tiktoken.Encoding` built from:

- the mergeable ranks of `tiktoken.model`, one `base64(token bytes) rank` line per token, ranks
  0..N-1 (N = 163,584 for Kimi-K2.5);
- 256 reserved special tokens with ids N..N+255, each named by `tokenizer_config.json`'s
  `added_tokens_decoder` where it names that id, else `<|reserved_token_{id}|>` (the id itself,
  e.g. `<|reserved_token_163589|>`);
- the split pattern `KIMI_PAT_STR` (o200k's, with a leading Han arm and Han taken out of the
  letter classes by `&&` class intersection).

Encoding turns special-token names written in the text into their ids (Kimi's `encode` passes
`allowed_special="all"`), and cuts the text first into pieces of at most 400,000 characters, then
each piece where a run of whitespace or of non-whitespace grows past 25,000 characters (Kimi's
TIKTOKEN_MAX_ENCODE_CHARS and MAX_NO_WHITESPACES_CHARS), encoding the pieces apart as Kimi does.

Which tokens are special (skipped by `decode(..., skip_special_tokens=True)`) follows
transformers: the `added_tokens_decoder` entries marked `"special": true`, plus the named special
tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...) and `additional_special_tokens`
(Kimi's default list when the config has none). Kimi's tool-call and `<think>` markers are added
tokens marked `"special": false`, so decoding keeps them; a reserved token that the config does not
name is not special either, and decodes to its name, as with transformers.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
from typing import Any, Iterator, Mapping, Sequence

import tiktoken

VOCAB_FILE = "tiktoken.model"  # Kimi's VOCAB_FILES_NAMES["vocab_file"]
NUM_RESERVED_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000  # Kimi's TIKTOKEN_MAX_ENCODE_CHARS
MAX_RUN_CHARS = 25_000  # Kimi's MAX_NO_WHITESPACES_CHARS (tiktoken issue 195)

# `TikTokenTokenizer.pat_str` of Moonshot's tokenization_kimi.py (Kimi-K2, K2.5), joined as it joins it
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# The special-token entries of a tokenizer_config.json (transformers' SPECIAL_TOKENS_ATTRIBUTES)
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenization_kimi.py's additional_special_tokens when tokenizer_config.json gives none
KIMI_ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                  "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")


class TiktokenFileError(ValueError):
    """A tiktoken vocabulary or its tokenizer_config.json that cannot be used, with the fix."""


def read_ranks(path: str) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken file: `base64(token bytes) rank` per line, ranks 0..N-1.

    Blank lines are skipped. Raises TiktokenFileError naming the file and line for a line that is
    not two fields, bad base64, a rank that is not an integer, a repeated token, or ranks that are
    not exactly 0..N-1 (the special tokens' ids start at N).
    """
    with open(path, "rb") as f:
        data = f.read()
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError(f"expected 2 fields, got {len(fields)}")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error) as e:
            raise TiktokenFileError(f"{path} line {lineno} is not `base64(token bytes) rank` ({e}): "
                                    f"{line[:60]!r}; restore the file from the original model folder") from None
        if token in ranks:
            raise TiktokenFileError(f"{path} line {lineno} repeats a token given rank {ranks[token]} before; "
                                    "restore the file from the original model folder")
        ranks[token] = rank
    if not ranks:
        raise TiktokenFileError(f"{path} holds no ranks; restore the file from the original model folder")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TiktokenFileError(f"{path}: the ranks of its {len(ranks)} tokens are not 0..{len(ranks) - 1} "
                                "(each once); restore the file from the original model folder")
    return ranks


def _content(value: Any) -> str | None:
    # tokenizer_config.json writes a token as a string or as an AddedToken {"content": ...}
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_token_names(config: Mapping[str, Any], num_base: int) -> dict[str, int]:
    """Kimi's 256 reserved special tokens (ids num_base..num_base+255) by name: the name
    `added_tokens_decoder` gives an id, else `<|reserved_token_{id}|>`."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise TiktokenFileError("tokenizer_config.json: added_tokens_decoder must be an object of {id: {\"content\": "
                                "...}}; restore the file from the original model folder")
    named: dict[int, str] = {}
    for key, entry in decoder.items():
        text = _content(entry)
        if not (str(key).isdigit() and text):
            raise TiktokenFileError(f"tokenizer_config.json: added_tokens_decoder entry {key!r} needs an integer id "
                                    "and a \"content\" string; restore the file from the original model folder")
        named[int(key)] = text
    ids = range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)
    out = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    if len(out) != len(ids):
        raise TiktokenFileError("tokenizer_config.json: added_tokens_decoder gives two special ids the same name; "
                                "restore the file from the original model folder")
    return out


def special_ids(config: Mapping[str, Any], names: Mapping[str, int]) -> frozenset[int]:
    """The ids decoding skips: added tokens marked special, the named special tokens and the
    additional special tokens (Kimi's default list where the config gives none)."""
    decoder = config.get("added_tokens_decoder") or {}
    ids = {int(k) for k, v in decoder.items() if isinstance(v, Mapping) and v.get("special") is True}
    extra = config.get("additional_special_tokens", config.get("extra_special_tokens"))
    if extra is None:
        extra = KIMI_ADDITIONAL_SPECIAL_TOKENS
    texts = [_content(config.get(k)) for k in _NAMED_SPECIALS]
    texts += [_content(t) for t in (extra if isinstance(extra, (list, tuple)) else [])]
    ids.update(names[t] for t in texts if t in names)
    return frozenset(ids & set(names.values()))


def split_long_runs(text: str, max_run: int = MAX_RUN_CHARS) -> Iterator[str]:
    """`text` cut where a run of whitespace or of non-whitespace characters (`str.isspace`) grows
    past `max_run`: every max_run characters from the run's start. The same cuts as Kimi's
    `_split_whitespaces_or_nonwhitespaces`; one piece (possibly "") when no run is that long."""
    start = 0
    for run in re.finditer(r"\s{%d,}|\S{%d,}" % (max_run + 1, max_run + 1), text):
        for cut in range(run.start() + max_run, run.end(), max_run):
            yield text[start:cut]
            start = cut
    yield text[start:]


@dataclasses.dataclass(frozen=True, eq=False)
class TiktokenBackend:
    """A `tiktoken.Encoding` with the special tokens Kimi's tokenizer gives it (module docstring)."""

    encoding: tiktoken.Encoding
    special_tokens: Mapping[str, int]  # all 256 special tokens (named or reserved) by name
    special_ids: frozenset[int]  # those skipped by decode(skip_special_tokens=True)
    num_base: int  # the special tokens' ids start here

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def added_ids(self) -> frozenset[int]:
        """The ids of all special tokens (named or reserved), special for decoding or not."""
        return frozenset(self.special_tokens.values())

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        return frozenset()  # byte-level BPE: every byte is a token of its own

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text` as Kimi's `encode` gives them (special-token names become their ids; long
        texts are cut as the module docstring says). `add_special_tokens` adds nothing: Kimi adds no
        BOS or EOS itself."""
        del add_special_tokens
        ids: list[int] = []
        for i in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
            for piece in split_long_runs(text[i:i + MAX_ENCODE_CHARS]):
                ids += self.encoding.encode(piece, allowed_special="all")
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; ids outside the vocabulary are dropped and bytes that are not whole
        UTF-8 characters become U+FFFD."""
        n = self.encoding.n_vocab
        keep = [int(i) for i in ids if 0 <= int(i) < n and not (skip_special_tokens and int(i) in self.special_ids)]
        return self.encoding.decode(keep, errors="replace")

    def token_to_id(self, text: str) -> int | None:
        """The id of a special token's name, or of a base token's text; None for anything else."""
        special = self.special_tokens.get(text)
        if special is not None:
            return special
        try:
            return self.encoding.encode_single_token(text.encode("utf-8"))
        except KeyError:
            return None

    def id_to_token(self, token_id: int) -> str | None:
        """The text of one token (U+FFFD for bytes that are not whole characters); None outside the vocabulary."""
        if not 0 <= int(token_id) < self.encoding.n_vocab:
            return None
        return self.encoding.decode_single_token_bytes(int(token_id)).decode("utf-8", errors="replace")


def load_tiktoken(vocab_path: str, config: Mapping[str, Any]) -> TiktokenBackend:
    """Kimi's tokenizer from its rank file and its folder's parsed tokenizer_config.json.

    Raises TiktokenFileError for a malformed rank file or added_tokens_decoder, OSError for an
    unreadable file.
    """
    ranks = read_ranks(vocab_path)
    names = special_token_names(config, len(ranks))
    try:
        encoding = tiktoken.Encoding(os.path.basename(vocab_path), pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=names)
    except ValueError as e:
        raise TiktokenFileError(f"{vocab_path} could not be made into a tiktoken encoding: {e}") from e
    return TiktokenBackend(encoding=encoding, special_tokens=names, special_ids=special_ids(config, names),
                           num_base=len(ranks))
