"""The server's Prometheus metrics, through `prometheus_client`.

Each server has its own `CollectorRegistry` (never the process-wide default), so several servers
in one process keep separate counts. Engine figures are read from `AsyncEngine.stats()` at scrape
time by a collector (the engine thread owns them); HTTP answers are counted by a labelled Counter.
Metric names carry the `eagle3_` prefix:

- counters: `eagle3_prompt_tokens_total`, `eagle3_generation_tokens_total`,
  `eagle3_requests_finished_total`, `eagle3_requests_aborted_total`, `eagle3_preemptions_total`,
  `eagle3_decode_steps_total`, `eagle3_accepted_tokens_total`, speculation's counts as vLLM names
  them (`eagle3_spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
  `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`), the prefix
  cache's as vLLM names them (`eagle3_prefix_cache_queries_total`, `eagle3_prefix_cache_hits_total`:
  prompt tokens looked up and found, and `eagle3_prefix_cache_requests_total`,
  `eagle3_prefix_cache_hit_requests_total`; of them, the host tier's: `eagle3_prefix_cache_host_hits_total`),
  the host tier's copies (`eagle3_host_kv_{pages,bytes}_{saved,restored}_total`,
  `eagle3_host_kv_restore_seconds_total`), where the serving path's time goes
  (`eagle3_scheduler_iterations_total`, `eagle3_scheduler_host_seconds_total`,
  `eagle3_scheduler_launch_seconds_total`, `eagle3_engine_step_seconds_total`,
  `eagle3_engine_deliver_seconds_total`, `eagle3_thread_cpu_seconds_total{thread}`: thread_cpu.py),
  `eagle3_http_requests_total{route, status}`;
- gauges: `eagle3_num_requests_waiting`, `eagle3_num_requests_running`, `eagle3_request_queue_depth`,
  `eagle3_kv_pages_free`, `eagle3_kv_pages_total`, `eagle3_kv_page_size`, `eagle3_kv_cache_usage_ratio`,
  `eagle3_mean_accept_length`, `eagle3_spec_acceptance_rate{position="k"}` (the fraction of
  verify passes accepting at least k draft tokens), `eagle3_kv_pages_cached`,
  `eagle3_host_kv_pages_total`, `eagle3_host_kv_pages_cached` (with a host tier),
  `eagle3_prefix_cache_hit_rate` (hit tokens / queried tokens), `eagle3_engine_healthy`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, exposition, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .thread_cpu import thread_cpu_seconds

# generate_latest writes the classic text format 0.0.4 (every name here is a classic name); newer
# prometheus_client releases call that content type CONTENT_TYPE_PLAIN_0_0_4, older ones LATEST.
CONTENT_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)

# (family name, help, key of AsyncEngine.stats()); a counter's samples get the `_total` suffix.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("eagle3_prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("eagle3_generation_tokens", "Generated tokens.", "generation_tokens_total"),
    ("eagle3_requests_finished", "Requests finished (stop or length).", "num_requests_finished"),
    ("eagle3_requests_aborted", "Requests aborted (client gone or cancelled).", "num_requests_aborted"),
    ("eagle3_preemptions", "Requests preempted to free KV pages.", "num_preemptions"),
    ("eagle3_decode_steps", "Verify passes, summed over requests.", "num_decode_steps_total"),
    ("eagle3_accepted_tokens", "Tokens emitted by verify passes (tau summed over passes).", "accepted_tokens_total"),
    ("eagle3_scheduler_iterations", "Scheduler iterations (each launches a prefill and / or a decode step).",
     "num_iterations_total"),
    ("eagle3_scheduler_host_seconds", "Host time of scheduler iterations not spent waiting for the device.",
     "host_seconds_total"),
    ("eagle3_scheduler_launch_seconds", "Host time inside the step programs' launches (part of the host time).",
     "launch_seconds_total"),
    ("eagle3_engine_step_seconds", "Wall time of the engine thread in scheduler iterations (host work and waits "
     "for the device).", "engine_step_seconds_total"),
    ("eagle3_engine_deliver_seconds", "Wall time of the engine thread handing the iterations' outputs to the "
     "requests' event loops.", "engine_deliver_seconds_total"),
    ("eagle3_spec_decode_num_drafts", "Verify passes that checked draft tokens, summed over requests.",
     "num_drafts_total"),
    ("eagle3_spec_decode_num_draft_tokens", "Draft tokens proposed to verify passes.", "num_draft_tokens_total"),
    ("eagle3_spec_decode_num_accepted_tokens", "Draft tokens accepted by verify passes (bonus tokens not counted).",
     "num_accepted_draft_tokens_total"),
    ("eagle3_prefix_cache_queries", "Prompt tokens of admitted requests looked up in the prefix cache.",
     "prefix_cache_queries_total"),
    ("eagle3_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
     "prefix_cache_hits_total"),
    ("eagle3_prefix_cache_requests", "Admitted requests looked up in the prefix cache.", "prefix_cache_requests_total"),
    ("eagle3_prefix_cache_hit_requests", "Admitted requests that found part of their prompt in the prefix cache.",
     "prefix_cache_hit_requests_total"),
    ("eagle3_prefix_cache_host_hits", "Prompt tokens found in the prefix cache's host tier (copied back, part of the "
     "hits).", "prefix_cache_host_hits_total"),
    ("eagle3_host_kv_pages_saved", "KV pages copied to the host tier as the device pool evicted them.",
     "host_kv_pages_saved_total"),
    ("eagle3_host_kv_bytes_saved", "Bytes of KV pages copied to the host tier.", "host_kv_bytes_saved_total"),
    ("eagle3_host_kv_pages_restored", "KV pages copied back from the host tier.", "host_kv_pages_restored_total"),
    ("eagle3_host_kv_bytes_restored", "Bytes of KV pages copied back from the host tier.", "host_kv_bytes_restored_total"),
    ("eagle3_host_kv_restore_seconds", "Host time restoring pages from the host tier (reading them, launching the "
     "copy).", "host_kv_restore_seconds_total"),
)
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("eagle3_num_requests_waiting", "Requests queued in the scheduler, not yet running.", "num_waiting"),
    ("eagle3_num_requests_running", "Requests running (holding KV pages).", "num_running"),
    ("eagle3_request_queue_depth", "Commands (new requests, aborts) not yet taken by the engine thread.",
     "request_queue_depth"),
    ("eagle3_kv_pages_free", "Free KV cache pages.", "num_free_pages"),
    ("eagle3_kv_pages_total", "Usable KV cache pages.", "num_pages"),
    ("eagle3_kv_page_size", "Tokens per KV cache page.", "page_size"),
    ("eagle3_kv_pages_cached", "KV pages the prefix cache holds (in use or evictable).", "num_cached_pages"),
    ("eagle3_host_kv_pages_total", "KV pages the prefix cache's host tier can hold.", "num_host_pages"),
    ("eagle3_host_kv_pages_cached", "KV pages the prefix cache's host tier holds.", "num_host_cached_pages"),
    ("eagle3_mean_accept_length", "Mean acceptance length tau (tokens per verify pass, bonus included).",
     "mean_accept_length"),
)


def engine_metrics(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of one `AsyncEngine.stats()` snapshot; stats without a key are left out."""
    for name, help_, key in COUNTERS:
        if stats.get(key) is not None:
            yield CounterMetricFamily(name, help_, value=stats[key])
    for name, help_, key in GAUGES:
        if stats.get(key) is not None:
            yield GaugeMetricFamily(name, help_, value=stats[key])
    if stats.get("num_pages"):
        used = 1 - stats.get("num_free_pages", 0) / stats["num_pages"]
        yield GaugeMetricFamily("eagle3_kv_cache_usage_ratio", "Fraction of KV pages in use.", value=used)
    if stats.get("prefix_cache_queries_total"):
        yield GaugeMetricFamily("eagle3_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.",
                                value=stats["prefix_cache_hits_total"] / stats["prefix_cache_queries_total"])
    per_pos = stats.get("per_position_accepted_total")
    if per_pos is not None:
        steps = stats.get("num_decode_steps_total") or 0
        drafted = stats.get("per_position_drafted_total") or [steps] * len(per_pos)
        rate = GaugeMetricFamily("eagle3_spec_acceptance_rate", "Fraction of verify passes that drafted `position` "
                                 "tokens accepting at least `position` draft tokens.", labels=["position"])
        accepted = CounterMetricFamily("eagle3_spec_decode_num_accepted_tokens_per_pos", "Verify passes that "
                                       "accepted the draft token at `position`.", labels=["position"])
        for k, (n, d) in enumerate(zip(per_pos, drafted), 1):
            rate.add_metric([str(k)], n / d if d else 0.0)
            accepted.add_metric([str(k)], n)
        yield rate
        yield accepted
    adaptive = stats.get("adaptive")
    if adaptive is not None:  # adaptive speculation: what the steps ran
        shapes = CounterMetricFamily("eagle3_spec_steps", "Decode steps by the speculation shape adaptive "
                                     "speculation chose (none, chain:k:1:k+1, ...).", labels=["shape"])
        for shape, n in sorted(adaptive["steps_by_shape"].items()):
            shapes.add_metric([shape], n)
        yield shapes
        if "steps_without_draft" in adaptive:
            yield CounterMetricFamily("eagle3_spec_steps_without_draft", "Decode steps in which no request had the "
                                      "draft (the plain program ran).", value=adaptive["steps_without_draft"])
            admitted = CounterMetricFamily("eagle3_spec_requests", "Requests admitted with the draft following them "
                                           "(draft=with) or decoding without it (draft=without).", labels=["draft"])
            admitted.add_metric(["with"], adaptive["requests_with_draft"])
            admitted.add_metric(["without"], adaptive["requests_without_draft"])
            yield admitted
    yield GaugeMetricFamily("eagle3_engine_healthy", "1 while the engine thread runs and steps.",
                            value=int(bool(stats.get("engine_healthy"))))


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        return engine_metrics(self._stats())


class _ThreadCollector(Collector):
    def __init__(self, roles: Callable[[], Mapping[int, str]]):
        self._roles = roles

    def collect(self) -> Iterator[Metric]:
        seconds = thread_cpu_seconds(self._roles())
        if seconds:
            family = CounterMetricFamily("eagle3_thread_cpu_seconds", "CPU time of the server's threads by role: "
                                         "event_loop (HTTP, detokenizing, streaming), engine (the scheduler), xla "
                                         "(XLA's compute threads on the CPU backend), other.", labels=["thread"])
            for role, value in sorted(seconds.items()):
                family.add_metric([role], value)
            yield family


class ServerMetrics:
    """One server's registry: the engine's figures (read at scrape time), its threads' CPU time and HTTP
    answer counts. `thread_roles`: the native ids of the engine and event-loop threads, by role."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], thread_roles: Callable[[], Mapping[int, str]] = dict):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(stats))
        self.registry.register(_ThreadCollector(thread_roles))
        self.http_requests = Counter("eagle3_http_requests", "HTTP requests answered, by route and status.",
                                     ["route", "status"], registry=self.registry)

    def count_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of everything in the registry."""
        return generate_latest(self.registry)
