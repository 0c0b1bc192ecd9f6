"""scripts/gpu_check.py runs on a CPU host at small shapes (kernels interpreted), so it works the
day a GPU is lent: every part is measured and written to its JSON, and greedy speculation through
the kernels equals plain greedy decoding. Its library, eagle3_jax.bench.gpu_check: the plan's
defaults, the fixed kernel shapes, a step's bytes, the record, and which parts' results fail it."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from eagle3_jax.bench import gpu_check, kernel_timing
from eagle3_jax.planning.memory import DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = DEVICES["H200"]


def test_gpu_check_runs_small_on_cpu(tmp_path):  # heavy (conftest): minutes of Triton's interpreter
    pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors; no torch here")
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
        ("xla", "none"), ("xla", "chain:3:1:4"), ("triton", "none"), ("triton", "chain:3:1:4")]
    plain = demo["rows"][0]["tokens"]
    assert all(r["tokens"] == plain and r["equal_first"] for r in demo["rows"])
    assert len(plain[0]) == demo["tokens"]
    assert demo["rows"][1]["tokens_per_step"] > 1.0 and demo["rows"][0]["tokens_per_step"] == 1.0


def test_step_shapes_parse_or_default():
    assert gpu_check.step_shapes(None, small=True) == ((2, 1), (2, 4))
    assert gpu_check.step_shapes(None, small=False) == ((1, 1), (1, 4), (64, 1), (64, 4))
    assert gpu_check.step_shapes(["64:4", "1:64"], small=True) == ((64, 4), (1, 64))
    for text in ("64x4", "0:1", "1:0", "1:65", "a:1", "1:", "-1:2"):
        with pytest.raises(ValueError, match=re.escape(f"--step_shapes: {text!r} is not batch:T")):
            gpu_check.step_shapes(["1:1", text], small=False)


def test_the_plans_defaults_small_and_on_a_gpu():
    small = gpu_check.check_plan(["demo"], True, H200, True)
    assert (small.parts, small.step_repeats, small.greedy_tokens, small.demo_dtypes, small.demo_specs) == (
        ("demo",), 2, 3, ("float32",), ("none", "chain:3:1:4"))
    big = gpu_check.check_plan(gpu_check.PARTS, False, H200, False)
    assert (big.step_repeats, big.greedy_tokens, big.demo_dtypes, big.demo_specs, big.step_shapes[-1]) == (
        20, 64, ("float32", "bfloat16"), gpu_check.DEMO_SPECS, (64, 4))
    given = gpu_check.check_plan(["steps"], False, H200, False, launches=["32:8:2:32"], step_shape_texts=["8:2"],
                                 step_repeats=3, greedy_tokens=9, demo_dtypes=["bfloat16"], demo_kernels=["triton"],
                                 demo_specs=["tree:5:4:16"])
    assert (given.launches, given.step_shapes, given.step_repeats, given.greedy_tokens, given.demo_dtypes,
            given.demo_kernels, given.demo_specs) == (("32:8:2:32",), ((8, 2),), 3, 9, ("bfloat16",), ("triton",),
                                                      ("tree:5:4:16",))


def test_the_device_a_kind_names():
    assert gpu_check.device_name("NVIDIA H200", "MI325X") == "H200"
    assert gpu_check.device_name("NVIDIA H100 80GB HBM3", "MI325X") == "H100"
    assert gpu_check.device_name("AMD Instinct MI300X", "H100") == "MI300X"
    assert gpu_check.device_name("cpu", "MI325X") == "MI325X"


def test_the_kernel_shapes_are_kimis_and_their_flags_are_refused():
    attention, moe = gpu_check.kernel_shapes(small=False)
    assert (attention.kind, attention.heads, attention.latent, attention.rope, attention.batches, attention.tokens,
            attention.contexts, attention.launches, attention.repeats) == (
        "mla", 64, 512, 64, (1, 64), (1, 4), (8192,), (), 20)
    assert (moe.hidden, moe.inter, moe.experts, moe.local_experts, moe.topk, moe.fmt, moe.tokens) == (
        7168, 2048, 384, 48, 8, "int4", (1, 4, 64, 256))
    attention, moe = gpu_check.kernel_shapes(small=True, launches=["32:8:2:32"])
    assert (attention.heads, attention.contexts, attention.launches, moe.tokens, moe.repeats) == (
        4, (40,), ("32:8:2:32",), (1, 8), 1)
    with open(os.path.join(ROOT, "scripts", "bench_kernels.py")) as f:
        defined = set(re.findall(r'flags\.DEFINE_\w+\(\s*"(\w+)"', f.read()))
    assert set(gpu_check.FIXED_SHAPE_FLAGS) <= defined and set(gpu_check.SMALL_KERNEL_SHAPES) == set(
        gpu_check.FIXED_SHAPE_FLAGS)


def test_the_steps_model_is_kimi_cut_to_one_moe_layer():
    assert gpu_check.one_moe_layer({"text_config": {"first_k_dense_replace": 3, "num_hidden_layers": 61}}) == {
        "text_config": {"first_k_dense_replace": 3, "num_hidden_layers": 4}}
    assert gpu_check.one_moe_layer({"num_hidden_layers": 8}) == {"num_hidden_layers": 1}
    cfg, context, name = gpu_check.step_model(small=False)
    assert (cfg.num_layers, cfg.num_experts, context, name) == (2, 384, 8192, "kimi-k2.5.config.json")
    assert gpu_check.step_model(small=True)[1:] == (64, "kimi-mini")


def test_a_steps_bytes_count_weights_the_experts_hit_and_the_prefix():
    cfg = types.SimpleNamespace(num_experts=8, num_experts_per_tok=2, attention="mla", kv_lora_rank=16,
                                qk_rope_head_dim=8, num_layers=3, num_kv_heads=2, head_dim=4)
    params = {"embed": np.zeros((100, 4), np.float32),  # a gather: not read whole
              "layers": {"wq": np.zeros((10,), np.float32), "experts_gate": np.zeros((8, 4), np.float32)}}
    # one token hits 2 of the 8 experts: a quarter of their bytes; the prefix is bf16
    assert gpu_check.step_bytes(params, cfg, 1, 1, 10) == pytest.approx(40 + 0.25 * 128 + 3 * 10 * 24 * 2)
    gqa = types.SimpleNamespace(**dict(vars(cfg), attention="gqa"))
    assert gpu_check.step_bytes(params, gqa, 2, 2, 10) == pytest.approx(
        40 + (1 - 0.75**4) * 128 + 3 * 2 * 10 * (2 * 2 * 4) * 2)


def test_the_record_is_rewritten_whole_after_every_part():
    texts = []
    record = gpu_check.CheckRecord({"device": "cpu"}, texts.append)
    record("ceilings", None)
    record("kernels", [{"op": "moe"}])
    first, last = json.loads(texts[0]), json.loads(texts[-1])
    assert len(texts) == 2 and first == {"device": "cpu", "ceilings": None, "seconds": first["seconds"]}
    assert last["kernels"] == [{"op": "moe"}] and last["ceilings"] is None and last["seconds"] >= first["seconds"]
    plan = gpu_check.check_plan(["kernels", "demo"], True, H200, True)
    header = gpu_check.check_header(["scripts/gpu_check.py", "--small"], "cpu", plan)
    assert (header["command"], header["peaks_from"], header["hbm_peak_gbps"], header["arch"], header["parts"]) == (
        "python scripts/gpu_check.py --small", "H200", 4800.0, "default", ["kernels", "demo"])
    assert header["interpret"] and header["small"] and header["backend"] == "cpu"


def test_the_kernels_part_adds_fractions_of_the_measured_ceilings(monkeypatch):
    timed = kernel_timing.timing(2.0, 4.0, 8e6, 4e9, 8.0, 4.0)  # kernel 4 GB/s, 2 TFLOP/s
    seen = {}

    def attention_rows(shapes, device, interpret, on_row, echo):
        seen["attention"] = shapes
        on_row(dict(timed, op="attention", equal=True))
        on_row(dict(op="attention", launch="64:4:1:16", error="refused", equal=None))

    def moe_rows(shapes, ws, device, interpret, on_row, echo):
        seen["moe"], seen["ws"] = shapes, ws
        on_row(dict(timed, op="moe", equal=False))

    monkeypatch.setattr(gpu_check, "measure_ceilings", lambda: {"copy_gbps": 10.0, "matmul_tflops": 4.0})
    monkeypatch.setattr(gpu_check, "expert_weights", lambda shapes: "weights")
    monkeypatch.setattr(gpu_check, "attention_rows", attention_rows)
    monkeypatch.setattr(gpu_check, "moe_rows", moe_rows)
    records, lines = [], []
    plan = gpu_check.check_plan(["kernels"], True, H200, False, launches=["64:4:1:16"])
    rows = gpu_check.kernel_part(plan, lambda part, value: records.append((part, copy.deepcopy(value))), lines.append)
    assert lines == ["ceilings measured: copy 10 GB/s (read + written), bf16 matmul 4 TFLOP/s"]
    assert [part for part, _ in records] == ["ceilings", "kernels", "kernels", "kernels"] and records[-1][1] == rows
    assert rows[0]["measured_copy_fraction"] == pytest.approx(0.4) and rows[0]["measured_flops_fraction"] == 0.5
    assert "measured_copy_fraction" not in rows[1] and rows[2]["xla_measured_copy_fraction"] == pytest.approx(0.2)
    assert seen["attention"].launches == ("64:4:1:16",) and seen["attention"].heads == 4 and seen["ws"] == "weights"
    records.clear()
    interpreted = gpu_check.kernel_part(gpu_check.check_plan(["kernels"], True, H200, True),
                                        lambda part, value: records.append(part), lines.append)
    assert records[0] == "ceilings" and "measured_copy_fraction" not in interpreted[0]


def test_the_check_fails_on_a_kernel_or_float32_output_that_differs(monkeypatch):
    ran = []
    monkeypatch.setattr(gpu_check, "kernel_part", lambda plan, record, echo: [
        {"op": "moe", "equal": False}, {"op": "moe", "equal": False}, {"op": "attention", "equal": None},
        {"op": "attention", "equal": True}])
    monkeypatch.setattr(gpu_check, "step_part", lambda plan, record, echo: ran.append("steps"))
    monkeypatch.setattr(gpu_check, "demo_part", lambda plan, record, echo: {"equal": False})
    plan = gpu_check.check_plan(["demo", "kernels"], True, H200, True)
    assert gpu_check.run_check(plan, lambda part, value: None, print) == [
        "a float32 demo output differs from its dtype's first row (plain greedy decoding)",
        "moe kernel differs from XLA"]
    assert not ran
    monkeypatch.setattr(gpu_check, "demo_part", lambda plan, record, echo: {"equal": True})
    assert gpu_check.run_check(gpu_check.check_plan(["steps", "demo"], True, H200, True), None, print) == []
    assert ran == ["steps"]
