"""The scheduler's counters: what `Scheduler.stats()` (and the server's /metrics) report."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

# The host tier's counters (cache/host_tier.py): pages and bytes copied each way, host seconds restoring.
HOST_TIER_KEYS = ("host_kv_pages_saved_total", "host_kv_bytes_saved_total", "host_kv_pages_restored_total",
                  "host_kv_bytes_restored_total", "host_kv_restore_seconds_total")


class SchedulerCounters:
    """Totals since the scheduler started, updated a batch at a time."""

    def __init__(self, max_accept: int):
        self.totals = collections.Counter()
        self.per_position = [0] * max_accept  # decode-step rows that accepted >= d draft tokens
        self.per_position_drafted = [0] * max_accept  # ... whose step drafted >= d tokens

    def decode_step(self, counts: np.ndarray, depth: int) -> None:
        """A decode step's rows committed `counts` tokens each, after proposing `depth` draft tokens."""
        # One histogram of the counts (one numpy call, whatever the batch), every total from its
        # few bins in plain Python.
        rows, max_accept = len(counts), len(self.per_position)
        per_count = np.bincount(counts, minlength=max_accept + 2)[: max_accept + 2].tolist()  # rows committing c
        committed = sum(c * n for c, n in enumerate(per_count))
        totals = self.totals
        totals["num_decode_steps_total"] += rows
        totals["accepted_tokens_total"] += committed
        if depth:  # speculation's counts, named as vLLM names them (spec_decode_num_*); a step that drafted
            # nothing accepted nothing: no per-position counts to add
            totals["num_drafts_total"] += rows
            totals["num_draft_tokens_total"] += rows * depth
            totals["num_accepted_draft_tokens_total"] += committed - rows + per_count[0]
            # rows that accepted at least d draft tokens (committed d + 1 or more), d = 1..max_accept
            at_least = 0
            for d in range(max_accept, 0, -1):
                at_least += per_count[d + 1]
                self.per_position[d - 1] += at_least
            for d in range(depth):
                self.per_position_drafted[d] += rows

    def stats(self) -> dict:
        c = self.totals
        steps = c["num_decode_steps_total"]
        return {
            "num_preemptions": c["num_preemptions"],
            "num_requests_finished": c["num_requests_finished"],
            "num_requests_aborted": c["num_requests_aborted"],
            "prompt_tokens_total": c["prompt_tokens_total"],
            "generation_tokens_total": c["generation_tokens_total"],
            "num_decode_steps_total": steps,
            "accepted_tokens_total": c["accepted_tokens_total"],
            "mean_accept_length": c["accepted_tokens_total"] / steps if steps else 1.0,
            "num_drafts_total": c["num_drafts_total"],
            "num_draft_tokens_total": c["num_draft_tokens_total"],
            "num_accepted_draft_tokens_total": c["num_accepted_draft_tokens_total"],
            "per_position_accepted_total": [int(x) for x in self.per_position],
            "per_position_drafted_total": [int(x) for x in self.per_position_drafted],
            "prefix_cache_queries_total": c["prefix_cache_queries_total"],  # prompt tokens looked up
            "prefix_cache_hits_total": c["prefix_cache_hits_total"],  # prompt tokens found
            "prefix_cache_requests_total": c["prefix_cache_requests_total"],
            "prefix_cache_hit_requests_total": c["prefix_cache_hit_requests_total"],
            # the host tier's part of the hits, and the pages it copied (cache/host_tier.py)
            "prefix_cache_host_hits_total": c["prefix_cache_host_hits_total"],
            **{key: c[key] for key in HOST_TIER_KEYS},
            "num_iterations_total": c["num_iterations_total"],
            "host_seconds_total": c["host_seconds_total"],  # step() time not spent waiting for the device
        }


# Cumulative counters of Scheduler.stats(), which stats_since counts from an earlier snapshot.
COUNTER_KEYS = ("num_preemptions", "num_requests_finished", "num_requests_aborted", "prompt_tokens_total",
                "generation_tokens_total", "num_decode_steps_total", "accepted_tokens_total", "num_iterations_total",
                "host_seconds_total", "launch_seconds_total", "num_drafts_total", "num_draft_tokens_total",
                "num_accepted_draft_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_requests_total",
                "prefix_cache_hit_requests_total", "prefix_cache_host_hits_total", *HOST_TIER_KEYS)
ADAPTIVE_COUNTER_KEYS = ("steps_without_draft", "requests_with_draft", "requests_without_draft")


def stats_since(stats: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """`stats` with the counters of `baseline` (an earlier snapshot) subtracted, and tau and the
    per-position acceptance counts recomputed over the steps in between."""
    out = dict(stats)
    for key in COUNTER_KEYS:
        if key in out and key in baseline:
            out[key] = out[key] - baseline[key]
    for key in ("per_position_accepted_total", "per_position_drafted_total"):
        now, base = stats.get(key), baseline.get(key)
        if now is not None and base is not None:
            out[key] = [a - b for a, b in zip(now, base)]
    if "adaptive" in stats and "adaptive" in baseline:
        now, base = stats["adaptive"], baseline["adaptive"]
        old = base["steps_by_shape"]
        steps = {k: v - old.get(k, 0) for k, v in now["steps_by_shape"].items()}
        counts = {k: now[k] - base.get(k, 0) for k in ADAPTIVE_COUNTER_KEYS if k in now}
        out["adaptive"] = dict(now, steps_by_shape=steps, **counts)
    if "mean_accept_length" in out and "num_decode_steps_total" in out:
        steps = out["num_decode_steps_total"]
        out["mean_accept_length"] = out.get("accepted_tokens_total", 0) / steps if steps else 1.0
    return out
