"""Prefix caching on the kimi-mini pair: TTFT, throughput and hit rate with and without the cache,
with and without speculation, on two workloads where prompts share prefixes.

- fewshot: GSM8K questions after the same --shots worked examples (lm-eval's few-shot prompt, one
  user turn through the model's chat template): every prompt starts with the same examples.
- multiturn: MT-bench's second turns: the first turn, the model's own answer to it, the second
  question. The first turns run first (unmeasured), so their pages are in the cache when the
  second turns arrive, as in a chat session.

Each (speculation, cache) setting gets its own scheduler, warmed up (`Scheduler.warm_up`, then
other prompts of the same workload: its programs compiled), its cache then emptied
(`Scheduler.reset_prefix_cache`, also before a repeat: a cell is measured again, up to 3 times,
while a program compiles during it); then
--num_requests requests run with --concurrency in flight (closed loop), greedy, --output_len
tokens each (EOS ignored). Greedy outputs must be identical across the four settings. Writes
--json_out (command, machine, date, figures).

    python scripts/bench_prefix_cache.py --json_out=benchmarks/results/prefix-cache.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder.")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder.")
flags.DEFINE_string("spec", "chain:3:1:4", "The speculative setting compared with plain decoding.")
flags.DEFINE_list("workloads", ["fewshot", "multiturn"], "fewshot and / or multiturn.")
flags.DEFINE_integer("shots", 1, "Worked GSM8K examples every fewshot prompt starts with (kimi-mini's 512 positions "
                     "hold one).", lower_bound=1)
flags.DEFINE_integer("num_requests", 24, "Measured requests per setting.", lower_bound=1)
flags.DEFINE_integer("num_warmups", 8, "Warm-up requests per setting (other prompts of the workload).", lower_bound=1)
flags.DEFINE_integer("concurrency", 8, "Requests in flight.", lower_bound=1)
flags.DEFINE_integer("output_len", 48, "Tokens generated per request.", lower_bound=1)
flags.DEFINE_integer("max_seq_len", 512, "Scheduler max_seq_len.", lower_bound=2)
flags.DEFINE_integer("page_size", 16, "KV page size.", lower_bound=1)
flags.DEFINE_integer("num_pages", 640, "KV pages of every setting's scheduler, the same for all (by default a "
                     "speculative scheduler would get more, for its lookahead, and so evict less).", lower_bound=2)
flags.DEFINE_string("json_out", None, "Write the figures here as JSON.")
cli.define_overwrite_flag("a --json_out file")


def fits(prompt: list[int]) -> bool:
    return len(prompt) + FLAGS.output_len <= FLAGS.max_seq_len


def fewshot_prompts(tok, render, n: int) -> list[list[int]]:
    """The first n GSM8K test prompts that fit max_seq_len with output_len."""
    from eagle3_jax.bench import gsm8k

    shots = gsm8k.load_problems(gsm8k.DEFAULT_FEWSHOT_FILE, limit=FLAGS.shots)
    problems = gsm8k.load_problems(os.path.join(ROOT, "data", "gsm8k", "test.jsonl"))
    prompts = [tok.encode(text) for text in gsm8k.render_prompts(problems, shots, multiturn=False, render=render)]
    kept = [p for p in prompts if fits(p)][:n]
    if len(kept) < n:
        raise app.UsageError(f"only {len(kept)} fewshot prompts fit --max_seq_len={FLAGS.max_seq_len} with "
                             f"--output_len={FLAGS.output_len}; lower --shots or --num_requests")
    return kept


def mt_bench_turns(n: int) -> list[list[str]]:
    with open(os.path.join(ROOT, "data", "mt_bench", "question.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["turns"][:2] for line in f if line.strip()][:n]


def drive(sched, prompts: list[list[int]], sampling, concurrency: int) -> tuple[list, float]:
    """Run prompts with `concurrency` in flight; (outputs in prompt order, wall seconds)."""
    pending, ids, done, start = list(enumerate(prompts)), {}, {}, time.perf_counter()
    while pending or sched.has_unfinished():
        while pending and len(ids) - len(done) < concurrency:
            i, prompt = pending.pop(0)
            ids[sched.add_request(prompt, sampling)] = i
        for delta in sched.step():
            if delta.finished:
                done[ids[delta.request_id]] = delta.output
    return [done[i] for i in range(len(prompts))], time.perf_counter() - start


def measure(sched, prompts, before: list[list[int]], sampling) -> dict:
    """From an empty cache, `before` (unmeasured, e.g. first turns) then `prompts`, measured; again
    (up to 3 times) while a program compiles during the measurement: the steps depend only on the
    requests, so a repeat runs the programs compiled by then."""
    for attempt in range(1, 4):
        sched.reset_prefix_cache()
        if before:
            drive(sched, before, sampling, FLAGS.concurrency)
        stats0, compiles = sched.stats(), sched.programs.num_compiles
        outs, wall = drive(sched, prompts, sampling, FLAGS.concurrency)
        stats1, compiles = sched.stats(), sched.programs.num_compiles - compiles
        if not compiles:
            break
    queries = stats1["prefix_cache_queries_total"] - stats0["prefix_cache_queries_total"]
    hits = stats1["prefix_cache_hits_total"] - stats0["prefix_cache_hits_total"]
    ttft = [o.metrics["ttft_s"] for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"requests": len(outs), "output_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_median_ms": 1e3 * statistics.median(ttft),
            "prompt_tokens_computed": stats1["prompt_tokens_total"] - stats0["prompt_tokens_total"],
            "hit_rate_tokens": hits / queries if queries else 0.0,
            "hit_requests": stats1["prefix_cache_hit_requests_total"] - stats0["prefix_cache_hit_requests_total"],
            "compiles_while_measured": compiles, "measure_attempts": attempt, "tokens": [o.token_ids for o in outs]}


def main(argv) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.text.chat_template import ChatTemplate
    from eagle3_jax.text.tokenizer import load_tokenizer

    target = e3.load_target(FLAGS.target, dtype="float32")
    draft = e3.load_draft(FLAGS.draft, target=target, dtype="float32")
    tok = load_tokenizer(FLAGS.target)
    template = ChatTemplate.from_dir(FLAGS.target)
    if not template.available:
        raise app.UsageError(f"{FLAGS.target} has no chat template; the workloads render chat prompts")
    sampling = e3.SamplingParams(max_tokens=FLAGS.output_len)  # greedy; no stop ids: EOS ignored
    n, w = FLAGS.num_requests, FLAGS.num_warmups
    results = []
    for workload in FLAGS.workloads:
        if workload == "fewshot":
            everything = fewshot_prompts(tok, template.render, n + w)
            warm, before, prompts = everything[n:], [], everything[:n]
        elif workload == "multiturn":
            turns = mt_bench_turns(10 * (n + w))
            first = [tok.encode(template.render([{"role": "user", "content": t[0]}])) for t in turns]
            turns, first = zip(*[(t, p) for t, p in zip(turns, first) if 2 * len(p) + 3 * FLAGS.output_len
                                 <= FLAGS.max_seq_len][: n + w])
            plain = Scheduler(target, max_num_seqs=FLAGS.concurrency, max_seq_len=FLAGS.max_seq_len)
            answers = [tok.decode_continuation(p, o.token_ids) for p, o in zip(first, plain.generate(first, sampling))]
            second = [tok.encode(template.render([{"role": "user", "content": t[0]}, {"role": "assistant", "content": a},
                                                  {"role": "user", "content": t[1]}]))
                      for t, a in zip(turns, answers)]
            if not all(fits(p) for p in second) or len(second) < n + w:
                raise app.UsageError("MT-bench second turns do not fit --max_seq_len; lower --output_len")
            warm, before, prompts = list(first[n:]) + second[n:], list(first[:n]), second[:n]
        else:
            raise app.UsageError(f"--workloads: unknown workload {workload!r}; give fewshot and / or multiturn")
        lengths = [len(p) for p in prompts]
        print(f"{workload}: {n} prompts of {min(lengths)}-{max(lengths)} tokens", flush=True)
        reference = None
        for spec in ("none", FLAGS.spec):
            for caching in (False, True):
                d, s = (None, None) if spec == "none" else (draft, e3.SpecConfig.parse(spec))
                sched = Scheduler(target, d, s, max_num_seqs=FLAGS.concurrency, max_seq_len=FLAGS.max_seq_len,
                                  page_size=FLAGS.page_size, num_pages=FLAGS.num_pages, prefix_caching=caching)
                sched.warm_up()  # compiles the programs of every batch and chunk bucket
                drive(sched, warm, sampling, FLAGS.concurrency)  # and of longer sequences: other prompts
                row = {"workload": workload, "spec": spec, "prefix_caching": caching, **measure(sched, prompts, before,
                                                                                              sampling)}
                tokens = row.pop("tokens")
                reference = reference or tokens
                row["greedy_identical"] = tokens == reference
                results.append(row)
                print(f"  spec={spec:12s} cache={'on ' if caching else 'off'}  {row['throughput_tok_s']:7.1f} tok/s  "
                      f"TTFT mean {row['ttft_mean_ms']:7.1f} ms  median {row['ttft_median_ms']:7.1f} ms  "
                      f"hit rate {row['hit_rate_tokens']:.2f}  prompt tokens computed {row['prompt_tokens_computed']}"
                      f"  identical {row['greedy_identical']}  compiles {row['compiles_while_measured']}", flush=True)
    if FLAGS.json_out:
        record = {"command": " ".join(["python", "scripts/bench_prefix_cache.py", *sys.argv[1:]]),
                  "date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
                  "results": results}
        cli.write_output("--json_out", FLAGS.json_out, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    cli.run(main)
