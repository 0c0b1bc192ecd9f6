"""Serve a target model (plainly or with EAGLE-3 speculation) over an OpenAI-compatible HTTP API.

    python scripts/serve.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --spec=chain:3:1:4 --max_seq_len=512 --port=8000
    python scripts/serve.py --target=/models/Kimi-K2.5 --draft=/models/Kimi-K2.5-eagle3 --dtype=bfloat16 \\
        --max_num_seqs=128 --max_seq_len=4096 --served_model_name=kimi-k2.5

Then, from another shell:

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Tom had a big red ball"}], "max_tokens": 32, "stream": true}'
    curl http://127.0.0.1:8000/metrics

or any OpenAI client with base_url http://127.0.0.1:8000/v1 (the API key is not checked).

On several hosts (one process per host, same command, see BUILD.md "Multi-host"), add
--distributed and a --mesh over all devices: process 0 listens and schedules, every other
process runs process 0's step programs on its own devices.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API), POST /v1/responses (OpenAI's Responses API, stateless;
both on the chat path), GET /v1/models, GET /health (200 while the engine runs), GET /ready (200 once
a lone request's programs are compiled), GET /metrics (Prometheus). Chat messages go through the tokenizer folder's chat template (the
bundled demo models carry one), or --chat_template=<file.jinja>; --chat_template=join joins their
contents with newlines on any model; without a template, chat requests get a 400 naming the flag.
Chat replies carry OpenAI `tool_calls` and `reasoning_content` as --tool_call_parser and
--reasoning_parser parse them (by default the model family's parsers; images and video are not
served). Requests run in a continuous-batching `Scheduler` (up to --max_num_seqs at once, paged
KV cache) driven by one engine thread; see eagle3_jax/serving/fields.py and messages.py for the
accepted request fields. The server listens on loopback only unless --host says otherwise; it
has no authentication, so expose it only behind something that has. Ctrl-C stops it.

The port is checked before the model loads: a busy port, like any other mistake in the flags,
paths or checkpoints, ends the script with one line on stderr and exit status 2. A request whose
max_tokens is cut to fit --max_seq_len, or that carries fields the server ignores, is answered
with a `warnings` list and an X-Eagle3-Warnings header (see eagle3_jax/serving/fields.py).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import flags

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import flags as shared_flags  # noqa: E402
from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import (  # noqa: E402
    chat_template_from_flags,
    check_draft_path,
    check_max_seq_len,
    check_target_path,
    define_chat_template_flag,
    define_kv_cache_flags,
    define_max_seq_len_flags,
    define_runtime_flags,
    define_quant_flags,
    define_spec_flags,
    runtime_from_flags,
    quant_options,
    spec_from_flags,
)
from eagle3_jax.cli.serve_flags import (  # noqa: E402
    check_port_free,
    scheduler_options,
    served_model_name,
    tokenizer_dir,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target model: HF folder (safetensors + config.json) or Orbax folder from "
                    "scripts/convert.py.")
flags.DEFINE_string("draft", None, "EAGLE-3 draft folder (HF LlamaForCausalLMEagle3 layout); unset = plain decoding.")
define_spec_flags()
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype of the weights.")
define_quant_flags()
flags.DEFINE_string("tokenizer", None, "Folder (tokenizer.json, or Kimi's tiktoken.model "
                    "layout) or tokenizer file to tokenize with; the chat template is read from its folder (default: "
                    "--target).")
flags.DEFINE_string("served_model_name", None, "Model name clients pass as `model` (default: the basename of --target).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on; the default is loopback only "
                    "(0.0.0.0 = every interface).")
flags.DEFINE_integer("port", 8000, "TCP port to listen on.", lower_bound=0, upper_bound=65535)
flags.DEFINE_string("api_key", None, "Require this key on /v1 routes: `Authorization: Bearer <key>` or `x-api-key: "
                    "<key>` (Anthropic clients' header); /health and /metrics stay open (default: no key).")
flags.DEFINE_integer("max_num_seqs", 64, "Requests running at once (the decode batch); more wait in a queue.",
                     lower_bound=1)
define_max_seq_len_flags("Prompt + generated tokens per request (default: min(model max positions, 2048)).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV cache page.", lower_bound=1)
flags.DEFINE_integer("num_pages", None, "KV cache pages in the pool (default: enough for max_num_seqs "
                     "sequences of max_seq_len tokens).", lower_bound=1)
flags.DEFINE_integer("context_parallel_len", None, "On a mesh with a data axis: requests of this many tokens or more "
                     "(prompt + max tokens) are spread over every data shard, each holding and reading a share of "
                     "their KV (default: more than a row's share of --num_pages).", lower_bound=1)
flags.DEFINE_integer("prefill_chunk", 256, "Prompt tokens prefilled per scheduler step: the longest chunk of one "
                     "prompt, and the budget shared by the requests prefilling in that step.", lower_bound=1)
flags.DEFINE_integer("max_compiled_programs", None, "Compiled step programs kept, the least recently used dropped "
                     "past it (--warmup compiles at most this many); default 48, or 96 with --spec=auto. On a CPU "
                     "each holds hundreds of memory mappings, and fewer are kept (said once) where more would pass "
                     "vm.max_map_count; on an accelerator raise it so that the warm-up covers larger batches.",
                     lower_bound=2)
define_runtime_flags("Process 0 serves HTTP and schedules; the other processes run its steps on their devices.")
flags.DEFINE_bool("warmup", True, "Compile the programs of bursts of up to --max_num_seqs requests of up to one "
                  "--prefill_chunk, for greedy and sampled batches (within the program cache's bound), a lone greedy "
                  "request's first, while listening: one at a time whenever no request runs; GET /ready answers 200 "
                  "once a lone request's are compiled (--nowarmup: each compiles on first use).")
flags.DEFINE_bool("warmup_before_listening", False, "With --warmup, compile them all before listening instead.")
flags.DEFINE_integer("max_logprobs", 20, "Most top alternatives a request may ask for per token (completions "
                     "`logprobs`, chat `top_logprobs`).", lower_bound=0)
flags.DEFINE_enum("logprobs_mode", "raw", ["raw", "processed"], "Which distribution logprobs are read from: raw (the "
                  "target's, before any sampling setting; vLLM's default) or processed (what each token was sampled "
                  "or judged from: after min_tokens, temperature and, when sampled, top-k / top-p).")
define_kv_cache_flags(True, "Keep full KV pages after their request ends, keyed by their tokens, so requests "
                          "that share a prefix (a system prompt, earlier turns, the n choices of one request) compute "
                          "it once; least recently used pages are evicted when pages run short (--noprefix_caching to "
                          "turn it off).")
flags.DEFINE_bool("allow_synthetic_acceptance", False, "Benchmarking only: let requests carry `synthetic_acceptance` "
                  "(per-position rates a speculative step is forced to accept; their outputs are then not the model's), "
                  "as scripts/bench.py --synthetic_acceptance sends. Off: such requests get a 400.")
define_chat_template_flag()
_PARSER_HELP = ("auto = the one the model's family uses (from config.json's model_type and the chat template; said at "
                "start), none = off")
flags.DEFINE_enum("tool_call_parser", "auto", ["auto", "none", "kimi_k2", "minimax_m2", "deepseek_v3", "deepseek_v31",
                                               "llama3_json"],
                  "How chat replies to requests with `tools` are parsed into OpenAI `tool_calls` (vLLM's parser "
                  f"names): {_PARSER_HELP}.")
flags.DEFINE_enum("reasoning_parser", "auto", ["auto", "none", "kimi_k2", "deepseek_r1", "deepseek_v3", "minimax_m2",
                                               "minimax_m2_append_think"],
                  "How chat replies are split into `reasoning_content` (also sent as `reasoning`) and `content` "
                  f"(vLLM's parser names): {_PARSER_HELP}.")
flags.mark_flag_as_required("target")
# --help lists the shared flags (speculation, mesh, kernels, quantization, --verbose) with the script's own
flags.adopt_module_key_flags(shared_flags)
flags.adopt_module_key_flags(cli)


def say(message: str) -> None:
    """A progress line for the operator (logging stays at WARNING unless --verbose)."""
    print(f"serve.py: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    spec = spec_from_flags(has_draft=FLAGS.draft is not None)
    check_target_path("--target", FLAGS.target)
    check_draft_path("--draft", FLAGS.draft)
    import jax

    import eagle3_jax as e3  # imported here so that --help works without loading JAX
    from eagle3_jax.runtime import compile_cache, host_allocator
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.serving import AsyncEngine, launch, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok_path = FLAGS.tokenizer or FLAGS.target
    mesh = runtime_from_flags()
    leader = jax.process_index() == 0
    if leader:  # process 0 listens: a busy port fails now, not after a long load and warm-up
        check_port_free(FLAGS.host, FLAGS.port)
    # config, tokenizer and length first: their errors come before a long weight load
    cfg = e3.load_model_config(FLAGS.target)
    tok = load_tokenizer(tok_path, bos_id=cfg.bos_token_id)
    max_seq_len = check_max_seq_len(FLAGS.max_seq_len, cfg.max_position_embeddings)
    chat_template = chat_template_from_flags(tokenizer_dir(tok_path), required=False)
    parsers = launch.output_parsers(cfg.model_type, chat_template, FLAGS.tool_call_parser, FLAGS.reasoning_parser)
    for flag in parsers.auto:
        say(f"--{flag}={getattr(parsers, flag) or 'none'} (auto, for model_type {cfg.model_type}; set --{flag} to "
            "change it)")
    if not chat_template.available:
        cli.warn(f"{tokenizer_dir(tok_path)} has no chat template: /v1/chat/completions answers 400 (use "
                  "/v1/completions, or restart with --chat_template=<file.jinja> or --chat_template=join)")
    target = e3.load_target(FLAGS.target, dtype=FLAGS.dtype, mesh=mesh, **quant_options())
    draft = None if FLAGS.draft is None else e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype,
                                                            fp8_format=FLAGS.fp8_format)
    with cli.usage_errors():  # what the flags ask of the scheduler (pages, chunk, a spec the draft cannot run)
        scheduler = Scheduler(target, draft=draft, spec=spec, max_seq_len=max_seq_len, tokenizer=tok,
                              **scheduler_options())
    model_name = served_model_name(FLAGS.served_model_name, FLAGS.target)
    if not leader:  # multi-host follower: mirror process 0's steps until it stops
        say(f"process {jax.process_index()}: running process 0's steps on this host's devices")
        steps = scheduler.follow()
        say(f"process 0 stopped serving after {steps} steps")
        return
    if jax.process_count() > 1:
        scheduler.lead()

    say(str(compile_cache.status()))  # (after every check of the flags: a mistake is one line)
    say(f"host allocator: {host_allocator.describe(FLAGS.tcmalloc)}")
    engine = AsyncEngine(scheduler, tokenizer=tok).start()
    if FLAGS.warmup and FLAGS.warmup_before_listening:
        say("warming up: compiling the prefill and decode programs of the first bursts...")
        say(f"warm-up {engine.warm_up()} (not counted in /metrics)")
    launch.settle_heap()
    application = make_app(engine, model_name, max_seq_len=max_seq_len,
                           eos_token_ids=launch.stop_ids(cfg.eos_token_ids, tok.eos_ids), chat_template=chat_template,
                           allow_synthetic_acceptance=FLAGS.allow_synthetic_acceptance,
                           tool_call_parser=parsers.tool_call_parser, reasoning_parser=parsers.reasoning_parser,
                           api_key=FLAGS.api_key)
    mode = "plain decoding" if spec is None else f"EAGLE-3 {spec}"
    if FLAGS.allow_synthetic_acceptance:
        say("--allow_synthetic_acceptance: requests may force speculative acceptance (benchmarking only; their "
            "outputs are not the model's)")
    say(f"serving {FLAGS.target} as {model_name!r} ({mode}, max_num_seqs {FLAGS.max_num_seqs}, max_seq_len "
        f"{max_seq_len}) on http://{FLAGS.host}:{FLAGS.port}/v1")
    if FLAGS.warmup and not FLAGS.warmup_before_listening:
        queued = engine.warm_up(background=True, progress=say)
        say(f"warming up while listening: {queued} programs to compile, a lone request's first (GET /ready: 503 "
            "until they are; requests are taken meanwhile)")
    try:
        launch.serve_until_stopped(application, engine, FLAGS.host, FLAGS.port)
    finally:
        scheduler.release_followers()  # after the engine thread stopped: no step runs beside it


if __name__ == "__main__":
    cli.run(main)
