"""Plan a draft's training before loading anything: per device, the target's weights, the draft's state,
the teacher's and the training step's temporaries and the peak, for each mesh and sequence length.

    python scripts/plan_training.py --target=tests/data/kimi-k2.5.config.json --meshes="8,1,1;1,1,8" \\
        --seq_lens=4096,16384,32768 --draft_arch=mla --draft_vocab_size=32000 --draft_intermediate_size=18432 \\
        --devices=MI325X

It compiles what `train_draft.py --mesh` runs (the target's forward over each batch in passes of
--teacher_chunk tokens, sharded as serving shards it; the draft's training-time-test step with its
weights and AdamW moments split over the devices) over shape-only sharded arguments, and reads XLA's
memory analysis of each (eagle3_jax/train/plan.py says how the peak is formed). A step trains
--batch sequences (default: one per data shard). Fake the devices on a CPU host with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import int_list  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target HF / converted folder, or a bare config.json.")
flags.DEFINE_string("meshes", "8,1,1", "Meshes data,tensor,expert separated by ';', e.g. '8,1,1;1,1,8'.")
flags.DEFINE_list("seq_lens", ["4096", "16384", "32768"], "Tokens per training sequence.")
flags.DEFINE_integer("batch", 0, "Sequences per step (0: the mesh's data axis, one per data shard).", lower_bound=0)
flags.DEFINE_enum("draft_arch", "llama", ["llama", "mla"], "Draft decoder layers, as train_draft.py takes them.")
flags.DEFINE_integer("draft_layers", 1, "Decoder layers in the draft.", lower_bound=1)
flags.DEFINE_integer("draft_intermediate_size", 0, "Draft MLP width (0 = 4 x hidden).", lower_bound=0)
flags.DEFINE_integer("draft_vocab_size", 32000, "Draft vocabulary size (0 = the target's).", lower_bound=0)
flags.DEFINE_integer("ttt_steps", 7, "Training-time-test unroll depth.", lower_bound=1)
flags.DEFINE_bool("context_parallel", False, "Each sequence split over the data axis instead of the batch.")
flags.DEFINE_integer("teacher_chunk", 2048, "Tokens per teacher forward pass.", lower_bound=1)
flags.DEFINE_enum("quant", "auto", ["auto", "dequantize", "w4a8"], "auto: weights as the config stores them.")
flags.DEFINE_string("dtype", "bfloat16", "Dtype of the target's unquantized weights and of the teacher.")
flags.DEFINE_enum("compute_dtype", "bfloat16", ["float32", "bfloat16"], "The draft's compute dtype.")
flags.DEFINE_string("kernels", "xla", "The teacher's path: xla (its MoE dequantizes int4 / FP8 experts to bfloat16 "
                    "before the dot, and those copies count) or triton with --arch (the GPU's program, kernels shape-only).")
flags.DEFINE_string("arch", None, "With --kernels=triton: the GPU (gfx942 = MI300X / MI325X, gfx950 = MI355X, sm_90).")
flags.DEFINE_list("devices", ["MI325X"], "Devices to compare the peak against.")
flags.DEFINE_string("json_out", None, "Also write every plan as JSON here.")
cli.define_overwrite_flag("--json_out")
flags.mark_flag_as_required("target")

COLUMNS = ("mesh d,t,e", "tokens / sequence", "sequences / step", "target weights", "draft state", "teacher temps",
           "step temps", "peak")


def row(plan) -> list[str]:
    gb = lambda n: f"{n / 1e9:.1f}"  # noqa: E731 (decimal GB, as vendors state HBM)
    mesh = ",".join(str(v) for v in plan.mesh_shape.values())
    return [mesh, f"{plan.seq_len:,}", str(plan.batch), gb(plan.target_bytes), gb(plan.state_bytes),
            gb(plan.teacher["temporaries"]), gb(plan.train_step["temporaries"]), gb(plan.peak_bytes)]


def main(argv: list[str]) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, {"--target": FLAGS.target}, is_file=True)
    import jax

    import eagle3_jax as e3
    from eagle3_jax.planning import report
    from eagle3_jax.planning.memory import DEVICES
    from eagle3_jax.train.draft_run import DraftRecipe
    from eagle3_jax.train.plan import plan_training

    with cli.usage_errors("--meshes"):
        meshes = report.parse_meshes(FLAGS.meshes)
    unknown = [d for d in FLAGS.devices if d not in DEVICES]
    if unknown:
        raise app.UsageError(f"unknown --devices {unknown}; known: {', '.join(DEVICES)}")
    seq_lens = int_list(FLAGS.seq_lens, "seq_lens", positive=True)
    for shape in meshes:
        if shape[0] * shape[1] * shape[2] > jax.device_count():
            raise app.UsageError(f"mesh {shape} needs {shape[0] * shape[1] * shape[2]} devices but {jax.device_count()} "
                                 "exist; set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    devices = [DEVICES[d] for d in FLAGS.devices]
    print(f"training plan for {FLAGS.target}: {FLAGS.draft_arch} draft x {FLAGS.draft_layers}, vocabulary "
          f"{FLAGS.draft_vocab_size or 'the target'}'s, TTT depth {FLAGS.ttt_steps}, teacher passes of "
          f"{FLAGS.teacher_chunk} tokens on the {FLAGS.kernels} path; GB per device (decimal)\n", flush=True)
    print("| " + " | ".join(COLUMNS + tuple(f"fits {d.name}" for d in devices)) + " |")
    print("|" + "---|" * (len(COLUMNS) + len(devices)), flush=True)
    plans, write = [], cli.rewritten_output("--json_out", FLAGS.json_out)  # after every plan: a cut run keeps its rows
    for shape in meshes:
        mesh = e3.make_mesh(*shape, devices=jax.devices()[: shape[0] * shape[1] * shape[2]])
        recipe = DraftRecipe(vocab_size=FLAGS.draft_vocab_size, arch=FLAGS.draft_arch, num_layers=FLAGS.draft_layers,
                             intermediate_size=FLAGS.draft_intermediate_size, ttt_steps=FLAGS.ttt_steps,
                             batch_size=FLAGS.batch or shape[0], context_parallel=FLAGS.context_parallel)
        for seq_len in seq_lens:
            with cli.usage_errors():  # a config the planner cannot read, kernels without their GPU
                plan = plan_training(FLAGS.target, mesh, seq_len, recipe, quant=None if FLAGS.quant == "auto" else FLAGS.quant,
                                     dtype=FLAGS.dtype, compute_dtype=FLAGS.compute_dtype,
                                     teacher_chunk=FLAGS.teacher_chunk, kernels=FLAGS.kernels, arch=FLAGS.arch)
            plans.append(plan.as_dict())
            print("| " + " | ".join(row(plan) + ["yes" if plan.fits(d) else "NO" for d in devices]) + " |", flush=True)
            write(json.dumps({"argv": sys.argv, "plans": plans}, indent=1))


if __name__ == "__main__":
    cli.run(main)
