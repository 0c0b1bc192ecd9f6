"""Convert an HF safetensors checkpoint to eagle3-jax's Orbax format.

    python scripts/convert.py --hf_dir /models/Kimi-K2.5 --out_dir /models/Kimi-K2.5-orbax

Works layer by layer (host memory ~ one layer), keeps quantized weights (int4, FP8, MXFP4) in their
quantized format (or dequantizes them with --dequantize), and writes the output atomically: the
folder appears only once it is complete, and an interrupted run resumes when run again. Loading
the result with `read_flat_params` / `load_target` gives bit-identical tensors to loading the HF folder.
Orbax's per-array INFO lines are hidden unless --verbose. Mistakes in the flags, paths, config or
checkpoint end the script with one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

# Run from a checkout without installing: make the repository's package importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import check_target_path  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF model folder: config.json + model.safetensors or a sharded index.")
flags.DEFINE_string("out_dir", None, "Output folder for the Orbax checkpoint (must not exist unless --overwrite).")
flags.DEFINE_enum(
    "dtype",
    None,
    ["float32", "bfloat16", "float16"],
    "Cast stored tensors to this dtype (router params stay float32). Default: keep the checkpoint's "
    "dtype (with --dequantize, dequantized weights are float32 then: use bfloat16).",
)
flags.DEFINE_bool("dequantize", False, "Store quantized weights dequantized (floats) instead of in their quantized format.")
flags.DEFINE_bool("overwrite", False, "Replace an existing --out_dir (swapped in only after the new one is complete).")
flags.DEFINE_bool("progress", True, "Show a per-layer progress bar.")
flags.mark_flags_as_required(["hf_dir", "out_dir"])


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments: {' '.join(argv[1:])} (use --hf_dir / --out_dir)")
    check_target_path("--hf_dir", FLAGS.hf_dir, draft_flag=None)
    cli.check_output("--out_dir", FLAGS.out_dir, {"--hf_dir": FLAGS.hf_dir})
    from eagle3_jax.checkpoint import save_orbax  # imported here so that --help works without loading JAX
    from eagle3_jax.config.model import load_model_config
    from eagle3_jax.models.target import with_quant_options

    start = time.time()
    cfg = with_quant_options(load_model_config(FLAGS.hf_dir), dequantize=FLAGS.dequantize, fp8_format="e4m3fn")
    marker = save_orbax(FLAGS.hf_dir, FLAGS.out_dir, cfg, progress=FLAGS.progress, dtype=FLAGS.dtype,
                        overwrite=FLAGS.overwrite)
    dtypes = sorted({t["dtype"] for t in marker["tensors"].values()})
    print(
        f"converted {cfg.model_type} ({cfg.num_layers} layers, {len(marker['tensors'])} tensors, "
        f"{marker['num_bytes'] / 2**30:.2f} GiB, dtypes {', '.join(dtypes)}) in {time.time() - start:.1f}s\n"
        f"  from {os.path.abspath(FLAGS.hf_dir)}\n  to   {os.path.abspath(FLAGS.out_dir)}"
    )
    return 0


if __name__ == "__main__":
    cli.run(main)
