"""Kernel loads over the least their contracts read: each Triton kernel run under Triton's
interpreter at a model's per-device shapes, with each architecture's launch-table entry, its
global-memory loads counted (`pallas_kernels.traffic`). Needs no GPU and times nothing.

    python scripts/kernel_traffic.py --json_out=benchmarks/results/kernel-traffic.json \\
        --markdown_out=benchmarks/results/kernel-traffic.md        # Kimi-K2.5 MLA + MoE, MiniMax-M2.5 GQA
    python scripts/kernel_traffic.py --ops=moe --hidden=1024 --moe_inter=512 --moe_tokens=64   # a quick run

Attention (--ops includes attention): Kimi-K2.5's MLA (latent 512 + rope 64) at 8 heads a device
(tensor parallel) and 64 (data-parallel attention), T 1 and 4, bfloat16 and FP8 pages of 16 and 64
slots; MiniMax-M2.5's GQA (48 heads over 8 KV heads of 128), T 1 and 4, bfloat16 and FP8 pages of
16. --batch rows of --context slots each (the ratio is per row: a batch of 64 reads 32 times what
2 do; the KV splits are a batch of 64's). MoE (--ops includes moe): Kimi-K2.5's routed experts on
one device of eight (48 of 384, top-8, int4 in groups of 32), --hidden -> --moe_inter -> --hidden,
the fused gate/up launch and the down launch for each of --moe_tokens routed uniformly at random.

A row per shape and distinct launch (architectures whose entries tile alike share a row): bytes
loaded, the minimum, and their ratio (1: every byte read once).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("ops", ["moe", "attention"], "Kernels to count: moe, attention.")
flags.DEFINE_list("archs", ["default", "gfx942", "gfx950", "sm_90", "sm_100"], "Launch-table entries to count with.")
flags.DEFINE_integer("batch", 2, "Attention: rows interpreted (the KV splits are a batch of 64's).", lower_bound=1)
flags.DEFINE_integer("context", 1024, "Attention: committed slots per row.", lower_bound=1)
flags.DEFINE_list("moe_tokens", ["64", "256"], "MoE: tokens per step (x top-8 routed).")
flags.DEFINE_integer("hidden", 7168, "MoE: hidden size.", lower_bound=32)
flags.DEFINE_integer("moe_inter", 2048, "MoE: expert intermediate width on the device.", lower_bound=32)
flags.DEFINE_string("json_out", None, "Also write the rows as JSON here.")
flags.DEFINE_string("markdown_out", None, "Also write the tables as Markdown here.")
cli.define_overwrite_flag("--json_out / --markdown_out")


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    cli.check_output("--markdown_out", FLAGS.markdown_out, {"--json_out": FLAGS.json_out}, is_file=True)
    from eagle3_jax.bench import kernel_timing
    from eagle3_jax.bench import traffic as bench
    from pallas_kernels import launch

    unknown = set(FLAGS.ops) - {"attention", "moe"}
    if unknown or not FLAGS.ops:
        raise app.UsageError(f"--ops takes attention and/or moe; got {','.join(FLAGS.ops)!r}")
    if set(FLAGS.archs) - set(bench.ARCHS) or not FLAGS.archs:
        raise app.UsageError(f"--archs takes {', '.join(bench.ARCHS)}; got {','.join(FLAGS.archs)!r}")
    with cli.usage_errors():
        tokens = kernel_timing.parse_counts(FLAGS.moe_tokens, "moe_tokens")
        shapes = bench.kimi_moe_shapes(FLAGS.hidden, FLAGS.moe_inter, tokens)
        if "moe" in FLAGS.ops:
            bench.expert_weights(shapes)  # the kernels take these shapes
    rows: list[dict] = []
    notes = [f"MoE at {FLAGS.hidden} -> {FLAGS.moe_inter} -> {FLAGS.hidden}" + (
        "" if (FLAGS.hidden, FLAGS.moe_inter) == (7168, 2048) else
        " (Kimi-K2.5's 7168 -> 2048 shrunk for the interpreter: the ratio is set by the rows per expert, "
        "the column tile and the bytes per weight element, not by K or N while the tiles divide them)"),
             f"attention: {FLAGS.batch} rows of {FLAGS.context} slots interpreted (the last a page and 3 slots "
             "shorter), KV splits as a batch of 64 picks them",
             "launch entries: " + "; ".join(f"{form} {arch}: {launch.launch(form, arch)}" for form in launch.FORMS
                                            for arch in FLAGS.archs)]
    write_json = cli.rewritten_output("--json_out", FLAGS.json_out)
    write_markdown = cli.rewritten_output("--markdown_out", FLAGS.markdown_out)

    def add(row: dict) -> None:  # after every row: a run cut short keeps what it counted
        rows.append(row)
        print(bench.moe_line(row) if row["op"] == "moe" else bench.attention_line(row), flush=True)
        record = bench.record(sys.argv, rows, notes)
        write_json(json.dumps(record, indent=1))
        write_markdown("\n".join(bench.markdown(record)))

    if "moe" in FLAGS.ops:
        print("\n".join(["", "MoE"] + bench.MOE_HEADER), flush=True)
        bench.moe_rows(shapes, FLAGS.archs, on_row=add)
    if "attention" in FLAGS.ops:
        print("\n".join(["", "attention"] + bench.ATTENTION_HEADER), flush=True)
        bench.attention_rows(bench.kimi_attention_cases() + bench.minimax_attention_cases(), FLAGS.archs,
                             FLAGS.batch, FLAGS.context, on_row=add)


if __name__ == "__main__":
    cli.run(main)
