"""Host time per scheduler iteration, on the scheduler driven directly (`scripts/bench_host.py`).

`measure_on_scheduler` keeps `num_seqs` requests in flight (one submitted as one finishes, each
with its own output length drawn from a seeded generator), runs `options.warmup` iterations
(programs compile), collects garbage and freezes what is left, then times `options.iterations`
iterations: the scheduler's host seconds (`host_seconds_total`), the launches' share
(`launch_seconds_total`), the thread's CPU seconds outside the output reads, the wall time, and
whether the iteration compiled a program (those are left out of the figures and counted). It adds
the launch floors and a step's relaunch (`launch_cost`). With `options.phases` timers wrapped
around the scheduler's methods (PHASES) give each phase's seconds; with `options.profile` each
clean iteration runs under cProfile and the profiles come back for `host_report.profile_tables`.

`measured_rows` runs a measurement (this one or `host_time_engine.measure_through_engine`) for
each (setting, num_seqs) and yields the rows as they come.
"""

from __future__ import annotations

import cProfile
import dataclasses
import functools
import gc
import random
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ..sampling.sampler import SamplingParams
from ..scheduler import Scheduler
from .launch_cost import launch_floors_ms, relaunch_ms
from .stand_in import stand_in_device

if TYPE_CHECKING:  # annotations only
    from ..models.draft import Draft
    from ..models.target import Target
    from ..spec_decode import AutoSpec, SpecConfig
    from ..text.tokenizer import Tokenizer

# The phases of one iteration: (label, the scheduler's attribute holding the method, "" for the
# scheduler itself; the method's file, as cProfile names it; the method). --phases wraps each
# method with a timer, --profile sums each one's cumulative time. Nested phases (indented) are
# inside the one above them.
PHASES = (("admission", "_batch", "scheduler/batch.py", "admit"),
          ("prefill rows", "_batch", "scheduler/batch.py", "prefill_rows"),
          ("prefill launch", "_launcher", "scheduler/launches.py", "prefill"),
          ("page growth", "_batch", "scheduler/batch.py", "grow_pages"),
          ("decode launch", "_launcher", "scheduler/launches.py", "decode"),
          ("  rows of the slot tables", "_batch", "scheduler/batch.py", "rows_batch"),
          ("  speculation plan", "policy", "spec_decode/policy.py", "plan"),
          ("  jitted calls (launches)", "programs", "scheduler/programs.py", "run"),
          ("outputs read (device wait)", "_executor", "scheduler/programs.py", "read"),
          ("collect prefill", "", "scheduler/core.py", "_collect_prefill"),
          ("collect decode", "", "scheduler/core.py", "_collect_decode"),
          ("  per-token emission", "", "scheduler/core.py", "_emit"),
          ("    finishing requests", "", "scheduler/core.py", "_finish"),
          ("  policy observe", "policy", "spec_decode/policy.py", "observe"),
          ("  metrics counters", "counters", "scheduler/metrics.py", "decode_step"))


@dataclasses.dataclass(frozen=True)
class HostTimeOptions:
    """What a host-time measurement runs (scripts/bench_host.py's flags of the same names)."""

    prompt_len: int = 16
    min_tokens: int = 16
    max_tokens: int = 64
    warmup: int = 40
    iterations: int = 60
    overlap: bool = False  # off: on a CPU host the device's threads would inflate the host figure
    stop_string: str | None = None
    stand_in_device: bool = False
    phases: bool = False
    profile: int = 0  # top functions to print; 0: no profiler


@dataclasses.dataclass
class HostMeasurement:
    """One (setting, num_seqs)'s figures (`row`, as the JSON records it) and, with --profile, the
    cProfile of each measured iteration that compiled nothing."""

    row: dict
    profiles: list[cProfile.Profile] | None = None


# One iteration's (host seconds, wall seconds, programs compiled, launch seconds, the thread's CPU seconds).
Iteration = tuple[float, float, int, float, float]
Measure = Callable[..., HostMeasurement]


def host_scheduler(target: Target, draft: Draft | None, spec: SpecConfig | AutoSpec | None, num_seqs: int,
                   options: HostTimeOptions,
                   tokenizer: Tokenizer | None = None) -> tuple[Scheduler, Callable[[], tuple]]:
    """The measured scheduler (the draft attached only with a speculative `spec`; its programs
    stood in for with `options.stand_in_device`), and a function drawing one request's (prompt,
    SamplingParams) from a generator seeded with 0: random ids from 3 up, a length in
    [min_tokens, max_tokens]."""
    rng = random.Random(0)
    vocab = target.config.vocab_size
    sched = Scheduler(target, draft if spec is not None else None, spec, max_num_seqs=num_seqs,
                      max_seq_len=options.prompt_len + options.max_tokens + 1, overlap=options.overlap,
                      tokenizer=tokenizer)
    if options.stand_in_device:
        stand_in_device(sched)
    stop = () if options.stop_string is None else (options.stop_string,)

    def draw() -> tuple:
        prompt = [rng.randrange(3, vocab) for _ in range(options.prompt_len)]
        return prompt, SamplingParams(max_tokens=rng.randint(options.min_tokens, options.max_tokens), stop=stop)

    return sched, draw


def install_phase_timers(sched: Scheduler, phases: Sequence[tuple] = PHASES) -> dict[str, float]:
    """Wrap the scheduler's `phases` methods (on the instances) with timers; returns the dict of
    seconds per label they add to (the caller clears it)."""
    seconds = dict.fromkeys((label for label, *_ in phases), 0.0)
    for label, owner, _, name in phases:
        obj = getattr(sched, owner) if owner else sched
        method = getattr(obj, name)

        def timed(*args, _method=method, _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - start

        setattr(obj, name, timed)
    return seconds


def count_read_cpu(sched: Scheduler) -> list[float]:
    """Wrap the scheduler's output reads (on the instance) to add the calling thread's CPU seconds
    in them to the returned one-element list: the CPU a wait takes (a spin, a program run inline)
    is the device's, not the host's work."""
    executor, spent = sched._executor, [0.0]
    read = executor.read

    def counted(*args, **kwargs):
        start = time.thread_time()
        try:
            return read(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - start

    executor.read = counted
    return spent


def freeze_heap() -> None:
    """Collect garbage once and keep what is left out of later collections, as scripts/serve.py
    does after its warm-up (`measured_rows` unfreezes it after each measurement): the model's and
    the programs' objects are then not walked by the measured iterations' collections."""
    gc.collect()
    gc.freeze()


def run_iterations(sched: Scheduler, submit: Callable[[], None], iterations: int, read_cpu: list[float],
                   phase_seconds: dict[str, float] | None = None, profiles: list | None = None,
                   phases: list | None = None) -> list[Iteration]:
    """Run `iterations` scheduler steps, submitting a request for each one that finished; returns
    each iteration's figures (Iteration). With `profiles`, each iteration that compiled nothing
    adds its cProfile there; with `phases`, its phase timers' seconds (`phase_seconds`, cleared
    before each iteration)."""
    per_iteration = []
    for _ in range(iterations):
        if phases is not None:
            phase_seconds.update(dict.fromkeys(phase_seconds, 0.0))
        profiler = None if profiles is None else cProfile.Profile()
        before, compiles, start = sched.stats(), sched.programs.num_compiles, time.perf_counter()
        if profiler is not None:
            profiler.enable()
        cpu = time.thread_time() - read_cpu[0]
        deltas = sched.step()
        wall = time.perf_counter() - start  # (the next requests' submission left out)
        cpu = time.thread_time() - read_cpu[0] - cpu
        for delta in deltas:
            if delta.finished:
                submit()
        if profiler is not None:
            profiler.disable()
        after = sched.stats()
        per_iteration.append((after["host_seconds_total"] - before["host_seconds_total"], wall,
                              sched.programs.num_compiles - compiles,
                              after["launch_seconds_total"] - before["launch_seconds_total"], cpu))
        if profiler is not None and not per_iteration[-1][2]:
            profiles.append(profiler)
        if phases is not None and not per_iteration[-1][2]:
            phases.append(dict(phase_seconds))
    return per_iteration


def scheduler_row(num_seqs: int, measured: Sequence[Iteration], tokens: int, floors: tuple[float, float],
                  relaunch: float | None, phases: Sequence[dict[str, float]] | None = None) -> dict:
    """The figures of one measurement on the scheduler, in ms (medians, and the host time's mean)
    over the iterations that compiled nothing: an iteration that compiled a program spent its host
    time compiling, so it is left out and counted. `tokens`: generated over all `measured`
    iterations; `floors`: the (warm, cold) launch floors; `phases`: each clean iteration's phase
    seconds (--phases), else no `phases_ms_per_iteration`."""
    clean = np.asarray([(host, wall, launch, cpu) for host, wall, compiled, launch, cpu in measured if not compiled])
    return {"num_seqs": num_seqs, "iterations": len(clean),
            "host_ms_per_iteration": 1e3 * float(np.median(clean[:, 0])),
            "host_ms_mean": 1e3 * float(clean[:, 0].mean()),
            "host_cpu_ms_per_iteration": 1e3 * float(np.median(clean[:, 3])),
            "launch_ms_per_iteration": 1e3 * float(np.median(clean[:, 2])),
            "launch_floor_ms": floors[0], "launch_floor_cold_ms": floors[1],
            "step_relaunch_ms": relaunch,
            "scheduler_ms_per_iteration": 1e3 * float(np.median(clean[:, 0] - clean[:, 2])),
            "device_wait_ms_per_iteration": 1e3 * float(np.median(clean[:, 1] - clean[:, 0])),
            "tokens_per_iteration": tokens / len(measured),
            "iterations_that_compiled": len(measured) - len(clean),
            **({"phases_ms_per_iteration": phase_medians_ms(phases)} if phases else {})}


def phase_medians_ms(phases: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each PHASES label's median ms over the iterations' phase seconds."""
    return {label: 1e3 * float(np.median([p[label] for p in phases])) for label, *_ in PHASES}


def measure_on_scheduler(target: Target, draft: Draft | None, spec: SpecConfig | AutoSpec | None, num_seqs: int,
                         options: HostTimeOptions, tokenizer: Tokenizer | None = None) -> HostMeasurement:
    """The scheduler driven directly: warm-up, frozen heap, measured iterations, then a step's
    relaunch (not with a stand-in device, which launches nothing) and the launch floors."""
    sched, draw = host_scheduler(target, draft, spec, num_seqs, options, tokenizer)

    def submit() -> None:
        sched.add_request(*draw())

    phase_seconds = install_phase_timers(sched) if options.phases else None
    iterate = functools.partial(run_iterations, sched, submit, read_cpu=count_read_cpu(sched),
                                phase_seconds=phase_seconds)
    for _ in range(num_seqs):
        submit()
    iterate(options.warmup)
    freeze_heap()
    tokens = sched.stats()["generation_tokens_total"]
    profiles = [] if options.profile else None
    phases = [] if options.phases else None
    measured = iterate(options.iterations, profiles=profiles, phases=phases)
    tokens = sched.stats()["generation_tokens_total"] - tokens
    relaunch = None if options.stand_in_device else relaunch_ms(sched, lambda: iterate(1))
    row = scheduler_row(num_seqs, measured, tokens, launch_floors_ms(sched), relaunch, phases)
    return HostMeasurement(row, profiles or None)


def measured_rows(measure: Measure, target: Target, draft: Draft | None, specs: Sequence[tuple], sizes: Sequence[int],
                  options: HostTimeOptions, tokenizer: Tokenizer | None = None) -> Iterator[HostMeasurement]:
    """`measure`'s figures for each (setting name, SpecConfig or None) of `specs` and each of
    `sizes` (requests in flight), in that order, each row led by its `spec` name; yielded as each
    measurement ends, after the heap `measure` froze is unfrozen (the next measurement's
    collections may then free this one's scheduler)."""
    for name, spec in specs:
        for n in sizes:
            try:
                measurement = measure(target, draft, spec, n, options, tokenizer)
            finally:
                gc.unfreeze()
            measurement.row = dict(spec=name, **measurement.row)
            yield measurement
