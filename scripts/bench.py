"""Serving benchmark: plain decoding vs EAGLE-3 under concurrent load, in the AMD blog's shape.

Runs every (speculation setting x concurrency x seed) cell the way `vllm bench serve
--max-concurrency C --request-rate inf` does: at most C requests in flight, the next submitted as
one finishes, 2 x C warm-up requests then 10 x C measured ones per cell (by default). Every
request generates exactly the workload's output length (ignore-EOS), so all settings do the same
work. Reports output tokens/s (also per device), requests/s, TTFT, TPOT, ITL and E2E latency
(mean, median, p99), tau and per-position acceptance, and each setting's speedup over the no-spec
cell of the same run; writes <out_dir>/<name>.json (everything, with the command line, machine and
date), <name>.md (the table), <name>_throughput.png and <name>_tpot.png (titled with the model,
machine and workload), and prints the table. The default <name> of a --base_url run ends in
`_http`, so it does not overwrite an in-process run's files.

In-process (the default), on the bundled demo pair, InferenceX 1k1k scaled by 1/16 (64 in / 64 out):

    python scripts/bench.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --spec=none,chain:3:1:4,tree:5:4:16 --workload=random --shape=1k1k --scale=0.0625 \\
        --concurrency=4,8,16

A dataset workload (chat-templated first turns, fixed output length), two seeds:

    python scripts/bench.py --workload=mt_bench --output_len=128 --concurrency=1,4 --seeds=0,1

Two-turn chat sessions (every MT-Bench first turn, and every second turn after the conversation so
far, the target's own greedy answer included; answers are generated before the run):

    python scripts/bench.py --workload=mt_bench_multiturn --output_len=64 --concurrency=1,16

An agent trace (contexts growing by answers and tool results; the hit rate from a cold cache):
    python scripts/bench.py --workload=agentic --output_len=64 --concurrency=4 --prefix_caching --num_pages=2048

Against a running server (scripts/serve.py or any OpenAI-compatible /v1/completions that streams
and honours ignore_eos); --target then only supplies the tokenizer and vocabulary, and --spec names
the one setting the server runs:

    python scripts/bench.py --base_url=http://localhost:8000 --target=checkpoints/kimi-mini \\
        --spec=chain:3:1:4 --concurrency=1,4,16

On several hosts (one process per host, same command, see BUILD.md "Multi-host"), add
--distributed and a --mesh over all devices; every process drives the same requests and process 0
writes the report.

Speculation settings: `none`, `chain:num_steps:topk:num_draft_tokens` (topk 1, num_draft_tokens =
num_steps + 1), `tree:num_steps:topk:num_draft_tokens` (an EAGLE-2 dynamic tree) and `auto` /
`auto:K` (adaptive: each step runs no speculation or a chain of 1..K draft tokens, whichever its
measured step times and running acceptance rates say is fastest; cells record the steps each
shape ran). Each cell also records the scheduler's host time per iteration (`--nooverlap` turns
off the overlap of host and device work, to measure what it saves).
Mistakes in the flags, paths or inputs end the script with one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import app, flags

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import flags as shared_flags  # noqa: E402
from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import (  # noqa: E402
    check_draft_path,
    check_max_seq_len,
    check_target_path,
    define_kv_cache_flags,
    define_max_seq_len_flags,
    define_runtime_flags,
    define_quant_flags,
    runtime_from_flags,
    quant_options,
    warn_without_chat_template,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder (HF or Orbax). With --base_url only its "
                    "config.json and tokenizer are read (vocabulary, max length, prompts).")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder, used by the speculative "
                    "settings (ignored with --base_url).")
flags.DEFINE_string("tokenizer", None, "Folder (tokenizer.json, or Kimi's tiktoken.model layout) or tokenizer "
                    "file to tokenize with (default: --target).")
flags.DEFINE_list("spec", ["none", "chain:3:1:4", "tree:5:4:16"], "Speculation settings: none, "
                  "chain:num_steps:topk:num_draft_tokens, tree:num_steps:topk:num_draft_tokens, auto[:K] "
                  "(adaptive). With --base_url, "
                  "exactly one: the setting the server runs (a label only).")
flags.DEFINE_string("workload", "random", "random (fixed-shape random tokens, see --shape/--scale), a dataset: "
                    "mt_bench, gsm8k, sharegpt, spec_bench (first user turns, see --output_len), or "
                    "mt_bench_multiturn (first turns and second turns after the target's own answers), or agentic "
                    "(8 agent sessions of up to 4 turns growing by the target's answer and a ~384-token tool result).")
flags.DEFINE_enum("shape", "1k1k", ["1k1k", "1k8k", "8k1k"], "InferenceX input/output shape of the random workload "
                  "(1024/1024, 1024/8192, 8192/1024 tokens), times --scale.")
flags.DEFINE_float("scale", 0.0625, "Multiplies the random shape's lengths (0.0625: 1k1k -> 64/64); 1 = full size.")
flags.DEFINE_integer("output_len", 128, "Tokens generated per request by dataset workloads.", lower_bound=1)
flags.DEFINE_string("data_dir", None, "Folder holding the dataset files (default: the repository's data/).")
flags.DEFINE_list("concurrency", ["4", "8", "16", "32", "64"], "Max requests in flight, one cell each.")
flags.DEFINE_integer("num_prompts", None, "Measured requests per cell (default: 10 x concurrency, at least "
                     "--min_prompts).", lower_bound=1)
flags.DEFINE_integer("min_prompts", 0, "Least measured requests per cell when --num_prompts is not given (a cell "
                     "at concurrency 1 with 10 requests lasts under a second on a small model: too short to time).",
                     lower_bound=0)
flags.DEFINE_integer("min_warmups", 0, "Least warm-up requests per cell when --num_warmups is not given (adaptive "
                     "speculation times its shapes at each batch and context size first).", lower_bound=0)
flags.DEFINE_integer("num_warmups", None, "Unmeasured warm-up requests per cell (default: 2 x concurrency, at least "
                     "--min_warmups).",
                     lower_bound=0)
flags.DEFINE_list("seeds", ["0"], "Seeds (prompts, per-request sampling); every cell runs once per seed and the "
                  "table shows the mean over seeds.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature of every request; 0 = greedy.", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "Top-p of every request (with --temperature > 0); 1 = the whole distribution.")
flags.DEFINE_integer("top_k", 0, "Top-k of every request (with --temperature > 0); 0 = no top-k.", lower_bound=0)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype of the weights.")
define_quant_flags()
define_max_seq_len_flags("Prompt + output tokens per sequence. Workloads must fit it; default: the model's "
                         "max_position_embeddings for that check, and the workload's longest prompt plus output "
                         "for the scheduler.")
flags.DEFINE_integer("page_size", None, "KV-cache page size in tokens (default: the scheduler's).", lower_bound=1)
flags.DEFINE_integer("prefill_chunk", None, "Prompt tokens per prefill chunk (default: the scheduler's).", lower_bound=1)
flags.DEFINE_integer("num_pages", None, "KV-cache pages per scheduler (default: max_seq_len for each of the most "
                     "concurrent requests; a prefix cache keeps what running requests leave free).", lower_bound=2)
flags.DEFINE_integer("max_measure_attempts", 3, "Measured passes per cell at most: a pass during which XLA "
                     "compiled a program is repeated, as the compile stalls the requests in flight.", lower_bound=1)
flags.DEFINE_integer("repeats", 1, "Clean measured passes per cell (warm-ups once); the cell reports the pass with "
                     "the median output throughput and records every pass's, as one pass on a shared machine can run "
                     "10-20% off. With --interleave every setting runs each pass in turn.", lower_bound=1)
flags.DEFINE_bool("interleave", True, "Run all settings at each concurrency in turn (one scheduler each, all held at "
                  "once) so slow spells hit every setting alike, their order rotating from one (seed, concurrency) to the "
                  "next; --nointerleave runs the settings one after another.")
define_runtime_flags("In-process runs only: every process drives the same requests (the scheduler's steps "
                  "depend only on them); process 0 writes and prints the report.")
flags.DEFINE_string("base_url", None, "Benchmark the server at this URL (e.g. http://localhost:8000) over HTTP "
                    "instead of running the model in-process.")
flags.DEFINE_string("model", None, "Model name sent to the server (default: the first id of GET /v1/models).")
flags.DEFINE_integer("num_devices", None, "Devices behind the figures, for tokens/s per device (default: the "
                     "in-process target's devices; 1 with --base_url).", lower_bound=1)
flags.DEFINE_string("out_dir", "benchmarks/results", "Folder for <name>.json, <name>.md and the two PNG plots.")
flags.DEFINE_string("name", None, "File stem of the outputs (default: <target>_random-<shape>_x<scale>, or "
                    "<target>_<dataset>_out<output_len>; with --base_url, followed by _http).")
flags.DEFINE_bool("progress", True, "Show tqdm progress bars.")
cli.define_overwrite_flag("reports (<out_dir>/<name>.json, .md, _throughput.png, _tpot.png)")
flags.adopt_module_key_flags(shared_flags)
flags.adopt_module_key_flags(cli)
define_kv_cache_flags(False, "In-process: the schedulers keep a prefix cache (reports then show its hit rate; a "
                          "cell measured again after a compile finds its own prompts cached). Over HTTP the server's "
                          "own settings apply, and reports show its hit rate from /metrics.")
flags.DEFINE_list("synthetic_acceptance", None, "Benchmarking only: force verification to accept these per-position "
                  "rates (non-increasing, in [0, 1]; rate d: a step accepts at least d draft tokens), e.g. 0.9,0.8,0.7, "
                  "to measure the speculative step's cost at a realistic acceptance without a trained draft. Outputs are "
                  "then not the target's, reports say 'synthetic acceptance', and over HTTP the server must run with "
                  "--allow_synthetic_acceptance.")
flags.DEFINE_bool("overlap", True, "In-process: the scheduler launches each step before reading the previous one's "
                  "tokens (--nooverlap: launch, wait, read, the older way; to measure what overlap saves).")


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    from eagle3_jax.bench import flag_checks  # no JAX: a flag mistake answers at once

    with cli.usage_errors():
        flag_checks.check_file_stem(FLAGS.name)
    check_target_path("--target", FLAGS.target)
    check_draft_path("--draft", FLAGS.draft)

    import jax

    import eagle3_jax as e3
    from eagle3_jax.bench import report as report_lib
    from eagle3_jax.bench import serving_run
    from eagle3_jax.bench.runner import RunConfig, ordered
    from eagle3_jax.bench.settings import parse_specs  # looked up here: benchmarks/harness/aa-noise-floor.py wraps it
    from eagle3_jax.bench.workloads import template_dir
    from eagle3_jax.text.tokenizer import load_tokenizer

    report_lib.pyplot()  # the plots' matplotlib (the bench extra): missing, say so before the run, not after it

    with cli.usage_errors("--spec"):
        settings = ordered(parse_specs(FLAGS.spec))
    with cli.usage_errors():
        serving_run.check_server_choices(settings, FLAGS.base_url, bool(FLAGS.mesh or FLAGS.distributed))
    mesh = runtime_from_flags()
    with cli.usage_errors():
        serving_run.check_workload_choice(FLAGS.workload, FLAGS.base_url)
        cfg = RunConfig(concurrencies=flag_checks.int_list(FLAGS.concurrency, "concurrency", 1),
                        seeds=flag_checks.int_list(FLAGS.seeds, "seeds", 0), num_prompts=FLAGS.num_prompts,
                        num_warmups=FLAGS.num_warmups, min_prompts=FLAGS.min_prompts, min_warmups=FLAGS.min_warmups,
                        temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
                        interleave=FLAGS.interleave, progress=FLAGS.progress,
                        max_measure_attempts=FLAGS.max_measure_attempts, repeats=FLAGS.repeats,
                        synthetic_acceptance=flag_checks.rates(FLAGS.synthetic_acceptance))
        serving_run.check_synthetic_acceptance(cfg, settings)

    model_cfg = e3.load_model_config(FLAGS.target)
    limit = model_cfg.max_position_embeddings
    if FLAGS.max_seq_len is not None:
        limit = check_max_seq_len(FLAGS.max_seq_len, model_cfg.max_position_embeddings)
    tok_dir = FLAGS.tokenizer or FLAGS.target
    tokenizer = load_tokenizer(tok_dir, bos_id=model_cfg.bos_token_id)
    if FLAGS.workload != "random":
        warn_without_chat_template(template_dir(tok_dir), f"the {FLAGS.workload} prompts")
    load_target = lambda: e3.load_target(FLAGS.target, dtype=FLAGS.dtype, mesh=mesh, **quant_options())  # noqa: E731
    with cli.usage_errors():
        workload, target = serving_run.load_workload(
            FLAGS.workload, shape=FLAGS.shape, scale=FLAGS.scale, output_len=FLAGS.output_len, data_dir=FLAGS.data_dir,
            tokenizer=tokenizer, template_dir=template_dir(tok_dir), model_vocab_size=model_cfg.vocab_size,
            max_seq_len=limit, load_target=load_target)
    name = FLAGS.name or serving_run.default_name(FLAGS.target, workload, over_http=bool(FLAGS.base_url))
    cli.check_not_input("--out_dir", FLAGS.out_dir, {"--target": FLAGS.target, "--draft": FLAGS.draft,
                                                      "--data_dir": FLAGS.data_dir})
    try:  # before the run: an earlier report in the way is said now, not after an hour of measuring
        report_lib.check_report_paths(FLAGS.out_dir, name, overwrite=FLAGS.overwrite)
    except ValueError as e:
        raise app.UsageError(f"--out_dir / --name: {e}") from None
    warning = serving_run.too_few_requests_warning(cfg)
    if warning:
        cli.warn(warning)
    config = serving_run.run_record_config(cfg, dtype=FLAGS.dtype, limit=limit, page_size=FLAGS.page_size,
                                           prefill_chunk=FLAGS.prefill_chunk, target=FLAGS.target)

    if FLAGS.base_url:
        try:
            run = serving_run.run_over_http(FLAGS.base_url, settings[0], workload, cfg, config, model=FLAGS.model,
                                            num_devices=FLAGS.num_devices)
        except ConnectionError as e:  # no server there: the user's --base_url or a server not started
            raise app.UsageError(f"--base_url: {e}") from None
    else:
        run = serving_run.run_in_process(
            settings, workload, cfg, config, target=target, load_target=load_target, mesh=mesh,
            load_draft=lambda loaded: e3.load_draft(FLAGS.draft, target=loaded, dtype=FLAGS.dtype,
                                                    fp8_format=FLAGS.fp8_format),
            draft_path=FLAGS.draft, max_seq_len=FLAGS.max_seq_len, page_size=FLAGS.page_size,
            prefill_chunk=FLAGS.prefill_chunk, num_devices=FLAGS.num_devices, overlap=FLAGS.overlap,
            prefix_caching=FLAGS.prefix_caching, kv_cache_dtype=FLAGS.kv_cache_dtype, num_pages=FLAGS.num_pages,
            host_kv_cache_gb=FLAGS.host_kv_cache_gb)

    if jax.process_index() > 0:  # multi-host: process 0 reports
        return
    report = report_lib.build_report(run.cells, settings=[s.name for s in settings], workload=workload.info,
                                     config=run.config, argv=sys.argv, mode=run.mode)
    paths = report_lib.write_report(report, FLAGS.out_dir, name, overwrite=FLAGS.overwrite)
    print()
    print(report_lib.markdown(report))
    print("wrote " + ", ".join(paths.values()))
    if any(r["identical_to_no_spec"] is False for r in report["rows"]):
        sys.exit("greedy outputs of a speculative setting differ from no-spec decoding")


if __name__ == "__main__":
    cli.run(main)
