"""Train a target model on a token corpus (from scratch, or further from --init_from's weights) and
save it as an HF folder.

    python scripts/train_target.py --config=checkpoints/kimi-mini.config.json --corpus=/tmp/corpus.npy \\
        --tokenizer_from=checkpoints/stories260K --epochs=2 --batch_size=16 --out=checkpoints/kimi-mini

The corpus is an int32 [N, seq_len] .npy of token ids (scripts/make_corpus.py). The result loads
with e3.load_target and follows the HF layout of the config's model_type. Flags, files and --out are
checked before training. --init_from starts from another folder's weights of the same sizes, e.g. the
model itself with a longer context in --config (its rotary extended) and a corpus of longer rows, to
train it at that length. Checkpoints (--ckpt_dir, default <out>.ckpt) resume only the same run (same
flags, config and corpus), as in train_draft.py; --overwrite starts again and replaces --out.
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
from eagle3_jax.cli.flags import check_target_path  # noqa: E402
from eagle3_jax.cli.runs import check_enough_examples, check_training_flags, plan_run, read_token_corpus, settings_of  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "HF config.json of the model to train.")
flags.DEFINE_string("corpus", None, "Token corpus .npy [N, seq_len].")
flags.DEFINE_string("tokenizer_from", None, "Folder whose tokenizer files are copied into --out.")
flags.DEFINE_string("init_from", None, "Start from this model folder's weights (of --config's sizes) instead of a "
                    "random initialisation.")
flags.DEFINE_string("out", None, "Output HF folder.")
flags.DEFINE_string("ckpt_dir", None, "Orbax checkpoint folder for resuming (default: <out>.ckpt).")
flags.DEFINE_integer("epochs", 1, "Passes over the corpus.", lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "Sequences per step.", lower_bound=1)
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_integer("warmup_steps", 50, "Linear warmup steps.", lower_bound=0)
flags.DEFINE_float("eval_fraction", 0.02, "Held-out share of the corpus.")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Compute dtype (master weights stay float32).")
flags.DEFINE_enum("save_dtype", "bfloat16", ["float32", "bfloat16"], "Dtype of the saved weights.")
flags.DEFINE_integer("seed", 0, "Init and data-order seed.")
cli.define_overwrite_flag("--out (and another run's --ckpt_dir)")
flags.mark_flags_as_required(["config", "corpus", "out"])

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# The flags that shape the trained model: a checkpoint folder resumes only a run with the same ones.
RUN_FLAGS = ("epochs", "batch_size", "learning_rate", "warmup_steps", "eval_fraction", "compute_dtype", "save_dtype",
             "seed", "init_from")


def read_config() -> dict:
    """--config's JSON object."""
    if not os.path.isfile(FLAGS.config):
        raise app.UsageError(f"--config {FLAGS.config} does not exist or is not a file")
    try:
        raw = json.loads(cli.read_text(FLAGS.config, "--config"))
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--config {FLAGS.config} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise app.UsageError(f"--config {FLAGS.config} must hold a JSON object (an HF config.json)")
    return raw


def check_settings(corpus) -> None:
    """The flags and the corpus's size, checked before any work."""
    check_training_flags()
    check_enough_examples(len(corpus), f"--corpus {FLAGS.corpus} has {len(corpus)} rows",
                          f"give at least {2 * FLAGS.batch_size} rows")
    if FLAGS.tokenizer_from is not None and not os.path.isfile(os.path.join(FLAGS.tokenizer_from, "tokenizer.json")):
        raise app.UsageError(f"--tokenizer_from {FLAGS.tokenizer_from} holds no tokenizer.json; give the folder of "
                             "the model whose tokenizer the corpus was made with")


def starting_weights(cfg) -> dict:
    """--init_from's weights, float32, in --config's layout; a usage error naming a tensor that does not fit."""
    import numpy as np

    import eagle3_jax as e3
    from eagle3_jax.train.lm import params_to_flat
    from eagle3_jax.weights.params import flat_specs, stack_flat

    check_target_path("--init_from", FLAGS.init_from, draft_flag=None)
    start = e3.load_target(FLAGS.init_from, dtype="float32")
    with cli.usage_errors(f"--init_from {FLAGS.init_from}"):  # another architecture: its layout does not unstack
        flat = params_to_flat(start.params, start.config)
    for name, spec in flat_specs(cfg).items():
        if name not in flat or tuple(flat[name].shape) != tuple(spec.shape):
            raise app.UsageError(f"--init_from {FLAGS.init_from} has no {name} of shape {tuple(spec.shape)} (it has "
                                 f"{tuple(flat[name].shape) if name in flat else 'none'}): give a model of --config's sizes")
    return stack_flat({name: np.asarray(flat[name], np.float32) for name in flat_specs(cfg)}, cfg)


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    import jax
    import numpy as np

    from eagle3_jax.checkpoint.hf_writer import save_hf_target
    from eagle3_jax.config.model import parse_model_config
    from eagle3_jax.train.lm import init_target_params, lm_loss, params_to_flat
    from eagle3_jax.train.trainer import TrainConfig, Trainer

    raw = read_config()
    cfg = parse_model_config(raw)
    corpus = np.asarray(read_token_corpus(FLAGS.corpus, vocab_size=cfg.vocab_size))
    check_settings(corpus)
    params = starting_weights(cfg) if FLAGS.init_from else init_target_params(cfg, FLAGS.seed)
    from eagle3_jax.train import run_record
    from eagle3_jax.train.split import held_out_count

    out = FLAGS.out.rstrip("/")
    ckpt_dir = FLAGS.ckpt_dir or out + ".ckpt"
    inputs = {"--config": FLAGS.config, "--corpus": FLAGS.corpus, "--tokenizer_from": FLAGS.tokenizer_from}
    settings = settings_of(RUN_FLAGS)
    fingerprint = run_record.data_fingerprint([FLAGS.config, FLAGS.corpus], [FLAGS.init_from] if FLAGS.init_from else [])
    state = plan_run(out, ckpt_dir, settings, fingerprint, inputs, what="model")
    if state == "finished":
        return
    rng = np.random.default_rng(FLAGS.seed)
    order = rng.permutation(len(corpus))
    n_eval = held_out_count(len(corpus), FLAGS.eval_fraction, FLAGS.batch_size)
    eval_set, train_set = corpus[order[:n_eval]], corpus[order[n_eval:]]
    steps_per_epoch = len(train_set) // FLAGS.batch_size
    mask = np.ones(corpus.shape[1:], bool)

    def batches(epoch: int):
        perm = np.random.default_rng(FLAGS.seed * 1000003 + epoch).permutation(len(train_set))
        for i in range(steps_per_epoch):
            rows = train_set[perm[i * FLAGS.batch_size:(i + 1) * FLAGS.batch_size]]
            yield {"tokens": rows, "loss_mask": np.broadcast_to(mask, rows.shape)}

    eval_batches = [{"tokens": eval_set[i:i + FLAGS.batch_size], "loss_mask": np.broadcast_to(mask, (FLAGS.batch_size,) + mask.shape)}
                    for i in range(0, n_eval - FLAGS.batch_size + 1, FLAGS.batch_size)]
    tc = TrainConfig(epochs=FLAGS.epochs, learning_rate=FLAGS.learning_rate, warmup_steps=FLAGS.warmup_steps,
                     compute_dtype=FLAGS.compute_dtype, seed=FLAGS.seed, checkpoint_every=200)
    trainer = Trainer(lambda p, frozen, b: lm_loss(p, cfg, b), params, {}, tc,
                      total_steps=steps_per_epoch * FLAGS.epochs, ckpt_dir=ckpt_dir)
    run_record.write_record(ckpt_dir, settings, fingerprint)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.state.params))
    print(f"{cfg.model_type}: {n_params / 1e6:.2f}M params; {len(train_set)} train / {n_eval} eval sequences of "
          f"{corpus.shape[1]} tokens; {steps_per_epoch} steps per epoch")
    start = time.perf_counter()
    trainer.fit(batches, steps_per_epoch, evaluate=lambda p: trainer.evaluate(eval_batches))
    flat = params_to_flat(trainer.state.params, cfg)
    dtype = np.dtype(jax.numpy.bfloat16) if FLAGS.save_dtype == "bfloat16" else np.float32
    flat = {k: v.astype(np.float32 if k.endswith(("router", "router_bias")) else dtype) for k, v in flat.items()}
    extra = {}
    if FLAGS.tokenizer_from:
        extra = cli.files_in(FLAGS.tokenizer_from, TOKENIZER_FILES)
    save_hf_target(out, flat, cfg, dict(raw, torch_dtype=FLAGS.save_dtype), extra, overwrite=FLAGS.overwrite,
                   inputs=inputs)
    run_record.write_record(ckpt_dir, settings, fingerprint, finished=True)
    print(f"saved {out} after {time.perf_counter() - start:.0f} s of training")


if __name__ == "__main__":
    cli.run(main)
