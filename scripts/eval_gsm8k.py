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
    define_runtime_flags,
    define_quant_flags,
    runtime_from_flags,
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
define_runtime_flags("Every process runs the same questions; process 0 prints and writes the report.")
flags.DEFINE_string("output", None, "Write the report as JSON here (scores, tau, tokens/s, agreement, and every "
                    "question's completions and extracted answers).")
flags.DEFINE_bool("warmup", True, "Answer the first --concurrency questions once, untimed, before each timed run, "
                  "so that its tokens/s mostly excludes compilation (in-process, or on a fresh server).")
flags.DEFINE_bool("progress", True, "Show tqdm progress bars.")
define_chat_template_flag()
cli.define_overwrite_flag("--output")
flags.adopt_module_key_flags(shared_flags)
flags.adopt_module_key_flags(cli)


def _usage_checks() -> None:
    from eagle3_jax.bench import flag_checks  # no JAX: a flag mistake answers at once

    with cli.usage_errors():
        flag_checks.check_gsm8k_sources(base_url=FLAGS.base_url, labels=FLAGS.labels, spec_given=FLAGS["spec"].present,
                                        mesh=FLAGS.mesh, distributed=FLAGS.distributed, target=FLAGS.target,
                                        draft=FLAGS.draft, chat_template=FLAGS.chat_template)
    if not FLAGS.base_url:
        check_target_path("--target", FLAGS.target)
        check_draft_path("--draft", FLAGS.draft)
    inputs = {"--data": FLAGS.data, "--fewshot_file": FLAGS.fewshot_file, "--target": FLAGS.target,
              "--draft": FLAGS.draft, "--tokenizer": FLAGS.tokenizer}
    cli.check_output("--output", FLAGS.output, inputs, is_file=True)


def run_servers(problems, shots) -> tuple[list, dict]:
    from eagle3_jax.bench import gsm8k_run

    with cli.usage_errors():
        return gsm8k_run.run_servers(problems, shots, FLAGS.base_url, FLAGS.labels,
                                     multiturn=FLAGS.fewshot_as_multiturn, max_tokens=FLAGS.max_tokens,
                                     concurrency=FLAGS.concurrency, model=FLAGS.served_model_name,
                                     warmup=FLAGS.warmup, progress=FLAGS.progress, echo=_say)


def run_in_process(problems, shots) -> tuple[list, dict]:
    import eagle3_jax as e3
    from eagle3_jax.bench import gsm8k_run, parse_specs  # the one import of the --spec parser
    from eagle3_jax.bench.runner import ordered
    from eagle3_jax.bench.workloads import template_dir
    from eagle3_jax.checkpoint import CheckpointError
    from eagle3_jax.text.tokenizer import TokenizerError, load_tokenizer

    with cli.usage_errors("--spec"):
        settings = ordered(parse_specs(FLAGS.spec))
    needs_draft = any(s.spec is not None for s in settings)
    if needs_draft and FLAGS.draft is None:
        raise app.UsageError("a speculative --spec setting needs --draft (an EAGLE-3 draft folder); or use --spec=none")
    mesh = runtime_from_flags()
    tok_path = FLAGS.tokenizer or FLAGS.target
    try:  # config, tokenizer and prompts first: their errors come before a long weight load
        model_cfg = e3.load_model_config(FLAGS.target)
        tok = load_tokenizer(tok_path, bos_id=model_cfg.bos_token_id)
        template = chat_template_from_flags(template_dir(tok_path), required=True)
        prompts = gsm8k_run.encode_prompts(problems, shots, tok, template.render, multiturn=FLAGS.fewshot_as_multiturn)
        lengths = [len(p) for p in prompts]
        max_seq_len, note = gsm8k_run.fit_max_seq_len(lengths, FLAGS.max_tokens, FLAGS.max_seq_len,
                                                      model_cfg.max_position_embeddings)
        if note:
            _say(note)
        target = e3.load_target(FLAGS.target, dtype=FLAGS.dtype, mesh=mesh, **quant_options())
        draft = e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype,
                              fp8_format=FLAGS.fp8_format) if needs_draft else None
    except (e3.ConfigError, CheckpointError, TokenizerError, FileNotFoundError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    runs = gsm8k_run.run_settings(target, draft, tok, settings, prompts, max_seq_len=max_seq_len,
                                  max_tokens=FLAGS.max_tokens, concurrency=FLAGS.concurrency,
                                  page_size=FLAGS.page_size, prefill_chunk=FLAGS.prefill_chunk, warmup=FLAGS.warmup,
                                  progress=FLAGS.progress, echo=_say)
    return runs, gsm8k_run.in_process_config(target, mesh, target_path=FLAGS.target,
                                             draft_path=FLAGS.draft if needs_draft else None, dtype=FLAGS.dtype,
                                             max_seq_len=max_seq_len, prompt_tokens_max=max(lengths))


def _say(line: str) -> None:
    print(line, flush=True)


def run(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    _usage_checks()
    from eagle3_jax.bench import gsm8k, gsm8k_run

    problems, shots = gsm8k_run.load_inputs(FLAGS.data, FLAGS.fewshot_file, FLAGS.limit, FLAGS.num_fewshot)
    runs, config = run_servers(problems, shots) if FLAGS.base_url else run_in_process(problems, shots)
    import jax

    from eagle3_jax.checkpoint.atomic import write_text_output

    if jax.process_index() > 0:  # multi-host: every process ran the same questions; process 0 reports
        return
    config = gsm8k_run.report_config(config, problems, shots, multiturn=FLAGS.fewshot_as_multiturn,
                                     max_tokens=FLAGS.max_tokens, concurrency=FLAGS.concurrency, data=FLAGS.data,
                                     fewshot_file=FLAGS.fewshot_file, argv=sys.argv)
    report = gsm8k.build_report(problems, runs, config=config)
    print()
    print(gsm8k.format_report(report))
    for line in gsm8k_run.compile_notes(report):
        print(line)
    if FLAGS.output:
        write_text_output(FLAGS.output, json.dumps(report, indent=1, ensure_ascii=False), name="--output",
                          overwrite=FLAGS.overwrite)
        print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
    cli.run(run)
