"""Every script answers a user's mistake with one line on stderr and exit status 2, and --help with
status 0; a bug keeps its traceback.

The scripts run as subprocesses, a few at a time: most cases stop before any weights load (the
tiny stories260K model where one must); the default run takes about half a minute, the slow run
adds more cases of the same kinds.
"""

from __future__ import annotations

import inspect
import io
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr

import pytest

from eagle3_jax.cli import script as _cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")

STORIES = "checkpoints/stories260K"
KIMI, KIMI_DRAFT = "checkpoints/kimi-mini", "checkpoints/kimi-mini-eagle3"
ALL_SCRIPTS = ("generate", "serve", "bench", "bench_burst", "bench_startup", "bench_host_tier", "bench_kernels",
               "bench_step", "bench_structured", "compile_gate", "convert", "demo", "gpu_check", "plan", "quantize",
               "train_draft", "train_target", "make_corpus", "random_target")


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")  # one CPU device: --mesh=1,1,2 is too big
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, f"{script}.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


def run_all(cases: list[tuple]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(lambda case: run_script(case[0], *case[1]), cases))


def assert_one_line_error(case: tuple, r: subprocess.CompletedProcess) -> None:
    script, args, words = case
    lines = r.stderr.strip().splitlines()
    where = f"{script}.py {' '.join(args)}: rc {r.returncode}, stderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 2, where
    assert len(lines) == 1 and "Traceback" not in r.stderr, where
    assert lines[0].startswith(f"{script}.py: error: ") and words in lines[0], where


# (script, arguments, words the error line must contain)
FLAG_CASES = [(s, ("--no_such_flag=1",), "Unknown command line flag 'no_such_flag'") for s in ALL_SCRIPTS] + [
    ("generate", (), "--model is required"),
    ("convert", ("--hf_dir=x",), "--out_dir is required"),
    ("generate", (f"--model={STORIES}", "--max_tokens=0"), "--max_tokens"),
    ("serve", (f"--target={KIMI}", "--kernels=fast"), "--kernels"),
    ("serve", (f"--target={KIMI}", "--noprefix_caching", "--host_kv_cache_gb=1"), "turn --prefix_caching on"),
    ("generate", (f"--model={STORIES}", "--batch_invariant", "--kernels=triton"), "use --kernels=xla"),
    ("train_draft", (f"--target={STORIES}", "--out=/tmp/x"), "exactly one of --prompts and --corpus"),
    ("train_draft", (f"--target={STORIES}", "--out=/tmp/x", "--corpus=/no/corpus.npy"), "/no/corpus.npy"),
    ("train_draft", (f"--target={STORIES}", "--out=/tmp/x", "--prompts=checkpoints/demo_prompts.txt", "--max_tokens=600",
                     "--batch_size=2"),
     "passes the target's 512 positions"),
]
INPUT_CASES = [
    ("generate", ("--model=/no/model",), "no config.json at /no/model"),
    ("generate", (f"--model={STORIES}", "--top_p=1.5"), "top_p must be in (0, 1]"),
    ("generate", (f"--model={STORIES}", "--prompts_file=/no/prompts.txt"), "--prompts_file /no/prompts.txt"),
    ("generate", (f"--model={STORIES}", "--mesh=1,1,2"), "--mesh"),
    ("generate", (f"--model={STORIES}", "--batch_invariant", "--mesh=1,1,1"), "drop --mesh or --batch_invariant"),
    ("generate", (f"--model={STORIES}", "--max_seq_len=1000"), "--allow_long_max_seq_len"),
    ("generate", (f"--model={STORIES}", "--spec=chain:3:2"), "needs 3 numbers"),
    ("bench", ("--spec=chain:3:2",), "--spec: speculation setting 'chain:3:2'"),
    ("bench", ("--base_url=http://127.0.0.1:9", "--spec=none", "--concurrency=1"), "no server answers"),
    ("bench_kernels", ("--device=XYZ",), "--device must be one of"),
    ("bench_kernels", ("--attention_launches=32:8:2",), "is not block_rows:num_warps:num_stages:block_slots"),
    ("compile_gate", ("--archs=gfx1",), "--archs: unknown gfx1"),
    ("gpu_check", ("--batches=8",), "gpu_check.py runs fixed shapes"),
    ("gpu_check", ("--parts=kernels,greedy",), "--parts takes kernels, steps, demo"),
    ("gpu_check", ("--parts=steps", "--step_shapes=64x4"), "--step_shapes: '64x4' is not batch:T"),
    ("plan", ("--target=tests/data/llama-3.1-8b-instruct.config.json", "--kernels=triton"), "name the GPU with --arch"),
    ("compile_gate", ("--configs=llama-9",), "--configs: unknown llama-9"),
    ("demo", ("--chain=chain:3:2:4",), "a chain has topk=1"),
    ("plan", (f"--target={KIMI}", "--draft=x", "--spec=tree:2:2:16"), "exceeds"),
    ("make_corpus", (f"--model={STORIES}", "--out=/tmp/never.npy", "--top_p=1.5", "--num_sequences=1"), "top_p"),
    ("bench", ("--synthetic_acceptance=0.5,0.9", "--spec=none,chain:3:1:4"), "cannot increase"),
    ("bench", ("--synthetic_acceptance=0.5", "--spec=none"), "add a speculative --spec"),
    ("bench", ("--workload=mt_bench_multiturn", "--base_url=http://127.0.0.1:9", "--spec=none"), "drop --base_url"),
    ("bench", ("--workload=nope",), "mt_bench_multiturn"),
    ("plan", (f"--target={KIMI}", "--nomemory"), "give --concurrency"),
    ("plan", (f"--target={KIMI}", f"--draft={KIMI_DRAFT}", "--concurrency=0"), "--concurrency must be"),
    ("plan", (f"--target={KIMI}", f"--draft={KIMI_DRAFT}", "--concurrency=4", "--acceptance=0.5,0.9"), "--acceptance"),
    ("bench_step", ("--batches=0",), "--batches must be"),
    ("bench_step", ("--spec=auto",), "fixed settings"),
    ("bench_step", ("--kernels=cuda",), "--kernels must be xla, triton, auto"),
    ("random_target", ("--config=/no/config.json", "--out=/tmp/never"), "--config /no/config.json is not a file"),
    ("random_target", (f"--config={STORIES}/config.json", "--out=/tmp/never", "--one_moe_layer"), "has no MoE layer"),
    ("random_target", (f"--config={KIMI}/config.json", "--out=/tmp/never", "--tokenizer_from=scripts"),
     "holds none of tokenizer.json"),
]
# More of the same kind, in the slow run.
MORE_INPUT_CASES = [
    ("generate", (f"--model={STORIES}", "--max_seq_len=4", "--prompt=Once upon a time there was"),
     "leaves no room to generate within --max_seq_len=4"),
    ("generate", (f"--model={STORIES}", "--draft=checkpoints/stories260K-eagle3", "--spec=chain:3:1:4",
                  "--num_steps=5"), "disagrees with --num_steps=5"),
    ("bench", ("--target=/no/model",), "no config.json"),
    ("convert", ("--hf_dir=/no/model", "--out_dir=/tmp/never"), "no config.json"),
    ("demo", ("--prompts=/no/prompts.txt",), "/no/prompts.txt"),
    ("quantize", ("--src=/no/model", "--out=/tmp/never"), "no config.json"),
    ("train_target", ("--config=/no/config.json", "--corpus=/no/c.npy", "--out=/tmp/never"), "/no/config.json"),
]


def test_help_exits_zero():
    results = run_all([(s, ("--help",), "") for s in ALL_SCRIPTS])
    for script, r in zip(ALL_SCRIPTS, results):
        assert r.returncode == 0 and f"{script}.py" in r.stdout and not r.stderr.strip(), (script, r.stderr[-2000:])
    generate_help = results[0].stdout
    assert "--draft=checkpoints/kimi-mini-eagle3 \\\n" in generate_help  # the example's line break survives
    # serve.py states the scheduler's defaults without importing it (--help stays fast): they must agree.
    from eagle3_jax.scheduler import Scheduler

    blocks = (re.match(r"(\w+):.*\(default: '(.*?)'\)", b, re.S) for b in re.split(r"\n\s+--", results[1].stdout))
    defaults = {m[1]: m[2] for m in blocks if m}
    wanted = inspect.signature(Scheduler).parameters
    for name in ("max_num_seqs", "page_size", "prefill_chunk", "max_logprobs", "max_compiled_programs"):
        assert defaults.get(name, "None") == str(wanted[name].default), name  # absl states no None default


def test_flag_mistakes_are_one_line():
    for case, r in zip(FLAG_CASES, run_all(FLAG_CASES)):
        assert_one_line_error(case, r)


def test_input_mistakes_are_one_line():
    for case, r in zip(INPUT_CASES, run_all(INPUT_CASES)):
        assert_one_line_error(case, r)


@pytest.mark.slow
def test_more_input_mistakes_are_one_line():
    for case, r in zip(MORE_INPUT_CASES, run_all(MORE_INPUT_CASES)):
        assert_one_line_error(case, r)


def test_serve_checks_the_port_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        case = ("serve", (f"--target={KIMI}", f"--draft={KIMI_DRAFT}", f"--port={port}"), f"127.0.0.1:{port}")
        r = run_script(case[0], *case[1])
    assert_one_line_error(case, r)
    assert "serving" not in r.stderr and "warming up" not in r.stderr  # nothing was loaded


# ---- the mechanism, in-process ----------------------------------------------------------------------------


def call(main, *args) -> tuple[int | None, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = _cli.guarded(main)(["script.py", *args])
    return code, err.getvalue()


def test_user_errors_are_one_line_and_bugs_propagate():
    from absl import app

    from eagle3_jax.config.model import ConfigError

    def raises(error):
        def main(argv):
            raise error
        return main

    code, err = call(raises(ConfigError("config.json is missing required field 'vocab_size'")))
    assert code == 2 and err.count("\n") == 1 and "error: config.json is missing required field 'vocab_size'" in err
    code, err = call(raises(app.UsageError("give --prompt or --prompts_file, not both")))
    assert code == 2 and "not both" in err
    code, err = call(raises(FileNotFoundError(2, "No such file or directory", "/no/file")))
    assert code == 2 and "No such file or directory: /no/file" in err
    code, err = call(raises(ConfigError("3 problems:\n  - a\n  - b\n  - c")))
    assert err.strip().endswith("3 problems: a [2 more; --verbose shows them all]")
    for bug in (ValueError("shapes do not match"), KeyError("x"), RuntimeError("XLA failed")):
        with pytest.raises(type(bug)):
            call(raises(bug))
    assert call(lambda argv: None) == (None, "")


def test_kernels_without_their_packages_are_one_line(monkeypatch):
    """--kernels=triton where Triton's interpreter is not installed (simulated): the load fails
    with one line naming what is missing and the extra, before any weights are read."""
    import eagle3_jax as e3
    from eagle3_jax.runtime import kernels as kernels_lib

    monkeypatch.setattr(kernels_lib, "installed", lambda module: module != "triton")
    code, err = call(lambda argv: e3.load_target(os.path.join(ROOT, STORIES), kernels="triton"))
    assert code == 2 and err.count("\n") == 1, err
    assert ("error: kernels='triton': running the Triton kernels on a CPU host (in Triton's interpreter) needs "
            "triton, which is not installed: pip install 'eagle3-jax[test]'") in err


def test_usage_errors_turns_value_errors_of_user_input_into_usage_errors():
    from absl import app

    with pytest.raises(app.UsageError, match="--top_p: top_p must be in"):
        with _cli.usage_errors("--top_p"):
            raise ValueError("top_p must be in (0, 1]; got 1.5")


def test_flag_error_line():
    msg = ("flag --hf_dir=None: Flag --hf_dir must have a value other than None.\n"
           "flag --out_dir=None: Flag --out_dir must have a value other than None.")
    assert _cli.flag_error_line(msg) == "--hf_dir is required; --out_dir is required (--help lists the flags)"

