"""Serving metrics from per-request records, with `vllm bench serve`'s definitions.

Per request (times in seconds, reported in ms):

- TTFT: arrival of the first delta carrying tokens minus the submit time.
- E2E latency: finish time minus submit time.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with at least 2 output tokens.
- ITL: the gaps between successive deltas. A delta carrying k tokens (a speculative step that
  accepted k - 1 draft tokens, or a streamed chunk holding several) is k tokens arriving together,
  so it contributes one ITL sample, as vLLM's benchmark does per streamed chunk.

Per run: output tokens/s (all output tokens over the wall time from the first submit to the last
finish), the same per device, total (input + output) tokens/s, requests/s; mean, median and p99
of TTFT, TPOT, ITL (samples pooled over all requests) and E2E latency (p99 by linear
interpolation, as numpy's percentile); tau (mean tokens per verify step, bonus token included,
pooled over every step of every request) and per-position acceptance (the fraction of verify steps
that accepted at least d draft tokens, d = 1..max_accept) when the records carry accept lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from ..request import pooled_acceptance


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request.

    `delta_times` holds the arrival time of every delta (in-process: each Scheduler delta with
    tokens; HTTP: each streamed chunk with a choice), `delta_tokens` the tokens each carried when
    known (None over HTTP, where chunks carry text). `accept_lengths` are the request's verify
    steps' accept lengths (in-process only). `error` is set when the request failed.
    """

    prompt_len: int
    submit_time: float
    delta_times: list[float] = dataclasses.field(default_factory=list)
    delta_tokens: list[int] | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    accept_lengths: list[int] | None = None
    token_ids: list[int] | None = None
    error: str | None = None


def ttft_s(rec: RequestRecord) -> float:
    """Time to first token: first delta arrival minus submit time."""
    if not rec.delta_times:
        raise ValueError("a request without any delta has no TTFT")
    return rec.delta_times[0] - rec.submit_time


def e2e_s(rec: RequestRecord) -> float:
    """End-to-end latency: finish time minus submit time."""
    if rec.finish_time is None:
        raise ValueError("an unfinished request has no end-to-end latency")
    return rec.finish_time - rec.submit_time


def tpot_s(rec: RequestRecord) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (n - 1); None for n < 2."""
    n = rec.num_output_tokens
    return (e2e_s(rec) - ttft_s(rec)) / (n - 1) if n > 1 else None


def itl_s(rec: RequestRecord) -> list[float]:
    """Inter-token latencies: gaps between successive deltas (one sample per delta after the first)."""
    t = rec.delta_times
    return [b - a for a, b in zip(t, t[1:])]


def distribution(values: Iterable[float], scale: float = 1.0) -> dict:
    """mean, median and p99 (numpy linear interpolation) of `values` times `scale`; None when empty."""
    v = np.asarray(list(values), np.float64) * scale
    if v.size == 0:
        return {"mean": None, "median": None, "p99": None, "count": 0}
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p99": float(np.percentile(v, 99)),
            "count": int(v.size)}


def hit_rate_between(before: dict, after: dict, queries_key: str, hits_key: str) -> float | None:
    """The prefix cache's hit rate (prompt tokens found / looked up) between two counter snapshots
    (the scheduler's stats() or a server's /metrics); None when nothing was looked up."""
    queries = after.get(queries_key, 0) - before.get(queries_key, 0)
    return (after.get(hits_key, 0) - before.get(hits_key, 0)) / queries if queries > 0 else None


def summarize(records: Sequence[RequestRecord], duration_s: float, *, num_devices: int = 1,
              max_accept: int | None = None) -> dict:
    """All run metrics of one benchmark cell (see the module docstring); latencies in ms.

    Failed requests (`error` set) are counted but excluded from every figure. `max_accept` (the
    speculation depth) enables the acceptance figures; pass None for plain decoding or when the
    records carry no accept lengths.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s; got {duration_s}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1; got {num_devices}")
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    out = {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": float(duration_s),
        "total_input_tokens": int(in_tokens),
        "total_output_tokens": int(out_tokens),
        "output_throughput": out_tokens / duration_s,
        "output_throughput_per_device": out_tokens / duration_s / num_devices,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "request_throughput": len(ok) / duration_s,
        "num_devices": int(num_devices),
        "ttft_ms": distribution((ttft_s(r) for r in ok), 1e3),
        "tpot_ms": distribution(tpots, 1e3),
        "itl_ms": distribution((g for r in ok for g in itl_s(r)), 1e3),
        "e2e_latency_ms": distribution((e2e_s(r) for r in ok), 1e3),
    }
    if max_accept is not None:
        if any(r.accept_lengths is None for r in ok):
            raise ValueError("acceptance figures need accept_lengths on every completed record")
        out["acceptance"] = pooled_acceptance((r.accept_lengths for r in ok), max_accept)  # type: ignore[misc]
    return out


def speedup(throughput: float, baseline: float | None) -> float | None:
    """throughput / baseline (output tokens/s of the no-speculation cell); None without a baseline."""
    if baseline is None or baseline <= 0:
        return None
    return throughput / baseline


def mean_or_none(values: Iterable[float | None]) -> float | None:
    """Mean of the values that are not None; None when none is left."""
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def attach_speedups(cells: list[dict]) -> list[dict]:
    """Set each cell's `speedup`: its output tokens/s over the no-speculation (`none`) cell of the
    same concurrency and seed (None when the run has no such cell). Returns `cells`."""
    base = {(c["concurrency"], c["seed"]): c["metrics"]["output_throughput"] for c in cells if c["setting"] == "none"}
    for c in cells:
        c["speedup"] = speedup(c["metrics"]["output_throughput"], base.get((c["concurrency"], c["seed"])))
    return cells
