"""The main job: plain decoding vs EAGLE-3 (chain and tree) on a target + draft pair.

    python scripts/demo.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \\
        --prompts=checkpoints/demo_prompts.txt --max_tokens=128

Runs the same greedy requests (batch 1, one prompt at a time, as a latency-bound user sees them)
without speculation, with an EAGLE-3 chain and with an EAGLE-3 tree; checks that all three emit
identical tokens; and prints one table: output tokens/s, TPOT (mean time per output token after
the first), tau (mean acceptance length, bonus included), per-position acceptance rates and the
speedup over plain decoding, a legend of those columns, and the first prompt's continuation as
text. The target runs in bfloat16 with batch-invariant numerics (what a server that promises
speculation's exact greedy output runs: --dtype, --nobatch_invariant change them); the draft keeps
the default numerics, as it only proposes. Every configuration is compiled and run once before it is timed (with progress lines);
the timed passes alternate between the modes and the table reports each mode's median pass.
With --json, the figures are also written to a file.

Speculation settings are written chain:num_steps:topk:num_draft_tokens and
tree:num_steps:topk:num_draft_tokens, as everywhere in eagle3-jax; --chain and --tree also take the
older num_steps,topk,num_draft_tokens.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import textwrap
import time
from typing import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle3_jax.cli import script as cli  # noqa: E402
from eagle3_jax.cli.flags import (  # noqa: E402
    check_draft_path,
    check_target_path,
    compilation_cache_from_flags,
    define_compilation_cache_flag,
    define_kv_cache_dtype_flag,
    parse_spec_text,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder.")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder.")
flags.DEFINE_string("prompts", "checkpoints/demo_prompts.txt", "One prompt per line.")
define_compilation_cache_flag()
flags.DEFINE_integer("max_tokens", 128, "Tokens generated per prompt.", lower_bound=1)
flags.DEFINE_string("chain", "chain:3:1:4", "The chain: chain:num_steps:1:num_draft_tokens (or the older "
                    "num_steps,topk,num_draft_tokens).")
flags.DEFINE_string("tree", "tree:5:4:16", "The tree: tree:num_steps:topk:num_draft_tokens (or the older "
                    "num_steps,topk,num_draft_tokens).")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Compute dtype (bfloat16: what a server runs).")
flags.DEFINE_bool("batch_invariant", True, "Batch-invariant numerics for the target (eagle3_jax/models/invariant.py): "
                  "every token is computed the same way whatever shares its pass, so the speculative modes emit "
                  "exactly plain decoding's greedy tokens in bfloat16 too. --nobatch_invariant runs the default "
                  "numerics (faster; in bfloat16 greedy outputs may then part at near-ties).")
flags.DEFINE_integer("repeats", 5, "Timed passes over the prompt set per mode, interleaved across modes; "
                     "the table reports the median pass.", lower_bound=1)
flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
cli.define_overwrite_flag("--json")
define_kv_cache_dtype_flag()


LEGEND = """\
output tok/s: generated tokens / wall time of the median pass (each prompt alone, batch 1)
TPOT: time per output token after the first, median over requests
tau: tokens emitted per target verify pass, bonus token included (1.00 without speculation)
per-position acceptance: share of verify passes that accepted at least k draft tokens, k = 1, 2, ...
speedup: output tok/s over the baseline (plain decoding)
chain:S:K:N / tree:S:K:N: EAGLE-3 with S draft steps, K children per draft node (a chain has K = 1)
  and N tokens verified per step, the root included"""


def spec_of(text: str, flag: str):
    """The SpecConfig of --chain / --tree (`none` is no speculation setting here)."""
    spec = parse_spec_text(text, flag)
    if spec is None:
        raise app.UsageError(f"--{flag} needs a speculation setting like chain:3:1:4 or tree:5:4:16; got {text!r}")
    return spec


def progress(message: str) -> None:
    """A progress line, at once (stdout, before the table: stderr is kept for errors)."""
    print(message, flush=True)


def sample_text(prompt: str, continuation: str, limit: int = 400) -> str:
    """The prompt and its continuation as plain text, indented, cut to `limit` characters."""
    text = prompt + continuation
    if len(text) > limit:
        text = text[:limit].rstrip() + " ..."
    return textwrap.indent(text, "  ")


def timed_pass(engine, prompts, sampling) -> tuple[float, list, list[float]]:
    """Generate every prompt alone (batch 1): (wall seconds, outputs, per-request TPOTs).

    The garbage collector is paused while timing, as `timeit` does.
    """
    gc.collect()
    gc.disable()
    try:
        return _timed(engine, prompts, sampling)
    finally:
        gc.enable()


def _timed(engine, prompts, sampling) -> tuple[float, list, list[float]]:
    outs, tpots, wall = [], [], 0.0
    for p in prompts:
        start = time.perf_counter()
        out = engine.generate([p], sampling)[0]
        wall += time.perf_counter() - start
        outs.append(out)
        n = len(out.token_ids)
        if n > 1:
            tpots.append((out.metrics["e2e_latency_s"] - out.metrics["ttft_s"]) / (n - 1))
    return wall, outs, tpots


def summarize(engine, passes: list) -> dict:
    """Figures of the median pass (by wall time); tau and acceptance are the same in every pass."""
    wall, outs, tpots = sorted(passes, key=lambda x: x[0])[len(passes) // 2]
    tokens = sum(len(o.token_ids) for o in outs)
    steps = [a for o in outs for a in o.metrics["accept_lengths"]]
    depth = engine.spec.max_accept if engine.spec else 0
    return {
        "outputs": [o.token_ids for o in outs],
        "tokens_per_s": tokens / wall,
        "tpot_ms": 1e3 * statistics.median(tpots) if tpots else 0.0,
        "tau": sum(steps) / len(steps) if steps else 1.0,
        "per_position": [sum(a - 1 >= d for a in steps) / max(len(steps), 1) for d in range(1, depth + 1)],
        "pass_tokens_per_s": sorted(tokens / p[0] for p in passes),
    }


def main(argv: Sequence[str]) -> None:
    cli.reject_positional(argv)
    specs = [spec_of(FLAGS.chain, "chain"), spec_of(FLAGS.tree, "tree")]
    texts = [line.strip() for line in cli.read_text(FLAGS.prompts, "--prompts").splitlines() if line.strip()]
    check_target_path("--target", FLAGS.target)
    check_draft_path("--draft", FLAGS.draft)
    cli.check_output("--json", FLAGS.json, {"--target": FLAGS.target, "--draft": FLAGS.draft,
                                             "--prompts": FLAGS.prompts}, is_file=True)
    if not texts:
        raise app.UsageError(f"--prompts {FLAGS.prompts} has no prompts (one per line)")
    import jax

    import eagle3_jax as e3
    from eagle3_jax.text.tokenizer import load_tokenizer

    start = time.perf_counter()
    progress(str(compilation_cache_from_flags()))
    progress(f"loading {FLAGS.target} and {FLAGS.draft} ...")
    target = e3.load_target(FLAGS.target, dtype=FLAGS.dtype, batch_invariant=FLAGS.batch_invariant)
    draft = e3.load_draft(FLAGS.draft, target=target, dtype=FLAGS.dtype)
    tok = load_tokenizer(FLAGS.target, bos_id=target.config.bos_token_id)
    prompts = [tok.encode(t, add_bos=True) for t in texts]
    sampling = e3.SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens)
    max_len = max(len(p) for p in prompts) + FLAGS.max_tokens + 1
    rows = [("baseline", None)] + [(f"EAGLE-3 {spec}", spec) for spec in specs]
    with cli.usage_errors():  # a spec the draft cannot run (topk above its vocabulary, ...)
        engines = {name: e3.Engine(target, draft=draft if spec else None, spec=spec, max_batch_size=1,
                                   max_seq_len=max_len, kv_cache_dtype=FLAGS.kv_cache_dtype) for name, spec in rows}
    for i, (name, engine) in enumerate(engines.items(), 1):
        t0 = time.perf_counter()
        progress(f"[{i}/{len(engines)}] compiling {name} (one request) ...")
        engine.generate(prompts[:1], sampling)
        progress(f"      done in {time.perf_counter() - t0:.1f} s")
    passes: dict[str, list] = {name: [] for name in engines}
    for r in range(FLAGS.repeats):  # interleaved, so slow spells of a shared machine hit every mode alike
        t0 = time.perf_counter()
        for name, engine in engines.items():
            passes[name].append(timed_pass(engine, prompts, sampling))
        times = ", ".join(f"{name} {passes[name][-1][0]:.1f} s" for name in engines)
        progress(f"timed pass {r + 1}/{FLAGS.repeats} over {len(prompts)} prompts: {times} "
                 f"({time.perf_counter() - t0:.0f} s)")
    progress(f"total {time.perf_counter() - start:.0f} s")
    results = {name: summarize(engines[name], passes[name]) for name in engines}

    base = results["baseline"]
    same = all(r["outputs"] == base["outputs"] for r in results.values())
    numerics = "batch-invariant" if FLAGS.batch_invariant else "default numerics"
    print(f"\n{len(prompts)} prompts x {FLAGS.max_tokens} tokens, greedy, batch 1, {FLAGS.dtype}, {numerics}, "
          f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"target {FLAGS.target}, draft {FLAGS.draft}")
    print("greedy outputs identical across all runs: " + ("yes" if same else "NO"))
    header = "| mode | output tok/s | TPOT (ms) | tau | per-position acceptance | speedup |"
    print("\n" + header + "\n|" + "---|" * 6)
    for name, r in results.items():
        per_pos = " ".join(f"{x:.2f}" for x in r["per_position"]) or "-"
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tpot_ms']:.2f} | {r['tau']:.2f} | {per_pos} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x |")
    print("\n" + LEGEND)
    print(f"\nprompt 1 of {len(texts)} and its greedy continuation (the same in every mode):")
    print(sample_text(texts[0], tok.decode_continuation(prompts[0], base["outputs"][0])))
    if FLAGS.json:
        summary = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}
        cli.write_output("--json", FLAGS.json, json.dumps(
            {"argv": sys.argv, "identical": same, "dtype": FLAGS.dtype, "kv_cache_dtype": FLAGS.kv_cache_dtype,
             "batch_invariant": FLAGS.batch_invariant,
             "results": summary, "date": time.strftime("%Y-%m-%d"),
             "machine": f"{platform.machine()} x{os.cpu_count()}"}, indent=2))
    if not same:
        sys.exit("greedy outputs differ between plain and speculative decoding")


if __name__ == "__main__":
    cli.run(main)
