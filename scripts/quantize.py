"""Write a quantized copy of a float HF target in a real checkpoint layout (round-to-nearest).

    python scripts/quantize.py --src=checkpoints/kimi-mini --out=/tmp/kimi-mini-int4
    python scripts/quantize.py --src=/models/my-moe --out=/models/my-moe-fp8 --method=fp8_block --scope=all

Methods: int4_pack (compressed-tensors pack-quantized, symmetric groups, as Kimi-K2.5 ships its
experts), fp8_block (128x128 blocks, DeepSeek-V3 / MiniMax-M2.5), mxfp4 (AMD Quark OCP MX, groups
of 32), fp8_channel (AMD Quark ptpc FP8). --scope=experts (default) quantizes only the routed
experts, --scope=all every linear weight but the LM head. The copy loads like a downloaded
checkpoint of that format (`load_target`, `scripts/demo.py --target=...`, `scripts/serve.py`),
its weights staying quantized on device. Rounding to nearest is the simplest quantizer: it is
meant for trying the formats on your own model, not as a calibrated (GPTQ / AWQ) one.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import flags

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import check_target_path  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("src", None, "Float HF target folder (config.json + safetensors).")
flags.DEFINE_string("out", None, "Output folder (must not exist unless --overwrite; never --src, inside it or "
                    "holding it).")
flags.DEFINE_enum("method", "int4_pack", ["int4_pack", "fp8_block", "mxfp4", "fp8_channel"], "Quantized format.")
flags.DEFINE_integer("group_size", 32, "int4_pack: input columns per scale (must divide every quantized weight's "
                     "input width).", lower_bound=8)
flags.DEFINE_enum("scope", "experts", ["experts", "all"], "experts: only routed experts; all: every linear weight "
                  "but the LM head.")
cli.define_overwrite_flag("--out")
flags.mark_flags_as_required(["src", "out"])


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    check_target_path("--src", FLAGS.src, draft_flag=None)
    cli.check_output("--out", FLAGS.out, {"--src": FLAGS.src})
    from eagle3_jax.checkpoint.quantized_copy import quantize_checkpoint
    from eagle3_jax.config.model import load_model_config
    from eagle3_jax.weights.params import flat_specs

    # quantize_checkpoint's ValueErrors name what the flags asked for and the model cannot take
    # (a --group_size that does not divide a weight)
    with cli.usage_errors():
        out = quantize_checkpoint(FLAGS.src, FLAGS.out, FLAGS.method, FLAGS.group_size, FLAGS.scope,
                                  overwrite=FLAGS.overwrite)
    cfg = load_model_config(out)
    quantized = [n for n, s in flat_specs(cfg).items() if s.quant is not None]
    print(f"wrote {out}: {cfg.quant.method} ({len(quantized)} of {len(flat_specs(cfg))} tensors quantized, "
          f"scope {FLAGS.scope})")


if __name__ == "__main__":
    cli.run(main)
