"""Text <-> token ids for the scripts, from a model folder's HF `tokenizer.json`.

Only the `tokenizers` library is used (no transformers, no remote code). BOS and EOS ids come from
the folder's `generation_config.json`, `config.json` and `tokenizer_config.json`, in the order
transformers' `generate` reads them, unless given explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import tokenizers


class TokenizerError(ValueError):
    """A model folder without a usable tokenizer.json, with the reason and the fix."""


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's BOS / EOS ids."""

    backend: tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; with `add_bos`, the ids start with BOS exactly once.

        Text that already starts with the BOS text (a rendered chat template) keeps that one BOS.
        """
        bos_text = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else None
        has_bos_text = bool(bos_text) and text.startswith(bos_text)
        ids = list(self.backend.encode(text, add_special_tokens=add_bos and not has_bos_text).ids)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_continuation(self, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
        """The text `new_ids` adds after `prompt_ids`, with the spacing it has in context.

        Decoding new tokens alone can drop a leading space (SentencePiece-style decoders strip the
        first one), so the prompt is decoded with them and its own text removed.
        """
        prefix = self.decode(prompt_ids)
        full = self.decode(list(prompt_ids) + list(new_ids))
        return full[len(prefix):] if full.startswith(prefix) else self.decode(new_ids)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    """Id of a special token given as a string or as {"content": ...} (tokenizer_config.json)."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _model_configs(folder: str) -> list[dict[str, Any]]:
    """generation_config.json, config.json and its text_config (multimodal wrappers), in that order."""
    config = _read_json(os.path.join(folder, "config.json"))
    text = config.get("text_config")
    return [_read_json(os.path.join(folder, "generation_config.json")), config,
            text if isinstance(text, dict) else {}]


def find_bos_id(folder: str, backend: tokenizers.Tokenizer) -> int | None:
    for cfg in _model_configs(folder):
        if cfg.get("bos_token_id") is not None:
            return int(cfg["bos_token_id"])
    return _token_id(backend, _read_json(os.path.join(folder, "tokenizer_config.json")).get("bos_token"))


def find_eos_ids(folder: str, backend: tokenizers.Tokenizer) -> tuple[int, ...]:
    for cfg in _model_configs(folder):
        ids = _as_ids(cfg.get("eos_token_id"))
        if ids:
            return ids
    eos = _token_id(backend, _read_json(os.path.join(folder, "tokenizer_config.json")).get("eos_token"))
    return () if eos is None else (eos,)


def load_tokenizer(path: str | os.PathLike, bos_id: int | None = None,
                   eos_ids: Sequence[int] | None = None) -> Tokenizer:
    """Load `path/tokenizer.json` (or `path` itself when it is the file).

    `bos_id` / `eos_ids` override what the folder's configs say.
    """
    p = os.fspath(path)
    folder, file = (p, os.path.join(p, "tokenizer.json")) if os.path.isdir(p) else (os.path.dirname(p), p)
    if not os.path.isfile(file):
        raise TokenizerError(
            f"no tokenizer.json at {file}; this loader reads Hugging Face `tokenizers` files only. "
            "Copy tokenizer.json from the original HF model folder, or pass token ids to the Python API"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        beside = os.path.join(folder, "tokenizer.json")
        if os.path.basename(file) != "tokenizer.json" and os.path.isfile(beside):
            raise TokenizerError(f"{file} is not a tokenizer file; pass its folder {folder or '.'} (or {beside})") from e
        raise TokenizerError(f"{file} could not be read as a `tokenizers` tokenizer.json: {e}") from e
    return Tokenizer(
        backend=backend,
        bos_id=find_bos_id(folder, backend) if bos_id is None else int(bos_id),
        eos_ids=find_eos_ids(folder, backend) if eos_ids is None else tuple(int(i) for i in eos_ids),
    )
