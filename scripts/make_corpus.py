"""Sample a token corpus from a model (e.g. text for training the bundled demo target).

    python scripts/make_corpus.py --model=checkpoints/stories260K --num_sequences=4096 \\
        --seq_len=128 --temperature=1.0 --out=/tmp/corpus.npy

Writes int32 [num_sequences, seq_len] token ids: BOS followed by sampled tokens (sequence i uses
seed + i, so the corpus is reproducible).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import check_target_path  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Model folder to sample from.")
flags.DEFINE_integer("num_sequences", 4096, "Sequences to sample.", lower_bound=1)
flags.DEFINE_integer("seq_len", 128, "Tokens per sequence, BOS included.", lower_bound=2)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (> 0).", lower_bound=1e-6)
flags.DEFINE_float("top_p", 1.0, "Nucleus threshold.")
flags.DEFINE_integer("seed", 0, "Base seed.")
flags.DEFINE_integer("batch_size", 256, "Sequences per generate wave.", lower_bound=1)
flags.DEFINE_string("out", None, "Output .npy path.")
cli.define_overwrite_flag("--out")
flags.mark_flags_as_required(["model", "out"])


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    check_target_path("--model", FLAGS.model, draft_flag=None)
    cli.check_output("--out", FLAGS.out, {"--model": FLAGS.model}, is_file=True)
    import numpy as np

    import eagle3_jax as e3
    from eagle3_jax.checkpoint.atomic import atomic_output

    target = e3.load_target(FLAGS.model, dtype="float32")
    bos = target.config.bos_token_id if target.config.bos_token_id is not None else 0
    engine = e3.Engine(target, max_batch_size=FLAGS.batch_size, max_seq_len=FLAGS.seq_len)
    with cli.usage_errors():  # SamplingParams names the bad flag value (top_p, ...)
        sampling = [e3.SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                                      max_tokens=FLAGS.seq_len - 1, seed=FLAGS.seed + i)
                    for i in range(FLAGS.num_sequences)]
    start = time.perf_counter()
    outs = engine.generate([[bos]] * FLAGS.num_sequences, sampling)
    corpus = np.zeros((FLAGS.num_sequences, FLAGS.seq_len), np.int32)
    for i, o in enumerate(outs):
        seq = [bos] + o.token_ids
        corpus[i, : len(seq)] = seq
    with atomic_output(FLAGS.out, name="--out", overwrite=FLAGS.overwrite, is_file=True) as tmp:
        with open(tmp, "wb") as f:  # a file object: np.save would add .npy to the temporary's name
            np.save(f, corpus)
    print(f"wrote {corpus.shape} tokens to {FLAGS.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    cli.run(main)
