"""GSM8K accuracy with and without EAGLE-3 speculation, scored as lm-evaluation-harness's `gsm8k` task.

Asks the GSM8K test questions (`--limit` of them, default all 1,319) with `--num_fewshot` worked
examples from the train split as earlier chat turns (lm-eval `--apply_chat_template
--fewshot_as_multiturn`; `--nofewshot_as_multiturn` puts them all in one user turn), decodes
greedily up to `--max_tokens` or a stop string (`Question:`, `</s>`, `<|im_end|>`), and scores
each run with lm-eval's two filters, `strict-match` (`#### N`) and `flexible-extract` (the last
number), with the standard error lm-eval prints. Also prints, per run, tau (mean acceptance
length) and output tokens/s, and for every run after the first how often its completions and
extracted answers are identical to the first run's. See eagle3_jax/bench/gsm8k.py for the exact
rules.

In-process, every --spec setting runs in turn through a continuous-batching Scheduler
(`--concurrency` requests in flight) on the same target; `none` runs first and is the reference
of the agreement figures:

    python scripts/eval_gsm8k.py --target=/models/Kimi-K2.5 --draft=/models/Kimi-K2.5-eagle3 \\
        --dtype=bfloat16 --mesh=1,1,8 --spec=none,chain:3:1:4 --output=gsm8k.json

    # the small bundled demo pair (512-token context: no few-shot examples, short answers)
    python scripts/eval_gsm8k.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --num_fewshot=0 --max_tokens=64 --limit=20

Against OpenAI-compatible servers (`/v1/chat/completions`; each applies its own chat template and
runs its own speculation), one run per --base_url, compared with the first:

    python scripts/eval_gsm8k.py --base_url=http://127.0.0.1:8000,http://127.0.0.1:8001 \\
        --labels=no-spec,chain --concurrency=32

Stop strings go to the server when it takes them (vLLM, SGLang); scripts/serve.py takes stop
token ids only, so its completions run to EOS or --max_tokens and are cut here (same text, more
tokens generated). Output tokens/s counts every token the engine generated, over the run's wall
time, after a warm-up pass over the first --concurrency questions (--nowarmup skips it) that
compiles most programs; in-process, compilations during the timed run are reported beside it.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Sequence

from absl import app, flags

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import flags as shared_flags  # noqa: E402
from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import (  # noqa: E402
    chat_template_from_flags,
    check_draft_path,
    check_target_path,
    define_chat_template_flag,
    define_mesh_flags,
    define_quant_flags,
    mesh_from_flags,
    quant_options,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target model folder (HF or Orbax) for in-process runs.")
flags.DEFINE_alias("model", "target")
flags.DEFINE_string("draft", None, "EAGLE-3 draft folder, needed by the speculative --spec settings.")
flags.DEFINE_string("tokenizer", None, "Folder (tokenizer.json, or Kimi's tiktoken.model "
                    "layout) or tokenizer file to tokenize with; its folder holds the chat template (default: "
                    "--target).")
flags.DEFINE_list("spec", ["none", "chain:3:1:4"], "In-process speculation settings, run in turn: none, "
                  "chain:num_steps:topk:num_draft_tokens, tree:num_steps:topk:num_draft_tokens.")
flags.DEFINE_list("base_url", [], "Evaluate these OpenAI-compatible servers (e.g. http://127.0.0.1:8000) instead "
                  "of an in-process model; one run each, compared with the first.")
flags.DEFINE_list("labels", [], "Names of the --base_url runs in the report (default: the URLs).")
flags.DEFINE_string("served_model_name", None, "`model` sent to the servers (default: each server's first id "
                    "of GET /v1/models).")
flags.DEFINE_string("data", None, "GSM8K test jsonl (question/answer records; default: the repository's "
                    "data/gsm8k/test_full.jsonl, all 1,319 problems).")
flags.DEFINE_string("fewshot_file", None, "jsonl of worked examples, used in file order (default: "
                    "data/gsm8k/train_fewshot.jsonl, the first 5 train problems).")
flags.DEFINE_integer("num_fewshot", 5, "Worked examples before each question (lm-eval's gsm8k default: 5).",
                     lower_bound=0)
flags.DEFINE_bool("fewshot_as_multiturn", True, "Each worked example as its own user/assistant turn (lm-eval "
                  "--fewshot_as_multiturn); false: all of them and the question in one user turn.")
flags.DEFINE_integer("limit", None, "Evaluate the first N test questions (default: all).", lower_bound=1)
flags.DEFINE_integer("max_tokens", 256, "Most tokens per answer (lm-eval's default: 256).", lower_bound=1)
flags.DEFINE_integer("concurrency", 16, "Questions in flight (in-process: the scheduler's batch).", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype of the weights.")
define_quant_flags()
flags.DEFINE_integer("max_seq_len", None, "Prompt + answer tokens per sequence (default: the longest prompt plus "
                     "--max_tokens, within the model's max_position_embeddings).", lower_bound=2)
flags.DEFINE_integer("page_size", None, "KV-cache page size in tokens (default: the scheduler's).", lower_bound=1)
flags.DEFINE_integer("prefill_chunk", None, "Prompt tokens per prefill chunk (default: the scheduler's).",
                     lower_bound=1)
define_mesh_flags("Every process runs the same questions; process 0 prints and writes the report.")
flags.DEFINE_string("output", None, "Write the report as JSON here (scores, tau, tokens/s, agreement, and every "
                    "question's completions and extracted answers).")
flags.DEFINE_bool("warmup", True, "Answer the first --concurrency questions once, untimed, before each timed run, "
                  "so that its tokens/s mostly excludes compilation (in-process, or on a fresh server).")
flags.DEFINE_bool("progress", True, "Show tqdm progress bars.")
define_chat_template_flag()
cli.define_overwrite_flag("--output")
flags.adopt_module_key_flags(shared_flags)
flags.adopt_module_key_flags(cli)

def _template_dir(tok_path: str) -> str:
    """The folder a chat template is read from: the tokenizer folder, or the folder of a tokenizer file."""
    return tok_path if os.path.isdir(tok_path) else os.path.dirname(tok_path)


def check_prompt_lengths(lengths: Sequence[int], max_seq_len: int) -> None:
    """A usage error unless every prompt leaves room for at least one answer token."""
    over = [n for n in lengths if n >= max_seq_len]
    if over:
        raise app.UsageError(f"{len(over)} of {len(lengths)} prompts have >= max_seq_len={max_seq_len} tokens (longest "
                        f"{max(lengths)}); lower --num_fewshot or raise --max_seq_len (up to what the model supports)")


def _usage_checks() -> None:
    if FLAGS.base_url:
        if FLAGS["spec"].present:
            raise app.UsageError("with --base_url each server runs its own speculation; drop --spec and name the runs "
                            "with --labels")
        if FLAGS.mesh or FLAGS.distributed:
            raise app.UsageError("--mesh and --distributed are for the in-process model; a server has its own "
                            "(scripts/serve.py --mesh)")
        if FLAGS.labels and len(FLAGS.labels) != len(FLAGS.base_url):
            raise app.UsageError(f"--labels names {len(FLAGS.labels)} runs but --base_url lists {len(FLAGS.base_url)}")
        if len(set(FLAGS.base_url)) != len(FLAGS.base_url):
            raise app.UsageError("--base_url lists a server more than once")
        if FLAGS.target is not None or FLAGS.draft is not None:
            raise app.UsageError("--target and --draft are for in-process runs; with --base_url the servers hold the "
                            "models (drop them, or drop --base_url)")
        if FLAGS.chat_template is not None:
            raise app.UsageError("--chat_template is for in-process runs; a server applies its own (scripts/serve.py "
                                 "--chat_template)")
    elif FLAGS.target is None:
        raise app.UsageError("give --target (a model folder, for an in-process run) or --base_url (a running server)")
    elif FLAGS.labels:
        raise app.UsageError("--labels names --base_url runs; in-process runs are named by --spec")
    else:
        check_target_path("--target", FLAGS.target)
        check_draft_path("--draft", FLAGS.draft)
    inputs = {"--data": FLAGS.data, "--fewshot_file": FLAGS.fewshot_file, "--target": FLAGS.target,
              "--draft": FLAGS.draft, "--tokenizer": FLAGS.tokenizer}
    cli.check_output("--output", FLAGS.output, inputs, is_file=True)


def load_inputs():
    """(test problems, few-shot examples) from the flags."""
    from eagle3_jax.bench import gsm8k

    try:
        problems = gsm8k.load_problems(FLAGS.data or gsm8k.DEFAULT_TEST_FILE, FLAGS.limit)
    except gsm8k.DataError as e:
        raise app.UsageError(f"--data: {e}") from None
    try:
        shots = gsm8k.load_problems(FLAGS.fewshot_file or gsm8k.DEFAULT_FEWSHOT_FILE, FLAGS.num_fewshot)
    except gsm8k.DataError as e:
        raise app.UsageError(f"--fewshot_file: {e}") from None
    if len(shots) < FLAGS.num_fewshot:
        raise app.UsageError(f"--num_fewshot={FLAGS.num_fewshot} but the few-shot file has only {len(shots)} examples; "
                        "lower --num_fewshot or pass a longer --fewshot_file")
    return problems, shots


def run_servers(problems, shots) -> tuple[list, dict]:
    from eagle3_jax.bench import gsm8k

    conversations = [gsm8k.fewshot_messages(p.question, shots, multiturn=FLAGS.fewshot_as_multiturn)
                     for p in problems]
    runs = []
    for url, label in zip(FLAGS.base_url, FLAGS.labels or FLAGS.base_url):
        print(f"{label}: {len(problems)} questions to {url} ...", flush=True)
        ask = functools.partial(gsm8k.generate_http, url, max_tokens=FLAGS.max_tokens, concurrency=FLAGS.concurrency,
                                model=FLAGS.served_model_name)
        try:
            if FLAGS.warmup:  # a fresh server compiles its programs on its first requests
                ask(conversations[:FLAGS.concurrency])
            out = ask(conversations, progress=FLAGS.progress, desc=label)
        except ConnectionError as e:
            raise app.UsageError(str(e)) from None
        except RuntimeError as e:  # a refused request (e.g. a prompt over the server's max_seq_len) or a failed one
            raise app.UsageError(f"{label}: {e}") from None
        runs.append((label, out))
    return runs, {"mode": "HTTP " + ", ".join(FLAGS.base_url)}


def run_in_process(problems, shots) -> tuple[list, dict]:
    import eagle3_jax as e3
    from eagle3_jax.bench import gsm8k, parse_specs  # the one import of the --spec parser
    from eagle3_jax.bench.runner import CompileCounter, make_scheduler, ordered
    from eagle3_jax.checkpoint import CheckpointError
    from eagle3_jax.text.tokenizer import TokenizerError, load_tokenizer

    try:
        settings = ordered(parse_specs(FLAGS.spec))
    except ValueError as e:
        raise app.UsageError(f"--spec: {e}") from None
    needs_draft = any(s.spec is not None for s in settings)
    if needs_draft and FLAGS.draft is None:
        raise app.UsageError("a speculative --spec setting needs --draft (an EAGLE-3 draft folder); or use --spec=none")
    mesh = mesh_from_flags()
    tok_path = FLAGS.tokenizer or FLAGS.target
    try:  # config, tokenizer and prompts first: their errors come before a long weight load
        model_cfg = e3.load_model_config(FLAGS.target)
        tok = load_tokenizer(tok_path, bos_id=model_cfg.bos_token_id)
        template = chat_template_from_flags(_template_dir(tok_path), required=True)
        texts = gsm8k.render_prompts(problems, shots, multiturn=FLAGS.fewshot_as_multiturn, render=template.render)
        prompts = [tok.encode(t, add_bos=True) for t in texts]  # as scripts/serve.py's chat endpoint does
        longest = max(len(p) for p in prompts)
        max_seq_len = FLAGS.max_seq_len or min(longest + FLAGS.max_tokens, model_cfg.max_position_embeddings)
        check_prompt_lengths([len(p) for p in prompts], max_seq_len)
        short = sum(len(p) + FLAGS.max_tokens > max_seq_len for p in prompts)
        if short:  # the scheduler cuts their budget to the room left, as scripts/serve.py does
            print(f"note: {short} of {len(prompts)} prompts leave fewer than --max_tokens={FLAGS.max_tokens} tokens "
                  f"within max_seq_len={max_seq_len}; their answers end there", flush=True)
        target = e3.load_target(FLAGS.target, dtype=FLAGS.dtype, mesh=mesh, **quant_options())
        draft = e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype,
                              fp8_format=FLAGS.fp8_format) if needs_draft else None
    except (e3.ConfigError, CheckpointError, TokenizerError, FileNotFoundError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    stop_ids = tuple(dict.fromkeys([*target.config.eos_token_ids, *tok.eos_ids]))
    runs = []
    for s in settings:
        sched = make_scheduler(target, draft, s, max_num_seqs=FLAGS.concurrency, max_seq_len=max_seq_len,
                               page_size=FLAGS.page_size, prefill_chunk=FLAGS.prefill_chunk)
        if FLAGS.warmup:  # compiles most of the programs the timed run needs
            gsm8k.generate_in_process(sched, tok, prompts[:FLAGS.concurrency], max_tokens=FLAGS.max_tokens,
                                      stop_token_ids=stop_ids, concurrency=FLAGS.concurrency)
        print(f"{s.label}: {len(problems)} questions ...", flush=True)
        with CompileCounter() as compiles:
            out = gsm8k.generate_in_process(sched, tok, prompts, max_tokens=FLAGS.max_tokens, stop_token_ids=stop_ids,
                                            concurrency=FLAGS.concurrency, progress=FLAGS.progress, desc=s.label)
        out.info.update({"setting": s.name, "compiles": compiles.count, "compile_s": compiles.seconds})
        runs.append((s.label, out))
        del sched  # one scheduler's KV pool at a time
    config = {"mode": "in-process", "target": FLAGS.target, "draft": FLAGS.draft if needs_draft else None,
              "dtype": FLAGS.dtype, "max_seq_len": max_seq_len, "prompt_tokens_max": longest,
              "mesh": None if mesh is None else list(mesh.devices.shape), "kernels": target.config.kernels,
              "batch_invariant": target.config.batch_invariant}
    return runs, config


def run(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    _usage_checks()
    from eagle3_jax.bench import gsm8k

    problems, shots = load_inputs()
    runs, config = run_servers(problems, shots) if FLAGS.base_url else run_in_process(problems, shots)
    import jax

    from eagle3_jax.checkpoint.atomic import write_text_output

    if jax.process_index() > 0:  # multi-host: every process ran the same questions; process 0 reports
        return
    config.update({"num_questions": len(problems), "num_fewshot": len(shots),
                   "fewshot_as_multiturn": FLAGS.fewshot_as_multiturn, "max_tokens": FLAGS.max_tokens,
                   "concurrency": FLAGS.concurrency, "stop_strings": list(gsm8k.STOP_STRINGS),
                   "data": FLAGS.data or os.path.relpath(gsm8k.DEFAULT_TEST_FILE),
                   "fewshot_file": FLAGS.fewshot_file or os.path.relpath(gsm8k.DEFAULT_FEWSHOT_FILE),
                   "argv": sys.argv})
    report = gsm8k.build_report(problems, runs, config=config)
    print()
    print(gsm8k.format_report(report))
    for row in report["runs"]:
        if row.get("compiles"):  # the engine thread waits for a compile, so its time adds up with the rest
            rest = row["wall_s"] - row["compile_s"]
            print(f"{row['label']}: {row['compiles']} XLA compilations took {row['compile_s']:.1f} s of its "
                  f"{row['wall_s']:.1f} s" + (f" ({row['num_output_tokens'] / rest:.1f} tok/s without them)"
                                               if rest > 0 else ""))
    if FLAGS.output:
        write_text_output(FLAGS.output, json.dumps(report, indent=1, ensure_ascii=False), name="--output",
                          overwrite=FLAGS.overwrite)
        print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
    cli.run(run)
