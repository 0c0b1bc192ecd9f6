"""The harness scripts of benchmarks/harness/ run as benchmarks/README.md documents them.

Each runs as a subprocess, as a reader would start it: `--help` for every one, then its cheapest
real path at tiny sizes (the demo pair, a request or two, a handful of tokens), writing into a
temporary folder. The ones that compile many programs (two `auto` schedulers, the step accounting)
are marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "benchmarks", "harness")
SCRIPTS = ("aa-noise-floor", "aa-ratios", "agent-soak", "auto-host-ab", "auto-steps-costed", "layers-unrolled-ab", "long-context",
           "long-pair-ab", "long-prompt", "moe-dense-ab", "moe-small-dense-ab", "paged-attention-forms",
           "sampling-sort-ab", "vllm-side-by-side")


def run_harness(script: str, *args: str, cwd: str = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")  # one CPU device
    r = subprocess.run([sys.executable, os.path.join(HARNESS, f"{script}.py"), *args], capture_output=True, text=True,
                       cwd=cwd, env=env, timeout=timeout)
    assert r.returncode == 0, f"{script}.py {' '.join(args)}: rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_the_harness_is_every_script_and_results_hold_data_only():
    modules = ("ab_common", "peer_servers")  # what the scripts share
    assert sorted(f[:-3] for f in os.listdir(HARNESS) if f.endswith(".py")) == sorted(SCRIPTS + modules)
    assert not [f for f in os.listdir(os.path.join(ROOT, "benchmarks", "results")) if f.endswith(".py")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, tmp_path):
    r = run_harness(script, "--help", cwd=str(tmp_path))  # from any folder
    assert f"benchmarks/harness/{script}.py" in r.stdout  # its docstring's command line
    if script == "aa-noise-floor":
        assert "--concurrency" in r.stdout  # then bench.py's flags
    else:
        assert r.stdout.startswith("usage:")


def test_aa_ratios_reproduces_its_record():
    r = run_harness("aa-ratios", "benchmarks/results/aa-random-1k1k.json")
    with open(os.path.join(ROOT, "benchmarks", "results", "aa-random-1k1k-ratios.txt")) as f:
        assert r.stdout == f.read()


def test_outputs_are_not_written_over(tmp_path):
    existing = tmp_path / "rows.json"
    existing.write_text("[]")
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    for script in ("layers-unrolled-ab", "long-prompt", "moe-dense-ab", "moe-small-dense-ab", "paged-attention-forms",
                   "sampling-sort-ab", "vllm-side-by-side"):
        r = subprocess.run([sys.executable, os.path.join(HARNESS, f"{script}.py"), f"--json_out={existing}"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert r.returncode != 0 and "already exists" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert existing.read_text() == "[]"


def test_auto_host_ab_reads_an_earlier_acceptance():
    """The earlier adaptive module loads, its relative import of settings rewritten, under either
    of the package's names (spec_decode/ now, spec/ before the rename)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("auto_host_ab", os.path.join(HARNESS, "auto-host-ab.py"))
    sys.path.insert(0, HARNESS)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        commits = ["HEAD"]
        if subprocess.run(["git", "cat-file", "-e", "363c411^{commit}"], cwd=ROOT, capture_output=True).returncode == 0:
            commits.append("363c411")  # the commit benchmarks/README.md names, before the rename
        elif subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
            pytest.skip("not a git checkout")
        for commit in commits:
            acceptance = module.acceptance_at(commit)
            a = acceptance(3, [], 1.0, 0.9)
            assert a.depth == 3
    finally:
        sys.path.remove(HARNESS)
        sys.modules.pop("adaptive_before", None)


def test_aa_noise_floor_then_aa_ratios(tmp_path):
    run_harness("aa-noise-floor", "--spec=none", "--concurrency=1", "--seeds=0", "--num_prompts=2", "--num_warmups=1",
                "--scale=0.0625", "--noprogress", f"--out_dir={tmp_path}", "--name=aa")
    cells = json.loads((tmp_path / "aa.json").read_text())["cells"]
    assert {c["setting"] for c in cells} == {"none", "none#2"}
    r = run_harness("aa-ratios", str(tmp_path / "aa.json"))
    assert "copy of best / best" in r.stdout and "min over seeds" in r.stdout


def test_layers_unrolled_ab(tmp_path):
    out = tmp_path / "rows.json"
    run_harness("layers-unrolled-ab", "--tokens=1", "--repeats=1", f"--json_out={out}")
    rows = json.loads(out.read_text())
    assert {(r["experts"], r["layers"]) for r in rows} == {(e, l) for e in ("gathered", "dense")
                                                           for l in ("stacked", "unrolled")}


def test_paged_attention_forms(tmp_path):
    """Every form runs and equals the engine's attention (the harness asserts it before timing)."""
    out = tmp_path / "rows.json"
    run_harness("paged-attention-forms", "--batch=2", "--contexts=64", "--tokens=1,4", "--rounds=3",
                f"--json_out={out}")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["tokens"]) for r in rows] == [(64, 1), (64, 4)]
    assert set(rows[0]["ms"]) == {"engine", "blocks32", "head_major_pool", "multiply_reduce", "block_diagonal",
                                  "gather_only"}


def test_sampling_sort_ab(tmp_path):
    out = tmp_path / "rows.json"
    run_harness("sampling-sort-ab", "--rows=4", "--vocab=64", "--repeats=1", f"--json_out={out}")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["vocab"]) for r in rows] == [(4, 64)] and rows[0]["temperature alone ms"] > 0


def test_long_pair_ab_on_the_demo_pair(tmp_path):
    """Three palindromic rounds of two prompts on the bundled pair: every run's greedy outputs equal
    (the script checks), the compiling rounds left out of the ratios and said, the median ratio
    inside its bootstrap interval."""
    out = tmp_path / "ab.json"
    run_harness("long-pair-ab", "--target=checkpoints/kimi-mini", "--draft=checkpoints/kimi-mini-eagle3",
                "--specs=none,chain:3:1:4", "--input_len=24", "--output_len=12", "--rounds=3", "--concurrency=2",
                f"--json_out={out}")
    record = json.loads(out.read_text())
    assert record["greedy_outputs_equal"] and len(record["rows"]) == 6
    assert set(record["rounds_left_out"]) < {0, 1, 2}
    chain = record["summary"]["chain:3:1:4"]
    assert chain["tau"] > 1.0 and len(chain["tpot_speedup_by_round"]) == 3 - len(record["rounds_left_out"])
    low, high = chain["e2e_speedup_interval90"]
    assert min(chain["e2e_speedup_by_round"]) <= low <= chain["e2e_speedup_median"] <= high <= max(
        chain["e2e_speedup_by_round"])


@pytest.mark.slow
@pytest.mark.parametrize("script,batch", [("moe-dense-ab", 8), ("moe-small-dense-ab", 1)])
def test_moe_ab(script, batch, tmp_path):
    out = tmp_path / "rows.json"
    run_harness(script, f"--batches={batch}", "--specs=none", "--reps=1", "--steps=2", "--runs=1",
                "--max_tokens=48", f"--json_out={out}")
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["dense"]) for r in rows] == [(batch, False), (batch, True)]
    assert all(r["step_ms"] > 0 and r["verify_ms"] > 0 for r in rows)


@pytest.mark.slow
def test_long_prompt(tmp_path):
    out = tmp_path / "long.json"
    r = run_harness("long-prompt", "--prompt_len=700", "--positions=4096", "--chunks=128,512", "--max_tokens=6",
                    f"--json_out={out}")
    record = json.loads(out.read_text())
    assert record["identical"] and [(x["chunk"], x["spec"]) for x in record["runs"]] == [
        (128, "none"), (512, "none"), (512, "chain:3:1:4")]
    assert all(x["peak_rss_gb"] > 0 for x in record["runs"]) and "identical" in r.stdout
    assert record["prefill_temp_bytes"]["512"] > record["prefill_temp_bytes"]["128"] > 0


@pytest.mark.slow
def test_auto_steps_costed():
    r = run_harness("auto-steps-costed", "1", "0", "none,auto", "--warmups=1", "--measured=2", "--rounds=1",
                    "--max_tokens=8")
    assert "auto" in r.stdout and "of the best fixed setting" in r.stdout and "table (ms):" in r.stdout


@pytest.mark.slow
def test_auto_host_ab():
    r = run_harness("auto-host-ab", "HEAD", "1", "--requests=1", "--max_tokens=8")
    lines = [line for line in r.stdout.splitlines() if line.startswith("C=1")]
    assert len(lines) == 2 and "before" in lines[0] and "after" in lines[1], r.stdout


def test_long_context_writes_the_extended_pair(tmp_path):
    import json

    folder = tmp_path / "pair"
    r = run_harness("long-context", f"--pair_dir={folder}", "--positions=4096")
    assert "scripts/bench.py" in r.stdout
    text = json.loads((folder / "config.json").read_text())
    text = text.get("text_config", text)
    assert text["max_position_embeddings"] == 4096
    assert text["rope_scaling"]["factor"] * text["rope_scaling"]["original_max_position_embeddings"] == 4096
    assert (folder / "model.safetensors").exists() or any(folder.glob("*.safetensors"))
    again = subprocess.run([sys.executable, os.path.join(HARNESS, "long-context.py"), f"--pair_dir={folder}"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert again.returncode != 0 and "is not empty" in again.stderr
