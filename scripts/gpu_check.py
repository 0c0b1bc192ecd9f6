"""One-shot GPU check: the Pallas kernels and the steps they serve, timed against XLA, and lossless.

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
3. demo: the bundled kimi-mini pair with kernels="pallas" and "xla", in float32 and bfloat16:
   greedy outputs of plain decoding, chain 3/1/4 and tree 5/4/16 (Engine.generate over the demo
   prompts), and their ms per token (a second, timed pass); --demo_kernels, --demo_dtypes and
   --demo_specs narrow it. In float32 every output must equal its dtype's first row (plain
   greedy decoding on the XLA path by default); bfloat16 rows are reported (kernels and XLA round
   differently, so a near-tie can flip a token there).

On a CPU host (or with --small) the same code runs at small shapes (kimi-mini's own config for the
steps; float32 plain and chain only in the demo) with the kernels in Pallas interpret mode: it
shows the script works, not how fast anything is. It exits 1 if a kernel disagrees with XLA or a
float32 demo output differs from plain greedy decoding.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels  # noqa: E402  (its measurements and flags; this script sets the flags itself)

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_bool("small", None, "Small shapes (default: on a CPU host). The kernels run interpreted on a CPU.")
FLAGS.set_default("json_out", "gpu_check.json")  # bench_kernels' flag: where the results go
flags.DEFINE_integer("step_repeats", None, "Timed runs per step (default 20 on a GPU, 2 small).", lower_bound=1)
flags.DEFINE_integer("greedy_tokens", None, "Tokens per prompt in the demo check (default 64 on a GPU, 6 small).",
                     lower_bound=1)
flags.DEFINE_list("parts", ["kernels", "steps", "demo"], "Parts to run, in this order: kernels, steps, demo.")
flags.DEFINE_list("step_shapes", None, "Steps part: batch:T pairs, in order (default 1:1,1:4,64:1,64:4 on a GPU; "
                  "2:1,2:4 small).")
flags.DEFINE_list("demo_dtypes", None, "Demo part: dtypes (default float32,bfloat16 on a GPU, float32 small).")
flags.DEFINE_list("demo_kernels", ["xla", "pallas"], "Demo part: kernels choices, each as load_target takes it.")
flags.DEFINE_list("demo_specs", None, "Demo part: settings (default none,chain:3:1:4,tree:5:4:16; small: the first two).")
PARTS = ("kernels", "steps", "demo")

KIMI = os.path.join(ROOT, "tests", "data", "kimi-k2.5.config.json")
PAIR = os.path.join(ROOT, "checkpoints", "kimi-mini"), os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
GREEDY_PROMPTS = ("Once upon a time", "The little dog")
DEMO_SPECS = ("none", "chain:3:1:4", "tree:5:4:16")


def _kernel_flags(small: bool) -> None:
    """Kimi-K2.5's per-device kernel shapes (or small ones) for bench_kernels' measurements; shapes
    given on the command line are refused (this check runs fixed shapes: bench_kernels.py takes them)."""
    shapes = dict(kind="mla", heads=64, latent=512, rope=64, batches=["1", "64"], tokens=["1", "4"], contexts=["8192"],
                  hidden=7168, moe_inter=2048, experts=384, local_experts=48, topk=8, moe_format="int4",
                  moe_tokens=["1", "4", "64", "256"], repeats=20, num_splits=0, page_size=16, dtype="bfloat16")
    if small:
        shapes.update(heads=4, latent=32, rope=16, batches=["2"], tokens=["1", "4"], contexts=["40"], hidden=64,
                      moe_inter=64, experts=16, local_experts=4, topk=2, moe_tokens=["1", "8"], repeats=1)
    given = [f"--{name}" for name in shapes if FLAGS[name].present]
    if given:
        raise app.UsageError(f"{', '.join(given)}: gpu_check.py runs fixed shapes (Kimi-K2.5's, or small ones with "
                             "--small); time other shapes with scripts/bench_kernels.py")
    for name, value in shapes.items():
        setattr(FLAGS, name, value)


def _one_moe_layer(raw: dict) -> dict:
    """A config cut to its dense layers plus one MoE layer."""
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = int(text.get("first_k_dense_replace", 0)) + 1
    return raw


def _random_params(cfg, dtype):
    """The target's parameter tree with random values made on the device (packed ints as random
    bytes, float8 as finite random bytes, floats as N(0, 0.02))."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax.weights.params import abstract_params

    leaves, tree = jax.tree.flatten(abstract_params(cfg, dtype))

    def make(key, shape, dt):
        if jnp.issubdtype(dt, jnp.floating) and dt.itemsize == 1:
            return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8) & 0x76, dt)
        if jnp.issubdtype(dt, jnp.integer):
            return jax.random.bits(key, shape, jnp.uint8).astype(dt)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dt)

    keys = jax.random.split(jax.random.key(0), len(leaves))
    made = [jax.jit(make, static_argnums=(1, 2))(k, leaf.shape, jnp.dtype(leaf.dtype)) for k, leaf in zip(keys, leaves)]
    return jax.tree.unflatten(tree, made)


def ceilings(copy_bytes: int = 2**30, n: int = 8192) -> dict:
    """The two ceilings measured on this device: copy GB/s (read + written) and bf16 matmul TFLOP/s."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (copy_bytes // 2,), jnp.bfloat16)
    copy_ms = bench_kernels._median_ms(jax.jit(lambda v: v + 1), (x,), 10)
    a, b = (jax.random.normal(jax.random.key(k), (n, n), jnp.bfloat16) for k in (2, 3))
    matmul_ms = bench_kernels._median_ms(jax.jit(jnp.matmul), (a, b), 10)
    out = {"copy_gbps": 2 * x.nbytes / (copy_ms * 1e6), "matmul_tflops": 2 * n**3 / (matmul_ms * 1e9)}
    print(f"ceilings measured: copy {out['copy_gbps']:.0f} GB/s (read + written), bf16 matmul "
          f"{out['matmul_tflops']:.0f} TFLOP/s")
    return out


def kernel_rows(peak: float, peak_tflops: float, interpret: bool, measured: dict | None,
                record=lambda rows: None) -> list[dict]:
    """bench_kernels' attention and MoE rows, with fractions of the measured ceilings added;
    `record(rows so far)` after each."""
    rows = []

    def add(row: dict) -> None:
        if measured and "kernel_ms" in row:  # (a swept launch that did not compile has no times)
            row["measured_copy_fraction"] = row["kernel_gbps"] / measured["copy_gbps"]
            row["xla_measured_copy_fraction"] = row["xla_gbps"] / measured["copy_gbps"]
            row["measured_flops_fraction"] = row["flops"] / (row["kernel_ms"] * 1e9) / measured["matmul_tflops"]
        rows.append(row)
        record(rows)

    bench_kernels.attention_rows(peak, interpret, peak_tflops, add)
    bench_kernels.moe_rows(peak, interpret, peak_tflops, add)
    return rows


def step_bytes(params, cfg, batch: int, t: int, context: int) -> float:
    """Bytes a step must read: every weight but the embedding table (a gather of `batch` x `t` rows),
    the routed experts as a share of those `batch` x `t` tokens are expected to hit, the K/V prefix."""
    import jax

    total = 0.0
    tokens = batch * t
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if "['embed']" in name:
            continue
        share = 1.0
        if "experts_" in name:
            e, k = cfg.num_experts, cfg.num_experts_per_tok
            share = 1.0 - (1.0 - k / e) ** tokens  # expected share of experts hit at least once
        total += share * leaf.nbytes
    per_slot = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                else 2 * cfg.num_kv_heads * cfg.head_dim)
    return total + cfg.num_layers * batch * context * per_slot * 2  # bf16 K/V


def step_shapes(texts: list[str] | None, small: bool) -> list[tuple[int, int]]:
    """(batch, T) pairs from --step_shapes' batch:T texts, or the defaults."""
    if texts is None:
        return [(2, 1), (2, 4)] if small else [(1, 1), (1, 4), (64, 1), (64, 4)]
    shapes = []
    for text in texts:
        batch, sep, t = text.partition(":")
        if not (sep and batch.isdigit() and t.isdigit() and int(batch) > 0 and 0 < int(t) <= 64):
            raise app.UsageError(f"--step_shapes: {text!r} is not batch:T (positive integers, T at most 64), "
                                 "e.g. 64:4")
        shapes.append((int(batch), int(t)))
    return shapes


def step_rows(small: bool, repeats: int, peak: float, shapes: list[tuple[int, int]],
              record=lambda rows: None) -> list[dict]:
    """Decode (T = 1) and verify (T > 1) steps of the target forward at `shapes` (batch, T),
    kernels against XLA; `record(rows so far)` after each."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from eagle3_jax.bench.step_accounting import median_ms
    from eagle3_jax.cache import kv_cache
    from eagle3_jax.config.model import load_model_config, parse_model_config
    from eagle3_jax.models.target import forward, resolve_dtype

    if small:
        cfg, context = load_model_config(os.path.join(PAIR[0], "config.json")), 64
    else:
        with open(KIMI) as f:
            cfg, context = parse_model_config(_one_moe_layer(json.load(f))), 8192
    dtype = resolve_dtype("bfloat16")
    params = _random_params(cfg, dtype)
    step = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))
    print(f"\ntarget steps: {cfg.num_layers} layers of {os.path.basename(KIMI) if not small else 'kimi-mini'}, "
          f"{'interpret mode: timings are not meaningful' if jax.default_backend() == 'cpu' else jax.devices()[0].device_kind}")
    print("| batch | T | kernels ms | XLA ms | speedup | MB read | kernels % of peak | XLA % of peak |\n"
          "|---|---|---|---|---|---|---|---|")
    rows = []
    for batch, t in shapes:
        read = step_bytes(params, cfg, batch, t, context)
        row = dict(op="step", batch=batch, tokens=t, context=context, bytes_read=read, kernel_ms=None, xla_ms=None,
                   peak_fraction=None, xla_peak_fraction=None)
        rows.append(row)
        for impl, ms_key, fraction_key in (("pallas", "kernel_ms", "peak_fraction"),
                                           ("xla", "xla_ms", "xla_peak_fraction")):
            run_cfg = dataclasses.replace(cfg, kernels=f"attention={impl},moe={impl}")
            # context + 16: a dense cache whose length is a whole number of the kernel's 16-slot tiles
            cache = kv_cache.advance(kv_cache.init_cache(run_cfg, batch, context + 16, dtype),
                                     jnp.full((batch,), context - t, jnp.int32))
            tokens = jnp.zeros((batch, t), jnp.int32)
            positions = (context - t) + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
            chain = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
            state = {"cache": cache}

            def one():
                logits, _, state["cache"] = step(params, run_cfg, tokens, positions, state["cache"], chain)
                return logits

            ms = median_ms(one, repeats)  # back to back: the step, not the launch's round trip
            del state
            row.update({ms_key: ms, fraction_key: read / (ms * 1e6) / peak})
            record(rows)  # the kernels' half first: a time limit during XLA's compile keeps it
        print(f"| {batch} | {t} | {row['kernel_ms']:.3f} | {row['xla_ms']:.3f} | {row['xla_ms'] / row['kernel_ms']:.2f}x | "
              f"{read / 1e6:.0f} | {100 * row['peak_fraction']:.1f} | {100 * row['xla_peak_fraction']:.1f} |",
              flush=True)
    return rows


def demo_rows(max_tokens: int, small: bool, record=lambda part: None) -> dict:
    """The kimi-mini pair under kernels="pallas" and "xla": greedy outputs and ms per token of plain,
    chain and tree decoding, per dtype (see the module doc); `record(part)` after every row."""
    import eagle3_jax as e3
    from eagle3_jax.text.tokenizer import load_tokenizer

    dtypes = FLAGS.demo_dtypes or (["float32"] if small else ["float32", "bfloat16"])
    specs = FLAGS.demo_specs or list(DEMO_SPECS[:2] if small else DEMO_SPECS)
    tokenizer = load_tokenizer(PAIR[0])
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    sp = e3.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = []
    part = {"tokens": max_tokens, "prompts": len(prompts), "rows": rows, "equal": True}
    print(f"\ndemo pair, greedy, {max_tokens} tokens x {len(prompts)} prompts (Engine.generate, one batch)")
    print("| dtype | kernels | setting | ms / token | tokens / step | == the dtype's first row |\n|---|---|---|---|---|---|")
    for dtype in dtypes:
        reference = None
        for kernels in FLAGS.demo_kernels:
            target = e3.load_target(PAIR[0], dtype=dtype, kernels=kernels)
            draft = e3.load_draft(PAIR[1], target=target, dtype=dtype)
            for name in specs:
                spec = e3.SpecConfig.parse(name)
                engine = e3.Engine(target, draft if spec is not None else None, spec, max_batch_size=len(prompts),
                                   max_seq_len=256)
                engine.generate(prompts, sp)  # compile
                start = time.perf_counter()
                outs = engine.generate(prompts, sp)
                wall = time.perf_counter() - start
                tokens = [o.token_ids for o in outs]
                reference = tokens if reference is None else reference
                steps = sum(len(o.metrics["accept_lengths"]) for o in outs)
                row = dict(dtype=dtype, kernels=kernels, spec=name, tokens=tokens, equal_first=tokens == reference,
                           ms_per_token=1e3 * wall / sum(len(t) for t in tokens),
                           tokens_per_step=(sum(len(t) for t in tokens) - len(tokens)) / max(steps, 1))
                rows.append(row)
                part["equal"] = all(r["equal_first"] for r in rows if r["dtype"] == "float32")
                record(part)
                print(f"| {dtype} | {kernels} | {name} | {row['ms_per_token']:.3f} | {row['tokens_per_step']:.2f} | "
                      f"{row['equal_first']} |", flush=True)
    return part


def _device_name(kind: str, default: str) -> str:
    """The plan.DEVICES entry a JAX device kind names ("NVIDIA H200" -> "H200"), else `default`."""
    from eagle3_jax.planning.memory import DEVICES

    return next((name for name in DEVICES if name.lower() in kind.lower()), default)


def main(argv) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    unknown = [p for p in FLAGS.parts if p not in PARTS]
    if unknown or not FLAGS.parts:
        raise app.UsageError(f"--parts takes {', '.join(PARTS)}; got {','.join(FLAGS.parts)!r}")
    import jax

    on_cpu = jax.default_backend() == "cpu"
    small = on_cpu if FLAGS.small is None else FLAGS.small
    repeats = FLAGS.step_repeats or (2 if small else 20)
    _kernel_flags(small)
    shapes = step_shapes(FLAGS.step_shapes, small)
    from eagle3_jax.planning.memory import DEVICES
    from pallas_kernels import launch

    kind = jax.devices()[0].device_kind
    if not FLAGS["device"].present:
        FLAGS.device = _device_name(kind, FLAGS.device)
    peak, peak_tflops = DEVICES[FLAGS.device].hbm_gbps, DEVICES[FLAGS.device].bf16_tflops
    started = time.perf_counter()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:]), "device": kind,
        "peaks_from": FLAGS.device, "hbm_peak_gbps": peak, "bf16_peak_tflops": peak_tflops,
        "backend": jax.default_backend(), "arch": launch.current_arch(), "interpret": on_cpu, "small": small,
        "jax": jax.__version__, "machine": f"{platform.machine()} x{os.cpu_count()}", "parts": list(FLAGS.parts),
    }
    write_json = cli.rewritten_output("--json_out", FLAGS.json_out)

    def record(part: str, value) -> None:  # the JSON after each part: a later part cut short loses only itself
        result[part] = value
        result["seconds"] = round(time.perf_counter() - started, 1)
        write_json(json.dumps(result, indent=1))

    failed = []
    if "kernels" in FLAGS.parts:
        result["ceilings"] = measured = None if on_cpu else ceilings()
        rows = kernel_rows(peak, peak_tflops, on_cpu, measured, lambda so_far: record("kernels", so_far))
        failed += [f"{r['op']} kernel differs from XLA" for r in rows if r["equal"] is False]
    if "steps" in FLAGS.parts:
        step_rows(small, repeats, peak, shapes, lambda so_far: record("steps", so_far))
    if "demo" in FLAGS.parts:
        demo = demo_rows(FLAGS.greedy_tokens or (6 if small else 64), small, lambda part: record("demo", part))
        if not demo["equal"]:
            failed.append("a float32 demo output differs from its dtype's first row (plain greedy decoding)")
    print(f"\nwrote {FLAGS.json_out}")
    if failed:
        print(f"gpu_check.py: {'; '.join(sorted(set(failed)))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
