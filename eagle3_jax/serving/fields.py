"""Request fields read and checked one by one, pure: each bad field is a 400 (`ApiError`) naming it
and saying what it must be. What the server does not implement is refused unless it is set to its
neutral value, never ignored; fields it does not know are reported (see `ignored_fields`).

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
completions' tools, `functions`, `suffix`, vLLM's `structural_tag`) get a 400 when set to
anything but their neutral value, rather than being ignored. Constrained output
(`response_format`, `structured_outputs`, `guided_*`) is constraints.py's. Benchmarking extension: `synthetic_acceptance` (per-position
rates, e.g. [0.9, 0.8, 0.7]) forces a speculative step to accept that profile, so that a step's
cost can be measured at a realistic acceptance without a trained draft; the output is then not
the model's, and the server refuses it (400) unless started to allow it
(`make_app(allow_synthetic_acceptance=True)`, `scripts/serve.py --allow_synthetic_acceptance`).

What the server changes or skips in a request is announced, never silent: `max_tokens` beyond the
room left in `max_seq_len` is cut to that room (finish_reason "length"), and fields it does not
know are ignored with vLLM's log line "The following fields were present in the request but
ignored: {...}". Both are also told to the client (protocol.py's `warnings`).
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Mapping, Sequence

from ..sampling.sampler import SamplingParams, check_acceptance_profile
from .choices import SEED_LIMIT
from .constraints import CONSTRAINT_FIELDS
from .errors import ApiError

MAX_CHOICES = 128  # most choices (n) one request may ask for


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
    # vLLM's structural tags (constrained spans inside free text): refused, never answered unconstrained
    "structural_tag": (None,),
}
# chat reads tools and tool_choice (messages.py)
_NEUTRAL_BY_KIND: dict[str, dict[str, tuple[Any, ...]]] = {
    "completion": _NEUTRAL,
    "chat": {**{k: v for k, v in _NEUTRAL.items() if k not in ("tools", "tool_choice")}, "echo": (None, False)}}
_HINTS: dict[str, str] = {"structural_tag": " (structural tags are not implemented; constrain the whole output with "
                                            "response_format or structured_outputs, or force calls with tool_choice)"}
# Fields a request may carry without a warning: the ones read here, the refused ones above, and
# `user` (an end-user id OpenAI's API takes and this server has no use for).
_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream",
                            "stream_options", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
                            "min_tokens", "logprobs", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
                            "user", "synthetic_acceptance", *CONSTRAINT_FIELDS, *_NEUTRAL})
KNOWN_FIELDS = {"completion": _COMMON_FIELDS | {"prompt", "echo"},
                "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "echo",
                                          "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}}


def ignored_fields(body: Mapping[str, Any], kind: str) -> list[str]:
    """The request's fields this server does not read (`kind` is "completion" or "chat"), sorted."""
    return sorted(k for k in body if k not in KNOWN_FIELDS[kind])


def check_unsupported(body: Mapping[str, Any], kind: str = "completion") -> None:
    """400 for a parameter this engine does not implement (for `kind`, "completion" or "chat"),
    unless it is set to its neutral value."""
    for key, neutral in _NEUTRAL_BY_KIND[kind].items():
        v = body.get(key)
        if not any(v == n and type(v) is type(n) or v is n for n in neutral):
            raise ApiError(f"'{key}' is not supported by this server{_HINTS.get(key, '')}; got {v!r}",
                           param=key, code="unsupported_parameter")


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
