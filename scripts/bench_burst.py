"""First bursts against a fresh `scripts/serve.py`: does its --warmup leave the first clients waiting?

Starts serve.py (on --port, with --target / --draft and any --serve_flags), waits until it listens,
then sends the same burst of --concurrency concurrent greedy /v1/completions requests --bursts
times (prompts of 3 to 120 words of checkpoints/demo_prompts.txt, 16 to 96 tokens each, EOS
ignored, seeded) and reports each burst's wall time, with the warm-up line serve.py printed.
The first burst should take no longer than the second. Writes --json_out (command, machine,
date, figures).

    python scripts/bench_burst.py --json_out=benchmarks/results/serve-first-bursts.json
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder, passed to serve.py.")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder, passed to serve.py ('' for none).")
flags.DEFINE_list("serve_flags", [], "More serve.py flags, e.g. --serve_flags=--max_num_seqs=16,--nowarmup.")
flags.DEFINE_integer("port", 8765, "Port serve.py listens on (127.0.0.1).", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("concurrency", 16, "Requests per burst, sent at once.", lower_bound=1)
flags.DEFINE_integer("bursts", 4, "Bursts, one after another (the same requests each time).", lower_bound=2)
flags.DEFINE_integer("seed", 0, "Seed of the burst's prompts and lengths.")
flags.DEFINE_integer("startup_timeout", 1800, "Seconds to wait for serve.py to listen (the warm-up included).",
                     lower_bound=1)
flags.DEFINE_string("json_out", None, "Write the figures here as JSON.")
cli.define_overwrite_flag("a --json_out file")


def burst_requests(seed: int, n: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) of one burst."""
    rng = random.Random(seed)
    with open(os.path.join(ROOT, "checkpoints", "demo_prompts.txt")) as f:
        words = f.read().split()
    return [(" ".join(rng.choice(words) for _ in range(rng.randint(3, 120))), rng.randint(16, 96)) for _ in range(n)]


async def one(session, url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url, json=body) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"serve.py answered {r.status}: {answer}")
        return answer["usage"]["completion_tokens"]


async def run_bursts(base: str, requests: list[tuple[str, int]], bursts: int) -> list[dict]:
    from eagle3_jax.bench.http_client import client

    aiohttp = client()

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        rows = []
        for i in range(bursts):
            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(session, f"{base}/v1/completions", model, p, m) for p, m in requests))
            rows.append({"burst": i + 1, "seconds": time.perf_counter() - start, "tokens": sum(tokens)})
            print(f"burst {i + 1}: {rows[-1]['seconds']:.2f} s, {rows[-1]['tokens']} tokens", flush=True)
    return rows


def start_server() -> tuple[subprocess.Popen, list[str]]:
    """serve.py running and listening, and the lines it printed until then."""
    args = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), f"--target={FLAGS.target}",
            f"--port={FLAGS.port}", *([f"--draft={FLAGS.draft}"] if FLAGS.draft else []), *FLAGS.serve_flags]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines, deadline = [], time.monotonic() + FLAGS.startup_timeout
    for line in proc.stderr:
        lines.append(line.rstrip())
        print(line, end="", file=sys.stderr, flush=True)
        if line.startswith("serve.py: serving "):
            return proc, lines
        if time.monotonic() > deadline:
            break
    proc.kill()
    cli.fail(f"serve.py did not start listening: {lines[-1] if lines else 'no output'}")


def main(argv) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    proc, lines = start_server()
    try:
        # Keep reading serve.py's log, or a full pipe would block it.
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        rows = asyncio.run(run_bursts(f"http://127.0.0.1:{FLAGS.port}", burst_requests(FLAGS.seed, FLAGS.concurrency),
                                      FLAGS.bursts))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    warmup = next((line for line in lines if "warm-up " in line and " in " in line), None)
    ratio = rows[0]["seconds"] / rows[1]["seconds"]
    print(f"first burst / second: {ratio:.2f}")
    if FLAGS.json_out:
        record = {"command": " ".join(["python", "scripts/bench_burst.py", *sys.argv[1:]]),
                  "date": datetime.date.today().isoformat(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
                  "warmup": warmup, "bursts": rows, "first_over_second": ratio}
        cli.write_output("--json_out", FLAGS.json_out, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    cli.run(main)
