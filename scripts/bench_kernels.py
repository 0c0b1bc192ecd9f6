"""Kernel benchmark: the paged prefix-attention kernel against its XLA reference.

    python scripts/bench_kernels.py                       # Kimi-K2.5 MLA per-device shapes (on a GPU)
    python scripts/bench_kernels.py --kind=gqa --heads=48 --kv_heads=8 --head_dim=128   # MiniMax-M2.5
    python scripts/bench_kernels.py --batches=1 --tokens=1 --contexts=64 --repeats=2    # a CPU smoke run

For every (batch, new tokens T, context) it builds random page pools and block tables, runs
`pallas_kernels.attention.paged_prefix_attention` and `paged_prefix_attention_reference` (both
jitted; the reference gathers every page of the table), checks they agree, and prints the median
time of each, the bytes the kernel must read (the prefix's K/V pages), the achieved GB/s and its
fraction of --device's HBM peak. MLA shapes: --heads query heads x T rows over latent 512 + rope
64 (Kimi-K2.5: 64 heads; 8 per device on a tensor-parallel mesh). On a CPU host the kernel runs in
Pallas interpret mode: the figures then only show that the script works.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Sequence

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
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
flags.DEFINE_integer("num_splits", 0, "KV splits per row and head (0: enough to give every row ~ 8 programs).",
                     lower_bound=0)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Pool and query dtype.")
flags.DEFINE_integer("repeats", 20, "Timed runs per configuration (median reported).", lower_bound=1)
flags.DEFINE_string("device", "MI325X", "Device whose HBM peak the GB/s is compared with (see eagle3_jax.plan.DEVICES).")
flags.DEFINE_string("json_out", None, "Also write the rows as JSON here.")


def _ints(values: Sequence[str], name: str) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name} must be comma-separated integers; got {','.join(values)!r}") from None
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name} needs positive integers; got {','.join(values)!r}")
    return out


def _median_ms(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def case(batch: int, t: int, context: int, rng):
    """Arguments (q, k_pool, v_pool, table, lengths, q2, k2_pool), the rows per head and the bytes to read."""
    import jax.numpy as jnp
    import numpy as np

    dt = jnp.dtype(FLAGS.dtype)
    ps = FLAGS.page_size
    pages_per_row = -(-context // ps)
    num_pages = batch * pages_per_row + 1
    table = (1 + rng.permutation(batch * pages_per_row)).reshape(batch, pages_per_row).astype(np.int32)
    lengths = np.full((batch,), context, np.int32)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dt)

    if FLAGS.kind == "mla":
        rows = FLAGS.heads * t
        q, q2 = normal(batch, 1, rows, FLAGS.latent), normal(batch, 1, rows, FLAGS.rope)
        k, k2 = normal(1, num_pages, ps, 1, FLAGS.latent), normal(1, num_pages, ps, 1, FLAGS.rope)
        read = batch * context * (FLAGS.latent + FLAGS.rope) * dt.itemsize
        return (q, k, None, table, lengths, q2, k2), read
    g = FLAGS.heads // FLAGS.kv_heads
    q = normal(batch, FLAGS.kv_heads, g * t, FLAGS.head_dim)
    k, v = (normal(1, num_pages, ps, FLAGS.kv_heads, FLAGS.head_dim) for _ in range(2))
    read = 2 * batch * context * FLAGS.kv_heads * FLAGS.head_dim * dt.itemsize
    return (q, k, v, table, lengths, None, None), read


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep JAX's backend-probing lines out of the table
    import functools

    import jax
    import numpy as np

    from eagle3_jax.plan import DEVICES
    from pallas_kernels.attention import paged_prefix_attention, paged_prefix_attention_reference

    if FLAGS.device not in DEVICES:
        raise app.UsageError(f"--device must be one of {', '.join(DEVICES)}; got {FLAGS.device!r}")
    peak = DEVICES[FLAGS.device].hbm_gbps
    batches, tokens, contexts = _ints(FLAGS.batches, "batches"), _ints(FLAGS.tokens, "tokens"), _ints(FLAGS.contexts, "contexts")
    interpret = jax.default_backend() == "cpu"
    scale = 0.1
    print(f"{FLAGS.kind} paged prefix attention, {FLAGS.dtype}, page {FLAGS.page_size}, {jax.devices()[0].device_kind}"
          + (" (Pallas interpret mode: timings are not meaningful)" if interpret else ""))
    print("| batch | T | context | splits | kernel ms | XLA ms | speedup | MB read | kernel GB/s | % of "
          f"{FLAGS.device} peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows, rng = [], np.random.default_rng(0)
    for batch in batches:
        for t in tokens:
            for context in contexts:
                (q, k, v, table, lengths, q2, k2), read = case(batch, t, context, rng)
                splits = FLAGS.num_splits or max(1, min(table.shape[1], 8 // max(1, batch) or 1))
                kernel = jax.jit(functools.partial(paged_prefix_attention, layer=0, scale=scale, num_splits=splits,
                                                   interpret=interpret))
                ref = jax.jit(functools.partial(paged_prefix_attention_reference, layer=0, scale=scale))
                args = dict(q=q, k_pool=k, v_pool=v, block_table=table, lengths=lengths, q2=q2, k2_pool=k2)
                got, want = kernel(**args), ref(**args)
                err = float(np.max(np.abs(np.asarray(got[0]) - np.asarray(want[0]))))
                if err > 5e-2:
                    sys.exit(f"kernel and reference disagree by {err:.3g} at batch {batch}, T {t}, context {context}")
                k_ms = _median_ms(lambda: kernel(**args), (), FLAGS.repeats)
                x_ms = _median_ms(lambda: ref(**args), (), FLAGS.repeats)
                gbps = read / (k_ms * 1e6)
                rows.append(dict(batch=batch, tokens=t, context=context, splits=splits, kernel_ms=k_ms, xla_ms=x_ms,
                                 bytes_read=read, kernel_gbps=gbps, peak_fraction=gbps / peak, max_abs_err=err))
                print(f"| {batch} | {t} | {context} | {splits} | {k_ms:.3f} | {x_ms:.3f} | {x_ms / k_ms:.2f}x | "
                      f"{read / 1e6:.1f} | {gbps:.1f} | {100 * gbps / peak:.1f} |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
                       "interpret": interpret, "machine": f"{platform.machine()} x{os.cpu_count()}", "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    app.run(main)
