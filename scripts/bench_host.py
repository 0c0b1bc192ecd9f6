"""Host time per scheduler iteration: the Python bookkeeping around the device programs.

Keeps --num_seqs requests in flight on the scheduler (one submitted as one finishes, each with
its own output length, so requests finish, are admitted and prefill during the measurement as in
serving), runs --warmup iterations (programs compile), then reports over --iterations:

- host ms per iteration (median; also the mean): `step()` time not spent waiting for device
  outputs (the scheduler's own `host_seconds_total`), the figure to keep small as batches grow;
  split into the time inside the jitted calls of compiled programs (`launch_seconds_total`: the
  launches) and the rest, the scheduler's own Python (the median of each, so they need not add up);
- host CPU ms per iteration (median): the scheduler thread's CPU time in `step()` outside the
  output reads. On a CPU device the programs' worker threads share the host's cores, and a program
  launched early in an iteration (the prefill) runs beside the rest of its host work: the wall
  figure above also holds the time the host's thread waited for a core, this one does not;
- the launch floor: one jitted call with the same params and donated state and no work
  (`_launch_floors_ms`), warm (calls back to back) and cold (each after writing twice the
  last-level cache). On a CPU host the device's programs go through the host's caches, so every
  launch and all the scheduler's Python after a program run cache-cold: the cold floor is the
  least one launch costs here, and a launch's time above it is its program's own launch work;
- a step's launch after its program: the measured run's next decode program launched again and
  again, each launch right after that program ran on an otherwise idle device (`_relaunch_ms`):
  on a CPU device the least a step's launch costs, each step following some program's run;
- device-wait ms per iteration (median). Iterations that compiled a program are left out (their
  host time is compile time) and counted.

With --phases, timers around the scheduler's methods (admission, the prefill and decode launches and
their jitted calls, page growth, the speculation plan, the outputs' read, the collection of prefill
and decode results, per-token emission, finishing requests, the policy's and the counters' updates;
PHASES) give each phase's host ms per iteration (median), a
table after the main one and `phases_ms_per_iteration` in the JSON; their overhead is a few
microseconds an iteration.

With --profile=N, cProfile runs over the measured iterations and the script prints where the host
time goes: each phase's cumulative ms per iteration (admission, page growth, the launches and
their jitted calls, the outputs' read, which holds the device wait, token emission, counters)
and the N functions of most own time. The profiler's own overhead inflates every figure of
that run (roughly 1.5-2x); compare profiles with profiles.

With --through_engine the requests run as the server runs them: the scheduler on an AsyncEngine's
thread, each request's deltas streamed to its own consumer on an event loop (the engine's
tokenizer decoding them there with --detokenize). It reports the scheduler's host ms per iteration
as above and the engine thread's time per iteration outside `step()` (median): handing the step's
deltas to the consumers and the stats snapshot, in CPU ms (the thread's own work) and wall ms
(which holds its waits for the GIL while the consumers' loop runs); and the engine thread's host
ms per iteration, the two together (all of its iteration but the device wait), which bounds the
steps of a server whose host is the bottleneck. --phases and --profile time
the scheduler driven directly, not in this mode.

With --stand_in_device the step programs are answered at once with random tokens
(eagle3_jax/bench/stand_in.py): the figures are then the scheduler's own host work, without what a
device on this host's CPU adds to it (the launches, the programs' threads on the host's cores,
the host's caches evicted by each program, which the Python and the next launch then run without). That is the host work
of a server whose device is an accelerator, its launches' own cost left out; the outputs mean
nothing.

After the warm-up iterations the script collects garbage once and freezes what is left, as
`scripts/serve.py` does after its warm-up: the model's and the compiled programs' objects are then
not walked by the collections of the measured iterations (an unfrozen full collection adds
milliseconds to one iteration in tens).

By default host and device work do not overlap (`--nooverlap`): on a CPU host the device's
threads would otherwise run beside the host's Python and inflate it. Prints a table and writes
--json_out (command, machine, date, figures).

    python scripts/bench_host.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --spec=none,chain:3:1:4 --num_seqs=64,256 --json_out=benchmarks/results/host-step.json
"""

from __future__ import annotations

import cProfile
import datetime
import gc
import glob
import json
import os
import platform
import pstats
import random
import string
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder (HF or Orbax).")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder, for the speculative settings.")
flags.DEFINE_list("spec", ["none", "chain:3:1:4"], "Speculation settings: none, chain:S:K:N, tree:S:K:N, auto[:K].")
flags.DEFINE_list("num_seqs", ["64", "256"], "Requests in flight (the scheduler's max_num_seqs), one row each.")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per request.", lower_bound=1)
flags.DEFINE_integer("min_tokens", 16, "Fewest tokens a request generates.", lower_bound=1)
flags.DEFINE_integer("max_tokens", 64, "Most tokens a request generates (each request draws its own).", lower_bound=1)
flags.DEFINE_integer("warmup", 40, "Unmeasured iterations first (programs compile).", lower_bound=0)
flags.DEFINE_integer("iterations", 60, "Measured iterations.", lower_bound=1)
flags.DEFINE_bool("overlap", False, "Let host and device work overlap (the serving default); off here so that on a "
                  "CPU host the device's threads do not inflate the host figure.")
flags.DEFINE_bool("detokenize", False, "Give the scheduler the target folder's tokenizer, as the server does (requests "
                  "with stop strings are then decoded on the scheduler's thread, others where their deltas are delivered).")
flags.DEFINE_string("stop_string", None, "With --detokenize: every request carries this stop string (one that never "
                    "occurs measures the decoding a stop string costs the scheduler's thread).")
flags.DEFINE_string("json_out", None, "Write the figures here as JSON.")
flags.DEFINE_bool("phases", False, "Also time the scheduler's phases with timers around its methods (no profiler: "
                  "a few microseconds of overhead per iteration) and print each one's host ms per iteration (median).")
flags.DEFINE_bool("stand_in_device", False, "Answer the step programs at once with random tokens instead of running "
                  "them, to measure the scheduler's own host work without the CPU device's (see the module doc); "
                  "no logprob or structured-output requests.")
flags.DEFINE_bool("through_engine", False, "Run the requests through an AsyncEngine, each streamed to its own "
                  "consumer on an event loop, as the server does, and report the engine thread's time outside step() "
                  "(see the module doc); --phases and --profile do not apply.")
flags.DEFINE_integer("profile", 0, "Profile the measured iterations with cProfile and print where the host time goes: "
                     "the scheduler's phases (cumulative ms per iteration) and the top N functions by own time.",
                     lower_bound=0)

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


# The printed tables' columns after spec and seqs: (header, format of the row's figures).
SCHEDULER_COLUMNS = (("host ms / iteration (median)", "{host_ms_per_iteration:.2f}"),
                     ("host ms (mean)", "{host_ms_mean:.2f}"),
                     ("of which launches (median)", "{launch_ms_per_iteration:.2f}"),
                     ("the rest: scheduler (median)", "{scheduler_ms_per_iteration:.2f}"),
                     ("host CPU ms (median)", "{host_cpu_ms_per_iteration:.2f}"),
                     ("launch floor ms", "{launch_floor_ms:.3f}"), ("cold floor ms", "{launch_floor_cold_ms:.3f}"),
                     ("a step's launch after its program ms", "{step_relaunch_ms:.3f}"),
                     ("device wait ms (median)", "{device_wait_ms_per_iteration:.2f}"),
                     ("tokens / iteration", "{tokens_per_iteration:.1f}"), ("iterations timed", "{iterations}"),
                     ("left out (compiled)", "{iterations_that_compiled}"))
ENGINE_COLUMNS = (("scheduler host ms / iteration (median)", "{host_ms_per_iteration:.2f}"),
                  ("engine thread outside step(): CPU ms (median)", "{engine_cpu_ms_outside_step:.3f}"),
                  ("wall ms (median)", "{engine_wall_ms_outside_step:.3f}"),
                  ("engine thread host ms / iteration (median)", "{engine_host_ms_per_iteration:.2f}"),
                  ("iterations timed", "{iterations}"), ("left out (compiled)", "{iterations_that_compiled}"))


def _install_phase_timers(sched) -> dict:
    """Wrap the scheduler's PHASES methods (on the instances) with timers; returns the dict of
    seconds per label they add to (the caller clears it)."""
    seconds = dict.fromkeys((label for label, *_ in PHASES), 0.0)
    for label, owner, _, name in PHASES:
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


def _count_read_cpu(sched) -> list[float]:
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


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs), else 64 MiB."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=64 << 20)


def _launch_floors_ms(sched, repeats: int = 50) -> tuple[float, float]:
    """What a jitted call costs with the step programs' arguments and no work: a program that hands
    back a copy of the scheduler's device state (donated, as the steps donate it) over the target's
    and draft's params, launched on an idle device (median ms). A step launch's time above it is
    the program's own launch work.

    (warm, cold): calls back to back, then each call after writing a buffer twice the size of the
    last-level cache, as a CPU device's own programs do between two launches (their weights, pages
    and activations go through the host's caches): the call's code and objects are then fetched
    from memory again."""
    import jax

    executor = sched._executor
    params = (executor.target.params, None if executor.draft is None else executor.draft.params)
    program = jax.jit(lambda params, state, step: (state, step + 1), donate_argnums=(1,))

    def launch(carry):  # carry: (device state, step counter)
        carry = program(params, *carry)
        return carry[1], carry

    carry = (_copied_state(sched), np.zeros((), np.int32))
    for _ in range(3):  # the first calls compile
        _, carry = launch(carry)
    jax.block_until_ready(carry)
    evict = np.zeros(2 * _last_level_cache_bytes() // 8)

    def evicting() -> None:
        evict[...] += 1.0

    warm, carry = _median_launch_ms(launch, carry, repeats)
    cold, _ = _median_launch_ms(launch, carry, repeats, before_each=evicting)
    return warm, cold


def _copied_state(sched):
    """A copy of the scheduler's device state, to donate to launches of the measurements' own."""
    import jax

    return jax.block_until_ready(jax.tree.map(lambda leaf: leaf.copy(), sched._executor.state))


def _median_launch_ms(launch, state, repeats: int, before_each=None) -> tuple[float, object]:
    """(median ms of `repeats` calls of `launch(state) -> (outputs, state)`, each after the previous
    one's outputs are ready and after `before_each()`, the state they leave)."""
    import jax

    seconds = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        outputs, state = launch(state)
        seconds.append(time.perf_counter() - start)
        jax.block_until_ready(outputs)
    return 1e3 * float(np.median(seconds)), state


def _relaunch_ms(sched, next_step, repeats: int = 20) -> float | None:
    """What the launch of a step's own program costs right after that program ran (median ms):
    the last program `next_step()` launches (its decode step) is captured, then launched `repeats`
    times over a copy of the device state, each after the previous one finished, with nothing
    else running. On a CPU device every launch of a step follows some program's run: this is the
    least a step's launch costs there, and against the launch floors it shows what that program
    leaves cold. None when the step launched nothing."""
    from eagle3_jax.scheduler.programs import DONATED

    programs, captured = sched.programs, []
    run, launch = programs.run, type(programs).run  # (the class's: no phase timer around the relaunches)

    def capturing(fn, static: tuple, key: tuple, *args):
        captured[:] = [(fn, static, key, args)]
        return run(fn, static, key, *args)

    programs.run = capturing
    try:
        next_step()
    finally:
        programs.run = run
    if not captured:
        return None
    fn, static, key, args = captured[0]

    def relaunch(state):
        *outputs, state = launch(programs, fn, static, key, *args[:DONATED], state, *args[DONATED + 1:])
        return (outputs, state), state

    return _median_launch_ms(relaunch, _copied_state(sched), repeats)[0]


def _freeze_heap() -> None:
    """Collect garbage once and keep what is left out of later collections, as scripts/serve.py
    does after its warm-up (`_measured_rows` unfreezes it after each measurement)."""
    gc.collect()
    gc.freeze()


def _scheduler(target, draft, spec, num_seqs: int, tokenizer=None):
    """The measured scheduler, and a function drawing one request's (prompt, SamplingParams)."""
    import eagle3_jax as e3

    rng = random.Random(0)
    vocab = target.config.vocab_size
    sched = e3.Scheduler(target, draft if spec is not None else None, spec, max_num_seqs=num_seqs,
                         max_seq_len=FLAGS.prompt_len + FLAGS.max_tokens + 1, overlap=FLAGS.overlap, tokenizer=tokenizer)
    if FLAGS.stand_in_device:
        from eagle3_jax.bench.stand_in import stand_in_device

        stand_in_device(sched)
    stop = () if FLAGS.stop_string is None else (FLAGS.stop_string,)

    def draw() -> tuple:
        prompt = [rng.randrange(3, vocab) for _ in range(FLAGS.prompt_len)]
        return prompt, e3.SamplingParams(max_tokens=rng.randint(FLAGS.min_tokens, FLAGS.max_tokens), stop=stop)

    return sched, draw


def _measure_through_engine(target, draft, spec, num_seqs: int, tokenizer=None) -> dict:
    """--through_engine: --num_seqs consumers on one event loop, each streaming one request after
    another through an AsyncEngine, until --warmup + --iterations steps ran."""
    import asyncio

    from eagle3_jax.serving import AsyncEngine

    sched, draw = _scheduler(target, draft, spec, num_seqs, tokenizer)
    engine = AsyncEngine(sched, tokenizer=tokenizer)
    steps, outer = [], []  # per step: (wall, CPU, host seconds, programs compiled); the engine's (wall, CPU)
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
            if len(steps) == FLAGS.warmup:
                _freeze_heap()

    def timed_engine_step():
        wall, cpu = time.perf_counter(), time.thread_time()
        engine_step()
        outer.append((time.perf_counter() - wall, time.thread_time() - cpu))

    sched.step, engine._step = timed_step, timed_engine_step
    wanted = FLAGS.warmup + FLAGS.iterations

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
    measured = [(s, o) for s, o in zip(steps[FLAGS.warmup: wanted], outer[FLAGS.warmup: wanted]) if not s[3]]
    median_ms = lambda values: 1e3 * float(np.median(values))  # noqa: E731
    return {"num_seqs": num_seqs, "iterations": len(measured),
            "host_ms_per_iteration": median_ms([s[2] for s, _ in measured]),
            "engine_cpu_ms_outside_step": median_ms([o[1] - s[1] for s, o in measured]),
            "engine_wall_ms_outside_step": median_ms([o[0] - s[0] for s, o in measured]),
            # the engine thread's whole iteration but the device wait: what bounds a host-bound server's steps
            "engine_host_ms_per_iteration": median_ms([s[2] + o[0] - s[0] for s, o in measured]),
            "iterations_that_compiled": min(len(steps), wanted) - FLAGS.warmup - len(measured)}


def _measure(target, draft, spec, num_seqs: int, tokenizer=None) -> dict:
    sched, draw = _scheduler(target, draft, spec, num_seqs, tokenizer)

    def submit() -> None:
        sched.add_request(*draw())

    phase_seconds = _install_phase_timers(sched) if FLAGS.phases else None
    read_cpu = _count_read_cpu(sched)

    def run(iterations: int, profiles: list | None = None, phases: list | None = None) -> list[tuple]:
        """(host seconds, wall seconds, programs compiled, launch seconds, the thread's CPU seconds)
        of each iteration; with `profiles`, each iteration that compiled nothing adds its cProfile
        there, with `phases` its phase timers' seconds."""
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

    for _ in range(num_seqs):
        submit()
    run(FLAGS.warmup)
    _freeze_heap()
    tokens = sched.stats()["generation_tokens_total"]
    profiles = [] if FLAGS.profile else None
    phases = [] if FLAGS.phases else None
    measured = run(FLAGS.iterations, profiles, phases)
    if profiles:
        _print_profile(profiles)
    tokens = sched.stats()["generation_tokens_total"] - tokens
    relaunch = None if FLAGS.stand_in_device else _relaunch_ms(sched, lambda: run(1))
    # An iteration that compiled a program spent its host time compiling: left out.
    clean = np.asarray([(host, wall, launch, cpu) for host, wall, compiled, launch, cpu in measured if not compiled])
    return {"num_seqs": num_seqs, "iterations": len(clean),
            "host_ms_per_iteration": 1e3 * float(np.median(clean[:, 0])),
            "host_ms_mean": 1e3 * float(clean[:, 0].mean()),
            "host_cpu_ms_per_iteration": 1e3 * float(np.median(clean[:, 3])),
            "launch_ms_per_iteration": 1e3 * float(np.median(clean[:, 2])),
            **dict(zip(("launch_floor_ms", "launch_floor_cold_ms"), _launch_floors_ms(sched))),
            "step_relaunch_ms": relaunch,
            "scheduler_ms_per_iteration": 1e3 * float(np.median(clean[:, 0] - clean[:, 2])),
            "device_wait_ms_per_iteration": 1e3 * float(np.median(clean[:, 1] - clean[:, 0])),
            "tokens_per_iteration": tokens / len(measured),
            "iterations_that_compiled": len(measured) - len(clean),
            **({"phases_ms_per_iteration": {label: 1e3 * float(np.median([p[label] for p in phases]))
                                            for label, *_ in PHASES}} if phases else {})}


def _print_profile(profiles: list) -> None:
    """The phases' cumulative ms per iteration, then the top --profile functions by own time, over
    the iterations that compiled nothing."""
    iterations = len(profiles)
    merged = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        merged.add(profile)
    stats = merged.stats  # (file, line, name) -> (calls, primitive, own, cumulative, callers)
    print("\n| phase | ms / iteration (cumulative) |\n|---|---|")
    for label, _, suffix, name in PHASES:
        total = sum(v[3] for (file, _, fn), v in stats.items() if fn == name and file.endswith(suffix))
        print(f"| {label} | {1e3 * total / iterations:.3f} |")
    print(f"\n| function (top {FLAGS.profile} by own time) | calls / iteration | own ms / iteration | cumulative ms |"
          "\n|---|---|---|---|")
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[: FLAGS.profile]
    for (file, line, name), (calls, _, own, cumulative, _) in top:
        where = f"{'/'.join(file.split('/')[-2:])}:{line}({name})"
        print(f"| {where} | {calls / iterations:.1f} | {1e3 * own / iterations:.3f} | {1e3 * cumulative / iterations:.3f} |")
    print()


def _print_phases(rows: list[dict]) -> None:
    """The --phases table: a phase per line, a column per measured (spec, seqs)."""
    print("\n| phase (host ms / iteration, median) | " + " | ".join(f"{r['spec']} x{r['num_seqs']}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label, *_ in PHASES:
        print(f"| {label} | " + " | ".join(f"{r['phases_ms_per_iteration'][label]:.3f}" for r in rows) + " |")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        sizes = [int(n) for n in FLAGS.num_seqs]
    except ValueError:
        raise app.UsageError(f"--num_seqs must be comma-separated integers; got {','.join(FLAGS.num_seqs)!r}") from None
    if not sizes or min(sizes) < 1:
        raise app.UsageError("--num_seqs needs integers >= 1")
    if FLAGS.min_tokens > FLAGS.max_tokens:
        raise app.UsageError(f"--min_tokens ({FLAGS.min_tokens}) exceeds --max_tokens ({FLAGS.max_tokens})")
    import eagle3_jax as e3

    with cli.usage_errors("--spec"):
        specs = [(name, e3.SpecConfig.parse(name)) for name in FLAGS.spec]
    if FLAGS.through_engine and (FLAGS.phases or FLAGS.profile):
        raise app.UsageError("--phases and --profile time the scheduler's own loop: leave them out with --through_engine")
    if FLAGS.stop_string is not None and not FLAGS.detokenize:
        raise app.UsageError("--stop_string needs --detokenize (stop strings are matched on the decoded text)")
    target = e3.load_target(FLAGS.target)
    tokenizer = None
    if FLAGS.detokenize:
        from eagle3_jax.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(FLAGS.target)
    draft = e3.load_draft(FLAGS.draft, target=target) if any(s is not None for _, s in specs) else None
    if FLAGS.through_engine:
        rows = _measured_rows(_measure_through_engine, ENGINE_COLUMNS, target, draft, specs, sizes, tokenizer)
    else:
        rows = _on_the_scheduler(target, draft, specs, sizes, tokenizer)
    if FLAGS.json_out:
        record = {"command": " ".join(["python"] + sys.argv), "date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
                  "overlap": FLAGS.overlap, "detokenize": FLAGS.detokenize, "stop_string": FLAGS.stop_string,
                  "through_engine": FLAGS.through_engine,
                  "stand_in_device": FLAGS.stand_in_device, "rows": rows}
        with open(FLAGS.json_out, "w") as f:
            json.dump(record, f, indent=1)


def _measured_rows(measure, columns: tuple, target, draft, specs: list, sizes: list[int], tokenizer) -> list[dict]:
    """`measure`'s figures for each (spec, seqs), printed as a table of `columns` as they come."""
    print("| spec | seqs | " + " | ".join(header for header, _ in columns) + " |\n|---|---|" + "---|" * len(columns))
    rows = []
    for name, spec in specs:
        for n in sizes:
            try:
                row = dict(spec=name, **measure(target, draft, spec, n, tokenizer))
            finally:
                gc.unfreeze()  # the next measurement's collections may free this one's scheduler
            rows.append(row)
            print(f"| {name} | {n} | " + " | ".join(_cell(cell, row) for _, cell in columns) + " |", flush=True)
    return rows


def _cell(template: str, row: dict) -> str:
    """A table cell of `row`'s figures, "-" where one is missing (None)."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    return "-" if any(row[name] is None for name in names) else template.format(**row)


def _on_the_scheduler(target, draft, specs: list, sizes: list[int], tokenizer) -> list[dict]:
    """The default rows (the scheduler driven directly), printed as they come, then the --phases table."""
    rows = _measured_rows(_measure, SCHEDULER_COLUMNS, target, draft, specs, sizes, tokenizer)
    if FLAGS.phases:
        _print_phases(rows)
    return rows


if __name__ == "__main__":
    cli.run(main)
