"""scripts/gpu_check.py runs on a CPU host at small shapes (kernels interpreted), so it works the
day a GPU is lent: every part is measured and written to its JSON, and greedy speculation through
the kernels equals plain greedy decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.newest_jax  # CI's newest-JAX leg runs it
def test_gpu_check_runs_small_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--small", f"--json_out={out}"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, XLA_FLAGS=""))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["interpret"] and result["small"] and result["arch"] == "default"
    ops = [row["op"] for row in result["kernels"]]
    assert ops.count("attention") == 2 and ops.count("moe") == 2  # T = 1 and 4; 1 and 8 tokens
    assert all(row["max_abs_err"] < 5e-2 for row in result["kernels"] if row["op"] == "attention")
    assert [(s["batch"], s["tokens"]) for s in result["steps"]] == [(2, 1), (2, 4)]
    assert all(s["kernel_ms"] > 0 and s["xla_ms"] > 0 for s in result["steps"])
    demo = result["demo"]
    assert demo["equal"] and [(r["kernels"], r["spec"]) for r in demo["rows"]] == [
        ("xla", "none"), ("xla", "chain:3:1:4"), ("pallas", "none"), ("pallas", "chain:3:1:4")]
    plain = demo["rows"][0]["tokens"]
    assert all(r["tokens"] == plain and r["equal_first"] for r in demo["rows"])
    assert len(plain[0]) == demo["tokens"]
    assert demo["rows"][1]["tokens_per_step"] > 1.0 and demo["rows"][0]["tokens_per_step"] == 1.0
