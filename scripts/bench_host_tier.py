"""The prefix cache's host tier on an agent trace: hit rate and the TTFT of returning turns.

Agent sessions (bench/workloads.py's agentic trace: a GSM8K task, then turn after turn the
conversation so far, the target's own answer and a tool result) are played in turn order, every
session's first turn, then every second turn, ..., --concurrency at a time, greedy, EAGLE-3
speculation (--spec), prefix caching on, in three settings:

- unbounded: a device pool that holds every session's pages at once;
- pool/4 (--pool_fraction): a device pool holding a quarter of them, no host tier: a session's
  pages are evicted while the others run, and its next turn computes them again;
- pool/4 + host: the same pool with a host tier of --host_kv_cache_gb.

Each setting's scheduler plays the trace once unmeasured (its programs compiled), empties its
caches, then plays it measured (again, up to 3 times, while a program compiles during it). Greedy
outputs must be identical across the three. Writes --json_out (command, machine, date, figures).

    python scripts/bench_host_tier.py --json_out=benchmarks/results/host-tier-agentic.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder (with a chat template).")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder.")
flags.DEFINE_string("spec", "chain:3:1:4", "Speculation of every setting.")
flags.DEFINE_integer("sessions", 32, "Agent sessions (8 times --concurrency: most wait for their tool).", lower_bound=1)
flags.DEFINE_integer("turns", 4, "Turns per session at most (a session stops at the first that does not fit "
                     "--max_seq_len).", lower_bound=2)
flags.DEFINE_integer("tool_tokens", 64, "Tokens of each tool result.", lower_bound=1)
flags.DEFINE_integer("output_len", 32, "Tokens generated per turn (EOS ignored).", lower_bound=1)
flags.DEFINE_integer("concurrency", 4, "Requests in flight.", lower_bound=1)
flags.DEFINE_integer("max_seq_len", 512, "Scheduler max_seq_len (kimi-mini has 512 positions).", lower_bound=2)
flags.DEFINE_integer("page_size", 16, "KV page size.", lower_bound=1)
flags.DEFINE_float("pool_fraction", 0.25, "The small pool's share of the pages every session holds at its end.",
                   lower_bound=0.01, upper_bound=1.0)
flags.DEFINE_float("host_kv_cache_gb", 1.0, "The host tier of the third setting.", lower_bound=0.0)
flags.DEFINE_string("json_out", None, "Write the figures here as JSON.")
cli.define_overwrite_flag("a --json_out file")


def returning(prompts: list[tuple[int, ...]]) -> list[bool]:
    """Whether each prompt continues an earlier one (a session's later turn)."""
    return [any(p[: len(q)] == q for q in prompts[:i]) for i, p in enumerate(prompts)]


def session_pages(prompts: list[tuple[int, ...]], output_len: int, page_size: int) -> int:
    """Pages every session holds at its end: its last turn's prompt and answer."""
    last = [p for i, p in enumerate(prompts) if not any(q[: len(p)] == p for q in prompts[i + 1:])]
    return sum(-(-(len(p) + output_len) // page_size) for p in last)


def measure(sched, name: str, prompts, later: list[bool], sampling) -> dict:
    """The trace from empty caches, measured (see the module doc)."""
    from eagle3_jax.bench.metrics import ttft_s
    from eagle3_jax.bench.runner import drive

    drive(sched, prompts, lambda i: sampling, FLAGS.concurrency, tag=f"{name}-warm-up")
    for attempt in range(1, 4):
        sched.reset_prefix_cache()
        before, compiles = sched.stats(), sched.programs.num_compiles
        records, wall = drive(sched, prompts, lambda i: sampling, FLAGS.concurrency, tag=f"{name}-{attempt}")
        after, compiles = sched.stats(), sched.programs.num_compiles - compiles
        if not compiles:
            break
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    ttft = [ttft_s(r) * 1e3 for r in records]
    tokens = sum(len(r.token_ids) for r in records)
    return {"wall_s": wall, "throughput_tok_s": tokens / wall,
            "hit_rate": delta["prefix_cache_hits_total"] / delta["prefix_cache_queries_total"],
            "host_hit_rate": delta["prefix_cache_host_hits_total"] / delta["prefix_cache_queries_total"],
            "ttft_returning_mean_ms": statistics.mean(t for t, r in zip(ttft, later) if r),
            "ttft_first_turn_mean_ms": statistics.mean(t for t, r in zip(ttft, later) if not r),
            "prompt_tokens_computed": delta["prompt_tokens_total"], "preemptions": delta["num_preemptions"],
            "host_tier": {k: delta.get(k, 0) for k in ("host_kv_pages_saved_total", "host_kv_bytes_saved_total",
                                                       "host_kv_pages_restored_total", "host_kv_bytes_restored_total",
                                                       "host_kv_restore_seconds_total")},
            "pages_free_at_end": after["num_free_pages"] == after["num_pages"],
            "compiles_while_measured": compiles, "measure_attempts": attempt, "tokens": [r.token_ids for r in records]}


def main(argv) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    import eagle3_jax as e3
    from eagle3_jax.bench.workloads import agentic_workload
    from eagle3_jax.scheduler import Scheduler

    target = e3.load_target(FLAGS.target, dtype="float32")
    draft = e3.load_draft(FLAGS.draft, target=target, dtype="float32")
    with cli.usage_errors():
        spec = e3.SpecConfig.parse(FLAGS.spec)
        workload = agentic_workload(target=target, tokenizer_dir=FLAGS.target, output_len=FLAGS.output_len,
                                    max_seq_len=FLAGS.max_seq_len, sessions=FLAGS.sessions, turns=FLAGS.turns,
                                    tool_tokens=FLAGS.tool_tokens, max_num_seqs=FLAGS.concurrency)
    prompts, sampling = list(workload.pool), e3.SamplingParams(max_tokens=FLAGS.output_len)
    later = returning(prompts)
    all_pages = session_pages(prompts, FLAGS.output_len, FLAGS.page_size)
    small = max(int(FLAGS.pool_fraction * all_pages), 2)
    print(f"{len(prompts)} turns of {FLAGS.sessions} sessions ({sum(later)} returning), prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens; the sessions hold {all_pages} pages at their end, "
          f"the small pool {small}", flush=True)
    settings = {"unbounded": dict(num_pages=2 * all_pages + 64), "small": dict(num_pages=small),
                "small+host": dict(num_pages=small, host_kv_cache_gb=FLAGS.host_kv_cache_gb)}
    results, reference = [], None
    for name, kw in settings.items():
        sched = Scheduler(target, draft, spec, max_num_seqs=FLAGS.concurrency, max_seq_len=FLAGS.max_seq_len,
                          page_size=FLAGS.page_size, prefix_caching=True, **kw)
        row = {"setting": name, **kw, **measure(sched, name, prompts, later, sampling)}
        tokens = row.pop("tokens")
        reference = reference or tokens
        row["greedy_identical"] = tokens == reference
        results.append(row)
        print(f"  {name:11s} hit rate {row['hit_rate']:.3f} (host {row['host_hit_rate']:.3f})  TTFT returning "
              f"{row['ttft_returning_mean_ms']:7.1f} ms, first turns {row['ttft_first_turn_mean_ms']:7.1f} ms  "
              f"{row['throughput_tok_s']:6.1f} tok/s  prompt tokens computed {row['prompt_tokens_computed']}  "
              f"preemptions {row['preemptions']}  identical {row['greedy_identical']}  compiles "
              f"{row['compiles_while_measured']}", flush=True)
    base, off, on = results
    summary = {"hit_rate_vs_unbounded": on["hit_rate"] / base["hit_rate"],
               "ttft_returning_vs_no_tier": on["ttft_returning_mean_ms"] / off["ttft_returning_mean_ms"]}
    print(f"host tier: hit rate {summary['hit_rate_vs_unbounded']:.2f}x the unbounded pool's, returning-turn TTFT "
          f"{summary['ttft_returning_vs_no_tier']:.2f}x the small pool's without it")
    if FLAGS.json_out:
        record = {"command": " ".join(["python", "scripts/bench_host_tier.py", *sys.argv[1:]]),
                  "date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
                  "workload": workload.info, "sessions_pages": all_pages, "summary": summary, "results": results}
        cli.write_output("--json_out", FLAGS.json_out, json.dumps(record, indent=1) + "\n")
    if not all(r["greedy_identical"] for r in results):
        sys.exit("greedy outputs differ across the settings")


if __name__ == "__main__":
    cli.run(main)
