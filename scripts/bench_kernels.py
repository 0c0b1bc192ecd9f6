"""Kernel benchmark: each Pallas kernel against its XLA reference, at a model's per-device shapes.

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
device's routed-expert compute, `moe.local_experts`, through the Pallas kernels (fused gate/up +
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

On a CPU host the kernels run in Pallas interpret mode: the figures then only show that the
script works.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
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
flags.DEFINE_integer("kv_heads", 8, "GQA: KV heads on the device.", lower_bound=1)
flags.DEFINE_integer("head_dim", 128, "GQA: head dimension.", lower_bound=1)
flags.DEFINE_integer("latent", 512, "MLA: kv_lora_rank.", lower_bound=1)
flags.DEFINE_integer("rope", 64, "MLA: qk_rope_head_dim.", lower_bound=1)
flags.DEFINE_integer("page_size", 16, "Slots per KV page.", lower_bound=1)
flags.DEFINE_integer("num_splits", 0, "KV splits per row and head (0: the kernel's own choice, as the engine runs it).",
                     lower_bound=0)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Activation, pool and query dtype.")
flags.DEFINE_list("attention_launches", [], "Attention launches to time besides the launch table's, each "
                  "block_rows:num_warps:num_stages:block_slots (e.g. 32:8:2:32), one row each (a launch that fails "
                  "to compile is a row with its error).")
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


def _ints(values: Sequence[str], name: str) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name} must be comma-separated integers; got {','.join(values)!r}") from None
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name} needs positive integers; got {','.join(values)!r}")
    return out


# Untimed calls before timing a program on a GPU, for this long: on the H200 each run's first row,
# timed right after its compile, read ~10 % slow (benchmarks/notes/2026-11-27-gpu-proof-h200.md).
WARM_SECONDS = 0.1
ROTATE_BYTES = 256 * 2**20  # what one timed program reads over its input sets: several times a GPU's L2
MAX_SETS = 16
ATTENTION_TOLERANCE = 5e-2  # absolute, on outputs of O(1)
MOE_TOLERANCE = 5e-2  # relative to the largest output


def input_sets(read_bytes: float, interpret: bool) -> int:
    """Input sets per timed program: enough to read ROTATE_BYTES (one in interpret mode)."""
    if interpret:
        return 1
    return int(max(1, min(MAX_SETS, -(-ROTATE_BYTES // max(int(read_bytes), 1)))))


def per_set_ms(fn, sets: list, repeats: int) -> float:
    """Median ms per input set of one program running `fn(**set)` over every set (see the module doc)."""
    import jax

    program = jax.jit(lambda all_sets: [fn(**one) for one in all_sets])
    return _median_ms(program, (sets,), repeats) / len(sets)


def timing(k_ms: float, x_ms: float, read: float, flops: float, peak: float, peak_tflops: float) -> dict:
    """A row's timing fields: both paths' ms and GB/s, their fractions of the HBM peak, the
    kernel's of the bf16 peak (None without one)."""
    return dict(kernel_ms=k_ms, xla_ms=x_ms, bytes_read=read, flops=flops, kernel_gbps=read / (k_ms * 1e6),
                xla_gbps=read / (x_ms * 1e6), peak_fraction=read / (k_ms * 1e6) / peak,
                xla_peak_fraction=read / (x_ms * 1e6) / peak,
                flops_fraction=flops / (k_ms * 1e9) / peak_tflops if peak_tflops else None)


def _row_line(cells: list, row: dict, err: float) -> str:
    """The printed table row: the leading `cells`, then times, speed, MB, GB/s, % of peak, error."""
    return ("| " + " | ".join(str(c) for c in cells) + f" | {row['kernel_ms']:.4f} | {row['xla_ms']:.4f} | "
            f"{row['xla_ms'] / row['kernel_ms']:.2f}x | {row['bytes_read'] / 1e6:.1f} | {row['kernel_gbps']:.1f} | "
            f"{100 * row['peak_fraction']:.1f} | {err:.2g}" + ("" if row["equal"] else " DIFFERS") + " |")


def _median_ms(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    if jax.default_backend() != "cpu":  # a GPU idle while compiling runs its first calls at idle clocks
        warm_until = time.perf_counter() + WARM_SECONDS
        while time.perf_counter() < warm_until:
            jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _attention_launch(text: str):
    """An AttentionLaunch from block_rows:num_warps:num_stages:block_slots."""
    from pallas_kernels.launch import AttentionLaunch

    try:
        rows, warps, stages, slots = (int(part) for part in text.split(":"))
    except ValueError:
        raise app.UsageError(f"--attention_launches: {text!r} is not block_rows:num_warps:num_stages:block_slots "
                             "(four integers, e.g. 32:8:2:32)") from None
    if min(rows, warps, stages, slots) < 1 or rows < 16 or rows & (rows - 1) or slots & (slots - 1):
        raise app.UsageError(f"--attention_launches: {text!r} needs block_rows a power of two >= 16, block_slots a "
                             "power of two and positive warps and stages")
    return AttentionLaunch(block_rows=rows, num_warps=warps, num_stages=stages, block_slots=slots)


def attention_bytes(batch: int, context: int) -> int:
    """The prefix's K/V bytes one attention call must read."""
    import jax.numpy as jnp

    itemsize = jnp.dtype(FLAGS.dtype).itemsize
    if FLAGS.kind == "mla":
        return batch * context * (FLAGS.latent + FLAGS.rope) * itemsize
    return 2 * batch * context * FLAGS.kv_heads * FLAGS.head_dim * itemsize


def attention_flops(batch: int, t: int, context: int) -> int:
    """Multiply-adds x 2 of scores and values over the prefix (MLA: latent + rope scores, latent values)."""
    if FLAGS.kind == "mla":
        return 2 * batch * FLAGS.heads * t * context * (2 * FLAGS.latent + FLAGS.rope)
    return 2 * batch * FLAGS.heads * t * context * 2 * FLAGS.head_dim


def case(batch: int, t: int, context: int, rng, sets: int = 1):
    """Arguments (q, k_pool, v_pool, tables, lengths, q2, k2_pool) and the bytes one call reads: one
    pool holding `sets` disjoint copies' worth of pages, and `sets` block tables over them."""
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(FLAGS.dtype)
    ps = FLAGS.page_size
    pages_per_row = -(-context // ps)
    num_pages = sets * batch * pages_per_row + 1
    tables = (1 + rng.permutation(sets * batch * pages_per_row)).reshape(sets, batch, pages_per_row).astype(np.int32)
    lengths = np.full((batch,), context, np.int32)
    read = attention_bytes(batch, context)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dt)

    if FLAGS.kind == "mla":
        rows = FLAGS.heads * t
        q, q2 = normal(batch, 1, rows, FLAGS.latent), normal(batch, 1, rows, FLAGS.rope)
        k, k2 = normal(1, num_pages, ps, 1, FLAGS.latent), normal(1, num_pages, ps, 1, FLAGS.rope)
        return (q, k, None, tables, lengths, q2, k2), read
    g = FLAGS.heads // FLAGS.kv_heads
    q = normal(batch, FLAGS.kv_heads, g * t, FLAGS.head_dim)
    k, v = (normal(1, num_pages, ps, FLAGS.kv_heads, FLAGS.head_dim) for _ in range(2))
    return (q, k, v, tables, lengths, None, None), read


def attention_rows(peak: float, interpret: bool, peak_tflops: float = 0.0, on_row=lambda row: None) -> list[dict]:
    """One row per (batch, T, context), each passed to `on_row` as it is measured."""
    import functools

    import jax
    import numpy as np

    from pallas_kernels.attention import default_splits, paged_prefix_attention, paged_prefix_attention_reference

    batches, tokens, contexts = _ints(FLAGS.batches, "batches"), _ints(FLAGS.tokens, "tokens"), _ints(FLAGS.contexts, "contexts")
    launches = [("table", None)] + [(text, _attention_launch(text)) for text in FLAGS.attention_launches]
    scale = 0.1
    print(f"\n{FLAGS.kind} paged prefix attention, {FLAGS.dtype}, page {FLAGS.page_size}, {jax.devices()[0].device_kind}"
          + (" (Pallas interpret mode: timings are not meaningful)" if interpret else ""))
    swept = " launch |" if launches[1:] else ""
    print(f"| batch | T | context | splits | sets |{swept} kernel ms | XLA ms | speedup | MB read | kernel GB/s | % of "
          f"{FLAGS.device} peak | max err |")
    print("|---" * (12 + bool(swept)) + "|")
    rows, rng = [], np.random.default_rng(0)
    for batch in batches:
        for t in tokens:
            for context in contexts:
                sets = input_sets(attention_bytes(batch, context), interpret)
                (q, k, v, tables, lengths, q2, k2), read = case(batch, t, context, rng, sets)
                form = "mla_attention" if FLAGS.kind == "mla" else "gqa_attention"
                heads, rows_per_head = (1, q.shape[2]) if FLAGS.kind == "mla" else (FLAGS.kv_heads, q.shape[2])
                dv = FLAGS.latent if FLAGS.kind == "mla" else FLAGS.head_dim
                ref = functools.partial(paged_prefix_attention_reference, layer=0, scale=scale)
                arg_sets = [dict(q=q, k_pool=k, v_pool=v, block_table=table, lengths=lengths, q2=q2, k2_pool=k2)
                            for table in tables]
                want = jax.jit(ref)(**arg_sets[0])
                x_ms = per_set_ms(ref, arg_sets, FLAGS.repeats)
                for name, launch in launches:
                    splits = FLAGS.num_splits or default_splits(batch, heads, rows_per_head, tables.shape[2], dv,
                                                                q.dtype.itemsize, launch, form)
                    kernel = functools.partial(paged_prefix_attention, layer=0, scale=scale, num_splits=splits,
                                               interpret=interpret, launch=launch)
                    row = dict(op="attention", kind=FLAGS.kind, launch=name, batch=batch, tokens=t, context=context,
                               splits=splits, input_sets=sets)
                    try:
                        got = jax.jit(kernel)(**arg_sets[0])
                    except Exception as error:  # a candidate launch Triton refuses: recorded, the sweep goes on
                        if launch is None:
                            raise
                        rows.append(dict(row, error=cli.one_line(str(error)), equal=None))
                        on_row(rows[-1])
                        print(f"| {batch} | {t} | {context} | {name}: does not compile ({rows[-1]['error'][:80]}) |")
                        continue
                    err = float(np.max(np.abs(np.asarray(got[0], np.float32) - np.asarray(want[0], np.float32))))
                    k_ms = per_set_ms(kernel, arg_sets, FLAGS.repeats)
                    rows.append(dict(row, **timing(k_ms, x_ms, read, attention_flops(batch, t, context), peak, peak_tflops),
                                     max_abs_err=err, equal=bool(err <= ATTENTION_TOLERANCE)))  # NaN fails
                    on_row(rows[-1])
                    cells = [batch, t, context, splits, sets] + ([name] if launches[1:] else [])
                    print(_row_line(cells, rows[-1], err), flush=True)
    return rows


def expert_weight(rng, fmt: str, e: int, k: int, n: int):
    """Random expert weights [e, k, n] in `fmt`, as the device holds them (random bytes, sane scales)."""
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from eagle3_jax.weights.quant import QArray, QFormat

    if fmt == "bfloat16":
        return jnp.asarray(rng.standard_normal((e, k, n), np.float32) / np.sqrt(k), jnp.bfloat16)
    if fmt in ("int4", "w4a8", "mxfp4"):
        values = jnp.asarray(rng.integers(0, 256, (e, k // 2, n), np.uint8))
        if fmt == "mxfp4":
            return QArray(values, jnp.asarray(rng.integers(118, 122, (e, k // 32, n), np.uint8)), QFormat("mxfp4", (32, 1), "uint8"))
        scales = jnp.asarray(np.full((e, k // 32, n), 0.25 / np.sqrt(k), np.float32), jnp.bfloat16)
        return QArray(values, scales, QFormat("int4", (32, 1), "bfloat16", act="int8" if fmt == "w4a8" else "float"))
    bits = rng.integers(0, 0x7E, (e, k, n), np.uint8) | (rng.integers(0, 2, (e, k, n), np.uint8) << 7)  # finite
    values = jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn))
    if fmt == "fp8_block":
        scales = np.full((e, -(-k // 128), -(-n // 128)), 0.01 / np.sqrt(k), np.float32)
        return QArray(values, jnp.asarray(scales), QFormat("fp8_block", (128, 128)))
    return QArray(values, jnp.asarray(np.full((e, 1, n), 0.01 / np.sqrt(k), np.float32)), QFormat("fp8_channel", (0, 1)))


def moe_rows(peak: float, interpret: bool, peak_tflops: float = 0.0, on_row=lambda row: None) -> list[dict]:
    """One row per token count, each passed to `on_row` as it is measured."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.models.moe import kernel_unfit, local_experts

    token_counts = _ints(FLAGS.moe_tokens, "moe_tokens")
    if FLAGS.local_experts > FLAGS.experts or FLAGS.topk > FLAGS.experts:
        raise app.UsageError("--local_experts and --topk must not exceed --experts")
    rng = np.random.default_rng(0)
    e, h, inter = FLAGS.local_experts, FLAGS.hidden, FLAGS.moe_inter
    ws = tuple(expert_weight(rng, FLAGS.moe_format, e, *shape) for shape in ((h, inter), (h, inter), (inter, h)))
    unfit = kernel_unfit(*ws)
    if unfit:
        raise app.UsageError(f"the MoE kernels cannot take these shapes ({unfit}); pick --hidden / --moe_inter "
                             "multiples of 32")
    expert_bytes = sum(leaf.nbytes for w in ws for leaf in jax.tree.leaves(w)) / e
    print(f"\nrouted experts: {e} of {FLAGS.experts} on the device, top-{FLAGS.topk}, {h} -> {inter} -> {h}, "
          f"{FLAGS.moe_format} weights, {FLAGS.dtype} activations"
          + (" (Pallas interpret mode: timings are not meaningful)" if interpret else ""))
    print(f"| tokens | local assignments | experts hit | sets | kernel ms | XLA ms | speedup | MB read | kernel GB/s | "
          f"% of {FLAGS.device} peak | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def kernel(x, weights, ids, ws):  # the weights are arguments: a closure would bake them into the program
        return local_experts(x, weights, ids, *ws, use_kernels=True)

    def ref(x, weights, ids, ws):
        return local_experts(x, weights, ids, *ws, use_kernels=False)

    def routing(n: int) -> dict:
        ids = np.stack([rng.choice(FLAGS.experts, FLAGS.topk, replace=False) for _ in range(n)]).astype(np.int32)
        weights = jnp.asarray(rng.uniform(0.1, 1.0, ids.shape), jnp.float32)
        return dict(weights=weights, ids=jnp.asarray(ids), ws=ws)

    def bytes_read(one: dict) -> float:  # the distinct local experts hit, and the activations
        ids = np.asarray(one["ids"])
        return len(set(ids[ids < e].tolist())) * expert_bytes + one["x"].nbytes

    rows = []
    for n in token_counts:
        x = jnp.asarray(rng.standard_normal((n, h), np.float32), FLAGS.dtype)
        first = dict(x=x, **routing(n))
        sets = input_sets(bytes_read(first), interpret)
        arg_sets = [first] + [dict(x=x, **routing(n)) for _ in range(sets - 1)]
        got, want = jax.jit(kernel)(**first), jax.jit(ref)(**first)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))
                    / (jnp.max(jnp.abs(want.astype(jnp.float32))) + 1e-30))
        equal = bool(err <= MOE_TOLERANCE)  # NaN fails
        ids = np.asarray(first["ids"])
        hit = len(set(ids[ids < e].tolist()))
        read = sum(bytes_read(one) for one in arg_sets) / sets
        assignments = sum(int((np.asarray(one["ids"]) < e).sum()) for one in arg_sets) / sets
        flops = 6 * h * inter * assignments  # gate, up and down: 2 flops per multiply-add
        k_ms, x_ms = per_set_ms(kernel, arg_sets, FLAGS.repeats), per_set_ms(ref, arg_sets, FLAGS.repeats)
        rows.append(dict(op="moe", format=FLAGS.moe_format, tokens=n, local_assignments=int((ids < e).sum()),
                         experts_hit=hit, input_sets=sets, **timing(k_ms, x_ms, read, flops, peak, peak_tflops),
                         max_rel_err=err, equal=equal))
        on_row(rows[-1])
        print(_row_line([n, int((ids < e).sum()), hit, sets], rows[-1], err), flush=True)
    return rows


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    import jax

    from eagle3_jax.planning.memory import DEVICES

    if FLAGS.device not in DEVICES:
        raise app.UsageError(f"--device must be one of {', '.join(DEVICES)}; got {FLAGS.device!r}")
    unknown = set(FLAGS.ops) - {"attention", "moe"}
    if unknown or not FLAGS.ops:
        raise app.UsageError(f"--ops takes attention and/or moe; got {','.join(FLAGS.ops)!r}")
    peak, peak_tflops = DEVICES[FLAGS.device].hbm_gbps, DEVICES[FLAGS.device].bf16_tflops
    interpret = jax.default_backend() == "cpu"
    rows, write_json = [], cli.rewritten_output("--json_out", FLAGS.json_out)

    def write(row: dict) -> None:  # after every row: a run cut short keeps what it measured
        rows.append(row)
        write_json(json.dumps({"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
                               "jax": jax.__version__, "interpret": interpret,
                               "machine": f"{platform.machine()} x{os.cpu_count()}", "rows": rows}, indent=1))

    if "attention" in FLAGS.ops:
        attention_rows(peak, interpret, peak_tflops, write)
    if "moe" in FLAGS.ops:
        moe_rows(peak, interpret, peak_tflops, write)
    differ = [r for r in rows if r["equal"] is False]  # None: a swept launch that does not compile
    if differ:
        print(f"bench_kernels.py: {len(differ)} kernel row(s) differ from the XLA reference beyond the tolerance "
              "(marked DIFFERS above)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
