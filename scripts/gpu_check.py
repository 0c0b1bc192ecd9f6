"""One-shot GPU check: the Pallas kernels and the steps they serve, timed against XLA, and lossless.

    python scripts/gpu_check.py --json_out=gpu_check.json          # on a GPU: Kimi-K2.5 per-device shapes
    python scripts/gpu_check.py --small --json_out=/tmp/check.json   # anywhere (a CPU runs it interpreted)

Three parts, one JSON:
1. kernels: each kernel against its XLA path (scripts/bench_kernels.py's measurements): Kimi-K2.5's
   MLA prefix attention (64 heads, latent 512 + rope 64) at batch 1 and 64, T = 1 and 4, 8K
   context; its routed experts in int4 (48 of 384 on the device, top-8, 7168 -> 2048 -> 7168).
2. steps: a plain decode step (T = 1) and a chain verify step (T = 4) of the target forward with
   the kernels and with XLA, at batch 1 and 64 over an 8K cache. Kimi-K2.5 does not fit one GPU,
   so the model is cut to its dense layers plus one MoE layer (all 384 int4 experts), with random
   weights made on the device (timings only; the numbers it computes mean nothing).
3. greedy: the bundled kimi-mini pair loaded with kernels="pallas": greedy speculation (chain
   3/1/4) emits exactly the plain greedy tokens.

On a CPU host (or with --small) the same code runs at small shapes (kimi-mini's own config for the
steps) with the kernels in Pallas interpret mode: it shows the script works, not how fast anything
is. It exits 1 if a kernel disagrees with XLA or greedy speculation differs from plain decoding.
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

import _cli  # noqa: E402
import bench_kernels  # noqa: E402  (its measurements and flags; this script sets the flags itself)

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_bool("small", None, "Small shapes (default: on a CPU host). The kernels run interpreted on a CPU.")
FLAGS.set_default("json_out", "gpu_check.json")  # bench_kernels' flag: where the results go
flags.DEFINE_integer("step_repeats", None, "Timed runs per step (default 20 on a GPU, 2 small).", lower_bound=1)
flags.DEFINE_integer("greedy_tokens", None, "Tokens per prompt in the greedy check (default 64 on a GPU, 6 small).",
                     lower_bound=1)

KIMI = os.path.join(ROOT, "tests", "data", "kimi-k2.5.config.json")
PAIR = os.path.join(ROOT, "checkpoints", "kimi-mini"), os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
GREEDY_PROMPTS = ("Once upon a time", "The little dog")


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

    from eagle3_jax.params import abstract_params

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


def step_rows(small: bool, repeats: int) -> list[dict]:
    """Decode (T = 1) and chain-verify (T = 4) steps of the target forward, kernels against XLA."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from eagle3_jax import kv_cache
    from eagle3_jax.config import load_model_config, parse_model_config
    from eagle3_jax.target import forward, resolve_dtype

    if small:
        cfg, batches, context = load_model_config(os.path.join(PAIR[0], "config.json")), (2,), 64
    else:
        with open(KIMI) as f:
            cfg, batches, context = parse_model_config(_one_moe_layer(json.load(f))), (1, 64), 8192
    dtype = resolve_dtype("bfloat16")
    params = _random_params(cfg, dtype)
    step = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))
    print(f"\ntarget steps: {cfg.num_layers} layers of {os.path.basename(KIMI) if not small else 'kimi-mini'}, "
          f"{'interpret mode: timings are not meaningful' if jax.default_backend() == 'cpu' else jax.devices()[0].device_kind}")
    print("| batch | T | kernels ms | XLA ms | speedup |\n|---|---|---|---|---|")
    rows = []
    for batch in batches:
        for t in (1, 4):
            times = {}
            for impl in ("pallas", "xla"):
                run_cfg = dataclasses.replace(cfg, kernels=f"attention={impl},moe={impl}")
                cache = kv_cache.advance(kv_cache.init_cache(run_cfg, batch, context + 8, dtype),
                                         jnp.full((batch,), context - t, jnp.int32))
                tokens = jnp.zeros((batch, t), jnp.int32)
                positions = (context - t) + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
                chain = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
                state = {"cache": cache}

                def one():
                    logits, _, state["cache"] = step(params, run_cfg, tokens, positions, state["cache"], chain)
                    return logits

                times[impl] = bench_kernels._median_ms(one, (), repeats)
            rows.append(dict(op="step", batch=batch, tokens=t, context=context, kernel_ms=times["pallas"],
                             xla_ms=times["xla"]))
            print(f"| {batch} | {t} | {times['pallas']:.3f} | {times['xla']:.3f} | {times['xla'] / times['pallas']:.2f}x |")
    return rows


def greedy_check(max_tokens: int) -> dict:
    """The bundled kimi-mini pair with kernels="pallas": chain speculation == plain greedy."""
    import eagle3_jax as e3
    from eagle3_jax.tokenizer import load_tokenizer

    target = e3.load_target(PAIR[0], dtype="float32", kernels="pallas")
    draft = e3.load_draft(PAIR[1], target=target, dtype="float32")
    tokenizer = load_tokenizer(PAIR[0])
    prompts = [tokenizer.encode(p) for p in GREEDY_PROMPTS]
    sp = e3.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = [o.token_ids for o in e3.Engine(target, max_batch_size=2, max_seq_len=256).generate(prompts, sp)]
    outs = e3.Engine(target, draft, e3.SpecConfig(3, 1, 4), max_batch_size=2, max_seq_len=256).generate(prompts, sp)
    spec = [o.token_ids for o in outs]
    tau = sum(o.metrics["mean_accept_length"] for o in outs) / len(outs)
    print(f"\ngreedy chain 3/1/4 with kernels=pallas == plain: {spec == plain} ({max_tokens} tokens x {len(prompts)} "
          f"prompts, tau {tau:.2f})")
    return {"equal": spec == plain, "tokens": max_tokens, "prompts": len(prompts), "mean_accept_length": tau,
            "plain": plain, "speculative": spec}


def main(argv) -> None:
    _cli.reject_positional(argv)
    _cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    import jax

    on_cpu = jax.default_backend() == "cpu"
    small = on_cpu if FLAGS.small is None else FLAGS.small
    repeats = FLAGS.step_repeats or (2 if small else 20)
    _kernel_flags(small)
    from eagle3_jax.plan import DEVICES
    from pallas_kernels import launch

    peak = DEVICES[FLAGS.device].hbm_gbps
    started = time.perf_counter()
    kernel_rows = bench_kernels.attention_rows(peak, on_cpu) + bench_kernels.moe_rows(peak, on_cpu)
    steps = step_rows(small, repeats)
    greedy = greedy_check(FLAGS.greedy_tokens or (6 if small else 64))
    result = {
        "date": datetime.date.today().isoformat(), "command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:]),
        "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "arch": launch.current_arch(),
        "interpret": on_cpu, "small": small, "jax": jax.__version__, "machine": f"{platform.machine()} x{os.cpu_count()}",
        "seconds": round(time.perf_counter() - started, 1), "kernels": kernel_rows, "steps": steps, "greedy": greedy,
    }
    _cli.write_output("--json_out", FLAGS.json_out, json.dumps(result, indent=1))
    print(f"\nwrote {FLAGS.json_out}")
    if not greedy["equal"]:
        print("gpu_check.py: greedy speculation with the kernels differs from plain greedy decoding", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _cli.run(main)
