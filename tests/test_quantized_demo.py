"""A quantized copy of the demo target (int4 routed experts, written by scripts/quantize.py) runs
through the demo script and the HTTP server with its experts resident in int4, and the planner
shows a plain decode step at batch 1 reading the expert bytes int4 saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_fixtures import ServerThread, request

import eagle3_jax as e3
from eagle3_jax.weights.quant import QArray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "kimi-mini")
DRAFT = os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def int4_copy(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("quantized") / "kimi-mini-int4")
    r = run_script("quantize.py", f"--src={TARGET}", f"--out={out}", "--method=int4_pack", "--group_size=32")
    assert r.returncode == 0, r.stderr
    assert "int4_pack (21 of 134 tensors quantized" in r.stdout  # 7 MoE layers x gate / up / down experts
    return out


def test_only_routed_experts_are_int4_on_device(int4_copy):
    target = e3.load_target(int4_copy, dtype="float32")
    moe = target.params["segments"][1]
    assert all(isinstance(moe[k], QArray) and moe[k].qformat.fmt == "int4" for k in
               ("experts_gate", "experts_up", "experts_down"))
    assert not any(isinstance(v, QArray) for k, v in moe.items() if not k.startswith("experts_"))
    assert not isinstance(target.params["lm_head"], QArray)


@pytest.mark.slow  # about 15 s; test_server_serves_the_int4_copy runs the same copy through a script
def test_demo_script_runs_the_int4_copy(int4_copy, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nLily and Ben went to the park\n")
    figures = tmp_path / "demo.json"
    r = run_script("demo.py", f"--target={int4_copy}", f"--draft={DRAFT}", f"--prompts={prompts}", "--max_tokens=16",
                   "--repeats=1", "--tree=3,2,6", f"--json={figures}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "greedy outputs identical across all runs: yes" in r.stdout
    results = json.loads(figures.read_text())["results"]
    assert set(results) == {"baseline", "EAGLE-3 chain:3:1:4", "EAGLE-3 tree:3:2:6"}  # --tree's old form is read
    assert results["EAGLE-3 chain:3:1:4"]["tau"] > 1.5  # the float-trained draft still predicts the int4 target


def test_server_serves_the_int4_copy(int4_copy):
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.serving import AsyncEngine, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(int4_copy)
    target = e3.load_target(int4_copy, dtype="float32")
    draft = e3.load_draft(DRAFT, target=target, dtype="float32")
    ids = tok.encode("One day, a little dog")
    want = e3.Engine(target, max_batch_size=1, max_seq_len=128).generate([ids], e3.SamplingParams(max_tokens=16))[0]
    sched = Scheduler(target, draft=draft, spec=e3.SpecConfig(3, 1, 4), max_num_seqs=4, max_seq_len=128)
    engine = AsyncEngine(sched, tokenizer=tok).start()
    server = ServerThread(make_app(engine, "kimi-mini-int4", eos_token_ids=tok.eos_ids, tokenizer_dir=int4_copy))
    try:
        status, _, body = request(server.port, "POST", "/v1/completions",
                                  {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    finally:
        server.stop()
        engine.shutdown(timeout=30)
    assert status == 200, body
    assert body["choices"][0]["text"] == tok.decode_continuation(ids, want.token_ids)


def test_planner_decode_step_reads_fewer_bytes_with_int4(int4_copy):
    plans = {name: e3.plan_memory(path, batch=1, max_len=256, dtype="bfloat16", programs=("decode",))
             for name, path in (("bf16", TARGET), ("int4", int4_copy))}
    cfg = e3.load_model_config(TARGET)
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    expert_params = moe_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    saved_per_param = 2 - (0.5 + 2 / 32)  # bf16 -> int4 nibble + one bf16 scale per 32
    held = plans["bf16"].weight_bytes - plans["int4"].weight_bytes
    read = plans["bf16"].step_read_bytes - plans["int4"].step_read_bytes
    assert held == pytest.approx(expert_params * saved_per_param, rel=1e-6)
    # One token routes to k of E experts per layer: a decode step reads k/E of the expert bytes.
    assert read == pytest.approx(expert_params * saved_per_param * cfg.num_experts_per_tok / cfg.num_experts, rel=1e-3)
    assert plans["int4"].step_read_bytes < plans["bf16"].step_read_bytes


def test_quantize_refuses_what_it_cannot_write(tmp_path, int4_copy):
    from eagle3_jax.checkpoint import CheckpointError
    from eagle3_jax.checkpoint.quantized_copy import quantize_checkpoint

    with pytest.raises(ValueError, match="groups of 48 do not divide the input width 128 of layers.1.experts_gate"):
        quantize_checkpoint(TARGET, str(tmp_path / "a"), "int4_pack", group_size=48)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(int4_copy, str(tmp_path / "b"))
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
