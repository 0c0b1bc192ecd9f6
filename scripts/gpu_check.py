"""One-shot GPU check: the Triton kernels and the steps they serve, timed against XLA, and lossless.

    python scripts/gpu_check.py --json_out=gpu_check.json          # on a GPU: Kimi-K2.5 per-device shapes
    python scripts/gpu_check.py --small --json_out=/tmp/check.json   # anywhere (a CPU runs it interpreted)
    python scripts/gpu_check.py --parts=kernels --json_out=k.json   # one part (scripts/gpu_proof.sh runs each
                                                                    # part in its own process and time limit)

Parts (--parts), one JSON, rewritten as each part finishes so a part cut short loses only itself:
1. kernels: on a GPU first the two ceilings measured (a device-to-device copy's GB/s counting bytes
   read and written; a bf16 8192^3 matrix product's TFLOP/s), then each kernel against its XLA
   path (scripts/bench_kernels.py's measurements): Kimi-K2.5's MLA prefix attention (64 heads,
   latent 512 + rope 64) at batch 1 and 64, T = 1 and 4, 8K context; its routed experts in int4
   (48 of 384 on the device, top-8, 7168 -> 2048 -> 7168). Each row has the kernel's and XLA's
   fraction of the data-sheet HBM peak and of the measured copy bandwidth.
2. steps: a plain decode step (T = 1) and a chain verify step (T = 4) of the target forward with
   the kernels and with XLA, at batch 1 and 64 over an 8K cache. Kimi-K2.5 does not fit one GPU,
   so the model is cut to its dense layers plus one MoE layer (all 384 int4 experts), with random
   weights made on the device (timings only; the numbers it computes mean nothing). Each row has
   the bytes a step must read (weights but the embedding table, the routed experts a batch is
   expected to hit, the K/V prefix) and the steps' fractions of the peaks. A row is recorded once
   the kernels' step is timed (XLA's fields null until its own is), so a time limit during XLA's
   compile keeps the kernels' half. --step_shapes picks other (batch, T) pairs.
3. demo: the bundled kimi-mini pair with kernels="triton" and "xla", in float32 and bfloat16:
   greedy outputs of plain decoding, chain 3/1/4 and tree 5/4/16 (Engine.generate over the demo
   prompts), and their ms per token (a second, timed pass); --demo_kernels, --demo_dtypes and
   --demo_specs narrow it. In float32 every output must equal its dtype's first row (plain
   greedy decoding on the XLA path by default); bfloat16 rows are reported (kernels and XLA round
   differently, so a near-tie can flip a token there).

On a CPU host (or with --small) the same code runs at small shapes (kimi-mini's own config for the
steps; float32 plain and chain only in the demo) with the kernels under Triton's interpreter: it
shows the script works, not how fast anything is. It exits 1 if a kernel disagrees with XLA or a
float32 demo output differs from plain greedy decoding.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels  # noqa: E402, F401  (its flags: the shapes this check refuses, --device, --json_out, ...)

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("small", None, "Small shapes (default: on a CPU host). The kernels run interpreted on a CPU.")
FLAGS.set_default("json_out", "gpu_check.json")  # bench_kernels' flag: where the results go
flags.DEFINE_integer("step_repeats", None, "Timed runs per step (default 20 on a GPU, 2 small).", lower_bound=1)
flags.DEFINE_integer("greedy_tokens", None, "Tokens per prompt in the demo check (default 64 on a GPU, 6 small).",
                     lower_bound=1)
flags.DEFINE_list("parts", ["kernels", "steps", "demo"], "Parts to run, in this order: kernels, steps, demo.")
flags.DEFINE_list("step_shapes", None, "Steps part: batch:T pairs, in order (default 1:1,1:4,64:1,64:4 on a GPU; "
                  "2:1,2:4 small).")
flags.DEFINE_list("demo_dtypes", None, "Demo part: dtypes (default float32,bfloat16 on a GPU, float32 small).")
flags.DEFINE_list("demo_kernels", ["xla", "triton"], "Demo part: kernels choices, each as load_target takes it.")
flags.DEFINE_list("demo_specs", None, "Demo part: settings (default none,chain:3:1:4,tree:5:4:16; small: the first two).")
PARTS = ("kernels", "steps", "demo")  # eagle3_jax.bench.gpu_check.PARTS, checked here before JAX loads


def main(argv) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    unknown = [p for p in FLAGS.parts if p not in PARTS]
    if unknown or not FLAGS.parts:
        raise app.UsageError(f"--parts takes {', '.join(PARTS)}; got {','.join(FLAGS.parts)!r}")
    import jax

    from eagle3_jax.bench import gpu_check
    from eagle3_jax.planning.memory import DEVICES

    on_cpu = jax.default_backend() == "cpu"
    small = on_cpu if FLAGS.small is None else FLAGS.small
    given = [f"--{name}" for name in gpu_check.FIXED_SHAPE_FLAGS if FLAGS[name].present]
    if given:
        raise app.UsageError(f"{', '.join(given)}: gpu_check.py runs fixed shapes (Kimi-K2.5's, or small ones with "
                             "--small); time other shapes with scripts/bench_kernels.py")
    kind = jax.devices()[0].device_kind
    device = FLAGS.device if FLAGS["device"].present else gpu_check.device_name(kind, FLAGS.device)
    if device not in DEVICES:
        raise app.UsageError(f"--device must be one of {', '.join(DEVICES)}; got {device!r}")
    with cli.usage_errors():
        plan = gpu_check.check_plan(FLAGS.parts, small, DEVICES[device], on_cpu, launches=FLAGS.attention_launches,
                                    step_shape_texts=FLAGS.step_shapes, step_repeats=FLAGS.step_repeats,
                                    greedy_tokens=FLAGS.greedy_tokens, demo_dtypes=FLAGS.demo_dtypes,
                                    demo_kernels=FLAGS.demo_kernels, demo_specs=FLAGS.demo_specs)
    record = gpu_check.CheckRecord(gpu_check.check_header(sys.argv, kind, plan),
                                   cli.rewritten_output("--json_out", FLAGS.json_out))
    failed = gpu_check.run_check(plan, record, lambda line: print(line, flush=True))
    print(f"\nwrote {FLAGS.json_out}")
    if failed:
        print(f"gpu_check.py: {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
