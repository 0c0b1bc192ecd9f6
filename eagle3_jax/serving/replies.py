"""The parts of a reply body that do not depend on how it is delivered: log-probabilities as
completions and chat give them, finish reasons, and usage (with speculation's figures)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence

from ..sampling.logprobs import Logprob

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


def cached_tokens(metrics: Mapping[str, Any] | None) -> int:
    """Prompt tokens a finished request took from the prefix cache (its metrics; 0 without them)."""
    return int(metrics.get("num_cached_tokens", 0)) if metrics else 0
