"""Write an HF target folder of random weights for a config.json, in the checkpoint's own formats
(Kimi-K2.5's int4 experts as compressed-tensors packs), for measuring what needs the model's shapes
but not its values: start-up and compile time, memory, step time.

    python scripts/random_target.py --config=tests/data/kimi-k2.5.config.json --one_moe_layer \\
        --tokenizer_from=checkpoints/kimi-mini --out=/tmp/kimi-k2.5-slice

--one_moe_layer cuts the model to its dense layers plus one MoE layer (the Kimi-K2.5 slice: one
dense layer and one layer of 384 int4 experts, about 13 GB). Norms are ones, other floats N(0, 0.02);
every routed expert of a shape stores a row rotation of one encoded random matrix (encoding each
would take an hour at Kimi-K2.5's size). Written as safetensors shards with their index, one shard
in memory at a time, swapped in complete. The outputs of such a model are meaningless.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from absl import flags

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tiktoken.model",
                   "tokenization_kimi.py", "chat_template.jinja")

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "An HF config.json (the model's shapes, layers and quantization).")
flags.DEFINE_string("out", None, "Output folder (must not exist unless --overwrite).")
flags.DEFINE_bool("one_moe_layer", False, "Cut the model to its dense layers plus one MoE layer.")
flags.DEFINE_string("tokenizer_from", None, "A folder whose tokenizer files are copied in (default: none; "
                    "serve.py then needs --tokenizer).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "The float weights' dtype.")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_integer("shard_gb", 2, "About this many GB per safetensors shard.", lower_bound=1)
cli.define_overwrite_flag("--out")
flags.mark_flags_as_required(["config", "out"])


def tokenizer_files(folder: str | None) -> dict[str, str]:
    """{name: path} of the tokenizer files in `folder` (none for None); a folder without any is refused."""
    if folder is None:
        return {}
    if not os.path.isdir(folder):
        cli.fail(f"--tokenizer_from {folder} is not a folder; pass a model folder holding tokenizer files")
    found = cli.files_in(folder, TOKENIZER_FILES)
    if not found:
        cli.fail(f"--tokenizer_from {folder} holds none of {', '.join(TOKENIZER_FILES)}")
    return found


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    if not os.path.isfile(FLAGS.config):
        cli.fail(f"--config {FLAGS.config} is not a file; pass an HF config.json")
    extra = tokenizer_files(FLAGS.tokenizer_from)
    cli.check_output("--out", FLAGS.out, {"--config": FLAGS.config, "--tokenizer_from": FLAGS.tokenizer_from})
    from eagle3_jax.checkpoint.hf_writer import save_random_hf_target
    from eagle3_jax.config.model import load_model_config, one_moe_layer, parse_model_config

    load_model_config(FLAGS.config)  # one line for a config that is not valid JSON
    with open(FLAGS.config) as f:
        raw = json.load(f)
    if FLAGS.one_moe_layer:
        raw = one_moe_layer(raw)
    cfg = parse_model_config(raw)
    if FLAGS.one_moe_layer and not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        cli.fail(f"--one_moe_layer: {FLAGS.config} has no MoE layer; leave the flag out for a dense model")
    written = save_random_hf_target(FLAGS.out, cfg, raw, extra, dtype=FLAGS.dtype, seed=FLAGS.seed,
                                    shard_bytes=FLAGS.shard_gb << 30, overwrite=FLAGS.overwrite)
    print(f"wrote {FLAGS.out}: {cfg.num_layers} layers, {written['tensors']} tensors, "
          f"{written['bytes'] / 1e9:.2f} GB in {written['shards']} shards (random weights)")


if __name__ == "__main__":
    cli.run(main)
