"""Generate text from a target model, plainly or with EAGLE-3 speculative decoding.

    python scripts/generate.py --model=checkpoints/stories260K --max_tokens=200
    python scripts/generate.py --model=/models/target --draft=/models/target-eagle3 \
        --num_steps=3 --topk=1 --num_draft_tokens=4
    python scripts/generate.py --model=/models/Llama-3.1-8B-Instruct --dtype=bfloat16 \\
        --prompt="The capital of France is" --temperature=0.7 --top_p=0.9 --seed=1

Prints each prompt with its continuation, then the number of generated tokens, the wall time
of the generate call and tokens/s; with --draft also the mean acceptance length tau (bonus token
included) and the per-position acceptance rates. By default generate runs once untimed first, so the timed
run excludes compilation (--nowarmup to skip it).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

from absl import app, flags, logging

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _shared_flags import define_mesh_flags, define_quant_flags, mesh_from_flags, quant_options  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF model folder (safetensors + config.json) or Orbax folder from scripts/convert.py.")
flags.DEFINE_string("tokenizer", None, "Folder or tokenizer.json to tokenize with (default: --model).")
flags.DEFINE_string("prompt", "", "Prompt text; empty means BOS only.")
flags.DEFINE_string("prompts_file", None, "Text file with one prompt per line (blank lines skipped); replaces --prompt.")
flags.DEFINE_integer("max_tokens", 64, "Maximum new tokens per prompt.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold in (0, 1].")
flags.DEFINE_integer("top_k", 0, "Top-k sampling; 0 disables it.")
flags.DEFINE_integer("seed", 0, "Sampling seed (prompt i uses seed + i).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype of the weights.")
flags.DEFINE_integer("max_seq_len", None, "Prompt + generated tokens per request (default: min(model max positions, 2048)).",
                     lower_bound=2)
flags.DEFINE_integer("batch_size", None, "Requests per batch (default: the number of prompts).", lower_bound=1)
define_quant_flags()
define_mesh_flags("Every process generates the same tokens; process 0 prints them.")
flags.DEFINE_bool("warmup", True, "Run generate once before the timed run so tokens/s excludes compilation.")
flags.DEFINE_string("draft", None, "EAGLE-3 draft folder (HF LlamaForCausalLMEagle3 layout); unset = plain decoding.")
flags.DEFINE_integer("num_steps", 3, "Draft levels per speculative step (tree depth).", lower_bound=1)
flags.DEFINE_integer("topk", 1, "Children expanded per draft node; 1 = chain.", lower_bound=1)
flags.DEFINE_integer("num_draft_tokens", None, "Tree nodes verified per step, root included "
                     "(default: num_steps + 1, a chain's size).", lower_bound=2)
flags.mark_flag_as_required("model")


def read_prompts(prompt: str, prompts_file: str | None) -> list[str]:
    """The prompt texts: the file's non-blank lines, or the single --prompt."""
    if prompts_file is None:
        return [prompt]
    with open(prompts_file, encoding="utf-8") as f:
        lines = [line.rstrip("\r\n") for line in f]
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise app.UsageError(f"--prompts_file {prompts_file} has no non-blank lines")
    return prompts


def default_max_seq_len(max_position_embeddings: int, cap: int = 2048) -> int:
    return min(int(max_position_embeddings), cap)


def stop_ids(model_eos: Sequence[int], tokenizer_eos: Sequence[int]) -> tuple[int, ...]:
    """EOS ids from the model config and the tokenizer folder, without repeats, in order."""
    return tuple(dict.fromkeys([*model_eos, *tokenizer_eos]))


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.prompts_file is not None and FLAGS.prompt:
        raise app.UsageError("give --prompt or --prompts_file, not both")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # hide JAX's backend-probing INFO lines
    texts = read_prompts(FLAGS.prompt, FLAGS.prompts_file)

    import jax

    import eagle3_jax as e3  # imported here so that --help works without loading JAX
    from eagle3_jax.checkpoint import CheckpointError
    from eagle3_jax.tokenizer import TokenizerError, load_tokenizer

    mesh = mesh_from_flags()
    try:  # config and tokenizer first: their errors come before a long weight load
        tok = load_tokenizer(FLAGS.tokenizer or FLAGS.model, bos_id=e3.load_model_config(FLAGS.model).bos_token_id)
        target = e3.load_target(FLAGS.model, dtype=FLAGS.dtype, mesh=mesh, **quant_options())
        draft = None if FLAGS.draft is None else e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype,
                                                                fp8_format=FLAGS.fp8_format)
        spec = None if draft is None else e3.SpecConfig(
            num_steps=FLAGS.num_steps, topk=FLAGS.topk,
            num_draft_tokens=FLAGS.num_draft_tokens or FLAGS.num_steps + 1)
    except (e3.ConfigError, CheckpointError, TokenizerError, ValueError) as e:
        sys.exit(f"generate.py: {e}")
    cfg = target.config
    prompts = [tok.encode(t, add_bos=True) for t in texts]

    max_seq_len = FLAGS.max_seq_len or default_max_seq_len(cfg.max_position_embeddings)
    engine = e3.Engine(target, draft=draft, spec=spec, max_batch_size=FLAGS.batch_size or len(prompts),
                       max_seq_len=max_seq_len)
    stops = stop_ids(cfg.eos_token_ids, tok.eos_ids)
    sampling = [
        e3.SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, top_k=FLAGS.top_k,
                          max_tokens=FLAGS.max_tokens, seed=FLAGS.seed + i, stop_token_ids=stops)
        for i in range(len(prompts))
    ]

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
    app.run(main)
