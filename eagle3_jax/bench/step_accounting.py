"""Where a decode step's time goes: its phases compiled and timed alone, the whole program alone,
and the scheduler's step around it.

For a scheduler holding `batch` requests in steady decoding, the decode launch it makes is captured
(its program and host arrays) and the device state snapshotted. Then, each figure the median of
`runs` timed calls, every call on a fresh copy of the snapshot (copies made outside the timing):

- phases alone: each phase of the step (spec_decode/step.py: propose, verify, judge, commit, extend; a
  plain step: verify, judge; both: state, the results scattered into the state slots) jitted on
  its own over the inputs the phases before it produce, donating the cache pools it rewrites as
  the step does;
- the program alone: the scheduler's compiled decode program on the captured arguments;
- the scheduler's step: `Scheduler.step()` wall time per iteration in steady decoding, and its
  host share (time in `step()` not spent waiting for device outputs; `stats()["host_seconds_total"]`),
  medians over the iterations that compiled nothing.

Phases and the program are timed as the scheduler runs its steps: calls launched back to back and
the last one waited for, so each call's dispatch overlaps the device's work on the one before
(a call timed alone, launched and waited for, adds its dispatch and the wake-up after it, about
0.2-0.3 ms on a CPU host). Figures are medians, and nothing is copied between timed calls:
donated caches and state are fed from one call to the next as the step loop feeds them (a copy of
the page pools between calls would evict the weights from a CPU host's caches and slow every call
after it).

"In-program extra" is the program's time beyond the sum of its phases (what composing them
costs: copies, layouts, the gathers and scatters between phases); "around the program" is the
step's wall time beyond the program's (host work and dispatch not hidden behind the device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from ..models.target import forward
from ..runtime.sharding import mesh_context
from ..sampling.sampler import PenaltyHistory, SamplingParams, apply_penalties, sample
from ..scheduler.batch import DECODE
from ..scheduler.programs import DeviceState, advance_state, record_token, slot_rows
from ..scheduler.slot_table import BatchRows
from ..spec_decode.propose import DraftRoot, propose
from ..spec_decode.step import extend_accepted, judge, verify_tree
from ..spec_decode.verify import commit_path

SPEC_PHASES = ("propose", "verify", "judge", "commit", "extend", "state")
PLAIN_PHASES = ("verify", "judge", "state")


@dataclasses.dataclass
class Launch:
    """A decode program launch as the scheduler made it."""

    kind: str
    shape: object
    rows: BatchRows
    args: tuple
    logprobs: object


@dataclasses.dataclass
class StepAccount:
    """Milliseconds per step of one (mode, batch): phases alone, the program alone, the scheduler's step."""

    mode: str
    batch: int
    phases: dict[str, float]
    program_ms: float
    step_ms: float
    host_ms: float
    tokens_per_step: float  # emitted per sequence per step (tau; 1 without speculation)
    steps_left_out: int = 0  # scheduler iterations that compiled a program, not in step_ms

    @property
    def phases_ms(self) -> float:
        return sum(self.phases.values())

    @property
    def in_program_extra_ms(self) -> float:
        return self.program_ms - self.phases_ms

    @property
    def around_program_ms(self) -> float:
        return self.step_ms - self.program_ms

    @property
    def unexplained_share(self) -> float | None:
        """The step's time its phases alone do not account for, as a share of the step (None: phases not timed)."""
        return 1.0 - self.phases_ms / self.step_ms if self.phases else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "phases_ms": self.phases_ms, "in_program_extra_ms": self.in_program_extra_ms,
                "around_program_ms": self.around_program_ms, "unexplained_share": self.unexplained_share,
                "program_over_phases": self.program_ms / self.phases_ms if self.phases else None,
                "host_share": self.host_ms / self.step_ms,
                "step_over_max_host_program": self.step_ms / max(self.host_ms, self.program_ms)}


def _copy(tree):
    return jax.tree.map(lambda x: None if x is None else jnp.array(x, copy=True), tree)


def median_ms(call: Callable[[], object], runs: int, inner: int = 8) -> float:
    """Milliseconds per `call()`: `runs` times, `inner` calls launched back to back and the last
    one's result waited for (as the scheduler launches a step before reading the one before, so
    dispatch overlaps the device's work); the median over the runs of their mean."""
    per_call = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / inner)
    return 1e3 * statistics.median(per_call)


@contextlib.contextmanager
def capture_decode(sched):
    """Within the block, record the decode launches `sched` makes; yields a function giving the
    last. The scheduler's own launch is put back on leaving, so no later step pays for the spy."""
    executor, last = sched._executor, {}
    run = executor.execute

    def spy(kind, shape, rows, *args, logprobs=None, masks=None):
        if kind in ("decode", "plain_decode") and masks is None:
            last["launch"] = Launch(kind, shape, rows, args, logprobs)
        return run(kind, shape, rows, *args, logprobs=logprobs, masks=masks)

    executor.execute = spy
    try:
        yield lambda: last.get("launch")
    finally:
        executor.execute = run


def time_program(sched, launch: Launch, snapshot: DeviceState, runs: int) -> float:
    """The scheduler's compiled decode program alone on `launch`'s arguments, ms per call. Each call
    takes the state the last one left (as the scheduler's next step would) with the snapshot's
    lengths put back, so that every call does the same work; nothing is copied between calls
    (a copy of the cache pools would evict the weights from a CPU host's caches)."""
    executor = sched._executor
    executor.state = _copy(snapshot)

    def call():
        executor.state = executor.state.replace(length=jnp.array(snapshot.length, copy=True))  # donated below
        return executor.execute(launch.kind, launch.shape, launch.rows, *launch.args,
                                logprobs=launch.logprobs), executor.state

    call()
    return median_ms(call, runs)


def _timed(timings: dict, runs: int, name: str, fn, args: tuple, donate: tuple[int, ...] = (), carry=None):
    """Time `fn(*args)` jitted alone into `timings[name]`; returns its first output. A donated
    argument is fed, call after call, what `carry(output)` ({argument index: value}) says replaces
    it, as the step loop feeds its state on: nothing is copied between calls."""
    jitted = jax.jit(fn, donate_argnums=donate)
    current = [_copy(a) if i in donate else a for i, a in enumerate(args)]
    first = None

    def call():
        nonlocal first
        out = jitted(*current)
        if first is None:
            first = _copy(out)
        for i, value in (carry(out) if carry else {}).items():
            current[i] = value
        return out

    call()
    timings[name] = median_ms(call, runs)
    return first


def time_phases(sched, launch: Launch, snapshot: DeviceState, runs: int) -> dict[str, float]:
    """Each phase of `launch`'s step jitted alone (ms per call), in step order. Every array a phase
    reads is an argument (none is captured as a constant); the cache pools and state it rewrites
    are donated and carried from call to call, their lengths kept as the snapshot's."""
    target, draft = sched.target, sched.draft
    tcfg = target.config
    rows = launch.rows
    slots, prompt_lens, bt = jnp.asarray(rows.slots), jnp.asarray(rows.prompt_lens), jnp.asarray(rows.block_table)
    sp = jax.tree.map(jnp.asarray, rows.sampling)
    spec = launch.shape if launch.kind == "decode" else None
    timings: dict[str, float] = {}
    timed = functools.partial(_timed, timings, runs)

    def same_lengths(cache):  # a cache the next call writes where this one did (its small arrays fresh: donated)
        return lambda out: _copy(cache.replace(k=None, v=None)).replace(k=out.k, v=out.v)

    with mesh_context(target.mesh):
        state = _copy(snapshot)
        lengths, counter = jax.jit(slot_rows)(state, slots, prompt_lens)
        history = PenaltyHistory(state.output_counts, state.prompt_seen, slots)
        tcache = state.target_cache(bt, lengths)
        keep_state = lambda out: {0: out.replace(length=jnp.array(snapshot.length, copy=True))}  # noqa: E731
        if spec is None:
            keep = same_lengths(tcache)
            logits, _, _ = timed("verify", lambda p, tc, tok: forward(p, tcfg, tok[:, None], tc.lengths[:, None], tc),
                                 (target.params, tcache, state.last_token[slots]), (1,),
                                 lambda out: {1: keep(out[2])})
            nxt = timed("judge", lambda lg, sp, h, c: sample(apply_penalties(lg[:, 0], sp, h), sp, c),
                        (logits, sp, history, counter))
            # the pools pass through (written by the target's pass)
            timed("state", lambda st, n, ln, sl: record_token(st, sl, ln, n), (state, nxt, lengths, slots), (0,),
                  keep_state)
            return timings
        dcfg = draft.config
        dcache = state.draft_cache(bt, lengths)
        keep_t, keep_d = same_lengths(tcache), same_lengths(dcache)
        root = DraftRoot(token=state.last_token[slots], hidden=state.draft_hidden[slots])
        tree, _ = timed("propose", lambda p, dc, r: propose(p, dcfg, dc, r, spec), (draft.params, dcache, root), (1,),
                        lambda out: {1: keep_d(out[1])})
        logits, aux, _, anc, depth = timed("verify", lambda p, tc, tr: verify_tree(p, tcfg, tc, tr),
                                           (target.params, tcache, tree), (1,), lambda out: {1: keep_t(out[2])})
        out, count, path, _, bonus = timed(
            "judge", lambda lg, tr, a, d, sp, c, h: judge(lg, tr, a, d, sp, c, h, spec.max_accept),
            (logits, tree, anc, depth, sp, counter, history))
        timed("commit", commit_path, (tcache, path, count), (0,), lambda o: {0: keep_t(o)})
        hidden, _ = timed("extend", lambda p, dc, *rest: extend_accepted(p, dcfg, dc, *rest),
                          (draft.params, dcache, aux, path, out, count), (1,), lambda o: {1: keep_d(o[1])})

        def spec_state(st, slots, lengths, out, count, root):  # the pools pass through
            return advance_state(st, slots, lengths, out, count, st.target_cache(bt, lengths),
                                 st.draft_cache(bt, lengths), root)

        timed("state", spec_state, (state, slots, lengths, out, count, DraftRoot(token=bonus, hidden=hidden)), (0,),
              keep_state)
    return timings


def steady_steps(sched, steps: int) -> tuple[float, float, int]:
    """(median wall ms, median host ms) per `sched.step()` over `steps` iterations, leaving out the
    iterations that compiled a program (a page-table bucket first reached), and how many those were."""
    walls, hosts, compiled = [], [], 0
    for _ in range(steps):
        host, compiles, start = sched.stats()["host_seconds_total"], sched.programs.num_compiles, time.perf_counter()
        sched.step()
        if sched.programs.num_compiles != compiles:
            compiled += 1
            continue
        walls.append(time.perf_counter() - start)
        hosts.append(sched.stats()["host_seconds_total"] - host)
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(hosts), compiled


def account(sched, mode: str, prompts: list[list[int]], *, batch: int, steps: int, runs: int,
            max_tokens: int, phases: bool = True, sampling: dict | None = None) -> StepAccount:
    """Admit `batch` requests (cycling through `prompts`, long enough to decode throughout, each
    with the SamplingParams fields `sampling` and its own seed; default greedy), let them reach
    steady decoding, then take the step's accounting (see the module doc; `phases` False leaves
    the phases alone untimed: each is a program of its own to compile)."""
    with capture_decode(sched) as last_launch:
        ids = [sched.add_request(prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, seed=i,
                                                                           **(sampling or {})))
               for i in range(batch)]
        requests = [sched._requests[str(i)] for i in ids]
        while any(r.state != DECODE for r in requests):
            sched.step()
        for _ in range(8):  # compile and settle
            sched.step()
        before = sched.stats()
        step_ms, host_ms, compiled = steady_steps(sched, steps)
        after = sched.stats()
        launch = last_launch()
    tau = ((after["accepted_tokens_total"] - before["accepted_tokens_total"])
           / max(after["num_decode_steps_total"] - before["num_decode_steps_total"], 1))
    snapshot = _copy(sched._executor.state)
    jax.block_until_ready(snapshot)
    program_ms = time_program(sched, launch, snapshot, runs)
    phases = time_phases(sched, launch, snapshot, runs) if phases else {}
    sched._executor.state = _copy(snapshot)
    for i in ids:
        sched.abort(i)
    while sched.has_unfinished():
        sched.step()
    return StepAccount(mode=mode, batch=batch, phases=phases, program_ms=program_ms, step_ms=step_ms,
                       host_ms=host_ms, tokens_per_step=tau, steps_left_out=compiled)
