"""Host time per iteration with the requests run as the server runs them (`scripts/bench_host.py
--through_engine`).

The scheduler steps on an AsyncEngine's thread; `num_seqs` consumers on one event loop each stream
one request after another through the engine (its tokenizer decoding their deltas there, when it
has one) until `options.warmup + options.iterations` steps ran. Each step records the scheduler's
host seconds, its wall and CPU time and whether it compiled a program; each engine iteration its
wall and CPU time. `engine_row` turns them into the scheduler's host ms per iteration and the
engine thread's time outside `step()` (handing the deltas to the consumers, the stats snapshot).

A module of its own because it needs `eagle3_jax.serving` (the `serve` extra), which the
measurement on the scheduler does not.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..serving import AsyncEngine
from .host_time import HostMeasurement, HostTimeOptions, freeze_heap, host_scheduler

if TYPE_CHECKING:  # annotations only
    from ..models.draft import Draft
    from ..models.target import Target
    from ..spec_decode import AutoSpec, SpecConfig
    from ..text.tokenizer import Tokenizer

# A step's (wall seconds, CPU seconds, the scheduler's host seconds, programs compiled).
Step = tuple[float, float, float, int]


def engine_row(num_seqs: int, steps: Sequence[Step], outer: Sequence[tuple[float, float]], warmup: int,
               iterations: int) -> dict:
    """The figures of one measurement through the engine, in ms (medians) over the measured
    iterations (after `warmup`, at most `iterations`) that compiled nothing. `outer[i]`: the
    engine thread's (wall, CPU) seconds of the iteration around `steps[i]`; its time outside
    `step()` is the difference."""
    wanted = warmup + iterations
    measured = [(s, o) for s, o in zip(steps[warmup: wanted], outer[warmup: wanted]) if not s[3]]

    def median_ms(values: list[float]) -> float:
        return 1e3 * float(np.median(values))

    return {"num_seqs": num_seqs, "iterations": len(measured),
            "host_ms_per_iteration": median_ms([s[2] for s, _ in measured]),
            "engine_cpu_ms_outside_step": median_ms([o[1] - s[1] for s, o in measured]),
            "engine_wall_ms_outside_step": median_ms([o[0] - s[0] for s, o in measured]),
            # the engine thread's whole iteration but the device wait: what bounds a host-bound server's steps
            "engine_host_ms_per_iteration": median_ms([s[2] + o[0] - s[0] for s, o in measured]),
            "iterations_that_compiled": min(len(steps), wanted) - warmup - len(measured)}


def measure_through_engine(target: Target, draft: Draft | None, spec: SpecConfig | AutoSpec | None, num_seqs: int,
                           options: HostTimeOptions, tokenizer: Tokenizer | None = None) -> HostMeasurement:
    """`num_seqs` consumers on one event loop, each streaming one request after another through an
    AsyncEngine, until `options.warmup + options.iterations` steps ran; the heap is frozen after the
    warm-up steps, as on the scheduler."""
    sched, draw = host_scheduler(target, draft, spec, num_seqs, options, tokenizer)
    engine = AsyncEngine(sched, tokenizer=tokenizer)
    steps: list[Step] = []
    outer: list[tuple[float, float]] = []  # the engine thread's (wall, CPU) per iteration
    step, engine_step = sched.step, engine._step
    totals = sched.counters.totals

    def timed_step():
        host, compiles = totals["host_seconds_total"], sched.programs.num_compiles
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return step()
        finally:
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            steps.append((wall, cpu, totals["host_seconds_total"] - host, sched.programs.num_compiles - compiles))
            if len(steps) == options.warmup:
                freeze_heap()

    def timed_engine_step():
        wall, cpu = time.perf_counter(), time.thread_time()
        engine_step()
        outer.append((time.perf_counter() - wall, time.thread_time() - cpu))

    sched.step, engine._step = timed_step, timed_engine_step
    wanted = options.warmup + options.iterations

    async def consumer() -> None:
        while len(steps) < wanted:
            async for _ in engine.generate(*draw()):
                pass

    async def run() -> None:
        engine.start()
        await asyncio.gather(*(consumer() for _ in range(num_seqs)))

    try:
        asyncio.run(run())
    finally:
        engine.shutdown(timeout=60)
    return HostMeasurement(engine_row(num_seqs, steps, outer, options.warmup, options.iterations))
