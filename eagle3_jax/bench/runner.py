"""In-process serving benchmark: drives `eagle3_jax.scheduler.Scheduler` like `vllm bench serve`.

Semantics of `vllm bench serve --max-concurrency C --request-rate inf`: all requests are ready at
once, at most C are in flight, and the next one is submitted as soon as one finishes. Each cell
(speculation setting x concurrency x seed) first runs `2 x C` warm-up requests (compiles the
batch buckets, not measured), then `10 x C` measured ones by default. A measured pass during
which XLA compiled a program is repeated (up to `max_measure_attempts` passes in all), since a
compile stalls every request in flight for seconds; cells record how many passes they took. With
`repeats` > 1 each cell is measured that many times (warm-ups once, before the first), and it
reports the pass with the median output throughput (the lower median for an even count), recording
every pass's throughput: one pass on a shared machine can run 10-20 % off its neighbours. There is
one Scheduler per speculation setting (max_num_seqs = the largest concurrency), reused by all its
cells.

With `interleave=True` (the default) the cells run concurrency by concurrency, every setting in
turn, so slow spells of a shared machine hit every setting alike; all Schedulers (and their KV
pools) then live at once. The settings' order rotates from one (seed, concurrency) block to the
next, so each runs first, second, ... equally often over the blocks and no setting always follows
the same one (cells record their `run_position`); repeated passes of a block run all settings in
turn again, the order rotated once more for each. With `interleave=False` the settings run one after the other and each
Scheduler is dropped before the next is built.

Every request must generate exactly the workload's output length (requests carry no stop tokens:
ignore-EOS), otherwise the cell raises. Each cell records a digest of its outputs, so greedy
speculative cells can be checked token for token against the no-speculation cell.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import time
from typing import Callable, Sequence

from ..sampling.sampler import SamplingParams
from ..scheduler import Scheduler
from ..scheduler.metrics import HOST_TIER_KEYS
from .metrics import RequestRecord, attach_speedups, hit_rate_between, summarize
from .settings import NO_SPEC, SpecSetting
from .workloads import MEASURED, WARMUP, Workload


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The grid and the per-cell request counts (None = vLLM-style defaults 10 x C and 2 x C, raised
    to `min_prompts` and `min_warmups`: cells at low concurrency then last long enough to time, and
    adaptive speculation has timed its shapes before the measurement)."""

    concurrencies: tuple[int, ...]
    seeds: tuple[int, ...] = (0,)
    num_prompts: int | None = None
    num_warmups: int | None = None
    min_prompts: int = 0
    min_warmups: int = 0
    temperature: float = 0.0
    top_p: float = 1.0  # of every sampled request (1: no nucleus)
    top_k: int = 0  # of every sampled request (0: no top-k)
    interleave: bool = True
    progress: bool = True
    max_measure_attempts: int = 3  # measured passes per cell until one runs without compiling
    repeats: int = 1  # clean measured passes per cell; the cell reports the median one
    # Forced per-position acceptance of every request (SamplingParams.synthetic_acceptance): the
    # speculative step's cost at that acceptance; outputs are then not the target's.
    synthetic_acceptance: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.concurrencies or any(not isinstance(c, int) or c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be integers >= 1; got {self.concurrencies!r}")
        if len(set(self.concurrencies)) != len(self.concurrencies):
            raise ValueError(f"concurrencies listed more than once: {self.concurrencies!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list without repeats; got {self.seeds!r}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1; got {self.num_prompts}")
        if self.min_prompts < 0 or self.min_warmups < 0:
            raise ValueError(f"min_prompts and min_warmups must be >= 0; got {self.min_prompts}, {self.min_warmups}")
        if self.max_measure_attempts < 1:
            raise ValueError(f"max_measure_attempts must be >= 1; got {self.max_measure_attempts}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1; got {self.repeats!r}")
        if self.num_warmups is not None and self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0; got {self.num_warmups}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       synthetic_acceptance=self.synthetic_acceptance)  # validates
        if self.greedy and (self.top_p != 1.0 or self.top_k != 0):
            raise ValueError(f"top_p ({self.top_p}) and top_k ({self.top_k}) apply to sampled requests, and temperature "
                             "is 0 (greedy): set a temperature > 0, or leave them at 1.0 and 0")

    @property
    def compares_outputs(self) -> bool:
        """Whether speculative outputs must equal no-spec's token for token: greedy, not forced."""
        return self.greedy and self.synthetic_acceptance is None

    def prompts_for(self, concurrency: int) -> int:
        return self.num_prompts if self.num_prompts is not None else max(10 * concurrency, self.min_prompts)

    def warmups_for(self, concurrency: int) -> int:
        return self.num_warmups if self.num_warmups is not None else max(2 * concurrency, self.min_warmups)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_for(cfg: RunConfig, output_len: int, seed: int, index: int) -> SamplingParams:
    """Request `index`'s sampling: fixed length, no stop tokens (ignore-EOS), a per-request seed."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=output_len,
                          seed=(seed * 1_000_003 + index) % 2**32, stop_token_ids=(),
                          synthetic_acceptance=cfg.synthetic_acceptance)


def outputs_digest(outputs: Sequence[Sequence[int]]) -> str:
    """SHA-256 of the requests' output token ids, in prompt order."""
    return hashlib.sha256(json.dumps([list(map(int, o)) for o in outputs]).encode()).hexdigest()


def check_lengths(records: Sequence[RequestRecord], output_len: int, what: str) -> None:
    """Raise RuntimeError unless every request succeeded with exactly `output_len` tokens."""
    for i, r in enumerate(records):
        if r.error is not None:
            raise RuntimeError(f"{what}: request {i} failed: {r.error}")
        if r.num_output_tokens != output_len:
            raise RuntimeError(
                f"{what}: request {i} generated {r.num_output_tokens} tokens (finish_reason {r.finish_reason!r}); "
                f"every request must generate exactly {output_len} (ignore-EOS, fixed length)"
            )


def make_cell(setting: SpecSetting, concurrency: int, seed: int, records: Sequence[RequestRecord],
              duration_s: float, *, num_warmups: int, num_devices: int, with_acceptance: bool,
              extra: dict | None = None) -> dict:
    """One result cell: its coordinates, request counts and `summarize`'s metrics."""
    max_accept = setting.spec.max_accept if (with_acceptance and setting.spec is not None) else None
    cell = {"setting": setting.name, "label": setting.label, "concurrency": concurrency, "seed": seed,
            "num_prompts": len(records), "num_warmups": num_warmups,
            "metrics": summarize(records, duration_s, num_devices=num_devices, max_accept=max_accept)}
    if all(r.token_ids is not None for r in records):
        cell["outputs_digest"] = outputs_digest([r.token_ids for r in records])  # type: ignore[misc]
    cell.update(extra or {})
    return cell


def mark_identical(cells: list[dict]) -> list[dict]:
    """Set `identical_to_no_spec` on speculative cells: their outputs digest equals the no-spec cell's
    of the same concurrency and seed (None when either digest is missing)."""
    base = {(c["concurrency"], c["seed"]): c.get("outputs_digest") for c in cells if c["setting"] == NO_SPEC}
    for c in cells:
        if c["setting"] != NO_SPEC:
            b, d = base.get((c["concurrency"], c["seed"])), c.get("outputs_digest")
            c["identical_to_no_spec"] = None if b is None or d is None else b == d
    return cells


def drive(sched, prompts: Sequence[Sequence[int]], sampling: Callable[[int], SamplingParams], concurrency: int,
          *, tag: str, progress: bool = False, desc: str = "") -> tuple[list[RequestRecord], float]:
    """Run `prompts` through `sched` with at most `concurrency` in flight; (records, wall seconds).

    Submits a new request whenever fewer than `concurrency` are unfinished (checked after every
    scheduler step), timestamps every delta, and stops when all have finished (then reads the
    step launched ahead of that, untimed). The wall time runs from just before the first submit to
    the return of the step that finished the last request.
    """
    from tqdm.auto import tqdm

    n = len(prompts)
    records: list[RequestRecord] = []
    inflight: dict[str, int] = {}
    nxt = 0
    bar = tqdm(total=n, desc=desc, unit="req", leave=False, disable=not progress)
    start = time.perf_counter()
    try:
        while nxt < n or inflight:
            while nxt < n and len(inflight) < concurrency:
                rid = f"{tag}-{nxt}"
                submit = time.perf_counter()
                sched.add_request(list(prompts[nxt]), sampling(nxt), request_id=rid)
                records.append(RequestRecord(prompt_len=len(prompts[nxt]), submit_time=submit, delta_tokens=[]))
                inflight[rid] = nxt
                nxt += 1
            deltas = sched.step()
            if not deltas and not sched.has_unfinished():
                raise RuntimeError(f"the scheduler has nothing left to run but {len(inflight)} requests never finished")
            for d in deltas:
                if d.request_id not in inflight:
                    raise RuntimeError(f"the scheduler returned a delta for unknown request {d.request_id!r}")
                rec = records[inflight[d.request_id]]
                if d.token_ids:
                    rec.delta_times.append(d.time)
                    rec.delta_tokens.append(len(d.token_ids))  # type: ignore[union-attr]
                    rec.num_output_tokens += len(d.token_ids)
                if d.finished:
                    rec.finish_time, rec.finish_reason = d.time, d.finish_reason
                    if d.output is not None:
                        rec.token_ids = list(d.output.token_ids)
                        rec.accept_lengths = list(d.output.metrics.get("accept_lengths", []))
                    if d.finish_reason == "abort":
                        rec.error = "aborted by the scheduler"
                    del inflight[d.request_id]
                    bar.update(1)
        duration = time.perf_counter() - start
        # Read what the last step launched ahead (void: its requests have finished) now, outside
        # the timed window: read at the next drive, after the other settings' passes, its step
        # time would span that whole pause and enter the scheduler's step costs (what `auto`
        # judges by) as one huge sample.
        while sched.has_unfinished():
            if stray := sched.step():
                raise RuntimeError(f"the scheduler returned a delta for {stray[0].request_id!r} after all finished")
    finally:
        bar.close()
    return records, duration


class CompileCounter:
    """Counts XLA backend compilations (JAX's monitoring events) while active, as a context manager."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def _listener(self, event: str, duration: float, **_) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self) -> "CompileCounter":
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listener)


def _timed_drive(*args, **kwargs) -> tuple[list[RequestRecord], float]:
    """`drive` with the garbage collector paused (as timeit does), so collections don't land in one cell."""
    gc.collect()
    gc.disable()
    try:
        return drive(*args, **kwargs)
    finally:
        gc.enable()


def _agreed(value: int) -> int:
    """Process 0's `value` on every process of a multi-host run (each drives the same requests and
    must take the same repeat decision, though a compilation cache may spare one of them a compile)."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def run_cell(sched, setting: SpecSetting, workload: Workload, concurrency: int, seed: int, cfg: RunConfig,
             *, num_devices: int, warm_up: bool = True, repeat: int = 0) -> dict:
    """Warm-ups (not measured; skipped unless `warm_up`), then the measured requests of one cell;
    returns the cell dict (one pass of it: `repeat` numbers the passes of a repeated cell)."""
    tag = f"{setting.name}-c{concurrency}-s{seed}" + (f"-r{repeat}" if repeat else "")
    n_warm, n = cfg.warmups_for(concurrency), cfg.prompts_for(concurrency)
    out_len = workload.output_len
    if n_warm and warm_up:
        warm = workload.prompts(n_warm, seed, WARMUP)
        records, _ = drive(sched, warm, lambda i: sampling_for(cfg, out_len, seed + 7919, i), concurrency,
                           tag=tag + "-warmup", progress=cfg.progress, desc=f"{setting.label} C={concurrency} warm-up")
        check_lengths(records, out_len, f"{tag} warm-up")
    prompts = workload.prompts(n, seed, MEASURED)
    # A program compiled mid-measurement (a batch / page-table bucket the warm-ups never reached)
    # would stall the cell for seconds. The scheduler's steps depend only on the requests, not on
    # timing, so a repeat of the same requests reuses exactly those programs: repeat until clean.
    for attempt in range(1, cfg.max_measure_attempts + 1):
        sched.reset_prefix_cache()  # hits come from the measured requests alone, not the warm-ups or an earlier attempt
        before = sched.stats()
        with CompileCounter() as compiles:
            records, duration = _timed_drive(sched, prompts, lambda i: sampling_for(cfg, out_len, seed, i),
                                             concurrency, tag=f"{tag}-a{attempt}", progress=cfg.progress,
                                             desc=f"{setting.label} C={concurrency} seed={seed}")
        after = sched.stats()
        check_lengths(records, out_len, tag)
        if _agreed(compiles.count) == 0:
            break
    extra = {"num_preemptions": after.get("num_preemptions", 0) - before.get("num_preemptions", 0),
             "measure_attempts": attempt, "compiles_during_measurement": compiles.count,
             "compile_s_during_measurement": compiles.seconds, **scheduler_figures(before, after)}
    cell = make_cell(setting, concurrency, seed, records, duration, num_warmups=n_warm, num_devices=num_devices,
                     with_acceptance=True, extra=extra)
    cell["metrics"]["prefix_cache_hit_rate"] = hit_rate_between(before, after, "prefix_cache_queries_total",
                                                                "prefix_cache_hits_total")
    if "num_host_pages" in after:
        cell["metrics"]["prefix_cache_host_hit_rate"] = hit_rate_between(
            before, after, "prefix_cache_queries_total", "prefix_cache_host_hits_total")
    return cell


def pass_label(repeat: int, repeats: int) -> str:
    """The log line's ' pass k/N' for a pass of a repeated cell ('' when cells run once)."""
    return f" pass {repeat + 1}/{repeats}" if repeats > 1 else ""


def median_pass(passes: Sequence[dict]) -> dict:
    """The pass of a repeated cell to report: the median by output throughput (the lower median for
    an even count), with every pass's throughput and run position recorded in it."""
    if len(passes) == 1:
        return passes[0]
    ranked = sorted(passes, key=lambda c: c["metrics"]["output_throughput"])
    cell = dict(ranked[(len(ranked) - 1) // 2])
    cell["passes_output_throughput"] = [c["metrics"]["output_throughput"] for c in passes]
    cell["passes_run_position"] = [c.get("run_position") for c in passes]
    cell["repeats"] = len(passes)
    return cell


def scheduler_figures(before: dict, after: dict) -> dict:
    """What the scheduler did between two `stats()`: host time per iteration (time in `step()` not
    spent waiting for the device), the host tier's counters and, with adaptive speculation, the
    steps each shape ran."""
    iterations = after.get("num_iterations_total", 0) - before.get("num_iterations_total", 0)
    host = after.get("host_seconds_total", 0.0) - before.get("host_seconds_total", 0.0)
    figures = {"host_ms_per_iteration": 1e3 * host / iterations if iterations else None}
    if "num_host_pages" in after:  # the prefix cache's host tier: its share of the hits, what it copied
        figures["host_tier"] = {key: after.get(key, 0) - before.get(key, 0)
                                for key in ("prefix_cache_host_hits_total", *HOST_TIER_KEYS)}
    if "adaptive" in after:
        old = before.get("adaptive", {}).get("steps_by_shape", {})
        figures["steps_by_shape"] = {k: v - old.get(k, 0) for k, v in after["adaptive"]["steps_by_shape"].items()
                                     if v - old.get(k, 0)}
        for key in ("steps_without_draft", "requests_without_draft"):
            figures[key] = after["adaptive"].get(key, 0) - before.get("adaptive", {}).get(key, 0)
    return figures


def num_devices_of(target) -> int:
    """Devices the target's parameters are spread over (its mesh size; 1 without a mesh)."""
    mesh = getattr(target, "mesh", None)
    return int(mesh.devices.size) if mesh is not None else 1


def make_scheduler(target, draft, setting: SpecSetting, *, max_num_seqs: int, max_seq_len: int,
                   page_size: int | None = None, prefill_chunk: int | None = None, num_pages: int | None = None,
                   overlap: bool = True, prefix_caching: bool = False, kv_cache_dtype: str = "auto",
                   host_kv_cache_gb: float = 0.0):
    """A Scheduler for one speculation setting (the draft is attached only for speculative ones)."""
    if setting.spec is not None and draft is None:
        raise ValueError(f"setting {setting.name} needs a draft model; pass --draft")
    kw = {k: v for k, v in (("page_size", page_size), ("prefill_chunk", prefill_chunk), ("num_pages", num_pages))
          if v is not None}
    return Scheduler(target, draft=draft if setting.spec is not None else None, spec=setting.spec,
                     max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, overlap=overlap, prefix_caching=prefix_caching,
                     kv_cache_dtype=kv_cache_dtype, host_kv_cache_gb=host_kv_cache_gb, **kw)


def ordered(settings: Sequence[SpecSetting]) -> list[SpecSetting]:
    """Settings with the no-spec baseline first (the order cells run and tables show)."""
    return sorted(settings, key=lambda s: s.spec is not None)


def rotated(items: Sequence, k: int) -> list:
    """`items` rotated left by k (mod its length)."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def run_benchmark(target, draft, settings: Sequence[SpecSetting], workload: Workload, cfg: RunConfig, *,
                  max_seq_len: int, page_size: int | None = None, prefill_chunk: int | None = None,
                  num_pages: int | None = None, num_devices: int | None = None, overlap: bool = True,
                  prefix_caching: bool = False, kv_cache_dtype: str = "auto", host_kv_cache_gb: float = 0.0,
                  log: Callable[[str], None] = print) -> list[dict]:
    """Every cell of the grid (settings x concurrencies x seeds), with speedups and identity checks.

    `max_seq_len` is the Schedulers' sequence length; the workload must fit it. `num_devices`
    (for tokens/s per device) defaults to the target's mesh size. Greedy runs mark each
    speculative cell `identical_to_no_spec`; sampled runs leave it None (sampling is lossless in
    distribution, not token for token), as do runs with synthetic acceptance (outputs not the
    target's).
    """
    if workload.max_total_len > max_seq_len:
        raise ValueError(f"workload {workload.name} needs sequences of {workload.max_total_len} tokens; "
                         f"max_seq_len is {max_seq_len}")
    settings = ordered(settings)
    devices = num_devices if num_devices is not None else num_devices_of(target)
    max_c = max(cfg.concurrencies)
    build = lambda s: make_scheduler(target, draft, s, max_num_seqs=max_c, max_seq_len=max_seq_len,  # noqa: E731
                                     page_size=page_size, prefill_chunk=prefill_chunk, num_pages=num_pages,
                                     overlap=overlap, prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype,
                                     host_kv_cache_gb=host_kv_cache_gb)
    passes: dict[tuple[str, int, int], list[dict]] = {}

    def one(sched, s: SpecSetting, c: int, seed: int, position: int = 0, repeat: int = 0) -> None:
        cell = run_cell(sched, s, workload, c, seed, cfg, num_devices=devices, warm_up=repeat == 0, repeat=repeat)
        cell["run_position"] = position
        passes.setdefault((s.name, c, seed), []).append(cell)
        m = cell["metrics"]
        tau = m.get("acceptance", {}).get("tau")
        host = cell.get("host_ms_per_iteration")
        log(f"{s.label:>24} C={c:<4} seed={seed}{pass_label(repeat, cfg.repeats)}: "
            f"{m['output_throughput']:9.1f} tok/s, "
            f"TPOT {m['tpot_ms']['mean'] or 0:.2f} ms" + (f", tau {tau:.2f}" if tau is not None else "")
            + (f", host {host:.2f} ms/step" if host is not None else "")
            + (f", shapes {cell['steps_by_shape']} ({cell['steps_without_draft']} without draft)"
               if "steps_by_shape" in cell else "")
            + (f" ({cell['measure_attempts']} measured passes: compiles)" if cell["measure_attempts"] > 1 else ""))

    if cfg.interleave:
        scheds = {s.name: build(s) for s in settings}
        blocks = [(seed, c) for seed in cfg.seeds for c in cfg.concurrencies]
        for block, (seed, c) in enumerate(blocks):
            for repeat in range(cfg.repeats):
                for position, s in enumerate(rotated(settings, block + repeat)):
                    one(scheds[s.name], s, c, seed, position, repeat)
    else:
        for s in settings:
            sched = build(s)
            for seed in cfg.seeds:
                for c in cfg.concurrencies:
                    for repeat in range(cfg.repeats):
                        one(sched, s, c, seed, repeat=repeat)
            del sched
    cells = [median_pass(p) for p in passes.values()]
    attach_speedups(cells)
    if cfg.compares_outputs:
        return mark_identical(cells)
    for c in cells:
        if c["setting"] != NO_SPEC:
            c["identical_to_no_spec"] = None
    return cells
