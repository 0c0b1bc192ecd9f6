"""Train an EAGLE-3 draft for a target, in JAX, and export it as an HF draft folder.

    python scripts/train_draft.py --target=checkpoints/stories260K --corpus=/tmp/corpus.npy \\
        --prompt_len=8 --max_tokens=120 --num_prompts=2048 --draft_vocab_size=256 \\
        --epochs=4 --out=checkpoints/stories260K-eagle3

Pipeline: prompts (a prompts file in the model's chat template, or corpus rows' first --prompt_len
tokens) -> the target's own responses (--temperatures) -> draft vocabulary by response-token counts
-> training-time-test training on the teacher's features, on the fly (--mode=online) or stored once
in --feature_dir (--mode=offline) -> an HF folder that e3.load_draft, vLLM and SGLang load. After
each epoch the draft speculates through the Engine on held-out prompts (--measure_prompts): the one
with the best measured tau is exported. With --mesh the target runs sharded as serving shards it and
the draft's state is split over the devices.

Every flag, file and folder is checked before the target loads. An interrupted run resumes from
--ckpt_dir (default <out>.ckpt), a finished one says so and exits, one with other settings or data is
refused naming them (--overwrite starts again); --out is replaced only with --overwrite, once the new
draft is complete. Layouts, switches, meshes and hosts, long sequences: docs/training.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import check_draft_path, check_target_path, define_runtime_flags, runtime_from_flags, warn_without_chat_template  # noqa: E402
from eagle3_jax.cli.runs import (check_enough_examples, check_training_flags, defaults_of, plan_run,  # noqa: E402
                                 read_token_corpus, settings_of)

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target model folder (HF or Orbax).")
flags.DEFINE_string("prompts", None, "Prompts file (.jsonl GSM8K / MT-Bench / Spec-Bench, ShareGPT .json, or .txt).")
flags.DEFINE_bool("conversations", False, "--prompts holds whole conversations (OpenAI messages with tools, ShareGPT): "
                  "every assistant turn answered again by the target, turn by turn, greedily; the loss on the answers.")
flags.DEFINE_string("corpus", None, "Token corpus .npy [N, L]: prompts are the first --prompt_len tokens of each row.")
flags.DEFINE_integer("prompt_len", 8, "Prompt tokens taken from each corpus row.", lower_bound=1)
flags.DEFINE_integer("num_prompts", 1024, "Prompts to use.", lower_bound=2)
flags.DEFINE_integer("max_tokens", 128, "Response tokens regenerated per prompt.", lower_bound=1)
flags.DEFINE_bool("ignore_eos", False, "Regenerate every response --max_tokens long, past end-of-sequence tokens.")
flags.DEFINE_string("regenerated", None, "Keep the regenerated responses here (.npz; default <ckpt_dir>/regenerated.npz); "
                    "a run with the same target, prompts and generation flags reuses them.")
flags.DEFINE_list("temperatures", ["0"], "One response per prompt per temperature (0 = greedy).")
flags.DEFINE_integer("gen_batch_size", 256, "Requests per regeneration wave.", lower_bound=1)
flags.DEFINE_string("regen_draft", None, "An EAGLE-3 draft for --target that speculates while it regenerates the "
                    "responses (they stay the target's own: greedy the same tokens, sampled the same distribution).")
flags.DEFINE_integer("draft_vocab_size", 0, "Draft vocabulary size (0 = the full target vocabulary).", lower_bound=0)
flags.DEFINE_enum("draft_arch", "llama", ["llama", "mla"],
                  "Draft decoder layers: llama (LlamaForCausalLMEagle3, GQA) or mla (Eagle3DeepseekV2ForCausalLM: DeepSeek "
                  "MLA attention, copied from an MLA target such as Kimi-K2.5, else sized from the target's heads).")
flags.DEFINE_integer("draft_layers", 1, "Decoder layers in the draft.", lower_bound=1)
flags.DEFINE_integer("draft_intermediate_size", 0, "Draft MLP width (0 = 4 x hidden).", lower_bound=0)
flags.DEFINE_bool("fc_norm", False, "EAGLE 3.1: an RMSNorm on each target feature before fc.")
flags.DEFINE_bool("norm_output", False, "EAGLE 3.1: hand the next draft step the hidden after the final norm.")
flags.DEFINE_bool("norm_before_fc", False, "An RMSNorm over the concatenated target features before fc.")
flags.DEFINE_integer("sliding_window", 0, "Draft layers attend over this many tokens (0 = the whole context).",
                     lower_bound=0)
flags.DEFINE_integer("ttt_steps", 7, "Training-time-test unroll depth.", lower_bound=1)
flags.DEFINE_integer("epochs", 2, "Epochs.", lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "Sequences per step (a multiple of the mesh's data axis).", lower_bound=1)
flags.DEFINE_float("learning_rate", 1e-3, "Peak AdamW learning rate (> 0).")
flags.DEFINE_integer("warmup_steps", 30, "Linear warmup steps.", lower_bound=0)
flags.DEFINE_float("max_grad_norm", 0.5, "Gradient clipping (global norm).")
flags.DEFINE_enum("compute_dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype (master weights stay float32).")
flags.DEFINE_enum("target_dtype", "float32", ["float32", "bfloat16"], "Dtype the target runs in.")
flags.DEFINE_enum("mode", "online", ["online", "offline"], "Teacher features on the fly, or written once and streamed.")
flags.DEFINE_string("feature_dir", None, "Offline feature store (default: <out>.features).")
flags.DEFINE_string("ckpt_dir", None, "Orbax checkpoints for resuming (default: <out>.ckpt).")
flags.DEFINE_float("eval_fraction", 0.05, "Held-out share of the examples.")
define_runtime_flags("Every host runs the same command; process 0 writes the files (a shared file system; each process "
                  "writes and reads its own rows of the --mode=offline store there).")
flags.DEFINE_bool("context_parallel", False, "Split each sequence over the --mesh data axis instead of the batch.")
flags.DEFINE_enum("save_dtype", "bfloat16", ["float32", "bfloat16"], "Dtype of the exported weights.")
flags.DEFINE_integer("measure_prompts", 16, "Held-out prompts the draft answers through the Engine (chain 3:1:4) after "
                     "each epoch; the best measured tau's draft is exported (0: no measuring, the last).", lower_bound=0)
flags.DEFINE_integer("measure_every", 0, "Also measure every this many steps (0 = after epochs only).", lower_bound=0)
flags.DEFINE_integer("seed", 0, "Seed for sampling, init and data order.")
flags.DEFINE_string("out", None, "Output HF draft folder.")
cli.define_overwrite_flag("--out (and another run's --ckpt_dir)")
flags.mark_flags_as_required(["target", "out"])


# The flags that shape the regenerated responses (with the data's fingerprint: the key they are kept under).
GEN_FLAGS = ("conversations", "prompt_len", "num_prompts", "max_tokens", "ignore_eos", "temperatures", "gen_batch_size",
             "regen_draft", "target_dtype", "seed")
# The flags that shape the trained draft: a checkpoint folder resumes only a run with the same ones (not
# --mesh: the state is restored into whatever layout the new mesh gives it).
RUN_FLAGS = GEN_FLAGS + ("draft_vocab_size", "draft_arch", "draft_layers", "draft_intermediate_size", "ttt_steps", "epochs",
                         "batch_size", "learning_rate", "warmup_steps", "max_grad_norm", "compute_dtype", "mode",
                         "eval_fraction", "context_parallel", "save_dtype", "fc_norm", "norm_output", "norm_before_fc",
                         "sliding_window", "measure_prompts", "measure_every")


def check_settings() -> list[float]:
    """The flags' values that no validator covers, checked before anything loads; the temperatures."""
    if (FLAGS.prompts is None) == (FLAGS.corpus is None):
        raise app.UsageError("give exactly one of --prompts and --corpus")
    try:
        temps = [float(t) for t in FLAGS.temperatures]
    except ValueError:
        raise app.UsageError(f"--temperatures must be numbers; got {','.join(FLAGS.temperatures)!r}") from None
    if not temps or min(temps) < 0 or (FLAGS.conversations and temps != [0.0]):
        raise app.UsageError(f"--temperatures must be numbers >= 0 (0 = greedy; only 0 with --conversations); got "
                             f"{','.join(FLAGS.temperatures)!r}")
    check_training_flags()
    return temps


def read_prompt_texts() -> list[str] | None:
    """The --prompts file's prompts (None with --corpus), read and decoded before anything loads."""
    if FLAGS.prompts is None:
        return None
    from eagle3_jax.train.data import load_prompts

    from eagle3_jax.train.conversations import load_conversations

    cli.read_text(FLAGS.prompts, "--prompts")  # binary or non-UTF-8: named with the byte offset
    with cli.usage_errors(f"--prompts {FLAGS.prompts}"):  # a malformed record, an unknown extension
        return (load_conversations if FLAGS.conversations else load_prompts)(FLAGS.prompts, limit=FLAGS.num_prompts)


def check_mesh(model_cfg):
    """The --mesh over this machine's devices (None without one): its data axis divides --batch_size
    (with --context_parallel: it splits the sequences instead), its axes the target's tensors."""
    mesh = runtime_from_flags()
    if mesh is None:
        if FLAGS.context_parallel:
            raise app.UsageError("--context_parallel splits each sequence over the --mesh data axis: give --mesh (e.g. 8,1,1)")
        return None
    if FLAGS.batch_size % mesh.shape["data"] and not FLAGS.context_parallel:
        raise app.UsageError(f"--batch_size={FLAGS.batch_size} is not a multiple of the --mesh data axis "
                             f"({mesh.shape['data']})")
    from eagle3_jax.train.draft_run import check_target_mesh

    with cli.usage_errors("--mesh"):  # an axis that would leave the target's tensors whole on every device
        check_target_mesh(model_cfg, tuple(mesh.shape.values()), FLAGS.target_dtype)
    return mesh


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    # everything the run will use is checked first: the flags, the inputs, the output, the checkpoints
    temps = check_settings()
    check_target_path("--target", FLAGS.target, draft_flag=None)
    check_draft_path("--regen_draft", FLAGS.regen_draft)
    import eagle3_jax as e3
    from eagle3_jax.train import draft_run, run_record
    from eagle3_jax.train.trainer import TrainConfig  # needs the train extra: checked before any work

    model_cfg = e3.load_model_config(FLAGS.target)
    if FLAGS.draft_vocab_size > model_cfg.vocab_size:
        raise app.UsageError(f"--draft_vocab_size={FLAGS.draft_vocab_size} exceeds the target's vocabulary "
                             f"({model_cfg.vocab_size}); lower it (0 = the full vocabulary)")
    texts = read_prompt_texts()
    corpus = read_token_corpus(FLAGS.corpus, FLAGS.prompt_len, model_cfg.vocab_size) if texts is None else None
    num_prompts = len(texts) if texts is not None else min(len(corpus), FLAGS.num_prompts)
    source = f"--prompts {FLAGS.prompts}" if FLAGS.prompts else f"--corpus {FLAGS.corpus}"
    n = sum(len(c.assistant_turns) for c in texts) if FLAGS.conversations else num_prompts * len(temps)  # examples
    check_enough_examples(n, f"{source} gives {num_prompts} prompts x {len(temps)} temperatures = {n} examples",
                          f"give at least {-(-2 * FLAGS.batch_size // len(temps))} prompts")
    mesh = check_mesh(model_cfg)
    out = FLAGS.out.rstrip("/")
    ckpt_dir = FLAGS.ckpt_dir or out + ".ckpt"
    feature_dir = FLAGS.feature_dir or out + ".features"
    inputs = {"--target": FLAGS.target, "--prompts": FLAGS.prompts, "--corpus": FLAGS.corpus}
    if FLAGS.mode == "offline" and not os.path.isdir(feature_dir):  # an existing store is reused once checked
        cli.check_output("--feature_dir", feature_dir, inputs)
    settings = dict(settings_of(RUN_FLAGS), rows="packed")  # runs before packing laid one example per row
    fingerprint = run_record.data_fingerprint([FLAGS.prompts or FLAGS.corpus], [FLAGS.target])
    state = plan_run(out, ckpt_dir, settings, fingerprint, inputs, what="draft")
    if state == "finished":
        return

    from eagle3_jax.text.tokenizer import load_tokenizer, tokenize_prompts

    if FLAGS.conversations:
        prompts = texts  # rendered turn by turn as they are answered
    elif texts is not None:
        warn_without_chat_template(FLAGS.target, "the --prompts")
        with cli.usage_errors(f"--target {FLAGS.target}"):  # a chat template that rejects a prompt
            prompts = tokenize_prompts(texts, FLAGS.target, load_tokenizer(FLAGS.target, bos_id=model_cfg.bos_token_id))
    else:
        prompts = [list(map(int, row[: FLAGS.prompt_len])) for row in corpus[: FLAGS.num_prompts]]
    longest = 0 if FLAGS.conversations else max(map(len, prompts))  # conversations: checked turn by turn
    if longest + FLAGS.max_tokens > model_cfg.max_position_embeddings:
        raise app.UsageError(f"a prompt of {longest} tokens plus --max_tokens={FLAGS.max_tokens} passes the target's "
                             f"{model_cfg.max_position_embeddings} positions: lower --max_tokens (or shorten the prompts)")
    with cli.usage_errors():  # TrainConfig names a field no check above covers
        tc = TrainConfig(epochs=FLAGS.epochs, learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                         max_grad_norm=FLAGS.max_grad_norm, compute_dtype=FLAGS.compute_dtype, seed=FLAGS.seed)
    same_names = ("ttt_steps", "batch_size", "eval_fraction", "seed", "fc_norm", "norm_output", "norm_before_fc",
                  "sliding_window", "context_parallel")  # the recipe's fields named as their flags
    recipe = draft_run.DraftRecipe(vocab_size=FLAGS.draft_vocab_size, arch=FLAGS.draft_arch, num_layers=FLAGS.draft_layers,
                                   intermediate_size=FLAGS.draft_intermediate_size, **{k: FLAGS[k].value for k in same_names})

    start = time.perf_counter()
    target = e3.load_target(FLAGS.target, dtype=FLAGS.target_dtype, mesh=mesh)
    cfg_t = target.config
    with cli.usage_errors(f"--regen_draft {FLAGS.regen_draft}"):  # a draft for another target
        regen_draft = e3.load_draft(FLAGS.regen_draft, target=target, dtype=FLAGS.target_dtype) if FLAGS.regen_draft else None
    kept, key = FLAGS.regenerated or os.path.join(ckpt_dir, run_record.REGENERATED_FILE), dict(
        settings_of(GEN_FLAGS), data=fingerprint)
    with cli.usage_errors():  # kept for other settings (named, with the fix); a conversation past the positions
        examples, read = draft_run.regenerated_examples(
            target, prompts, kept, key, defaults_of(key), max_tokens=FLAGS.max_tokens, temperatures=temps, seed=FLAGS.seed,
            batch_size=FLAGS.gen_batch_size, stop_token_ids=() if FLAGS.ignore_eos else cfg_t.eos_token_ids,
            draft=regen_draft)
    print(f"{len(examples)} responses regenerated before, read from {kept}" if read else f"regenerated {len(examples)} "
          f"responses ({len(prompts)} prompts x temperatures {temps}) in {time.perf_counter() - start:.0f} s (kept in {kept})")
    shards = mesh.shape["data"] if FLAGS.context_parallel else 1
    data = draft_run.prepare_data(examples, cfg_t.vocab_size, recipe, length_multiple=shards)
    print(data.summary())
    store = None
    if FLAGS.mode == "offline":
        try:  # starting again (--overwrite over another run's checkpoints): fresh features
            store = draft_run.offline_store(feature_dir, target, data, fresh=state == "start" and FLAGS.overwrite,
                                            overwrite=FLAGS.overwrite)
        except draft_run.StaleFeatureStore as e:
            raise app.UsageError(f"{e}; pass --overwrite to write it again, or another --feature_dir") from None
        print(f"feature store {feature_dir}: {len(store)} rows, {store.bytes_per_token:,.0f} bytes per token")
    measurement = draft_run.measurement_of(data, FLAGS.measure_prompts, FLAGS.measure_every)
    with cli.usage_errors("--context_parallel" if FLAGS.context_parallel else ""):  # a split or a draft refused
        training = draft_run.DraftTraining(target, data, recipe, tc, ckpt_dir=ckpt_dir, mesh=mesh, measurement=measurement)
    run_record.write_record(ckpt_dir, settings, fingerprint)
    history = training.fit(draft_run.train_batches(target, data, recipe, store))
    log = json.dumps({"argv": sys.argv, "history": history, "covered_mass": data.vocab.covered_mass,
                      "num_examples": len(examples), "seconds": time.perf_counter() - start}, indent=2)
    training.export(out, dtype=FLAGS.save_dtype, overwrite=FLAGS.overwrite, extra_files={"training_log.json": log})
    run_record.write_record(ckpt_dir, settings, fingerprint, finished=True)
    print(f"exported {out} ({training.export_note()}) after {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cli.run(main)
