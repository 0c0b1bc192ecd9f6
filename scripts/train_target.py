"""Train a target model from scratch on a token corpus and save it as an HF folder.

    python scripts/train_target.py --config=checkpoints/kimi-mini.config.json --corpus=/tmp/corpus.npy \\
        --tokenizer_from=checkpoints/stories260K --epochs=2 --batch_size=16 --out=checkpoints/kimi-mini

The corpus is an int32 [N, seq_len] .npy of token ids (scripts/make_corpus.py). The result loads
with e3.load_target and follows the HF layout of the config's model_type.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "HF config.json of the model to train.")
flags.DEFINE_string("corpus", None, "Token corpus .npy [N, seq_len].")
flags.DEFINE_string("tokenizer_from", None, "Folder whose tokenizer files are copied into --out.")
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
flags.mark_flags_as_required(["config", "corpus", "out"])

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def main(argv: Sequence[str]) -> None:
    _cli.reject_positional(argv)
    import jax
    import numpy as np

    from eagle3_jax.checkpoint.hf_writer import save_hf_target
    from eagle3_jax.config import parse_model_config
    from eagle3_jax.train.lm import init_target_params, lm_loss, params_to_flat
    from eagle3_jax.train.trainer import Trainer, TrainConfig

    with open(FLAGS.config) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise app.UsageError(f"--config {FLAGS.config} is not valid JSON: {e}") from None
    cfg = parse_model_config(raw)
    with _cli.usage_errors(f"--corpus {FLAGS.corpus}"):  # not a .npy file
        corpus = np.load(FLAGS.corpus)
    if corpus.ndim != 2 or corpus.max() >= cfg.vocab_size:
        raise app.UsageError(f"--corpus must be int [N, seq_len] with ids < {cfg.vocab_size}")
    rng = np.random.default_rng(FLAGS.seed)
    order = rng.permutation(len(corpus))
    n_eval = max(int(len(corpus) * FLAGS.eval_fraction), FLAGS.batch_size)
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
    trainer = Trainer(lambda p, frozen, b: lm_loss(p, cfg, b), init_target_params(cfg, FLAGS.seed), {}, tc,
                      total_steps=steps_per_epoch * FLAGS.epochs, ckpt_dir=FLAGS.ckpt_dir or FLAGS.out.rstrip("/") + ".ckpt")
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
        extra = {n: os.path.join(FLAGS.tokenizer_from, n) for n in TOKENIZER_FILES
                 if os.path.isfile(os.path.join(FLAGS.tokenizer_from, n))}
    save_hf_target(FLAGS.out, flat, cfg, dict(raw, torch_dtype=FLAGS.save_dtype), extra)
    print(f"saved {FLAGS.out} after {time.perf_counter() - start:.0f} s of training")


if __name__ == "__main__":
    _cli.run(main)
