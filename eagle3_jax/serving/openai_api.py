"""An OpenAI-compatible HTTP API (aiohttp) over an `AsyncEngine`.

Endpoints:

- `POST /v1/completions`: `prompt` is a string, a list of token ids, or a one-element list holding
  either (several prompts per request are refused with 400: send one request each).
- `POST /v1/chat/completions`: `messages` are rendered with the model's chat template (see
  `ChatTemplate`).
- `GET /v1/models`, `GET /health` (200 while the engine runs, 503 when it stopped),
  `GET /metrics` (Prometheus text format through `prometheus_client`, metric names prefixed
  `eagle3_`; see `metrics.py`).

Sampling fields: `max_tokens` (chat also `max_completion_tokens`), `temperature` (default 1.0;
0 = greedy), `top_p`, `top_k` (-1 or 0 = off), `seed` (default: a random one), `n` (up to 128
choices of one prompt: choice i samples with seed + i, the later ones admitted once the first has
prefilled, so with the scheduler's prefix cache they share the prompt's full pages; each choice
has its `index`, streamed chunks too; usage counts the prompt once and every choice's tokens;
`best_of` only equal to n),
`presence_penalty`, `frequency_penalty` (in [-2, 2]) and vLLM's `repetition_penalty` (> 0; on the
target's distribution in plain and speculative steps alike: greedy and sampled tokens are the
penalised target's),
`stop` (a string or a list of strings, matched on the decoded text across token boundaries; the
reply ends before the stop string, or after it with vLLM's `include_stop_str_in_output`, and its
choice's `stop_reason` names it), `stream`, `stream_options.include_usage`, and the vLLM
extensions `stop_token_ids`, `ignore_eos` (by default a request also stops at the model's EOS
ids) and `min_tokens` (no stop token or stop string ends a reply before it has that many tokens:
the stop token ids are held out of the target's distribution until then). A speculative step that
accepts tokens past a stop string emits none of them. Log-probabilities: completions' `logprobs`
(an integer: each token's logprob and that many top alternatives, `tokens`, `token_logprobs`,
`top_logprobs` with the token itself among them, `text_offset`) and `echo` (the reply starts with
the prompt, and with `logprobs` its prompt logprobs, the first None; `max_tokens: 0` is allowed
with it: one token is generated and left out), chat's `logprobs` + `top_logprobs` (`content`
items with `token`, `logprob`, `bytes`, `top_logprobs`), at most the scheduler's `max_logprobs`
alternatives; streamed chunks carry their own tokens' logprobs. -inf reads -9999.0. Parameters
this engine does not implement (`logit_bias`, `best_of` other than n, chat's `echo`,
tools, `suffix`, non-text `response_format`) get a 400 when set to anything but their neutral
value, rather than being ignored. Benchmarking extension: `synthetic_acceptance` (per-position
rates, e.g. [0.9, 0.8, 0.7]) forces a speculative step to accept that profile, so that a step's
cost can be measured at a realistic acceptance without a trained draft; the output is then not
the model's, and the server refuses it (400) unless started to allow it
(`make_app(allow_synthetic_acceptance=True)`, `scripts/serve.py --allow_synthetic_acceptance`).

What the server changes or skips in a request is announced, never silent: `max_tokens` beyond the
room left in `max_seq_len` is cut to that room (finish_reason "length"), and fields it does not
know are ignored with vLLM's log line "The following fields were present in the request but
ignored: {...}". Both are also told to the client: a `warnings` list in the (non-streamed)
response body and the `X-Eagle3-Warnings` header (the messages joined by "; ") on every answer,
streamed or not.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for malformed
requests, 404 for an unknown model or route, 500 / 503 when the engine fails.

Streaming answers are Server-Sent Events, `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`; the
response starts once the first token is out, so add_request's validation errors still get a 4xx
status. With `stream_options.include_usage`, a last chunk with empty `choices` carries `usage`.
Text is decoded incrementally (`text_stream.TextStream`): text that later tokens may still change
(an incomplete UTF-8 character, shown as U+FFFD), and an end that may begin a stop string, are held
back until they settle, so the chunks concatenate to the non-streamed text. A client that disconnects mid-request has its
request aborted, freeing its KV pages; run the app with `handler_cancellation=True` (as
`scripts/serve.py` does) so that this also happens while a request waits for its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import secrets
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

from aiohttp import web

from ..logprobs import Logprob
from ..sampling import SamplingParams, check_acceptance_profile
from ..scheduler import CapacityError
from ..text_stream import TextStream
from ..tokenizer import Tokenizer
from ..train.data import _compile_template, read_chat_template, render_messages
from .async_engine import AsyncEngine, EngineDeadError, EngineError
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics

logger = logging.getLogger(__name__)

SEED_LIMIT = 2**32  # SamplingParams seeds are uint32
MAX_CHOICES = 128  # most choices (n) one request may ask for
_SERVER_KEY: web.AppKey["_Server"] = web.AppKey("eagle3_server")


# ---- errors ------------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def response(self) -> web.Response:
        return error_response(self.message, status=self.status, param=self.param, code=self.code, type=self.type)


def error_response(message: str, *, status: int, param: str | None = None, code: str | None = None,
                   type: str = "invalid_request_error") -> web.Response:
    """OpenAI's error body with the given HTTP status."""
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return web.json_response(body, status=status)


# ---- field validation (pure) -------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    """`body[key]` as an int (absent or null -> default); 400 when it is not an integer."""
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise ApiError(f"'{key}' must be an integer; got {v!r}", param=key, code="invalid_type")
    return v


def get_float(body: Mapping[str, Any], key: str, default: float) -> float:
    """`body[key]` as a finite float (absent or null -> default); 400 otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise ApiError(f"'{key}' must be a number; got {v!r}", param=key, code="invalid_type")
    if not math.isfinite(v):
        raise ApiError(f"'{key}' must be finite; got {v!r}", param=key, code="invalid_value")
    return float(v)


def get_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """`body[key]` as a bool (absent or null -> default); 400 otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{key}' must be true or false; got {v!r}", param=key, code="invalid_type")
    return v


# Parameters this engine does not implement, with the values that mean "off" (chat's `echo`, which
# repeats the last message in vLLM, only there).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}
_NEUTRAL_BY_KIND: dict[str, dict[str, tuple[Any, ...]]] = {"completion": _NEUTRAL,
                                                           "chat": {**_NEUTRAL, "echo": (None, False)}}
_HINTS: dict[str, str] = {}
# Fields a request may carry without a warning: the ones read here, the refused ones above, and
# `user` (an end-user id OpenAI's API takes and this server has no use for).
_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream",
                            "stream_options", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                            "min_tokens", "logprobs", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
                            "response_format", "user", "synthetic_acceptance",
                            *_NEUTRAL})
KNOWN_FIELDS = {"completion": _COMMON_FIELDS | {"prompt", "echo"},
                "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "echo"}}
WARNINGS_HEADER = "X-Eagle3-Warnings"


def ignored_fields(body: Mapping[str, Any], kind: str) -> list[str]:
    """The request's fields this server does not read (`kind` is "completion" or "chat"), sorted."""
    return sorted(k for k in body if k not in KNOWN_FIELDS[kind])


def max_tokens_cap(prompt_len: int, max_tokens: int, max_seq_len: int) -> int | None:
    """The tokens a request can generate when its max_tokens does not fit in max_seq_len, else None."""
    room = max_seq_len - prompt_len
    return room if max_tokens > room else None


def check_unsupported(body: Mapping[str, Any], kind: str = "completion") -> None:
    """400 for a parameter this engine does not implement (for `kind`, "completion" or "chat"),
    unless it is set to its neutral value."""
    for key, neutral in _NEUTRAL_BY_KIND[kind].items():
        v = body.get(key)
        if not any(v == n and type(v) is type(n) or v is n for n in neutral):
            raise ApiError(f"'{key}' is not supported by this server{_HINTS.get(key, '')}; got {v!r}",
                           param=key, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
        raise ApiError(f"only response_format type 'text' is supported; got {fmt!r}", param="response_format",
                       code="unsupported_parameter")


def parse_logprobs(body: Mapping[str, Any], kind: str, max_logprobs: int) -> tuple[int | None, bool]:
    """(top alternatives per token, or None for no logprobs; echo) of a request. Completions:
    `logprobs` an integer and `echo`; chat: `logprobs` true / false and `top_logprobs`. At most
    `max_logprobs` alternatives; 400 otherwise."""
    if kind == "completion":
        k, key, echo = get_int(body, "logprobs", None), "logprobs", get_bool(body, "echo", False)
    else:
        wanted, k, key, echo = get_bool(body, "logprobs", False), get_int(body, "top_logprobs", None), "top_logprobs", False
        if not wanted:
            if k:
                raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
            return None, echo
        k = k or 0
    if k is not None and not 0 <= k <= max_logprobs:
        raise ApiError(f"'{key}' must be in [0, {max_logprobs}] (this server's --max_logprobs); got {k}", param=key,
                       code="invalid_value")
    return k, echo


def parse_sampling(body: Mapping[str, Any], *, default_max_tokens: int, eos_token_ids: Sequence[int],
                   max_tokens_keys: Sequence[str] = ("max_tokens",), logprobs: int | None = None,
                   echo: bool = False, allow_synthetic_acceptance: bool = False) -> SamplingParams:
    """The request's SamplingParams; 400 (`ApiError`) naming the bad field otherwise.

    top_k -1 means off (vLLM) and becomes 0. A missing seed gets a random one, so sampled requests
    differ. Stop ids are `stop_token_ids` plus `eos_token_ids` unless `ignore_eos` is true.
    `logprobs` (`parse_logprobs`) is asked for each generated token and, with `echo`, each prompt
    token; `echo` also allows max_tokens 0 (the prompt scored, nothing generated: the engine
    generates one token, which the reply leaves out, as vLLM does). `synthetic_acceptance` (a
    benchmarking extension: per-position rates verification is forced to accept) is refused unless
    `allow_synthetic_acceptance`.
    """
    max_tokens, key_used = default_max_tokens, max_tokens_keys[0]
    for key in max_tokens_keys:
        v = get_int(body, key, None)
        if v is not None:
            max_tokens, key_used = v, key
            break
    if max_tokens < (0 if echo else 1):
        raise ApiError(f"'{key_used}' must be >= 1 (0 only with 'echo'); got {max_tokens}", param=key_used,
                       code="invalid_value")
    temperature = get_float(body, "temperature", 1.0)
    if temperature < 0:
        raise ApiError(f"'temperature' must be >= 0 (0 = greedy); got {temperature}", param="temperature",
                       code="invalid_value")
    top_p = get_float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(f"'top_p' must be in (0, 1]; got {top_p}", param="top_p", code="invalid_value")
    top_k = get_int(body, "top_k", 0)
    if top_k < -1:
        raise ApiError(f"'top_k' must be >= 0, or -1 to disable it; got {top_k}", param="top_k", code="invalid_value")
    seed = get_int(body, "seed", None)
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    elif not 0 <= seed < SEED_LIMIT:
        raise ApiError(f"'seed' must be in [0, 2**32); got {seed}", param="seed", code="invalid_value")
    n = get_int(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(f"'n' must be in [1, {MAX_CHOICES}]; got n={n}", param="n", code="invalid_value")
    best_of = get_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise ApiError(f"'best_of' other than n (ranking choices by logprob) is not supported; got best_of={best_of}, "
                       f"n={n}", param="best_of", code="unsupported_parameter")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not (isinstance(stop_ids, list) and all(_is_int(t) and t >= 0 for t in stop_ids)):
        raise ApiError(f"'stop_token_ids' must be a list of non-negative token ids; got {stop_ids!r}",
                       param="stop_token_ids", code="invalid_type")
    if not get_bool(body, "ignore_eos", False):
        stop_ids = [*stop_ids, *eos_token_ids]
    stop = parse_stop(body.get("stop"))
    include_stop = get_bool(body, "include_stop_str_in_output", False)
    min_tokens = get_int(body, "min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(f"'min_tokens' must be in [0, max_tokens={max_tokens}]; got {min_tokens}", param="min_tokens",
                       code="invalid_value")
    penalties = {key: get_float(body, key, neutral) for key, neutral in
                 (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))}
    for key in ("presence_penalty", "frequency_penalty"):
        if not -2 <= penalties[key] <= 2:
            raise ApiError(f"'{key}' must be in [-2, 2]; got {penalties[key]}", param=key, code="invalid_value")
    if penalties["repetition_penalty"] <= 0:
        raise ApiError(f"'repetition_penalty' must be > 0 (1 = off); got {penalties['repetition_penalty']}",
                       param="repetition_penalty", code="invalid_value")
    synthetic = parse_synthetic_acceptance(body.get("synthetic_acceptance"), allow_synthetic_acceptance)
    try:
        return SamplingParams(**penalties, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                              max_tokens=max(max_tokens, 1),
                              seed=seed, stop_token_ids=tuple(dict.fromkeys(stop_ids)), stop=stop,
                              include_stop_str_in_output=include_stop, min_tokens=min_tokens, logprobs=logprobs,
                              prompt_logprobs=logprobs if echo else None, synthetic_acceptance=synthetic)
    except ValueError as e:  # SamplingParams' own checks, should any be stricter than the above
        raise ApiError(str(e), code="invalid_value") from e


def parse_synthetic_acceptance(value: Any, allowed: bool) -> tuple[float, ...] | None:
    """A request's synthetic acceptance profile (None when absent); 400 when the server does not
    allow it or the rates are not a non-increasing list in [0, 1]."""
    if value is None:
        return None
    if not allowed:
        raise ApiError("'synthetic_acceptance' forces verification to accept (benchmarking only: the output is not "
                       "the model's); this server refuses it unless started with --allow_synthetic_acceptance",
                       param="synthetic_acceptance", code="unsupported_parameter")
    if not (isinstance(value, list) and all(_is_number(x) for x in value)):
        raise ApiError(f"'synthetic_acceptance' must be a list of numbers; got {value!r}",
                       param="synthetic_acceptance", code="invalid_type")
    try:
        return check_acceptance_profile(value)
    except ValueError as e:
        raise ApiError(str(e), param="synthetic_acceptance", code="invalid_value") from None


def parse_stop(stop: Any) -> tuple[str, ...]:
    """`stop`: a string or a list of strings (null, "" and [] mean none); 400 otherwise."""
    if stop is None or stop == "":
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(x, str) and x for x in stops)):
        raise ApiError(f"'stop' must be a string or a list of non-empty strings; got {stop!r}", param="stop",
                       code="invalid_type")
    return tuple(stops)


def parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options",
                       code="invalid_value")
    if not isinstance(opts, dict):
        raise ApiError(f"'stream_options' must be an object; got {opts!r}", param="stream_options", code="invalid_type")
    return stream, get_bool(opts, "include_usage", False)


def single_prompt(prompt: Any) -> Any:
    """A completion prompt with a one-element list around it (how batching clients send one) taken off."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def parse_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a completion prompt: a string (BOS added), a list of token ids (used as is), or a
    one-element list holding either."""
    prompt = single_prompt(prompt)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if min(prompt) < 0:
            raise ApiError("'prompt' token ids must be >= 0", param="prompt", code="invalid_value")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(f"batched prompts are not supported ({len(prompt)} prompts); send one request per prompt",
                       param="prompt", code="unsupported_value")
    if isinstance(prompt, list) and not prompt:
        raise ApiError("'prompt' must not be an empty list", param="prompt", code="invalid_value")
    raise ApiError("'prompt' must be a string or a list of token ids" + (" (it is missing)" if prompt is None else
                   f"; got {type(prompt).__name__}"), param="prompt", code="invalid_type")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as [{"role", "content"}] with string content (a list of text parts is joined)."""
    if messages is None:
        raise ApiError("'messages' is missing", param="messages", code="invalid_type")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {role, content} objects", param="messages",
                       code="invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object with 'role' and 'content'", param=where, code="invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{where}.role",
                           code="invalid_value")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(f"{where}.content parts must all be {{'type': 'text', 'text': ...}}; this server "
                               "takes text only", param=f"{where}.content", code="unsupported_value")
            content = "".join(p["text"] for p in content)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(f"{where}.content must be a string or a list of text parts; got {content!r}",
                           param=f"{where}.content", code="invalid_type")
        out.append({"role": role, "content": content})
    return out


# ---- chat template -----------------------------------------------------------------------------------


JOIN = "join"  # the chat template flag's value that asks for the plain fallback


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer folder's jinja chat template and its special tokens, the plain fallback, or none.

    With a template (`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja` /
    `chat_template.json`, or a file given with `from_flag`), messages are rendered as transformers
    does, with `add_generation_prompt=True` and bos/eos/unk/pad tokens (sandboxed jinja2, the
    machinery of `eagle3_jax.train.data`). The plain fallback (`join=True`, only when asked for:
    `--chat_template=join`) is each message's content on its own line, roles dropped and nothing
    added after the last line, so a base model simply continues the last message. Without either,
    a chat request is refused (as vLLM refuses one for a model without a template) with the flag
    that supplies one: guessing a format the model was not trained on gives poor answers silently.
    """

    source: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()
    join: bool = False

    @staticmethod
    def from_dir(tokenizer_dir: str | os.PathLike | None) -> "ChatTemplate":
        """The template of a tokenizer folder (None, a file, or a folder without one: no template)."""
        if tokenizer_dir is None or not os.path.isdir(tokenizer_dir):
            return ChatTemplate()
        source, specials = read_chat_template(tokenizer_dir)
        return ChatTemplate(source, tuple(specials.items()))

    @staticmethod
    def from_flag(value: str | None, tokenizer_dir: str | os.PathLike | None) -> "ChatTemplate":
        """What a `--chat_template` flag asks for: None, the tokenizer folder's template; "join", the
        plain fallback; else a jinja file (`.jinja`, or a `.json` holding `chat_template`), with the
        tokenizer folder's special tokens. A file that cannot be read raises OSError / ValueError."""
        if value is None:
            return ChatTemplate.from_dir(tokenizer_dir)
        if value == JOIN:
            return ChatTemplate(join=True)
        specials = ChatTemplate.from_dir(tokenizer_dir).special_tokens
        with open(value, encoding="utf-8") as f:
            text = f.read()
        if value.endswith(".json"):
            source = json.loads(text).get("chat_template") if text.strip().startswith("{") else None
            if not isinstance(source, str) or not source:
                raise ValueError(f"{value} holds no \"chat_template\" string; give a .jinja file or a JSON object "
                                 "with one")
            text = source
        if not text.strip():
            raise ValueError(f"{value} is empty; give a jinja chat template")
        try:
            _compile_template(text)
        except Exception as e:  # jinja2's TemplateSyntaxError
            raise ValueError(f"{value} is not a valid jinja template: {e}") from None
        return ChatTemplate(text, specials)

    @property
    def available(self) -> bool:
        """Whether chat requests can be rendered (a template, or the fallback asked for)."""
        return self.source is not None or self.join

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text for `messages`, ready for the assistant's answer."""
        if self.source is None:
            if not self.join:
                raise ApiError("this model has no chat template: restart the server with --chat_template=<file.jinja> "
                               "(or --chat_template=join to send the messages' contents joined by newlines), or use "
                               "/v1/completions", param="messages", code="no_chat_template")
            return "\n".join(m["content"] for m in messages)
        try:
            return render_messages(self.source, messages, dict(self.special_tokens))
        except Exception as e:  # templates reject some conversations with raise_exception(...)
            raise ApiError(f"the chat template rejected these messages: {e}", param="messages",
                           code="invalid_value") from e


# ---- logprobs in replies -----------------------------------------------------------------------------

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token filtered out of the distribution reads so (as in vLLM)


def _floor(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[Logprob | None],
                        token_text: Callable[[int], str], offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs object for tokens and their logprobs (None: the first prompt token):
    each token's text, logprob, top alternatives ({text: logprob}, the token itself included, as
    vLLM gives them) and its offset in the text from `offset` on."""
    texts = [token_text(t) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else []
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else _floor(e.logprob) for e in entries],
        "top_logprobs": [None if e is None else {**{token_text(i): _floor(v) for i, v in e.top},
                                                 token_text(t): _floor(e.logprob)}
                         for t, e in zip(token_ids, entries)],
        "text_offset": offsets,
    }


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Logprob],
                  token_text: Callable[[int], str]) -> dict[str, Any]:
    """Chat's logprobs object: per token its text, logprob, UTF-8 bytes and `top_logprobs`."""

    def item(token: int, value: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": _floor(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                        for t, e in zip(token_ids, entries)]}


def finish_reason(reason: str | None) -> str | None:
    """The OpenAI finish_reason of a scheduler finish reason ("stop", "length"; others unchanged)."""
    return {"stop": "stop", "length": "length"}.get(reason, reason) if reason is not None else None


def usage(prompt_tokens: int, completion_tokens: int, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's usage; with a speculative request's metrics also `spec_decode` (an extension field):
    draft tokens proposed and accepted, and its mean acceptance length (bonus token included)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if metrics is not None:
        out["spec_decode"] = {"num_draft_tokens": metrics["num_draft_tokens"],
                              "num_accepted_tokens": metrics["num_accepted_tokens"],
                              "mean_accept_length": metrics["mean_accept_length"]}
    return out


def merge_spec_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The speculation figures of n choices as one request's: draft tokens proposed and accepted
    summed, the mean acceptance length over all their verify passes."""
    steps = [a for m in metrics for a in m["accept_lengths"]]
    return {"num_draft_tokens": sum(m["num_draft_tokens"] for m in metrics),
            "num_accepted_tokens": sum(m["num_accepted_tokens"] for m in metrics),
            "mean_accept_length": sum(steps) / len(steps) if steps else 1.0}


# ---- the server ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Job:
    """A validated generation request."""

    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    warnings: tuple[str, ...] = ()  # what was changed or skipped in the request, told to the client
    echo: bool = False  # completions: the reply starts with the prompt (and its logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the one token generated is left out of the reply
    prompt_text: str = ""  # echo: the prompt as the reply repeats it

    n: int = 1  # choices

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    def choice_samplings(self) -> list[SamplingParams]:
        """Each choice's SamplingParams: choice i draws with seed + i (vLLM's rule), so a seeded
        request of n choices reproduces."""
        return [dataclasses.replace(self.sampling, seed=(self.sampling.seed + i) % SEED_LIMIT) for i in range(self.n)]

    def headers(self) -> dict[str, str]:
        return {WARNINGS_HEADER: "; ".join(self.warnings)} if self.warnings else {}


class _Server:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_seq_len: int,
                 eos_token_ids: Sequence[int], chat_template: ChatTemplate, default_max_tokens: int,
                 allow_synthetic_acceptance: bool = False):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_seq_len, self.eos_token_ids = int(max_seq_len), tuple(int(t) for t in eos_token_ids)
        self.chat_template, self.default_max_tokens = chat_template, int(default_max_tokens)
        self.created = int(time.time())
        self.metrics_registry = ServerMetrics(engine.stats)
        self.max_logprobs = int(getattr(engine.scheduler, "max_logprobs", 0))
        self.allow_synthetic_acceptance = bool(allow_synthetic_acceptance)
        # A token's text in logprobs replies (decoded alone, special tokens shown, as vLLM does).
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token: tokenizer.decode([token], skip_special_tokens=False))

    # -- middleware: OpenAI error bodies everywhere, request counts for /metrics

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        resource = getattr(request.match_info.route, "resource", None)
        route = resource.canonical if resource is not None else "other"  # unmatched paths share one label
        try:
            response = await handler(request)
        except ApiError as e:
            response = e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = error_response(e.reason, status=e.status, code=e.reason.lower().replace(" ", "_"),
                                      type="invalid_request_error" if e.status < 500 else "server_error")
        except EngineDeadError as e:
            response = error_response(str(e), status=503, type="server_error", code="engine_dead")
        except EngineError as e:
            response = error_response(str(e), status=500, type="server_error", code="engine_error")
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the client is gone: nobody to answer
        except Exception as e:
            logger.exception("unhandled error in %s %s", request.method, request.path)
            response = error_response(f"internal server error: {type(e).__name__}: {e}", status=500,
                                      type="server_error", code="internal_error")
        self.metrics_registry.count_http(route, response.status)
        return response

    # -- simple endpoints

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.is_healthy:
            return web.json_response({"status": "ok"})
        reason = self.engine.error or "the engine is not running"
        return error_response(str(reason), status=503, type="server_error", code="engine_unavailable")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics_registry.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "eagle3-jax",
                "max_model_len": self.max_seq_len}

    # -- generation endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError("'prompt' is required", param="prompt", code="missing_required_parameter")
        prompt_ids = parse_prompt(body["prompt"], self.tokenizer)
        job = self._job("completion", body, prompt_ids, "prompt", self.default_max_tokens, ("max_tokens",))
        if job.echo:
            prompt = single_prompt(body["prompt"])
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
            job = dataclasses.replace(job, prompt_text=text)
        return await self._run(request, job, f"cmpl-{uuid.uuid4().hex}")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = parse_messages(body.get("messages"))
        prompt_ids = self.tokenizer.encode(self.chat_template.render(messages), add_bos=True)
        # Chat defaults to the whole room left in max_seq_len, as vLLM does.
        job = self._job("chat", body, prompt_ids, "messages", max(self.max_seq_len - len(prompt_ids), 1),
                        ("max_completion_tokens", "max_tokens"))
        return await self._run(request, job, f"chatcmpl-{uuid.uuid4().hex}")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from e
        if not isinstance(body, dict):
            raise ApiError(f"the request body must be a JSON object; got {type(body).__name__}", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           status=404, param="model", code="model_not_found")
        check_unsupported(body, "chat" if request.path.endswith("/chat/completions") else "completion")
        return body

    def _job(self, kind: str, body: Mapping[str, Any], prompt_ids: list[int], prompt_param: str,
             default_max_tokens: int, max_tokens_keys: Sequence[str]) -> _Job:
        logprobs, echo = parse_logprobs(body, kind, self.max_logprobs)
        sampling = parse_sampling(body, default_max_tokens=default_max_tokens, eos_token_ids=self.eos_token_ids,
                                  max_tokens_keys=max_tokens_keys, logprobs=logprobs, echo=echo,
                                  allow_synthetic_acceptance=self.allow_synthetic_acceptance)
        echo_only = echo and any(body.get(key) == 0 for key in max_tokens_keys)
        stream, include_usage = parse_stream(body)
        if len(prompt_ids) >= self.max_seq_len:
            raise ApiError(f"the prompt has {len(prompt_ids)} tokens, but this server's max_seq_len is "
                           f"{self.max_seq_len} and at least one token must be generated; shorten the prompt",
                           param=prompt_param, code="context_length_exceeded")
        warnings = []
        cap = max_tokens_cap(len(prompt_ids), sampling.max_tokens, self.max_seq_len)
        if cap is not None:
            warnings.append(f"max_tokens={sampling.max_tokens} was cut to {cap}: the prompt's {len(prompt_ids)} "
                            f"tokens plus max_tokens must fit max_seq_len={self.max_seq_len}")
        ignored = ignored_fields(body, kind)
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", set(ignored))
            warnings.append(f"these fields are not supported and were ignored: {', '.join(ignored)}")
        n = get_int(body, "n", 1)
        return _Job(kind, prompt_ids, sampling, stream, include_usage, tuple(warnings), echo, echo_only, n=n)

    def _spec_metrics(self, last: Any) -> Mapping[str, Any] | None:
        """A finished request's metrics when this server speculates (for usage's spec_decode)."""
        if getattr(self.engine.scheduler, "draft", None) is None or last.output is None:
            return None
        return last.output.metrics

    def _text_stream(self, job: _Job) -> TextStream:
        """The reply's text: decoded as the request layer decodes it, so both cut at the same stop."""
        sp = job.sampling
        return TextStream(self.tokenizer, job.prompt_ids, sp.stop, sp.include_stop_str_in_output, sp.min_tokens)

    async def _run(self, request: web.Request, job: _Job, request_id: str) -> web.StreamResponse:
        """Run the job's n choices (choice i seeded seed + i; the later ones admitted once the first
        has prefilled, so they take its prompt's pages from the prefix cache) and answer."""
        async with contextlib.AsyncExitStack() as stack:
            ids = [request_id if job.n == 1 else f"{request_id}-{i}" for i in range(job.n)]
            streams = [await stack.enter_async_context(contextlib.aclosing(self.engine.generate(
                job.prompt_ids, sampling, rid, wait_for=None if i == 0 else ids[0])))
                for i, (rid, sampling) in enumerate(zip(ids, job.choice_samplings()))]
            # Every choice's request is queued (in order) before any first delta is awaited.
            starts = [asyncio.ensure_future(anext(deltas)) for deltas in streams]
            try:
                firsts = [await start for start in starts]
            except CapacityError as e:
                raise ApiError(str(e), param="max_tokens", code="request_too_large") from e
            except ValueError as e:  # add_request's validation: bad token ids, no room in max_seq_len
                raise ApiError(str(e), param="prompt" if job.kind == "completion" else "messages",
                               code="invalid_value") from e
            finally:
                for start in starts:
                    start.cancel()
                await asyncio.gather(*starts, return_exceptions=True)
            if job.stream:
                return await self._stream(request, job, request_id, firsts, streams)
            return await self._complete(job, request_id, firsts, streams)

    def _logprobs(self, job: _Job, token_ids: Sequence[int], entries: Sequence[Logprob | None] | None,
                  offset: int = 0) -> dict[str, Any] | None:
        """The reply's logprobs object for these tokens (None when the request did not ask)."""
        if not job.logprobs or entries is None:
            return None
        if job.kind == "chat":
            return chat_logprobs(token_ids, entries, self.token_text)
        return completion_logprobs(token_ids, entries, self.token_text, offset)

    async def _whole_choice(self, job: _Job, index: int, first: Any, deltas: Any) -> tuple[dict[str, Any], int, Any]:
        """A choice of a whole reply: (its object, tokens generated, its last delta)."""
        tokens, delta = list(first.token_ids), first
        while not delta.finished:
            delta = await anext(deltas)
            tokens += delta.token_ids
        reason = finish_reason(delta.finish_reason)
        output = delta.output
        if job.echo_only:
            tokens, text, reason = [], "", "length"
        elif output is not None and output.text is not None \
                and getattr(self.engine.scheduler, "tokenizer", None) is self.tokenizer:
            text = output.text  # the request layer decoded it already, as streaming would
        else:  # the same decoding as streaming, so a streamed answer concatenates to this text
            text_stream = self._text_stream(job)
            text_stream.push(tokens, final=True)
            text = text_stream.take(final=True)
        stop_reason = output.stop_reason if output is not None and not job.echo_only else None
        entries = None if output is None or output.logprobs is None else output.logprobs[: len(tokens)]
        generated = len(tokens)
        if job.echo:
            text = job.prompt_text + text
            if entries is not None:
                tokens, entries = job.prompt_ids + tokens, list(first.prompt_logprobs) + entries
        logprobs = self._logprobs(job, tokens, entries)
        if job.kind == "completion":
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                      "stop_reason": stop_reason}
        else:
            choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": reason, "stop_reason": stop_reason}
        return choice, generated, delta

    def _usage(self, job: _Job, generated: int, lasts: Sequence[Any]) -> dict[str, Any]:
        """Usage as vLLM counts n choices: the prompt once, every choice's tokens."""
        metrics = [self._spec_metrics(d) for d in lasts]
        if None in metrics:
            return usage(len(job.prompt_ids), generated)
        return usage(len(job.prompt_ids), generated, metrics[0] if len(metrics) == 1 else merge_spec_metrics(metrics))

    async def _complete(self, job: _Job, request_id: str, firsts: Sequence[Any], streams: Sequence[Any]) -> web.Response:
        # Each choice's deltas queue up on its own: reading them one choice after another loses nothing.
        results = [await self._whole_choice(job, i, first, deltas) for i, (first, deltas) in enumerate(zip(firsts, streams))]
        body = {
            "id": request_id, "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": int(time.time()), "model": self.model_name, "choices": [c for c, _, _ in results],
            "usage": self._usage(job, sum(n for _, n, _ in results), [d for _, _, d in results]),
        }
        if job.warnings:
            body["warnings"] = list(job.warnings)
        return web.json_response(body, headers=job.headers())

    async def _stream(self, request: web.Request, job: _Job, request_id: str, firsts: Sequence[Any],
                      streams: Sequence[Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache", **job.headers()})
        created = int(time.time())
        chat = job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, reason: str | None, role: bool = False, stop_reason=None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = stop_reason
            out = {"id": request_id, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}
            if job.include_usage:
                out["usage"] = None
            return out

        merged: asyncio.Queue = asyncio.Queue()  # (choice index, delta or exception), choices interleaved

        async def forward(index: int, first: Any, deltas: Any) -> None:
            delta = first
            try:
                await merged.put((index, delta))
                while not delta.finished:
                    delta = await anext(deltas)
                    await merged.put((index, delta))
            except Exception as e:  # an engine error: the reply reports it
                await merged.put((index, e))

        text_streams = [self._text_stream(job) for _ in firsts]
        offsets = [0] * job.n  # the tokens' texts sent so far, per choice (completions' text_offset)
        lasts: list[Any] = [None] * job.n
        num_tokens = 0
        forwards = [asyncio.ensure_future(forward(i, f, d)) for i, (f, d) in enumerate(zip(firsts, streams))]
        try:
            await response.prepare(request)
            for i, first in enumerate(firsts):
                if chat:
                    await _send(response, chunk(i, None, None, role=True))
                if job.echo:
                    await _send(response, chunk(i, job.prompt_text, None,
                                                logprobs=self._logprobs(job, job.prompt_ids, first.prompt_logprobs)))
                    offsets[i] = sum(len(self.token_text(t)) for t in job.prompt_ids)
            while any(last is None for last in lasts):
                i, delta = await merged.get()
                if isinstance(delta, Exception):
                    raise delta
                ids = [] if job.echo_only else delta.token_ids
                num_tokens += len(ids)
                text_streams[i].push(ids, final=delta.finished)
                text = text_streams[i].take(final=delta.finished)
                logprobs = self._logprobs(job, ids, delta.logprobs, offsets[i]) if ids else None
                if delta.finished:
                    lasts[i] = delta
                    stop_reason = delta.output.stop_reason if delta.output is not None and not job.echo_only else None
                    reason = "length" if job.echo_only else finish_reason(delta.finish_reason)
                    await _send(response, chunk(i, text, reason, stop_reason=stop_reason, logprobs=logprobs))
                    continue
                if text or logprobs:
                    await _send(response, chunk(i, text, None, logprobs=logprobs))
                offsets[i] += sum(len(self.token_text(t)) for t in ids) if logprobs else 0
            if job.include_usage:
                await _send(response, {"id": request_id, "object": obj, "created": created, "model": self.model_name,
                                       "choices": [], "usage": self._usage(job, num_tokens, lasts)})
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # the client left; leaving the choices' deltas (aclosing in _run) aborts them
        except EngineError as e:  # headers are sent: report in-band, as OpenAI does mid-stream
            logger.warning("request %s failed mid-stream: %s", request_id, e)
            with contextlib.suppress(ConnectionError):
                await _send(response, {"error": {"message": str(e), "type": "server_error", "param": None,
                                                 "code": "engine_error"}})
                await response.write_eof()
        finally:
            for task in forwards:
                task.cancel()
            await asyncio.gather(*forwards, return_exceptions=True)
        return response


async def _send(response: web.StreamResponse, payload: Mapping[str, Any]) -> None:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    await response.write(f"data: {data}\n\n".encode("utf-8"))


def make_app(async_engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, *, max_seq_len: int | None = None,
             eos_token_ids: Sequence[int] | None = None, tokenizer_dir: str | os.PathLike | None = None,
             default_max_tokens: int = 16, client_max_size: int = 8 * 2**20,
             chat_template: ChatTemplate | None = None, allow_synthetic_acceptance: bool = False) -> web.Application:
    """The aiohttp application serving `async_engine` under the OpenAI API as `model_name`.

    `max_seq_len` defaults to the scheduler's; `eos_token_ids` (where requests stop unless
    `ignore_eos`) to the tokenizer's. `chat_template` renders chat requests (default: the one in
    `tokenizer_dir`; without one, chat requests are refused, see `ChatTemplate`). `default_max_tokens` is the
    completions default (OpenAI's is 16). A scheduler without a tokenizer gets `tokenizer`, which it
    needs to match stop strings. The caller starts and closes the engine; run the app with
    `handler_cancellation=True` so that a client leaving before its first token aborts at once.
    `allow_synthetic_acceptance` lets requests force speculative acceptance (benchmarking only).
    """
    if max_seq_len is None:
        max_seq_len = async_engine.scheduler.max_seq_len
    if getattr(async_engine.scheduler, "tokenizer", None) is None:  # it matches stop strings on the text
        async_engine.scheduler.tokenizer = tokenizer
    server = _Server(async_engine, tokenizer, model_name, max_seq_len,
                     tokenizer.eos_ids if eos_token_ids is None else eos_token_ids,
                     chat_template or ChatTemplate.from_dir(tokenizer_dir), default_max_tokens,
                     allow_synthetic_acceptance)
    app = web.Application(middlewares=[server.middleware], client_max_size=client_max_size)
    app[_SERVER_KEY] = server
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics)
    return app
