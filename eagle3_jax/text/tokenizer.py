"""Text <-> token ids for the scripts and the server, from a model folder as it ships its tokenizer.

Two layouts, one `Tokenizer`:

- `tokenizer.json`, read with the Hugging Face `tokenizers` library (no transformers, no remote code);
- Kimi's `tiktoken.model` beside `tokenizer_config.json` (Kimi-K2 / K2.5 ship no tokenizer.json),
  read with `tiktoken` as Moonshot's `tokenization_kimi.py` reads it (eagle3_jax/text/tiktoken_tokenizer.py).

A folder with tokenizer.json uses it; else the tiktoken file that tokenizer_config.json's
`vocab_file` names, else `tiktoken.model`. BOS and EOS ids come from the folder's configs unless
given explicitly (`find_bos_id`, `find_eos_ids`), and chat messages are rendered with the folder's
chat template (eagle3_jax/text/chat_template.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from .chat_template import ChatTemplate, ChatTemplateError, render_prompts
from .tiktoken_tokenizer import VOCAB_FILE, TiktokenBackend, TiktokenFileError, load_tiktoken

HF_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A model folder without a usable tokenizer (tokenizer.json or tiktoken.model), with the reason and the fix."""


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizersBackend:
    """A `tokenizers.Tokenizer` (tokenizer.json) behind the interface the tiktoken backend has too."""

    hf: tokenizers.Tokenizer

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def added_ids(self) -> frozenset[int]:
        """The ids of the added tokens, special or not."""
        return frozenset(int(i) for i in self.hf.get_added_tokens_decoder())

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (those decode skips)."""
        return frozenset(int(i) for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens `<0xXX>` of the vocabulary (none for byte-level BPE)."""
        return frozenset(i for t, i in self.hf.get_vocab(with_added_tokens=False).items()
                         if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.hf.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(int(token_id))

    @functools.cached_property
    def post_processor_adds_bos(self) -> bool:
        """Whether tokenizer.json's post-processor puts a token before the text (a BOS template, as
        Llama's has; a GPT-2 style ByteLevel one adds none)."""
        plain = self.hf.encode("a", add_special_tokens=False).ids
        full = self.hf.encode("a", add_special_tokens=True).ids
        return len(full) > len(plain) and full[len(full) - len(plain):] == plain


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A tokenizer backend (tokenizer.json or Kimi's tiktoken.model), the model's BOS / EOS ids and
    the folder its chat template is read from. Hashed by identity (text_stream caches per tokenizer)."""

    backend: TokenizersBackend | TiktokenBackend
    bos_id: int | None
    eos_ids: tuple[int, ...]
    folder: str | None = None  # where the chat template is read from; None: no template
    adds_bos: bool = True  # whether the model's own tokenizer starts an encoding with BOS (Kimi's never does)

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokens `decode` skips with skip_special_tokens=True."""
        return self.backend.special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens `<0xXX>` (empty for byte-level BPE, and for tiktoken)."""
        return self.backend.byte_fallback_ids

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; with `add_bos`, the ids start with BOS exactly once; None (the
        default) adds it where the model's own tokenizer does (`adds_bos`: tokenizer_config.json's
        `add_bos_token`; without it, whether tokenizer.json's post-processor adds one (yes for a bare
        tokenizer.json with no tokenizer_config.json), and no for Kimi's tiktoken layout).

        Text that already starts with the BOS text (a rendered chat template) keeps that one BOS.
        Special-token names in the text become their ids.
        """
        add_bos = self.adds_bos if add_bos is None else add_bos
        bos_text = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else None
        has_bos_text = bool(bos_text) and text.startswith(bos_text)
        ids = self.backend.encode(text, add_special_tokens=add_bos and not has_bos_text)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. With skip_special_tokens, the special tokens are left out (added tokens
        not marked special, such as Kimi's tool-call and think markers, stay). Bytes that are not
        whole UTF-8 characters decode to U+FFFD."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_continuation(self, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
        """The text `new_ids` adds after `prompt_ids`, with the spacing it has in context.

        Decoding new tokens alone can drop a leading space (SentencePiece-style decoders strip the
        first one), so the prompt is decoded with them and its own text removed.
        """
        prefix = self.decode(prompt_ids)
        full = self.decode(list(prompt_ids) + list(new_ids))
        return full[len(prefix):] if full.startswith(prefix) else self.decode(new_ids)

    def token_to_id(self, text: str) -> int | None:
        """The id of the token whose text is `text` exactly, or None."""
        return self.backend.token_to_id(text)

    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        """The folder's chat template (`ChatTemplate.from_dir`); without a folder, none. Raises
        ChatTemplateError for a template that does not compile."""
        return ChatTemplate.from_dir(self.folder)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """The prompt text of `messages` rendered with the folder's chat template (see
        `ChatTemplate.render`); ChatTemplateError without one or when it rejects the messages."""
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


# ---- BOS and EOS ---------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_id(backend: TokenizersBackend | TiktokenBackend, token: Any) -> int | None:
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


def find_bos_id(models: Sequence[Mapping[str, Any]], tokenizer_config: Mapping[str, Any],
                backend: TokenizersBackend | TiktokenBackend) -> int | None:
    """BOS from generation_config.json, config.json, its text_config (`models`, `_model_configs`),
    else tokenizer_config's bos_token."""
    for cfg in models:
        if cfg.get("bos_token_id") is not None:
            return int(cfg["bos_token_id"])
    return _token_id(backend, tokenizer_config.get("bos_token"))


_MARKER = "EAGLE3_END_OF_TURN_PROBE"


def end_of_turn_id(folder: str, backend: TokenizersBackend | TiktokenBackend) -> int | None:
    """The added token the folder's chat template writes right after an assistant message (its
    end-of-turn token, e.g. `<|im_end|>`), found by rendering a user turn and an assistant turn
    whose content is a marker. None without a template, when the template refuses the probe, or
    when what follows the marker (leading whitespace aside) is not an added token."""
    try:
        rendered = ChatTemplate.from_dir(folder).render(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}], add_generation_prompt=False)
    except (ChatTemplateError, OSError):
        return None
    if _MARKER not in rendered:
        return None
    after = rendered[rendered.index(_MARKER) + len(_MARKER):].lstrip()
    ids = backend.encode(after, add_special_tokens=False)[:1] if after else []
    return ids[0] if ids and ids[0] in backend.added_ids else None


def find_eos_ids(folder: str, models: Sequence[Mapping[str, Any]], tokenizer_config: Mapping[str, Any],
                 backend: TokenizersBackend | TiktokenBackend) -> tuple[int, ...]:
    """Every id that ends generation, in order, without repeats: generation_config.json's, config.json's
    and its text_config's eos_token_id (an int or a list; `models`), tokenizer_config's eos_token, and
    the chat template's end-of-turn token (`end_of_turn_id`)."""
    ids = [i for cfg in models for i in _as_ids(cfg.get("eos_token_id"))]
    ids.append(_token_id(backend, tokenizer_config.get("eos_token")))
    ids.append(end_of_turn_id(folder, backend))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


# ---- loading ------------------------------------------------------------------------------------------------


def _tiktoken_file(folder: str, config: Mapping[str, Any]) -> str | None:
    """The tiktoken vocabulary of a folder: the file tokenizer_config's vocab_file names, else tiktoken.model."""
    named = config.get("vocab_file")
    for name in ([os.path.basename(named)] if isinstance(named, str) and named else []) + [VOCAB_FILE]:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def _load_tokenizers(file: str, folder: str) -> TokenizersBackend:
    try:
        return TokenizersBackend(tokenizers.Tokenizer.from_file(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        beside = os.path.join(folder, HF_FILE)
        if os.path.basename(file) != HF_FILE and os.path.isfile(beside):
            raise TokenizerError(f"{file} is not a tokenizer file; pass its folder {folder or '.'} "
                                 f"(or {beside})") from e
        raise TokenizerError(f"{file} could not be read as a `tokenizers` tokenizer.json: {e}") from e


def _load_tiktoken(file: str, tokenizer_config: Mapping[str, Any]) -> TiktokenBackend:
    try:
        return load_tiktoken(file, tokenizer_config)
    except TiktokenFileError as e:
        raise TokenizerError(str(e)) from e


def load_tokenizer(path: str | os.PathLike, bos_id: int | None = None,
                   eos_ids: Sequence[int] | None = None) -> Tokenizer:
    """The tokenizer of a model folder (or of a tokenizer.json / tiktoken file given itself).

    A folder's tokenizer.json is used when present, else its tiktoken vocabulary (the module
    docstring). `bos_id` / `eos_ids` override what the folder's configs say; `encode` adds BOS where
    the model's own tokenizer does (`Tokenizer.adds_bos`). Raises TokenizerError
    (one line: the problem and the fix) for a folder with neither file or a file that cannot be read.
    """
    p = os.fspath(path)
    folder = p if os.path.isdir(p) else os.path.dirname(p)
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = _read_json(config_path)
    if os.path.isdir(p):
        file = os.path.join(p, HF_FILE)
        if not os.path.isfile(file):
            file = _tiktoken_file(p, config) or file
    else:
        file = p
    if not os.path.isfile(file):
        raise TokenizerError(
            f"no {HF_FILE} (Hugging Face `tokenizers`) nor {VOCAB_FILE} (Kimi's tiktoken layout) at "
            f"{p if os.path.isdir(p) else file}: copy the tokenizer files of the original model folder "
            f"({HF_FILE}, or {VOCAB_FILE} with tokenizer_config.json), or pass token ids to the Python API")
    tiktoken_file = os.path.basename(file) == VOCAB_FILE or file.endswith(".tiktoken")
    backend = _load_tiktoken(file, config) if tiktoken_file else _load_tokenizers(file, folder)
    adds_bos = config.get("add_bos_token")
    if adds_bos is None:
        # as transformers' fast tokenizer: its tokenizer.json's post-processor decides (a folder
        # whose tokenizer_config.json says nothing, e.g. MiniMax's GPT2Tokenizer, adds no BOS); a
        # bare tokenizer.json without that config keeps BOS, and Kimi's tiktoken layout never has one
        adds_bos = (False if tiktoken_file else
                    backend.post_processor_adds_bos if os.path.isfile(config_path) else True)
    models = _model_configs(folder)
    return Tokenizer(
        backend=backend,
        bos_id=find_bos_id(models, config, backend) if bos_id is None else int(bos_id),
        eos_ids=find_eos_ids(folder, models, config, backend) if eos_ids is None else tuple(int(i) for i in eos_ids),
        folder=folder or ".",
        adds_bos=bool(adds_bos),
    )

def encode_rendered(rendered: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a chat-template rendering, starting with BOS exactly once.

    Templates usually write the BOS text themselves, so the tokenizer's own special tokens are
    not added (as transformers' apply_chat_template does); BOS is prepended only when missing.
    """
    ids = tokenizer.encode(rendered, add_bos=False)
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids.insert(0, int(tokenizer.bos_id))
    return ids


def tokenize_prompts(texts: Iterable[str], tokenizer_dir: str | os.PathLike, tokenizer: Tokenizer) -> list[list[int]]:
    """Each text as the user turn of the chat template (if any), tokenized (BOS exactly once)."""
    return [encode_rendered(r, tokenizer) for r in render_prompts(list(texts), tokenizer_dir)]
