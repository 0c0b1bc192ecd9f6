"""A server's start-up, cold and warm, as `vllm bench startup` measures one: `scripts/serve.py` from
launch to healthy (`/health` 200: listening, the engine running), to ready (`/ready` 200: a lone
request's programs compiled), to the first token of a request sent the moment it is healthy, and to
the end of its warm-up, for each of --runs:

- cold: an empty compilation cache (--cache_dir emptied first);
- warm: the cache the run before left (a restart).

    python scripts/bench_startup.py --json_out=benchmarks/results/serve-startup.json

Writes --json_out (command, machine, date, figures, and serve.py's lines about the cache and the
warm-up).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from eagle3_jax.cli import script as cli  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target model folder, passed to serve.py.")
flags.DEFINE_string("draft", "checkpoints/kimi-mini-eagle3", "EAGLE-3 draft folder, passed to serve.py ('' for none).")
flags.DEFINE_string("serve_flags", "--spec=chain:3:1:4 --max_seq_len=512",
                    "More serve.py flags, split as a shell splits them (the default: the demo pair as the README "
                    "serves it).")
flags.DEFINE_list("runs", ["cold", "warm"], "Start-ups in order: cold (the cache emptied first) or warm.")
flags.DEFINE_string("cache_dir", None, "The compilation cache the runs use (default: a fresh temporary folder).")
flags.DEFINE_integer("port", 8766, "Port serve.py listens on (127.0.0.1).", lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("max_tokens", 16, "Tokens the first request asks for.", lower_bound=1)
flags.DEFINE_integer("startup_timeout", 1800, "Seconds to wait for each milestone.", lower_bound=1)
flags.DEFINE_string("json_out", None, "Write the figures here as JSON.")
cli.define_overwrite_flag("a --json_out file")

MILESTONES = ("healthy_s", "first_token_s", "ready_s", "warm_up_done_s")


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def first_token_seconds(base: str, start: float) -> float:
    """Seconds from `start` to the first streamed token of a greedy completion."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": FLAGS.max_tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=FLAGS.startup_timeout) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the first request streamed no token")


def start_up(kind: str, cache_dir: str) -> dict:
    """One launch of serve.py: its milestones in seconds from launch, and its lines on the cache and warm-up."""
    if kind == "cold":
        shutil.rmtree(cache_dir, ignore_errors=True)
    args = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), f"--target={FLAGS.target}",
            f"--port={FLAGS.port}", f"--compilation_cache_dir={cache_dir}",
            *([f"--draft={FLAGS.draft}"] if FLAGS.draft else []), *shlex.split(FLAGS.serve_flags)]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    row: dict = {"run": kind, "lines": []}

    def read_log() -> None:
        for line in proc.stderr:
            line = line.rstrip()
            if "compilation cache" in line or "warm-up" in line or "ready:" in line or "error" in line.lower():
                row["lines"].append(line)
            if line.startswith("serve.py: warm-up compiled"):
                row["warm_up_done_s"] = time.perf_counter() - start

    threading.Thread(target=read_log, daemon=True).start()
    base, deadline = f"http://127.0.0.1:{FLAGS.port}", start + FLAGS.startup_timeout
    try:
        for milestone, path in (("healthy_s", "/health"), ("ready_s", "/ready")):
            while get(base + path) != 200:
                if proc.poll() is not None:
                    cli.fail(f"serve.py exited with status {proc.returncode}: {row['lines'][-1:] or 'no output'}")
                if time.perf_counter() > deadline:
                    cli.fail(f"serve.py did not answer {path} with 200 within --startup_timeout")
                time.sleep(0.1)
            row[milestone] = time.perf_counter() - start
            if milestone == "healthy_s":  # the first client comes the moment the server is up
                asked = threading.Thread(target=lambda: row.update(first_token_s=first_token_seconds(base, start)))
                asked.start()
        asked.join(FLAGS.startup_timeout)
        while "warm_up_done_s" not in row and proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"{kind}: " + ", ".join(f"{m[:-2].replace('_', ' ')} {row[m]:.1f} s" for m in MILESTONES if m in row),
          flush=True)
    return row


def main(argv) -> None:
    cli.reject_positional(argv)
    cli.check_output("--json_out", FLAGS.json_out, is_file=True)
    unknown = [r for r in FLAGS.runs if r not in ("cold", "warm")]
    if unknown:
        cli.fail(f"--runs takes cold and warm; got {', '.join(unknown)}")
    cache_dir = FLAGS.cache_dir or tempfile.mkdtemp(prefix="eagle3-startup-")
    rows = [start_up(kind, cache_dir) for kind in FLAGS.runs]
    if FLAGS.json_out:
        record = {"command": " ".join(["python", "scripts/bench_startup.py", *sys.argv[1:]]),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
                  "cache_dir": cache_dir, "runs": rows}
        cli.write_output("--json_out", FLAGS.json_out, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    cli.run(main)
