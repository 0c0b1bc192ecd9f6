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
  (`eagle3_jax/bench/launch_cost.py`), warm (calls back to back) and cold (each after writing twice the
  last-level cache). On a CPU host the device's programs go through the host's caches, so every
  launch and all the scheduler's Python after a program run cache-cold: the cold floor is the
  least one launch costs here, and a launch's time above it is its program's own launch work;
- a step's launch after its program: the measured run's next decode program launched again and
  again, each launch right after that program ran on an otherwise idle device (`relaunch_ms`):
  on a CPU device the least a step's launch costs, each step following some program's run;
- device-wait ms per iteration (median). Iterations that compiled a program are left out (their
  host time is compile time) and counted.

With --phases, timers around the scheduler's methods (admission, the prefill and decode launches and
their jitted calls, page growth, the speculation plan, the outputs' read, the collection of prefill
and decode results, per-token emission, finishing requests, the policy's and the counters' updates;
`eagle3_jax/bench/host_time.py` PHASES) give each phase's host ms per iteration (median), a
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

import json
import os
import sys

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


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from eagle3_jax.bench import flag_checks  # no JAX: a flag mistake answers at once

    with cli.usage_errors():
        sizes = flag_checks.num_seqs(FLAGS.num_seqs)
        flag_checks.check_token_range(FLAGS.min_tokens, FLAGS.max_tokens)
    import eagle3_jax as e3

    with cli.usage_errors("--spec"):
        specs = [(name, e3.SpecConfig.parse(name)) for name in FLAGS.spec]
    with cli.usage_errors():
        flag_checks.check_host_modes(through_engine=FLAGS.through_engine, phases=FLAGS.phases, profile=FLAGS.profile,
                                     stop_string=FLAGS.stop_string, detokenize=FLAGS.detokenize)
    from eagle3_jax.bench import host_report, host_time

    target = e3.load_target(FLAGS.target)
    tokenizer = None
    if FLAGS.detokenize:
        from eagle3_jax.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(FLAGS.target)
    draft = e3.load_draft(FLAGS.draft, target=target) if any(s is not None for _, s in specs) else None
    options = host_time.HostTimeOptions(
        prompt_len=FLAGS.prompt_len, min_tokens=FLAGS.min_tokens, max_tokens=FLAGS.max_tokens, warmup=FLAGS.warmup,
        iterations=FLAGS.iterations, overlap=FLAGS.overlap, stop_string=FLAGS.stop_string,
        stand_in_device=FLAGS.stand_in_device, phases=FLAGS.phases, profile=FLAGS.profile)
    if FLAGS.through_engine:
        from eagle3_jax.bench.host_time_engine import measure_through_engine  # (the serve extra)

        measure, columns = measure_through_engine, host_report.ENGINE_COLUMNS
    else:
        measure, columns = host_time.measure_on_scheduler, host_report.SCHEDULER_COLUMNS
    print(host_report.table_header(columns))
    rows = []
    for measurement in host_time.measured_rows(measure, target, draft, specs, sizes, options, tokenizer):
        if measurement.profiles:
            stats = host_report.merged_stats(measurement.profiles)
            print(host_report.profile_tables(stats, len(measurement.profiles), FLAGS.profile))
        rows.append(measurement.row)
        print(host_report.table_row(columns, measurement.row), flush=True)
    if FLAGS.phases:
        print(host_report.phases_table(rows))
    if FLAGS.json_out:
        record = host_report.host_time_record(
            rows, argv=sys.argv, overlap=FLAGS.overlap, detokenize=FLAGS.detokenize, stop_string=FLAGS.stop_string,
            through_engine=FLAGS.through_engine, stand_in_device=FLAGS.stand_in_device)
        with open(FLAGS.json_out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
