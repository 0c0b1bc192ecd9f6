"""Draft training's memory and tokens per second against the sequence length
(`eagle3_jax/bench/train_memory.py`): a fresh draft for --target as train_draft.py makes it, one
training step per point, each point in a process of its own.

    python scripts/bench_train.py --json_out=benchmarks/results/train-memory.json \\
        --markdown_out=benchmarks/results/train-memory.md        # 512 .. 8K, the whole form to 2K
    python scripts/bench_train.py --seq_lens=1024,2048 --mesh=4,2,1 --context_parallel   # 8 fake devices

Each row: XLA's plan for the step per device (arguments + outputs + temporaries, shapes only), the
process's peak resident set over the one before the first step, training tokens per second, and
each peak against the same form's at half the length (memory linear in the sequence: 2x). The
whole form (`TTTMemory.whole()`: the T x T scores and the logits held at once) runs up to
--baseline_max_len as the baseline.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import check_target_path, int_list  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder the draft is made for.")
flags.DEFINE_list("seq_lens", ["512", "1024", "2048", "4096", "8192"], "Sequence lengths (positions per sequence).")
flags.DEFINE_integer("baseline_max_len", 2048, "Also run the whole (quadratic) form up to this length (0: never).",
                     lower_bound=0)
flags.DEFINE_integer("batch_size", 1, "Sequences per step.", lower_bound=1)
flags.DEFINE_integer("ttt_steps", 7, "Training-time-test unroll depth.", lower_bound=1)
flags.DEFINE_enum("draft_arch", "llama", ["llama", "mla"], "Draft decoder layer.")
flags.DEFINE_integer("draft_vocab_size", 0, "Draft vocabulary (0: the target's whole vocabulary).", lower_bound=0)
flags.DEFINE_enum("compute_dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype (master weights float32).")
flags.DEFINE_list("mesh", [], "data,tensor,expert mesh (empty: one device).")
flags.DEFINE_bool("context_parallel", False, "Split each sequence over the --mesh data axis.")
flags.DEFINE_integer("steps", 2, "Timed steps per point (after one untimed).", lower_bound=1)
flags.DEFINE_integer("timeout_s", 900, "Per-point time limit.", lower_bound=10)
flags.DEFINE_string("json_out", None, "Write the rows, command, machine and date here.")
flags.DEFINE_string("markdown_out", None, "Write the table here.")
cli.define_overwrite_flag("--json_out / --markdown_out")


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    check_target_path("--target", FLAGS.target, draft_flag=None)
    lengths = int_list(FLAGS.seq_lens, "seq_lens", positive=True)
    from eagle3_jax.runtime.sharding import parse_mesh

    with cli.usage_errors("--mesh"):
        mesh = parse_mesh(FLAGS.mesh)
    if FLAGS.context_parallel and mesh is None:
        raise app.UsageError("--context_parallel splits each sequence over the --mesh data axis: give --mesh")
    for path in (FLAGS.json_out, FLAGS.markdown_out):
        if path and os.path.exists(path) and not FLAGS.overwrite:
            raise app.UsageError(f"{path} exists; pass --overwrite to replace it")

    from eagle3_jax.bench.report import machine_info
    from eagle3_jax.bench.train_memory import TrainPoint, markdown, ratios, run_in_process

    common = dict(target=FLAGS.target, batch_size=FLAGS.batch_size, ttt_steps=FLAGS.ttt_steps,
                  draft_arch=FLAGS.draft_arch, draft_vocab_size=FLAGS.draft_vocab_size,
                  compute_dtype=FLAGS.compute_dtype, mesh=mesh, context_parallel=FLAGS.context_parallel,
                  steps=FLAGS.steps)
    points = [TrainPoint(length=t, **common) for t in lengths]
    points += [TrainPoint(length=t, bounded=False, **common) for t in lengths if t <= FLAGS.baseline_max_len]
    rows = []
    for point in points:
        rows.append(run_in_process(point, FLAGS.timeout_s))
        print(f"{point.label}: " + (rows[-1].get("error") or f"plan peak {rows[-1]['plan_peak_bytes'] / 2**20:.0f} MiB, "
              f"peak RSS over start {rows[-1]['peak_over_start_bytes'] / 2**20:.0f} MiB, "
              f"{rows[-1]['tokens_per_s']:.0f} tokens/s"), flush=True)
    rows = ratios(rows)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    header = (f"Draft training memory against the sequence length, `{' '.join(['python'] + sys.argv)}`, "
              f"{date}, {os.cpu_count()} CPU cores")
    table = markdown(rows, header)
    print(table)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "date": date, "machine": machine_info(),
                       "rows": rows}, f, indent=1)
    if FLAGS.markdown_out:
        with open(FLAGS.markdown_out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    cli.run(main)
