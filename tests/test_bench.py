"""The serving benchmark (eagle3_jax.bench): metrics, workloads, settings, reports, drivers, end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from eagle3_jax.bench import flag_checks
from eagle3_jax.bench import metrics as M
from eagle3_jax.bench import report as R
from eagle3_jax.bench import serving_run as S
from eagle3_jax.bench import workloads as W
from eagle3_jax.bench.http_client import completion_payload, parse_sse_line, run_requests
from eagle3_jax.bench.runner import (
    RunConfig,
    check_lengths,
    drive,
    make_cell,
    mark_identical,
    outputs_digest,
    sampling_for,
)
from eagle3_jax.bench.settings import parse_spec, parse_specs
from eagle3_jax.runtime.extras import MissingExtraError, require
from eagle3_jax.sampling.sampler import SamplingParams
from eagle3_jax.request import RequestOutput
from eagle3_jax.spec_decode import SpecConfig
from eagle3_jax.text.chat_template import render_prompt
from eagle3_jax.text.tokenizer import load_tokenizer
from eagle3_jax.train.data import load_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIMI = os.path.join(ROOT, "checkpoints", "kimi-mini")
KIMI_DRAFT = os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- metrics on hand-made records ------------------------------------------------------------------


def _records() -> list[M.RequestRecord]:
    # A: submitted at 0.0; deltas of 1, 2, 1 tokens at 0.1, 0.3, 0.4 s; verify steps accepted 2 then 1.
    a = M.RequestRecord(prompt_len=10, submit_time=0.0, delta_times=[0.1, 0.3, 0.4], delta_tokens=[1, 2, 1],
                        finish_time=0.4, num_output_tokens=4, accept_lengths=[2, 1])
    # B: submitted at 0.05; two single-token deltas at 0.25 and 0.35 s; one verify step.
    b = M.RequestRecord(prompt_len=20, submit_time=0.05, delta_times=[0.25, 0.35], delta_tokens=[1, 1],
                        finish_time=0.35, num_output_tokens=2, accept_lengths=[1])
    # C failed: counted, excluded from every figure.
    c = M.RequestRecord(prompt_len=99, submit_time=0.0, error="boom")
    return [a, b, c]


def test_per_request_metrics():
    a, b, _ = _records()
    assert M.ttft_s(a) == pytest.approx(0.1) and M.ttft_s(b) == pytest.approx(0.2)
    assert M.e2e_s(a) == pytest.approx(0.4) and M.e2e_s(b) == pytest.approx(0.3)
    assert M.tpot_s(a) == pytest.approx((0.4 - 0.1) / 3) and M.tpot_s(b) == pytest.approx(0.1)
    assert M.itl_s(a) == pytest.approx([0.2, 0.1])  # the 2-token delta is one ITL sample
    one = M.RequestRecord(prompt_len=1, submit_time=0.0, delta_times=[0.5], finish_time=0.5, num_output_tokens=1)
    assert M.tpot_s(one) is None and M.itl_s(one) == []


def test_summarize_hand_computed():
    s = M.summarize(_records(), 0.5, num_devices=2, max_accept=3)
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (3, 2, 1)
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(12.0)
    assert s["output_throughput_per_device"] == pytest.approx(6.0)
    assert s["request_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(72.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0) and s["ttft_ms"]["median"] == pytest.approx(150.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(199.0)  # 100 + 0.99 * (200 - 100), linear interpolation
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0) and s["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 3  # samples 200, 100 (A) and 100 (B)
    assert s["itl_ms"]["mean"] == pytest.approx(400.0 / 3) and s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["itl_ms"]["p99"] == pytest.approx(198.0)  # sorted 100, 100, 200: 100 + 0.98 * 100
    assert s["e2e_latency_ms"]["mean"] == pytest.approx(350.0) and s["e2e_latency_ms"]["p99"] == pytest.approx(399.0)
    acc = s["acceptance"]  # steps pooled: 2, 1, 1
    assert acc["tau"] == pytest.approx(4 / 3) and acc["num_verify_steps"] == 3
    assert acc["per_position"] == pytest.approx([1 / 3, 0.0, 0.0])
    assert "acceptance" not in M.summarize(_records(), 0.5)
    with pytest.raises(ValueError, match="duration"):
        M.summarize(_records(), 0.0)


def test_distribution_and_acceptance_edge_cases():
    assert M.distribution([]) == {"mean": None, "median": None, "p99": None, "count": 0}
    assert M.pooled_acceptance([[], []], 2) == {"tau": 1.0, "per_position": [0.0, 0.0], "num_verify_steps": 0}


def test_speedups_against_no_spec_cell():
    def cell(setting, conc, seed, tput):
        return {"setting": setting, "concurrency": conc, "seed": seed, "metrics": {"output_throughput": tput}}

    cells = M.attach_speedups([cell("none", 4, 0, 100.0), cell("chain:3:1:4", 4, 0, 180.0),
                               cell("chain:3:1:4", 8, 0, 300.0), cell("none", 4, 1, 50.0),
                               cell("chain:3:1:4", 4, 1, 75.0)])
    assert cells[0]["speedup"] == pytest.approx(1.0) and cells[1]["speedup"] == pytest.approx(1.8)
    assert cells[2]["speedup"] is None  # no baseline at concurrency 8
    assert cells[4]["speedup"] == pytest.approx(1.5)  # seed 1 against seed 1's baseline


# ---- settings -------------------------------------------------------------------------------------------


def test_parse_spec():
    assert parse_spec("none").spec is None and parse_spec(" None ").name == "none"
    chain = parse_spec("chain:3:1:4")
    assert chain.spec == SpecConfig(num_steps=3, topk=1, num_draft_tokens=4) and chain.label == "EAGLE-3 chain:3:1:4"
    assert parse_spec("tree:5:4:16").spec == SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
    assert [s.name for s in parse_specs(["none", "chain:3:1:4", ""])] == ["none", "chain:3:1:4"]


def test_spec_config_written_form():
    """SpecConfig.parse reads the one written form and .name / str() write it back."""
    assert SpecConfig.parse("none") is None and SpecConfig.parse(" NONE ") is None
    for text in ("chain:3:1:4", "tree:5:4:16", "chain:1:1:2"):
        spec = SpecConfig.parse(text)
        assert spec.name == str(spec) == text and SpecConfig.parse(spec.name) == spec
    assert SpecConfig.parse("tree:3:1:4").name == "chain:3:1:4"  # a tree with topk=1 is a chain
    assert f"EAGLE-3 {SpecConfig(5, 4, 16)}" == "EAGLE-3 tree:5:4:16"
    with pytest.raises(ValueError, match="none, chain:num_steps:topk:num_draft_tokens"):
        SpecConfig.parse("3,1,4")


@pytest.mark.parametrize("bad, msg", [
    ("beam:3:1:4", "unknown speculation setting"),
    ("chain:3:1", "needs 3 numbers"),
    ("chain:3:x:4", "non-integer"),
    ("chain:3:2:4", "a chain has topk=1"),
    ("chain:3:1:5", "num_draft_tokens=4"),
    ("tree:2:2:16", "exceeds"),
])
def test_parse_spec_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        parse_spec(bad)


def test_parse_specs_errors():
    with pytest.raises(ValueError, match="more than once"):
        parse_specs(["none", "chain:3:1:4", "none"])
    with pytest.raises(ValueError, match="at least one"):
        parse_specs([])


# ---- workloads -------------------------------------------------------------------------------------------


def test_scaled_shapes():
    assert W.scaled_shape("1k1k", 1 / 16) == (64, 64)
    assert W.scaled_shape("1k8k", 1 / 16) == (64, 512)
    assert W.scaled_shape("8k1k", 1 / 16) == (512, 64)
    assert W.scaled_shape("1k1k") == (1024, 1024)
    with pytest.raises(ValueError, match="unknown shape"):
        W.scaled_shape("2k2k", 1.0)
    with pytest.raises(ValueError, match="scale"):
        W.scaled_shape("1k1k", 0.0)


def test_random_workload_lengths_range_and_seeds():
    wl = W.random_workload("1k1k", scale=1 / 16, vocab_size=512, special_ids={0, 1, 2}, max_seq_len=512)
    prompts = wl.prompts(20, seed=0)
    assert wl.output_len == 64 and len(prompts) == 20 and all(len(p) == 64 for p in prompts)
    flat = np.asarray(prompts)
    assert flat.min() >= 3 and flat.max() < 512  # special ids 0..2 never drawn
    assert wl.prompts(20, seed=0) == prompts  # deterministic
    assert wl.prompts(20, seed=1) != prompts
    assert wl.prompts(20, seed=0, stream=W.WARMUP) != prompts  # warm-ups are other prompts
    assert wl.max_total_len == 128


def test_random_workload_for_tokenizer_excludes_special_ids():
    tok = load_tokenizer(KIMI)
    assert W.special_token_ids(tok) >= {0, 1, 2}
    wl = W.random_workload_for("1k1k", scale=1 / 16, tokenizer=tok, model_vocab_size=10_000, max_seq_len=512)
    assert wl.info["vocab_size"] == tok.vocab_size  # capped by what the tokenizer knows


def test_workload_too_long_errors():
    with pytest.raises(ValueError, match="max_seq_len=512"):
        W.random_workload("8k1k", scale=1 / 16, vocab_size=512, special_ids=(), max_seq_len=512)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        W.dataset_workload("mt_bench", tokenizer_dir=KIMI, output_len=4, max_seq_len=8)


def templated_tokenizer(tmp_path, template: str):
    """kimi-mini's tokenizer in a folder of its own with `template` as its chat template, so the
    rendering is visible in the token ids: (folder, tokenizer)."""
    tdir = tmp_path / "tok"
    tdir.mkdir()
    shutil.copy(os.path.join(KIMI, "tokenizer.json"), tdir / "tokenizer.json")
    with open(os.path.join(KIMI, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    tcfg["chat_template"] = template
    (tdir / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return tdir, load_tokenizer(tdir, bos_id=1)


def test_dataset_workload_rendered_and_tokenized(tmp_path):
    tdir, tok = templated_tokenizer(tmp_path, "{{ bos_token }}USER: {{ messages[0]['content'] }} ASSISTANT:")
    wl = W.dataset_workload("gsm8k", tokenizer_dir=tdir, output_len=16, max_seq_len=512, tokenizer=tok, limit=10)
    texts = load_prompts(os.path.join(ROOT, "data", "gsm8k", "test.jsonl"), 10)
    rendered = [render_prompt(t, tdir) for t in texts]
    assert rendered[0] == f"<s>USER: {texts[0]} ASSISTANT:"
    expected = [[1] + tok.encode(r[len("<s>"):], add_bos=False) for r in rendered]
    assert sorted(map(tuple, expected)) == sorted(wl.pool)
    assert all(p[0] == 1 and p[1] != 1 for p in wl.pool)  # BOS exactly once, though the template writes it
    assert tok.decode(wl.pool[0]).startswith("USER:") and tok.decode(wl.pool[0]).endswith("ASSISTANT:")
    assert wl.info["num_records"] == 10 and wl.info["num_skipped_too_long"] == 0
    assert wl.prompts(25, seed=3) == wl.prompts(25, seed=3)  # cycles through the 10, reproducibly
    assert sorted(map(tuple, wl.prompts(10, seed=3))) == sorted(wl.pool)


@pytest.mark.parametrize("name", sorted(W.DATASETS))
def test_bundled_datasets_load(name):
    wl = W.dataset_workload(name, tokenizer_dir=KIMI, output_len=32, max_seq_len=512, limit=20)
    assert wl.info["num_prompts_fitting"] >= 1 and all(len(p) + 32 <= 512 for p in wl.pool)
    assert all(p[0] == 1 and p[1] != 1 for p in wl.pool)  # no chat template: BOS + the text
    assert wl.info["num_prompts_fitting"] + wl.info["num_skipped_too_long"] == wl.info["num_records"]


# ---- report --------------------------------------------------------------------------------------------


def _cells() -> list[dict]:
    none, chain = parse_spec("none"), parse_spec("chain:3:1:4")
    cells = []
    for conc, scale in ((1, 1.0), (4, 0.5)):
        recs = _records()[:2]
        cells.append(make_cell(none, conc, 0, recs, 0.5 * scale * 2, num_warmups=2 * conc, num_devices=1,
                               with_acceptance=True))
        cells.append(make_cell(chain, conc, 0, recs, 0.5 * scale, num_warmups=2 * conc, num_devices=1,
                               with_acceptance=True))
    for c in cells:
        c["outputs_digest"] = outputs_digest([[1, 2]])
    return mark_identical(M.attach_speedups(cells))


def test_report_files(tmp_path):
    report = R.build_report(_cells(), settings=["none", "chain:3:1:4"],
                            workload={"kind": "random", "shape": "1k1k", "scale": 0.0625, "input_len": 64,
                                      "output_len": 64},
                            config={"num_prompts": None, "num_warmups": None, "seeds": [0], "temperature": 0.0},
                            argv=["scripts/bench.py", "--concurrency=1,4"])
    paths = R.write_report(report, tmp_path / "out", "run")
    with open(paths["json"]) as f:
        data = json.load(f)
    assert data["command"] == "scripts/bench.py --concurrency=1,4" and data["machine"]["cpu_count"] == os.cpu_count()
    assert len(data["cells"]) == 4 and len(data["rows"]) == 4
    table = R.markdown_table(report)
    lines = table.splitlines()
    assert lines[0] == ("| concurrency | no-spec tok/s | EAGLE-3 chain:3:1:4 tok/s (speedup) | no-spec TPOT (ms) "
                        "| chain:3:1:4 TPOT (ms) | chain:3:1:4 tau |")
    # these test cells time a handful of requests: their figures carry the too-few mark
    assert lines[2] == "| 1 | 6.0 * | 12.0 (2.00x) * | 100.00 | 100.00 | 1.33 |"
    assert lines[3].startswith("| 4 | 12.0 * | 24.0 (2.00x) * |")
    with open(paths["md"]) as f:
        md = f.read()
    assert table in md and "identical to no-spec: yes" in md
    for key in ("throughput", "tpot"):
        with open(paths[key], "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
    title = R.plot_title(dict(report, config=dict(report["config"], target="checkpoints/kimi-mini",
                                                  draft="checkpoints/kimi-mini-eagle3")))
    assert title.startswith("kimi-mini + kimi-mini-eagle3 on cpu x") and "64 in / 64 out" in title


# ---- the drivers, on stand-ins ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Delta:
    request_id: str
    token_ids: list
    time: float
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None


class _FakeScheduler:
    """Emits up to 3 tokens (the prompt's first id) per running request per step, max_num_seqs at once."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs, self.reqs, self.order, self.peak = max_num_seqs, {}, [], 0
        self.ahead = False  # a step launched ahead, read by the next step() (as with overlap)

    def add_request(self, prompt, sampling, request_id):
        assert request_id not in self.reqs
        self.reqs[request_id] = [prompt[0], sampling.max_tokens, []]
        self.order.append(request_id)
        self.peak = max(self.peak, sum(len(r[2]) < r[1] for r in self.reqs.values()))
        return request_id

    def has_unfinished(self):
        return self.ahead or any(len(r[2]) < r[1] for r in self.reqs.values())

    def stats(self):
        return {"num_preemptions": 0}

    def step(self):
        import time

        out = []
        running = [r for r in self.order if len(self.reqs[r][2]) < self.reqs[r][1]][: self.max_num_seqs]
        self.ahead = bool(running)
        for rid in running:
            tok, budget, got = self.reqs[rid]
            new = [tok] * min(3, budget - len(got))
            got += new
            done = len(got) == budget
            output = RequestOutput(list(got), "length", {"accept_lengths": [3] * (len(got) // 3)}) if done else None
            out.append(_Delta(rid, new, time.perf_counter(), done, "length" if done else None, output))
        return out


def test_drive_keeps_concurrency_and_records_deltas():
    sched = _FakeScheduler(max_num_seqs=64)
    prompts = [[i + 5] for i in range(7)]
    records, duration = drive(sched, prompts, lambda i: SamplingParams(max_tokens=7), 2, tag="t")
    assert sched.peak == 2 and duration > 0
    assert not sched.has_unfinished()  # the step launched ahead was read too, not left for the next drive
    assert [r.num_output_tokens for r in records] == [7] * 7
    assert [r.token_ids for r in records] == [[i + 5] * 7 for i in range(7)]
    assert all(r.delta_tokens == [3, 3, 1] and len(r.delta_times) == 3 for r in records)
    check_lengths(records, 7, "fake")
    with pytest.raises(RuntimeError, match="exactly 8"):
        check_lengths(records, 8, "fake")


def test_settings_order_rotates_between_blocks():
    from eagle3_jax.bench.runner import rotated

    assert [rotated("abc", k) for k in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_run_config_defaults_and_errors():
    cfg = RunConfig(concurrencies=(4, 8))
    assert (cfg.prompts_for(4), cfg.warmups_for(8)) == (40, 16)
    floors = RunConfig(concurrencies=(1, 64), min_prompts=64, min_warmups=16)
    assert [floors.prompts_for(c) for c in (1, 64)] == [64, 640] and [floors.warmups_for(c) for c in (1, 64)] == [16, 128]
    assert RunConfig(concurrencies=(1,), num_prompts=5, min_prompts=64).prompts_for(1) == 5  # an explicit count wins
    with pytest.raises(ValueError, match="concurrencies"):
        RunConfig(concurrencies=(0,))
    with pytest.raises(ValueError, match="min_warmups"):
        RunConfig(concurrencies=(1,), min_warmups=-1)
    with pytest.raises(ValueError, match="apply to sampled requests"):  # top-p / top-k of greedy requests: no effect
        RunConfig(concurrencies=(1,), top_p=0.9)
    with pytest.raises(ValueError, match="top_p"):
        RunConfig(concurrencies=(1,), temperature=0.8, top_p=1.5)
    sp = sampling_for(RunConfig(concurrencies=(1,), temperature=0.8, top_p=0.95, top_k=40), 16, 0, 3)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.8, 0.95, 40, 16)


def test_repeated_passes_report_the_median_pass(monkeypatch):
    """With repeats, every setting runs each measured pass in turn (warm-ups before the first
    only, the order rotated again per pass) and each cell is its median pass by throughput."""
    from eagle3_jax.bench import runner

    with pytest.raises(ValueError, match="repeats"):
        RunConfig(concurrencies=(1,), repeats=0)
    throughput = {"none": [100.0, 90.0, 130.0], "chain:3:1:4": [150.0, 200.0, 120.0]}
    runs = []

    def fake_cell(sched, setting, workload, c, seed, cfg, *, num_devices, warm_up=True, repeat=0):
        runs.append((setting.name, repeat, warm_up))
        tp = throughput[setting.name][repeat]
        return {"setting": setting.name, "label": setting.label, "concurrency": c, "seed": seed,
                "metrics": {"output_throughput": tp, "tpot_ms": {"mean": 1e3 / tp}}, "measure_attempts": 1}

    monkeypatch.setattr(runner, "run_cell", fake_cell)
    monkeypatch.setattr(runner, "make_scheduler", lambda *a, **k: None)
    wl = W.random_workload("1k1k", scale=1 / 128, vocab_size=512, special_ids={0}, max_seq_len=512)
    cfg = RunConfig(concurrencies=(2,), repeats=3, progress=False, synthetic_acceptance=(0.9,))
    cells = runner.run_benchmark(None, object(), parse_specs(["none", "chain:3:1:4"]), wl, cfg,
                                 max_seq_len=512, num_devices=1, log=lambda s: None)
    assert runs == [("none", 0, True), ("chain:3:1:4", 0, True), ("chain:3:1:4", 1, False), ("none", 1, False),
                    ("none", 2, False), ("chain:3:1:4", 2, False)]
    none, chain = cells
    assert none["metrics"]["output_throughput"] == 100.0 and chain["metrics"]["output_throughput"] == 150.0
    assert none["passes_output_throughput"] == [100.0, 90.0, 130.0] and none["passes_run_position"] == [0, 1, 0]
    assert chain["speedup"] == pytest.approx(1.5) and chain["repeats"] == 3
    assert runner.median_pass(cells[:1] * 2)["metrics"]["output_throughput"] == 100.0  # a lone or even count
    assert any("median of 3 measured passes" in line for line in R._repeats_note(3)) and not R._repeats_note(1)


def test_synthetic_acceptance_reaches_every_request_and_the_report():
    """A forced profile is validated, set on every request (in-process and over HTTP), keeps the
    outputs from being compared with no-spec's, and heads the report."""
    from eagle3_jax.bench.runner import sampling_for

    with pytest.raises(ValueError, match="cannot increase"):
        RunConfig(concurrencies=(1,), synthetic_acceptance=(0.5, 0.9))
    cfg = RunConfig(concurrencies=(1,), synthetic_acceptance=(0.9, 0.5))
    assert sampling_for(cfg, 8, 0, 3).synthetic_acceptance == (0.9, 0.5) and not cfg.compares_outputs
    assert RunConfig(concurrencies=(1,)).compares_outputs
    body = completion_payload([1], output_len=2, temperature=0.0, seed=0, model=None, synthetic_acceptance=(0.9, 0.5))
    assert body["synthetic_acceptance"] == [0.9, 0.5]
    report = R.build_report(_cells(), settings=["none", "chain:3:1:4"],
                            workload={"kind": "random", "shape": "1k1k", "scale": 0.0625, "input_len": 64,
                                      "output_len": 64},
                            config={"num_prompts": None, "num_warmups": None, "seeds": [0], "temperature": 0.0,
                                    "synthetic_acceptance": [0.9, 0.5]})
    assert R.markdown(report).startswith("**Synthetic acceptance** (0.9, 0.5 per draft position, tau 2.40")
    assert "SYNTHETIC acceptance 0.9,0.5" in R.plot_title(report)


def test_sse_parsing_and_payload():
    assert parse_sse_line(b"data: [DONE]\n") == "[DONE]"
    assert parse_sse_line(b": keep-alive\n") is None and parse_sse_line(b"\n") is None
    assert parse_sse_line(b'data: {"choices": []}\n') == {"choices": []}
    with pytest.raises(ValueError, match="not JSON"):
        parse_sse_line(b"data: {oops\n")
    body = completion_payload([1, 2], output_len=5, temperature=0.0, seed=3, model=None)
    assert body == {"prompt": [1, 2], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
    body = completion_payload([1, 2], output_len=5, temperature=0.8, seed=3, model=None, top_p=0.95, top_k=40)
    assert (body["seed"], body["top_p"], body["top_k"]) == (3, 0.95, 40)
    assert "top_p" not in completion_payload([1], output_len=1, temperature=0.8, seed=0, model=None)


def test_acceptance_from_server_metrics():
    from eagle3_jax.bench.http_client import acceptance_between, parse_prometheus

    def scrape(steps, accepted, rates):
        lines = ["# HELP eagle3_decode_steps_total Verify passes.", f"eagle3_decode_steps_total {steps}",
                 f"eagle3_accepted_tokens_total {accepted}"]
        lines += [f'eagle3_spec_acceptance_rate{{position="{k}"}} {r!r}' for k, r in enumerate(rates, 1)]
        return parse_prometheus("\n".join(lines) + "\n")

    before = scrape(10, 25, [0.8, 0.5, 0.2])  # counts 8, 5, 2
    after = scrape(30, 85, [0.9, 0.6, 0.3])  # counts 27, 18, 9: 20 new steps with 19, 13, 7 acceptances
    acc = acceptance_between(before, after)
    assert acc["tau"] == pytest.approx(3.0) and acc["num_verify_steps"] == 20
    assert acc["per_position"] == pytest.approx([19 / 20, 13 / 20, 7 / 20])
    assert acceptance_between(before, before) is None and acceptance_between({}, after) is None


def test_acceptance_from_vllm_metrics():
    """vLLM's spec-decode counters, as vLLM 0.32's /metrics writes them (one engine, its model label)."""
    from eagle3_jax.bench.http_client import acceptance_between, parse_prometheus

    def scrape(drafts, per_position):
        labels = 'engine="0",model_name="/m"'
        lines = ["# TYPE vllm:spec_decode_num_drafts counter", f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
                 "# TYPE vllm:spec_decode_num_accepted_tokens counter",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {sum(per_position)}",
                 "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{k}"}} {n}'
                  for k, n in enumerate(per_position)]
        return parse_prometheus("\n".join(lines) + "\n")

    before, after = scrape(100, [60, 30, 10]), scrape(300, [200, 90, 40])  # 200 drafts: 140, 60, 30 accepted
    acc = acceptance_between(before, after)
    assert acc["tau"] == pytest.approx(1 + 230 / 200) and acc["num_verify_steps"] == 200
    assert acc["per_position"] == pytest.approx([0.7, 0.3, 0.15]) and acc["source"] == "vLLM /metrics"
    assert acceptance_between(before, before) is None


def test_http_driver_against_a_stub_server():
    from aiohttp import web

    seen, active = [], [0, 0]  # bodies; [in flight now, peak]

    async def completions(request):
        body = await request.json()
        seen.append(body)
        active[0] += 1
        active[1] = max(active)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(0, n, 2):  # chunks of 2 tokens' text
            await asyncio.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": "ab", "finish_reason": "length" if i + 2 >= n else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        active[0] -= 1
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            bodies = [completion_payload([7] * (i + 1), output_len=6, temperature=0.0, seed=0, model="m")
                      for i in range(5)]
            return await run_requests(f"http://127.0.0.1:{port}", bodies, 2)
        finally:
            await runner.cleanup()

    records, duration = asyncio.run(main())
    assert active[1] <= 2 and len(seen) == 5 and all(b["ignore_eos"] and b["model"] == "m" for b in seen)
    assert all(r.error is None for r in records), [r.error for r in records]
    assert [r.prompt_len for r in records] == [1, 2, 3, 4, 5]
    assert all(r.num_output_tokens == 6 and len(r.delta_times) == 3 and r.finish_reason == "length" for r in records)
    s = M.summarize(records, duration)
    assert s["itl_ms"]["count"] == 10 and s["output_throughput"] == pytest.approx(30 / duration)


# ---- scripts/bench.py's choices (bench.flag_checks, bench.serving_run) --------------------------------------


def test_bench_flag_values():
    assert flag_checks.int_list(["4", "1", "16"], "concurrency", 1) == (4, 1, 16)
    assert flag_checks.int_list(["0"], "seeds", 0) == (0,)
    for values, lo, words in ((["a"], 1, "--concurrency must be a comma-separated list of integers; got 'a'"),
                              (["0", "2"], 1, "--concurrency needs integers >= 1; got '0,2'"),
                              ([], 0, "--concurrency needs integers >= 0; got ''"),
                              (["2", "2"], 1, "--concurrency lists a value more than once: '2,2'")):
        with pytest.raises(ValueError) as e:
            flag_checks.int_list(values, "concurrency", lo)
        assert str(e.value) == words
    assert flag_checks.rates(None) is None and flag_checks.rates(["0.9", "0.5"]) == (0.9, 0.5)
    with pytest.raises(ValueError, match="--synthetic_acceptance must be comma-separated numbers; got '0.9,x'"):
        flag_checks.rates(["0.9", "x"])
    for good in (None, "run", "run.v2"):
        flag_checks.check_file_stem(good)
    for bad in ("", ".", "..", os.path.join("a", "b")):
        with pytest.raises(ValueError, match="--name is a file stem"):
            flag_checks.check_file_stem(bad)


def test_bench_run_choices():
    none, chain = parse_specs(["none", "chain:3:1:4"])
    S.check_server_choices([none, chain], None, True)  # in-process: any settings, a mesh
    S.check_server_choices([chain], "http://h:8000", False)
    with pytest.raises(ValueError, match="names the one setting the server runs"):
        S.check_server_choices([none, chain], "http://h:8000", False)
    with pytest.raises(ValueError, match="--mesh and --distributed are for the in-process model"):
        S.check_server_choices([chain], "http://h:8000", True)
    for workload in ("random", "mt_bench", "mt_bench_multiturn", "agentic"):
        S.check_workload_choice(workload, None)
    S.check_workload_choice("gsm8k", "http://h:8000")
    with pytest.raises(ValueError, match="random or one of mt_bench, gsm8k, sharegpt, spec_bench, "
                                         "mt_bench_multiturn, agentic; got 'nope'"):
        S.check_workload_choice("nope", None)
    for workload in ("mt_bench_multiturn", "agentic"):
        with pytest.raises(ValueError, match="drop --base_url"):
            S.check_workload_choice(workload, "http://h:8000")
    forced = RunConfig(concurrencies=(1,), synthetic_acceptance=(0.9,))
    S.check_synthetic_acceptance(forced, [none, chain])
    S.check_synthetic_acceptance(RunConfig(concurrencies=(1,)), [none])
    with pytest.raises(ValueError, match="add a speculative --spec"):
        S.check_synthetic_acceptance(forced, [none])


def test_bench_default_name_and_short_cells():
    wl = W.random_workload("1k1k", scale=1 / 16, vocab_size=512, special_ids={0}, max_seq_len=512)
    assert S.default_name("checkpoints/kimi-mini/", wl) == "kimi-mini_random-1k1k_x0.0625"
    dataset = W.Workload(name="mt_bench", output_len=128, info={"kind": "dataset"}, pool=((1, 2),))
    assert S.default_name("/m/Kimi", dataset, over_http=True) == "Kimi_mt_bench_out128_http"
    assert S.too_few_requests_warning(RunConfig(concurrencies=(1, 4))) is None  # 10 and 40 requests
    line = S.too_few_requests_warning(RunConfig(concurrencies=(1, 4, 8), num_prompts=12))
    assert line.startswith("too few requests to time (12 at concurrency 4, 12 at concurrency 8; fewer than 5 per "
                           "concurrent client or 10 in all)")
    assert line.endswith("give --num_prompts=40 (or --min_prompts=40) to time them")


def test_bench_workload_choice_and_record_config():
    tok = load_tokenizer(KIMI)

    def no_target():
        raise AssertionError("only a multi-turn workload loads the target")

    common = dict(shape="1k1k", scale=1 / 16, output_len=16, data_dir=None, tokenizer=tok, template_dir=KIMI,
                  model_vocab_size=10_000, max_seq_len=512, load_target=no_target)
    wl, target = S.load_workload("random", **common)
    assert target is None and wl.info["kind"] == "random" and wl.max_total_len == 128
    wl, target = S.load_workload("sharegpt", **common)
    assert target is None and wl.name == "sharegpt" and wl.output_len == 16
    with pytest.raises(FileNotFoundError, match="dataset file"):
        S.load_workload("mt_bench", **{**common, "data_dir": "/no/data"})
    cfg = RunConfig(concurrencies=(2,), seeds=(0, 1))
    config = S.run_record_config(cfg, dtype="bfloat16", limit=512, page_size=None, prefill_chunk=64, target="t")
    assert config["concurrencies"] == (2,) and config["seeds"] == (0, 1)
    assert list(config)[-5:] == ["dtype", "max_seq_len_limit", "page_size", "prefill_chunk", "target"]
    assert (config["dtype"], config["max_seq_len_limit"], config["prefill_chunk"]) == ("bfloat16", 512, 64)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(kernels="xla", batch_invariant=False))
    mesh = types.SimpleNamespace(devices=np.zeros((1, 2, 4)))
    assert S.in_process_config(fake, mesh, draft="d", scheduler_max_seq_len=80, overlap=False,
                               prefix_caching=True) == {
        "mesh": [1, 2, 4], "kernels": "xla", "batch_invariant": False, "draft": "d", "scheduler_max_seq_len": 80,
        "overlap": False, "prefix_caching": True, "kv_cache_dtype": "auto", "host_kv_cache_gb": 0.0}


def test_bench_runs_in_process_and_over_http(monkeypatch):
    calls = []
    monkeypatch.setattr(S, "run_benchmark", lambda *args, **kw: calls.append(("in-process", args, kw)) or ["cell"])
    monkeypatch.setattr(S, "run_http_benchmark", lambda *args, **kw: calls.append(("http", args, kw)) or ["c"])
    fake = types.SimpleNamespace(config=types.SimpleNamespace(kernels="xla", batch_invariant=True))
    wl = W.random_workload("1k1k", scale=1 / 16, vocab_size=512, special_ids={0}, max_seq_len=512)
    cfg, config = RunConfig(concurrencies=(1,)), {"dtype": "float32", "target": "t"}
    none, chain = parse_specs(["none", "chain:3:1:4"])
    drafts = []
    common = dict(target=None, load_target=lambda: fake, load_draft=lambda t: drafts.append(t) or "draft",
                  draft_path="d", mesh=None, max_seq_len=None, page_size=16, prefill_chunk=None, num_devices=None,
                  overlap=True, prefix_caching=False)
    run = S.run_in_process([none], wl, cfg, config, **common)
    assert run.cells == ["cell"] and run.mode == "in-process" and drafts == []  # no speculative setting: no draft
    assert run.config == {"dtype": "float32", "target": "t", "mesh": None, "kernels": "xla", "batch_invariant": True,
                          "draft": None, "scheduler_max_seq_len": 128, "overlap": True, "prefix_caching": False,
                          "kv_cache_dtype": "auto", "host_kv_cache_gb": 0.0, "num_pages": None}
    (_, args, kw), = calls
    assert args[:2] == (fake, None) and kw["max_seq_len"] == 128 and kw["page_size"] == 16
    run = S.run_in_process([none, chain], wl, cfg, config, **{**common, "max_seq_len": 200})
    assert drafts == [fake] and calls[-1][1][1] == "draft" and calls[-1][2]["max_seq_len"] == 200
    assert run.config["draft"] == "d" and run.config["scheduler_max_seq_len"] == 200
    run = S.run_over_http("http://h:8000", chain, wl, cfg, config, model=None, num_devices=None)
    assert run.cells == ["c"] and run.mode == "HTTP http://h:8000" and run.config == {"dtype": None, "target": "t"}
    assert calls[-1][1][0] == "http://h:8000" and calls[-1][2] == {"model": None, "num_devices": 1}
    assert config == {"dtype": "float32", "target": "t"}  # the caller's config is left as it was


# ---- end to end on the bundled demo pair -------------------------------------------------------------------


def test_end_to_end_in_process_demo_pair():
    import eagle3_jax as e3
    from eagle3_jax.bench.runner import run_benchmark

    target = e3.load_target(KIMI, dtype="float32")
    draft = e3.load_draft(KIMI_DRAFT, target=target, dtype="float32")
    wl = W.random_workload("1k1k", scale=1 / 128, vocab_size=target.config.vocab_size, special_ids={0, 1, 2},
                           max_seq_len=512)  # 8 in / 8 out
    cfg = RunConfig(concurrencies=(2,), num_prompts=5, num_warmups=2, progress=False)
    cells = run_benchmark(target, draft, parse_specs(["chain:3:1:4", "none"]), wl, cfg,
                          max_seq_len=wl.max_total_len, log=lambda s: None)
    assert [c["setting"] for c in cells] == ["none", "chain:3:1:4"]  # baseline first
    assert [c["run_position"] for c in cells] == [0, 1]  # the first block runs in table order
    none, chain = cells
    for c in cells:
        m = c["metrics"]
        assert m["num_completed"] == 5 and m["total_output_tokens"] == 5 * 8
        assert m["output_throughput"] > 0 and m["tpot_ms"]["count"] == 5
    assert chain["outputs_digest"] == none["outputs_digest"] and chain["identical_to_no_spec"] is True
    assert none["speedup"] == pytest.approx(1.0) and chain["speedup"] > 0
    acc = chain["metrics"]["acceptance"]
    assert 1.0 <= acc["tau"] <= 4.0 and len(acc["per_position"]) == 3


def test_multiturn_workload_plays_the_targets_own_answers(tmp_path):
    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler

    tdir, tok = templated_tokenizer(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
                                              "{{ m['content'] }}\n{% endfor %}assistant:")
    target = e3.load_target(KIMI)
    wl = W.multiturn_workload("mt_bench_multiturn", target=target, tokenizer_dir=tdir, output_len=8,
                              max_seq_len=512, tokenizer=tok, limit=3)
    sessions = W.load_turns(os.path.join(ROOT, "data", "mt_bench", "question.jsonl"), 3)
    assert len(sessions) == 3 and wl.info["num_second_turns"] == 3 and len(wl.pool) == 6
    texts = sorted(tok.decode(p) for p in wl.pool)
    first = tok.encode(f"user: {sessions[0][0]}\nassistant:", add_bos=True)
    answer = Scheduler(target, max_num_seqs=1, max_seq_len=512).generate(
        [first], SamplingParams(max_tokens=8, stop_token_ids=tok.eos_ids))[0]
    reply = tok.decode_continuation(first, answer.token_ids)
    second = f"user: {sessions[0][0]}\nassistant: {reply}\nuser: {sessions[0][1]}\nassistant:"
    assert any(t.endswith(second) for t in texts)  # the history a chat client sends back
    assert sum(t.count("user:") == 1 for t in texts) == 3  # and the three first turns
    with pytest.raises(ValueError, match="max_seq_len"):
        W.multiturn_workload("mt_bench_multiturn", target=target, tokenizer_dir=tdir, output_len=8,
                             max_seq_len=24, tokenizer=tok, limit=3)
    with pytest.raises(ValueError, match="chat template"):
        W.multiturn_workload("mt_bench_multiturn", target=target, tokenizer_dir=tmp_path, output_len=8,
                             max_seq_len=512, tokenizer=tok, limit=3)


def test_agentic_workload_grows_each_session_by_its_answer_and_a_tool_result(tmp_path):
    import eagle3_jax as e3

    tdir, tok = templated_tokenizer(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
                                              "{{ m['content'] }}\n{% endfor %}assistant:")
    target = e3.load_target(KIMI)
    wl = W.agentic_workload(target=target, tokenizer_dir=tdir, output_len=8, max_seq_len=512, tokenizer=tok,
                            sessions=3, turns=3, tool_tokens=40)
    assert wl.info["turns"] == 3 and len(wl.pool) == 9 and wl.ordered
    by_turn = [wl.pool[3 * t: 3 * t + 3] for t in range(3)]
    for earlier, later in zip(by_turn, by_turn[1:]):
        for a, b in zip(earlier, later):  # the same session: its earlier prompt, then answer and tool result
            assert b[: len(a) - 1] == a[: len(a) - 1] and len(b) > len(a) + 40
            assert tok.decode(b).count("Tool result:") == tok.decode(a).count("Tool result:") + 1
    assert wl.prompts(4, seed=0) == wl.prompts(4, seed=5) == [list(p) for p in wl.pool[:4]]  # played in order
    short = W.agentic_workload(target=target, tokenizer_dir=tdir, output_len=8, max_seq_len=200, tokenizer=tok,
                               sessions=2, turns=4, tool_tokens=80)
    assert short.info["turns"] < 4 and all(len(p) + 8 <= 200 for p in short.pool)  # sessions stop where they no longer fit


# ---- optional dependencies (pip extras) ---------------------------------------------------------------------

EXTRAS_MODULES = ("optax", "matplotlib", "aiohttp", "prometheus_client")


def test_require_names_the_extra(tmp_path, monkeypatch):
    assert require("json", "bench", "x") is json
    with pytest.raises(MissingExtraError, match=r"^plotting needs no_such_mod, which is not installed: "
                                                r"pip install 'eagle3-jax\[bench\]'$"):
        require("no_such_mod.pyplot", "bench", "plotting")
    (tmp_path / "broken_extra_mod.py").write_text("import no_such_inner_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:  # an installed module that fails inside keeps its error
        require("broken_extra_mod", "bench", "x")
    assert not isinstance(info.value, MissingExtraError)


def run_without_extras(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Python with the extras' modules unimportable, as in an install without them (`pip install -e .`)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nfor m in {EXTRAS_MODULES!r}:\n    sys.modules[m] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]), XLA_FLAGS="")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_library_and_entry_points_without_the_extras(tmp_path):
    r = run_without_extras(tmp_path, "-c", "import sys, eagle3_jax, eagle3_jax.engine, eagle3_jax.text.chat_template, "
                           "eagle3_jax.bench, eagle3_jax.bench.gsm8k, eagle3_jax.bench.http_client, "
                           "eagle3_jax.bench.report, eagle3_jax.train; "
                           f"print([m for m in {EXTRAS_MODULES!r} if sys.modules.get(m) is not None])")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-3000:]
    cases = [(("scripts/bench.py", f"--target={KIMI}"), "plotting benchmark results needs matplotlib", "bench"),
             (("scripts/train_target.py", "--config=/no/config.json", "--corpus=/no/c.npy", "--out=/tmp/never"),
              "training needs optax", "train")]
    for args, words, extra in cases:
        r = run_without_extras(tmp_path, *args)
        script = os.path.basename(args[0])
        assert r.returncode == 2 and r.stderr.strip() == (f"{script}: error: {words}, which is not installed: "
                                                          f"pip install 'eagle3-jax[{extra}]'"), r.stderr[-3000:]


def _bench_host(tmp_path, *flags: str) -> tuple:
    """scripts/bench_host.py on the demo target, plain decoding, a few short requests -> (the
    finished process, its JSON record)."""
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, "scripts/bench_host.py", f"--target={KIMI}", "--spec=none", "--warmup=4",
                        "--min_tokens=3", "--max_tokens=6", *flags, f"--json_out={out}"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=""), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(out.read_text())


def test_host_time_script_reports_its_phases(tmp_path):
    """scripts/bench_host.py on the demo target: host ms per iteration, the launches' share and,
    with --phases, each phase's host ms, all recorded in its JSON."""
    r, record = _bench_host(tmp_path, "--num_seqs=2", "--iterations=6", "--phases")
    (row,) = record["rows"]
    assert row["spec"] == "none" and row["num_seqs"] == 2 and row["iterations"] >= 1
    assert row["host_ms_per_iteration"] > 0 and 0 < row["launch_ms_per_iteration"] <= row["host_ms_mean"] * 6
    assert 0 < row["launch_floor_ms"] < row["launch_ms_per_iteration"] * 10
    assert row["launch_floor_cold_ms"] > 0 and "| cold floor ms |" in r.stdout
    assert row["step_relaunch_ms"] > 0 and "| a step's launch after its program ms |" in r.stdout
    assert 0 < row["host_cpu_ms_per_iteration"] < 2 * (row["host_ms_per_iteration"] + row["device_wait_ms_per_iteration"])
    phases = row["phases_ms_per_iteration"]
    assert phases["decode launch"] > 0 and phases["collect decode"] > 0 and phases["  jitted calls (launches)"] > 0
    assert phases["outputs read (device wait)"] > 0
    assert "| phase (host ms / iteration, median) | none x2 |" in r.stdout and "| admission |" in r.stdout


def test_host_time_script_with_a_stand_in_device(tmp_path):
    """scripts/bench_host.py --stand_in_device: the speculative steps answered at once with random
    tokens; the requests still run to their budgets and no program is launched."""
    r, record = _bench_host(tmp_path, "--num_seqs=3", "--iterations=8", "--stand_in_device", "--spec=chain:3:1:4",
                            f"--draft={KIMI_DRAFT}")
    (row,) = record["rows"]
    assert record["stand_in_device"] and row["spec"] == "chain:3:1:4" and row["iterations"] == 8
    assert row["launch_ms_per_iteration"] == 0 and row["host_ms_per_iteration"] > 0 and row["step_relaunch_ms"] is None
    assert 1 < row["tokens_per_iteration"] <= 3 * 4  # 1 to 4 tokens a row, some rows prefilling
    assert row["device_wait_ms_per_iteration"] < row["host_ms_per_iteration"] * 10


def test_host_time_script_through_the_engine(tmp_path):
    """scripts/bench_host.py --through_engine: the requests streamed through an AsyncEngine; the
    engine thread's time outside step() and its whole host time per iteration, recorded."""
    r, record = _bench_host(tmp_path, "--num_seqs=3", "--iterations=8", "--through_engine")
    (row,) = record["rows"]
    assert record["through_engine"] and row["num_seqs"] == 3 and 1 <= row["iterations"] <= 8
    assert 0 < row["engine_cpu_ms_outside_step"] and 0 < row["engine_wall_ms_outside_step"]
    assert row["host_ms_per_iteration"] > 0 and row["engine_host_ms_per_iteration"] > row["host_ms_per_iteration"] / 2
    assert "| engine thread host ms / iteration (median) |" in r.stdout
    r = subprocess.run([sys.executable, "scripts/bench_host.py", "--through_engine", "--phases"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=""), timeout=300)
    assert r.returncode == 2 and "leave them out with --through_engine" in r.stderr.strip().splitlines()[-1]


def test_serving_path_per_iteration_from_two_scrapes():
    from eagle3_jax.bench.serving_path import serving_path_between, serving_path_line

    def scrape(iterations, step, host, deliver, loop_cpu, engine_cpu):
        return {"eagle3_scheduler_iterations_total": iterations, "eagle3_engine_step_seconds_total": step,
                "eagle3_scheduler_host_seconds_total": host, "eagle3_engine_deliver_seconds_total": deliver,
                'eagle3_thread_cpu_seconds_total{thread="event_loop"}': loop_cpu,
                'eagle3_thread_cpu_seconds_total{thread="engine"}': engine_cpu}

    before, after = scrape(10, 1.0, 0.2, 0.1, 5.0, 3.0), scrape(110, 2.0, 0.5, 0.3, 6.0, 3.5)
    path = serving_path_between(before, after, duration_s=1.5, client_cpu_s=0.4)
    assert path["iterations"] == 100 and path["wall_ms"] == pytest.approx(15.0)
    assert (path["engine_step_ms"], path["scheduler_host_ms"], path["device_wait_ms"], path["deliver_ms"]) == \
        pytest.approx((10.0, 3.0, 7.0, 2.0))
    assert path["cpu_ms"] == pytest.approx({"event_loop": 10.0, "engine": 5.0, "client": 4.0})
    assert "device wait 7.00" in serving_path_line(path)
    assert serving_path_between(before, before, 1.0, 0.0) is None  # no iteration ran
    assert serving_path_between({}, {"vllm:num_requests_running": 1.0}, 1.0, 0.0) is None  # another server


def test_thread_cpu_seconds_by_role():
    import sys
    import threading
    import time

    from eagle3_jax.serving.thread_cpu import thread_cpu_seconds

    if not sys.platform.startswith("linux"):
        assert thread_cpu_seconds({}) == {}
        return
    start = time.process_time()
    while time.process_time() - start < 0.2:  # burn CPU on this thread
        pass
    seconds = thread_cpu_seconds({threading.get_native_id(): "me"})
    assert seconds["me"] >= 0.1 and all(v >= 0 for v in seconds.values())
