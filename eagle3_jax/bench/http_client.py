"""The serving benchmark over HTTP: drives a running OpenAI-compatible server like `vllm bench serve`.

Each request is a streaming `POST {base_url}/v1/completions` with the prompt as a list of token
ids, `max_tokens` = the workload's output length, `ignore_eos: true` (vLLM's extension: generate
exactly max_tokens) and `stream_options: {"include_usage": true}`. Every SSE chunk that carries a
choice is timestamped on arrival (vLLM's benchmark does the same: one ITL sample per chunk), and
the output token count comes from the final chunk's `usage.completion_tokens`.

Concurrency follows `--max-concurrency C --request-rate inf`: every request is ready at once and
an asyncio semaphore keeps at most C in flight. Each cell runs 2 x C warm-up requests (not
measured) before its measured ones. The server runs one speculation setting, so a run has one
setting. tau and per-position acceptance come from the server's Prometheus `/metrics` counters,
scraped before and after the measured requests, when it exposes them (scripts/serve.py does, and
vLLM's spec-decode counters are read too), and so does where the serving path's time went per
scheduler iteration (serving_path.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import types
from typing import Callable, Sequence

from ..runtime.extras import require
from .metrics import RequestRecord, attach_speedups, hit_rate_between
from .runner import RunConfig, check_lengths, make_cell, median_pass, pass_label
from .serving_path import serving_path_between
from .settings import SpecSetting
from .workloads import MEASURED, WARMUP, Workload

TIMEOUT_S = 6 * 3600  # a long benchmark cell must not be cut off by the client


def client() -> types.ModuleType:
    """aiohttp, the client of every run against a server (the bench extra's; imported when used, so
    in-process runs do without it)."""
    return require("aiohttp", "bench", "running against a server")


def completion_payload(prompt: Sequence[int], *, output_len: int, temperature: float, seed: int,
                       model: str | None, synthetic_acceptance: Sequence[float] | None = None, top_p: float = 1.0,
                       top_k: int = 0) -> dict:
    """Body of one streaming /v1/completions request with a token-id prompt and ignore-EOS (and a
    synthetic acceptance profile, which the server takes only when started to allow it)."""
    body = {"prompt": [int(t) for t in prompt], "max_tokens": int(output_len), "temperature": float(temperature),
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if synthetic_acceptance is not None:
        body["synthetic_acceptance"] = [float(x) for x in synthetic_acceptance]
    if temperature > 0:
        body["seed"] = int(seed)  # per-request seed (vLLM / OpenAI extension) for reproducible sampling
        if top_p != 1.0:
            body["top_p"] = float(top_p)
        if top_k:
            body["top_k"] = int(top_k)  # vLLM's extension
    if model is not None:
        body["model"] = model
    return body


def parse_sse_line(line: bytes) -> dict | str | None:
    """One SSE line: the JSON of a `data:` line, "[DONE]" for the end marker, None otherwise.

    Blank lines, comments (`: ...`) and other fields (`event:`, `id:`) give None.
    """
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[len(b"data:"):].strip()
    if data == b"[DONE]":
        return "[DONE]"
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"the server sent a data line that is not JSON: {data[:200]!r}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"the server sent a data line that is not a JSON object: {data[:200]!r}")
    return obj


def apply_event(rec: RequestRecord, event: dict, now: float) -> None:
    """Fold one streamed JSON chunk into `rec`: a chunk with a choice is a delta arriving at `now`;
    `usage` gives the output token count; an `error` object marks the request failed."""
    if event.get("error") is not None:
        err = event["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return
    choices = event.get("choices") or []
    if choices:
        rec.delta_times.append(now)
        choice = choices[0]
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.num_output_tokens = int(usage["completion_tokens"])


async def send_request(session, url: str, body: dict) -> RequestRecord:
    """Send one streaming completion and record what arrived when (never raises for request errors)."""
    aiohttp = client()

    rec = RequestRecord(prompt_len=len(body["prompt"]), submit_time=time.perf_counter())
    got_usage = done = False
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return rec
            async for line in resp.content:  # aiohttp's StreamReader yields one line at a time
                now = time.perf_counter()
                event = parse_sse_line(line)
                if event == "[DONE]":
                    done = True
                    break
                if isinstance(event, dict):
                    apply_event(rec, event, now)
                    got_usage = got_usage or isinstance(event.get("usage"), dict)
                    if rec.error is not None:
                        return rec
        rec.finish_time = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if not done:
        rec.error = "the stream ended without `data: [DONE]`"
    elif not got_usage:
        rec.error = ("the server sent no usage chunk; it must support stream_options.include_usage "
                     "(the output token count comes from usage.completion_tokens)")
    elif not rec.delta_times and rec.num_output_tokens > 0:
        rec.error = "the server reported output tokens but streamed no chunk with a choice"
    return rec


async def run_requests(base_url: str, bodies: Sequence[dict], concurrency: int, *, progress: bool = False,
                       desc: str = "") -> tuple[list[RequestRecord], float]:
    """Send `bodies` with at most `concurrency` in flight; (records in order, wall seconds)."""
    aiohttp = client()
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(bodies), desc=desc, unit="req", leave=False, disable=not progress)

    async def one(session, body: dict) -> RequestRecord:
        async with sem:
            rec = await send_request(session, url, body)
        bar.update(1)
        return rec

    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.perf_counter()
            records = await asyncio.gather(*(one(session, b) for b in bodies))
            duration = time.perf_counter() - start
    finally:
        bar.close()
    return list(records), duration


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, parsed by `prometheus_client`: `name` or
    `name{label="value",...}` (labels in the order the text gives them) -> value."""
    text_string_to_metric_families = require("prometheus_client.parser", "bench",
                                             "reading a server's /metrics").text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def acceptance_between(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """tau and per-position acceptance of the verify passes between two /metrics scrapes.

    Reads this project's counters `eagle3_decode_steps_total` and `eagle3_accepted_tokens_total`
    and the gauges `eagle3_spec_acceptance_rate{position="k"}` (cumulative fractions, turned back
    into counts by multiplying with the step counter), else vLLM's counters
    (`vllm_acceptance_between`). None when the server exposes neither or no verify pass ran in
    between.
    """
    steps_key, acc_key = "eagle3_decode_steps_total", "eagle3_accepted_tokens_total"
    if any(k not in d for k in (steps_key, acc_key) for d in (before, after)):
        return vllm_acceptance_between(before, after)
    steps = after[steps_key] - before[steps_key]
    if steps <= 0:
        return None
    per_position = []
    k = 1
    while (key := f'eagle3_spec_acceptance_rate{{position="{k}"}}') in after:
        n_after = round(after[key] * after[steps_key])
        n_before = round(before.get(key, 0.0) * before[steps_key])
        per_position.append((n_after - n_before) / steps)
        k += 1
    return {"tau": (after[acc_key] - before[acc_key]) / steps, "per_position": per_position,
            "num_verify_steps": int(steps), "source": "server /metrics"}


def _summed(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """The sum of the samples of metric `name` whose labels include `labels` (None if there is none)."""
    found = [value for key, value in samples.items()
             if key.split("{", 1)[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items())]
    return sum(found) if found else None


def vllm_acceptance_between(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """tau and per-position acceptance from vLLM's counters between two scrapes: drafts
    (`vllm:spec_decode_num_drafts_total`, one per verify pass of a request), accepted draft tokens
    and their split by position (`..._per_pos_total{position="k"}`, k from 0). tau counts the
    verify pass's own token as this project's does: 1 + accepted / drafts."""
    prefix = "vllm:spec_decode_num_"
    drafts = [_summed(d, prefix + "drafts_total") for d in (before, after)]
    accepted = [_summed(d, prefix + "accepted_tokens_total") for d in (before, after)]
    if None in drafts or None in accepted or drafts[1] - drafts[0] <= 0:
        return None
    steps = drafts[1] - drafts[0]
    per_position, k = [], 0
    while (n_after := _summed(after, prefix + "accepted_tokens_per_pos_total", position=str(k))) is not None:
        per_position.append((n_after - (_summed(before, prefix + "accepted_tokens_per_pos_total", position=str(k))
                                        or 0.0)) / steps)
        k += 1
    return {"tau": 1 + (accepted[1] - accepted[0]) / steps, "per_position": per_position,
            "num_verify_steps": int(steps), "source": "vLLM /metrics"}


async def scrape_metrics(base_url: str) -> dict[str, float] | None:
    """GET /metrics parsed by `parse_prometheus`; None when the server does not answer it."""
    aiohttp = client()

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(base_url.rstrip("/") + "/metrics") as resp:
                return parse_prometheus(await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def served_model(base_url: str) -> str | None:
    """The first model id of GET /v1/models, or None when the server does not answer it."""
    aiohttp = client()

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
                if resp.status != 200:
                    return None
                data = (await resp.json()).get("data") or []
                return str(data[0]["id"]) if data and isinstance(data[0], dict) and "id" in data[0] else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
        return None


async def check_server(base_url: str) -> None:
    """Raise ConnectionError with the fix when nothing answers at base_url."""
    aiohttp = client()

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(base_url.rstrip("/") + "/v1/models"):
                return
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ConnectionError(f"no server answers at {base_url} ({type(e).__name__}: {e}); start one with "
                              "scripts/serve.py or fix --base_url") from None


def run_http_benchmark(base_url: str, setting: SpecSetting, workload: Workload, cfg: RunConfig, *,
                       model: str | None = None, num_devices: int = 1,
                       log: Callable[[str], None] = print) -> list[dict]:
    """Every (concurrency, seed) cell against the server at `base_url`, which runs `setting`."""
    asyncio.run(check_server(base_url))
    if model is None:
        model = asyncio.run(served_model(base_url))
    out_len = workload.output_len
    cells = []
    for seed in cfg.seeds:
        for c in cfg.concurrencies:
            tag = f"{setting.name} C={c} seed={seed}"
            n_warm = cfg.warmups_for(c)

            def bodies(prompts: list[list[int]], s: int) -> list[dict]:
                return [completion_payload(p, output_len=out_len, temperature=cfg.temperature,
                                           seed=(s * 1_000_003 + i) % 2**32, model=model,
                                           synthetic_acceptance=cfg.synthetic_acceptance, top_p=cfg.top_p,
                                           top_k=cfg.top_k)
                        for i, p in enumerate(prompts)]

            if n_warm:
                warm_bodies = bodies(workload.prompts(n_warm, seed, WARMUP), seed + 7919)
                warm, _ = asyncio.run(run_requests(base_url, warm_bodies, c, progress=cfg.progress,
                                                   desc=f"{tag} warm-up"))
                check_lengths(warm, out_len, f"{tag} warm-up")
            measured = bodies(workload.prompts(cfg.prompts_for(c), seed, MEASURED), seed)
            passes = []
            for repeat in range(cfg.repeats):
                before, client_cpu = asyncio.run(scrape_metrics(base_url)), time.process_time()
                records, duration = asyncio.run(run_requests(base_url, measured, c, progress=cfg.progress, desc=tag))
                client_cpu, after = time.process_time() - client_cpu, asyncio.run(scrape_metrics(base_url))
                check_lengths(records, out_len, tag)
                cell = make_cell(setting, c, seed, records, duration, num_warmups=n_warm, num_devices=num_devices,
                                 with_acceptance=False, extra={"base_url": base_url, "model": model})
                acc = acceptance_between(before, after) if before and after and setting.spec is not None else None
                if acc is not None:  # the server's counters: exact when nothing else ran on it meanwhile
                    cell["metrics"]["acceptance"] = acc
                if before and after:
                    cell["metrics"]["prefix_cache_hit_rate"] = hit_rate_between(
                        before, after, "eagle3_prefix_cache_queries_total", "eagle3_prefix_cache_hits_total")
                    if "eagle3_host_kv_pages_total" in after:
                        cell["metrics"]["prefix_cache_host_hit_rate"] = hit_rate_between(
                            before, after, "eagle3_prefix_cache_queries_total", "eagle3_prefix_cache_host_hits_total")
                    cell["metrics"]["serving_path"] = serving_path_between(before, after, duration, client_cpu)
                passes.append(cell)
                m = cell["metrics"]
                log(f"{setting.label:>24} C={c:<4} seed={seed}{pass_label(repeat, cfg.repeats)}: "
                    f"{m['output_throughput']:9.1f} tok/s, TPOT {m['tpot_ms']['mean'] or 0:.2f} ms")
            cells.append(median_pass(passes))
    return attach_speedups(cells)
