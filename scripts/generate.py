"""Generate text from a target model, plainly or with EAGLE-3 speculative decoding.

    python scripts/generate.py --model=checkpoints/stories260K --max_tokens=200
    python scripts/generate.py --model=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --spec=chain:3:1:4 --prompt="Once upon a time"
    python scripts/generate.py --model=/models/Llama-3.1-8B-Instruct --dtype=bfloat16 \\
        --prompt="The capital of France is" --temperature=0.7 --top_p=0.9 --seed=1

Prints each prompt with its continuation, then the number of generated tokens, the wall time
of the generate call and tokens/s; with --draft also the mean acceptance length tau (bonus token
included) and the per-position acceptance rates. By default generate runs once untimed first, so the timed
run excludes compilation (--nowarmup to skip it).

A prompt whose --max_tokens does not fit in --max_seq_len generates only what fits (the engine's
warning says so); --max_seq_len above the model's max_position_embeddings needs --allow_long_max_seq_len.
Mistakes in the flags, paths or inputs end the script with one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys
import time
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
    define_kv_cache_dtype_flag,
    define_max_seq_len_flags,
    define_runtime_flags,
    define_quant_flags,
    define_spec_flags,
    runtime_from_flags,
    quant_options,
    spec_from_flags,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF model folder (safetensors + config.json) or Orbax folder from scripts/convert.py.")
flags.DEFINE_string("tokenizer", None, "Folder (tokenizer.json, or Kimi's tiktoken.model layout) or tokenizer "
                    "file to tokenize with (default: --model).")
flags.DEFINE_string("prompt", "", "Prompt text; empty means BOS only.")
flags.DEFINE_string("prompts_file", None, "Text file with one prompt per line (blank lines skipped); replaces --prompt.")
flags.DEFINE_integer("max_tokens", 64, "Maximum new tokens per prompt.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold in (0, 1].")
flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 disables it.")
flags.DEFINE_integer("seed", 0, "Sampling seed (prompt i uses seed + i).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype of the weights.")
define_max_seq_len_flags("Prompt + generated tokens per request (default: min(model max positions, 2048)).")
flags.DEFINE_integer("batch_size", None, "Requests per batch (default: the number of prompts).", lower_bound=1)
define_quant_flags()
define_runtime_flags("Every process generates the same tokens; process 0 prints them.")
flags.DEFINE_bool("warmup", True, "Run generate once before the timed run so tokens/s excludes compilation.")
flags.DEFINE_string("draft", None, "EAGLE-3 draft folder (HF LlamaForCausalLMEagle3 layout); unset = plain decoding.")
define_spec_flags()
define_kv_cache_dtype_flag()
flags.mark_flag_as_required("model")
# --help lists the shared flags (speculation, mesh, kernels, quantization, --verbose) with the script's own
flags.adopt_module_key_flags(shared_flags)
flags.adopt_module_key_flags(cli)


def read_prompts(prompt: str, prompts_file: str | None) -> list[str]:
    """The prompt texts: the file's non-blank lines, or the single --prompt."""
    if prompts_file is None:
        return [prompt]
    lines = cli.read_text(prompts_file, "--prompts_file").splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise app.UsageError(f"--prompts_file {prompts_file} has no non-blank lines")
    return prompts


def stop_ids(model_eos: Sequence[int], tokenizer_eos: Sequence[int]) -> tuple[int, ...]:
    """EOS ids from the model config and the tokenizer folder, without repeats, in order."""
    return tuple(dict.fromkeys([*model_eos, *tokenizer_eos]))


def check_prompt_lengths(prompt_lens: Sequence[int], max_seq_len: int) -> None:
    """A usage error naming the first prompt that leaves no room to generate within max_seq_len."""
    for i, n in enumerate(prompt_lens):
        if n >= max_seq_len:
            raise app.UsageError(f"prompt {i} has {n} tokens, which leaves no room to generate within "
                                 f"--max_seq_len={max_seq_len}; shorten the prompt or raise --max_seq_len")


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    if FLAGS.prompts_file is not None and FLAGS.prompt:
        raise app.UsageError("give --prompt or --prompts_file, not both")
    texts = read_prompts(FLAGS.prompt, FLAGS.prompts_file)
    spec = spec_from_flags(has_draft=FLAGS.draft is not None, allow_auto=False)
    check_target_path("--model", FLAGS.model)
    check_draft_path("--draft", FLAGS.draft)

    import jax

    import eagle3_jax as e3  # imported here so that --help works without loading JAX
    from eagle3_jax.text.tokenizer import load_tokenizer

    mesh = runtime_from_flags()
    # config, tokenizer and the checks of what the flags ask for first: their errors come before a
    # long weight load
    model_cfg = e3.load_model_config(FLAGS.model)
    tok = load_tokenizer(FLAGS.tokenizer or FLAGS.model, bos_id=model_cfg.bos_token_id)
    max_seq_len = check_max_seq_len(FLAGS.max_seq_len, model_cfg.max_position_embeddings)
    prompts = [tok.encode(t, add_bos=True) for t in texts]
    check_prompt_lengths([len(p) for p in prompts], max_seq_len)
    stops = stop_ids(model_cfg.eos_token_ids, tok.eos_ids)
    with cli.usage_errors():  # SamplingParams names the flag's field (top_p, temperature, ...)
        sampling = [
            e3.SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
                              max_tokens=FLAGS.max_tokens, seed=FLAGS.seed + i, stop_token_ids=stops)
            for i in range(len(prompts))
        ]

    target = e3.load_target(FLAGS.model, dtype=FLAGS.dtype, mesh=mesh, **quant_options())
    draft = None if FLAGS.draft is None else e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype,
                                                            fp8_format=FLAGS.fp8_format)
    with cli.usage_errors():  # a spec the draft cannot run (topk above its vocabulary, ...)
        engine = e3.Engine(target, draft=draft, spec=spec, max_batch_size=FLAGS.batch_size or len(prompts),
                           max_seq_len=max_seq_len, kv_cache_dtype=FLAGS.kv_cache_dtype)

    if FLAGS.warmup:
        engine.generate(prompts, sampling)
    start = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    wall = time.perf_counter() - start
    if jax.process_index() > 0:  # multi-host: every process generated the same tokens; process 0 prints
        return

    for i, (ids, out) in enumerate(zip(prompts, outs)):
        if len(prompts) > 1:
            print(f"=== [{i}] {len(out.token_ids)} tokens ===")
        print(texts[i] + tok.decode_continuation(ids, out.token_ids))
    total = sum(len(out.token_ids) for out in outs)
    ttft = sum(out.metrics["ttft_s"] for out in outs) / len(outs)
    print(f"\n{total} tokens generated in {wall:.3f} s: {total / wall:.1f} tokens/s "
          f"({len(prompts)} prompt(s), batch {engine.max_batch_size}, mean TTFT {ttft * 1e3:.1f} ms, {FLAGS.dtype})")
    if spec is not None:
        steps = [a for out in outs for a in out.metrics["accept_lengths"]]
        tau = sum(steps) / max(len(steps), 1)
        rates = [sum(a - 1 >= d for a in steps) / max(len(steps), 1) for d in range(1, spec.max_accept + 1)]
        print(f"EAGLE-3 {spec}: mean acceptance length tau = {tau:.2f} over {len(steps)} verify steps; "
              f"per-position acceptance {', '.join(f'{r:.2f}' for r in rates)}")


if __name__ == "__main__":
    cli.run(main)
