"""A prompt of 40,000 tokens through the Engine on CPU, exact: the bundled kimi-mini pair with the
target's YaRN extended to 131,072 positions (factor 1,024 over its 128 original ones; no training
at that length, so the text is poor, but every run must give the same tokens), greedy, for each
prefill chunk size and for chain speculation, each run in its own process so that its peak
resident memory is its own; and the prefill program's temporaries per chunk size from the memory
planner.

    python benchmarks/harness/long-prompt.py --json_out=benchmarks/results/long-prompt-40k.json --overwrite

The prompt is the GSM8K test questions (data/gsm8k) joined until it holds --prompt_len tokens.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from ab_common import DRAFT, TARGET, add_output_flags, check_output, extended_target, prompt_ids, write_json


def one_run(args) -> dict:
    """This process's run: load, generate once (compiling), then once timed."""
    import eagle3_jax as e3
    from eagle3_jax.text.tokenizer import load_tokenizer

    folder = extended_target(tempfile.mkdtemp(), args.positions)
    target = e3.load_target(folder, dtype="float32")
    draft = e3.load_draft(DRAFT, target=target, dtype="float32") if args.spec != "none" else None
    prompt = prompt_ids(load_tokenizer(TARGET), args.prompt_len)
    engine = e3.Engine(target, draft=draft, spec=e3.SpecConfig.parse(args.spec), max_batch_size=1,
                       max_seq_len=args.prompt_len + args.max_tokens + 8, prefill_chunk=args.chunk,
                       kv_cache_dtype=args.kv_cache_dtype)
    start = time.perf_counter()
    out = engine.generate([prompt], e3.SamplingParams(max_tokens=args.max_tokens))[0]
    seconds = time.perf_counter() - start
    return {"chunk": args.chunk, "spec": args.spec, "kv_cache_dtype": args.kv_cache_dtype, "tokens": out.token_ids,
            "tau": out.metrics["mean_accept_length"], "seconds_with_compiles": round(seconds, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def planned_temps(args, chunk: int) -> int:
    """The prefill program's temporaries (bytes) for one row of `chunk` tokens at full context."""
    import eagle3_jax as e3

    folder = extended_target(tempfile.mkdtemp(), args.positions)
    plan = e3.plan_memory(folder, batch=1, max_len=args.prompt_len + args.max_tokens + 8, programs=("prefill",),
                          prefill_chunk=chunk, dtype="float32", kv_cache_dtype=args.kv_cache_dtype)
    return plan.programs["prefill"]["temp_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt_len", type=int, default=40000, help="Prompt tokens (default: %(default)s).")
    parser.add_argument("--positions", type=int, default=131072, help="The target's positions (default: %(default)s).")
    parser.add_argument("--chunks", default="512,2048", help="Prefill chunk sizes, plain decoding (default: %(default)s).")
    parser.add_argument("--spec", default="chain:3:1:4", help="Speculation run at the last chunk size (default: "
                        "%(default)s; none: skip).")
    parser.add_argument("--max_tokens", type=int, default=32, help="Tokens generated (default: %(default)s).")
    parser.add_argument("--kv_cache_dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)  # a child's run
    add_output_flags(parser, "long-prompt-40k.json")
    args = parser.parse_args()
    if args.chunk is not None:
        print(json.dumps(one_run(args)))
        return
    check_output(args)
    chunks = [int(c) for c in args.chunks.split(",")]
    runs = [(c, "none") for c in chunks] + ([(chunks[-1], args.spec)] if args.spec != "none" else [])
    rows = []
    for chunk, spec in runs:
        cmd = [sys.executable, __file__, f"--chunk={chunk}", f"--spec={spec}", f"--prompt_len={args.prompt_len}",
               f"--positions={args.positions}", f"--max_tokens={args.max_tokens}",
               f"--kv_cache_dtype={args.kv_cache_dtype}"]
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"run chunk={chunk} spec={spec} failed:\n{child.stderr[-3000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print({k: v for k, v in rows[-1].items() if k != "tokens"}, flush=True)
    temps = {c: planned_temps(args, c) for c in chunks}
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"greedy tokens identical across chunk sizes and speculation: {'yes' if same else 'NO'}")
    print("prefill temporaries (planner, one row): " + ", ".join(f"chunk {c}: {t / 2**20:.0f} MiB" for c, t in temps.items()))
    write_json(args.json_out, {"argv": sys.argv, "prompt_len": args.prompt_len, "positions": args.positions,
                               "identical": same, "runs": rows, "prefill_temp_bytes": temps,
                               "date": time.strftime("%Y-%m-%d"), "machine": f"{os.uname().machine} x{os.cpu_count()}"})


if __name__ == "__main__":
    main()
