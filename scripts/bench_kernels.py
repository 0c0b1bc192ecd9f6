"""Kernel benchmark: each Triton kernel against its XLA reference, at a model's per-device shapes.

    python scripts/bench_kernels.py                       # Kimi-K2.5 per-device shapes (on a GPU)
    python scripts/bench_kernels.py --kind=gqa --heads=48 --kv_heads=8 --head_dim=128 \\
        --hidden=3072 --moe_inter=1536 --experts=256 --local_experts=32 --moe_format=fp8_block   # MiniMax-M2.5
    python scripts/bench_kernels.py --batches=1 --tokens=1 --contexts=64 --repeats=2 --hidden=64 \\
        --moe_inter=64 --experts=16 --local_experts=4 --moe_tokens=1,32   # a CPU smoke run

Attention (--ops includes attention): for every (batch, new tokens T, context) it builds random
page pools and block tables, runs
`pallas_kernels.attention.paged_prefix_attention` and `paged_prefix_attention_reference` (both
jitted; the reference gathers every page of the table), checks they agree, and prints the median
time of each, the bytes the kernel must read (the prefix's K/V pages), the achieved GB/s and its
fraction of --device's HBM peak. MLA shapes: --heads query heads x T rows over latent 512 + rope
64 (Kimi-K2.5: 64 heads; 8 per device on a tensor-parallel mesh).

MoE (--ops includes moe): for every token count (decode: batch x T; prefill: chunk sizes) it routes
the tokens uniformly at random to --topk of --experts experts, of which this device holds the
first --local_experts (expert parallelism: Kimi-K2.5 on 8 devices holds 48 of 384), and runs the
device's routed-expert compute, `moe.local_experts`, through the Triton kernels (fused gate/up +
SiLU, then down) and through XLA (gathered matmuls at decode sizes, ragged_dot above). Weights are
random bytes in --moe_format. The bytes are those of the distinct local experts the tokens hit
(a lower bound on what either path must read).

Timing: on a GPU each timed program runs the op over several input sets (block tables over
distinct pages of one pool; distinct routings), enough that together they read ~256 MB, so the
L2 (50-60 MB on an H100 / H200) does not hold what one call reads and the launch overhead is
spread over them; the median of --repeats programs, divided by the sets, is the op's time (after
untimed calls for WARM_SECONDS, so the GPU's clocks are up). Each
row also counts the op's floating-point work and its share of --device's peak bf16 rate (the
bound that matters where the op is compute-bound: large MoE token counts).

A row where kernel and reference disagree beyond the tolerance (attention: 5e-2 absolute, MoE:
5e-2 relative to the largest output) is printed and recorded with `equal: false`; the script
then exits 1 after measuring every row. --attention_launches times other attention launches
beside the launch table's (a sweep: a launch Triton refuses is a row with its error and
`equal: null`); blocks of more slots than a page are walked a page at a time, so sweep those
with a larger --page_size.

On a CPU host the kernels run under Triton's interpreter: the figures then only show that the
script works.
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
flags.DEFINE_list("ops", ["attention", "moe"], "Kernels to measure: attention, moe.")
flags.DEFINE_enum("kind", "mla", ["mla", "gqa"], "mla: one shared latent (+ rope) key per slot; gqa: K/V per KV head.")
flags.DEFINE_list("batches", ["1", "16", "64"], "Rows per step.")
flags.DEFINE_list("tokens", ["1", "4", "16"], "New tokens per row (1 = decode, 4 = chain verify, 16 = tree verify).")
flags.DEFINE_list("contexts", ["1024", "8192"], "Committed prefix length per row.")
flags.DEFINE_integer("heads", 64, "Query heads on the device.", lower_bound=1)
flags.DEFINE_enum("layout", "replicated", ["replicated", "tensor", "data"], "What the attention shapes stand for, "
                  "recorded on each row: replicated (every head and sequence on each device), tensor (heads split over "
                  "the devices, e.g. Kimi-K2.5's 64 as 8 per device on 8), data (sequences split, all heads).")
flags.DEFINE_integer("kv_heads", 8, "GQA: KV heads on the device.", lower_bound=1)
flags.DEFINE_integer("head_dim", 128, "GQA: head dimension.", lower_bound=1)
flags.DEFINE_integer("latent", 512, "MLA: kv_lora_rank.", lower_bound=1)
flags.DEFINE_integer("rope", 64, "MLA: qk_rope_head_dim.", lower_bound=1)
flags.DEFINE_integer("page_size", 16, "Slots per KV page.", lower_bound=1)
flags.DEFINE_integer("num_splits", 0, "KV splits per row and head (0: the kernel's own choice, as the engine runs it).",
                     lower_bound=0)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Activation, pool and query dtype.")
flags.DEFINE_list("attention_launches", [], "Attention launches to time besides the launch table's, each "
                  "block_rows:num_warps:num_stages:block_slots[:row_parts] (e.g. 32:8:2:32, or 64:8:1:16:2), one row "
                  "each (a launch that fails to compile is a row with its error).")
flags.DEFINE_list("moe_tokens", ["1", "16", "64", "256", "1024", "4096"], "MoE: tokens per step (decode batch x T, "
                  "or a prefill chunk).")
flags.DEFINE_integer("hidden", 7168, "MoE: hidden size.", lower_bound=16)
flags.DEFINE_integer("moe_inter", 2048, "MoE: expert intermediate width on the device.", lower_bound=16)
flags.DEFINE_integer("experts", 384, "MoE: routed experts in the model.", lower_bound=1)
flags.DEFINE_integer("local_experts", 48, "MoE: experts held by this device.", lower_bound=1)
flags.DEFINE_integer("topk", 8, "MoE: experts per token.", lower_bound=1)
flags.DEFINE_enum("moe_format", "int4", ["bfloat16", "int4", "w4a8", "mxfp4", "fp8_block", "fp8_channel"],
                  "MoE: expert weight format (int4 in groups of 32, as Kimi-K2.5).")
flags.DEFINE_integer("repeats", 20, "Timed runs per configuration (median reported).", lower_bound=1)
flags.DEFINE_string("device", "MI325X", "Device whose HBM peak the GB/s is compared with (see eagle3_jax.planning.memory.DEVICES).")
flags.DEFINE_string("json_out", None, "Also write the rows as JSON here.")
cli.define_overwrite_flag("--json_out")


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    import jax

    from eagle3_jax.bench import attention_timing, kernel_timing, moe_timing
    from eagle3_jax.planning.memory import DEVICES

    if FLAGS.device not in DEVICES:
        raise app.UsageError(f"--device must be one of {', '.join(DEVICES)}; got {FLAGS.device!r}")
    unknown = set(FLAGS.ops) - {"attention", "moe"}
    if unknown or not FLAGS.ops:
        raise app.UsageError(f"--ops takes attention and/or moe; got {','.join(FLAGS.ops)!r}")
    device, interpret = DEVICES[FLAGS.device], jax.default_backend() == "cpu"
    with cli.usage_errors():  # the shapes' flags, and expert weights the kernels cannot take
        attention = attention_timing.attention_shapes(FLAGS) if "attention" in FLAGS.ops else None
        moe = moe_timing.moe_shapes(FLAGS) if "moe" in FLAGS.ops else None
        weights = moe_timing.expert_weights(moe) if moe else None
    rows, write_json = [], cli.rewritten_output("--json_out", FLAGS.json_out)

    def write(row: dict) -> None:  # after every row: a run cut short keeps what it measured
        rows.append(row)
        write_json(json.dumps(kernel_timing.kernel_record(sys.argv, interpret, rows), indent=1))

    def echo(line: str) -> None:
        print(line, flush=True)

    if attention:
        attention_timing.attention_rows(attention, device, interpret, write, echo)
    if moe:
        moe_timing.moe_rows(moe, weights, device, interpret, write, echo)
    differ = [r for r in rows if r["equal"] is False]  # None: a swept launch that does not compile
    if differ:
        print(f"bench_kernels.py: {len(differ)} kernel row(s) differ from the XLA reference beyond the tolerance "
              "(marked DIFFERS above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
