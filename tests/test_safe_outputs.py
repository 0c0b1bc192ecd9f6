"""Nothing a user owns is overwritten, silently resumed or silently changed.

Every writer refuses an existing output without --overwrite, and an output that is, holds or lies
in an input even with it, before any work; a refused or interrupted run leaves the old output byte
for byte as it was and no stray temporaries. Training checkpoints resume only the run that wrote
them. The scripts run as subprocesses, as a user runs them; the cases stop before any weights load
except one tiny training run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
KIMI, KIMI_DRAFT, STORIES = (os.path.join(ROOT, "checkpoints", n) for n in ("kimi-mini", "kimi-mini-eagle3", "stories260K"))
PLAN_CONFIG = os.path.join(ROOT, "tests", "data", "llama-3.1-8b-instruct.config.json")


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, f"{script}.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


def run_all(cases: list[tuple]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(lambda case: run_script(case[0], *case[1]), cases))


def assert_one_line_error(script: str, r: subprocess.CompletedProcess, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    where = f"{script}.py: rc {r.returncode}, stderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 2, where
    assert len(lines) == 1 and "Traceback" not in r.stderr, where
    assert lines[0].startswith(f"{script}.py: error: "), where
    for w in words:
        assert w in lines[0], (w, where)
    return lines[0]


def digest(path: str) -> dict[str, str]:
    """relative path -> sha256 of every file under `path` (or of `path` itself)."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": hashlib.sha256(f.read()).hexdigest()}
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def no_temporaries(folder: str) -> bool:
    return not [n for n in os.listdir(folder) if ".tmp-" in n or ".old-" in n or n.endswith(".partial")]


@pytest.fixture()
def models(tmp_path):
    """Copies of the demo target and draft (the cases must not risk the repository's own)."""
    root = tmp_path / "models"
    root.mkdir()
    for src in (KIMI, STORIES, KIMI_DRAFT):
        shutil.copytree(src, root / os.path.basename(src))
    return str(root)


# ---- every writer -----------------------------------------------------------------------------------------


def test_writers_refuse_what_they_must_not_replace(models, tmp_path):
    kimi, stories, draft = (os.path.join(models, n) for n in ("kimi-mini", "stories260K", "kimi-mini-eagle3"))
    existing = str(tmp_path / "existing.json")
    with open(existing, "w") as f:
        f.write('{"mine": true}\n')
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    (report_dir / "run.json").write_text("{}\n")
    corpus = str(tmp_path / "corpus.npy")
    np.save(corpus, np.ones((40, 16), np.int32))
    cases = [  # (script, args, words of the error line, the output that must stay as it was)
        ("quantize", (f"--src={kimi}", f"--out={kimi}", "--overwrite"), ("is the input --src",), kimi),
        ("quantize", (f"--src={kimi}", f"--out={stories}"), ("already exists", "--overwrite"), stories),
        ("quantize", (f"--src={kimi}", f"--out={kimi}/q", "--overwrite"), ("inside the input",), kimi),
        ("quantize", (f"--src={kimi}", f"--out={models}", "--overwrite"), ("contains the input",), models),
        ("convert", (f"--hf_dir={kimi}", f"--out_dir={stories}"), ("--out_dir", "already exists"), stories),
        ("convert", (f"--hf_dir={kimi}", f"--out_dir={kimi}", "--overwrite"), ("is the input --hf_dir",), kimi),
        ("train_draft", (f"--target={stories}", f"--corpus={corpus}", f"--out={draft}", "--batch_size=4"),
         ("--out", "already exists"), draft),
        ("train_target", (f"--config={kimi}/config.json", f"--corpus={corpus}", f"--out={stories}", "--batch_size=4"),
         ("--out", "already exists"), stories),
        ("plan", (f"--target={PLAN_CONFIG}", f"--json_out={existing}"), ("--json_out", "already exists"), existing),
        ("eval_gsm8k", (f"--target={kimi}", "--spec=none", f"--output={existing}"), ("--output", "already exists"),
         existing),
        ("make_corpus", (f"--model={stories}", f"--out={existing}"), ("--out", "already exists"), existing),
        ("demo", (f"--target={kimi}", f"--draft={draft}", f"--json={existing}"), ("--json", "already exists"), existing),
        ("bench_kernels", (f"--json_out={existing}",), ("--json_out", "already exists"), existing),
        ("bench_burst", (f"--json_out={existing}",), ("--json_out", "already exists"), existing),
        ("bench_startup", (f"--json_out={existing}",), ("--json_out", "already exists"), existing),
        ("bench_host_tier", (f"--json_out={existing}",), ("--json_out", "already exists"), existing),
        ("gpu_check", (f"--json_out={existing}",), ("--json_out", "already exists"), existing),
        ("compile_gate", (f"--json_out={existing}",), ("--json_out", "already exists"), existing),
        ("bench", (f"--target={kimi}", f"--draft={draft}", f"--out_dir={report_dir}", "--name=run"),
         ("run.json", "already exists"), str(report_dir)),
        ("bench", (f"--target={kimi}", f"--draft={draft}", f"--out_dir={kimi}/reports"), ("inside the input --target",), kimi),
    ]
    before = {case[3]: digest(case[3]) for case in cases}
    for case, r in zip(cases, run_all([(c[0], c[1]) for c in cases])):
        assert_one_line_error(case[0], r, *case[2])
        assert digest(case[3]) == before[case[3]], case
    assert no_temporaries(models) and no_temporaries(str(tmp_path))


def test_unwritable_output_names_the_flag_not_internals(models):
    kimi = os.path.join(models, "kimi-mini")
    r = run_script("convert", f"--hf_dir={kimi}", "--out_dir=/proc/eagle3/out")
    line = assert_one_line_error("convert", r, "--out_dir /proc/eagle3/out", "cannot write in /proc")
    assert ".partial" not in line


def test_quantize_with_overwrite_replaces_only_when_complete(models):
    kimi, stories = os.path.join(models, "kimi-mini"), os.path.join(models, "stories260K")
    src_before = digest(kimi)
    r = run_script("quantize", f"--src={kimi}", f"--out={stories}", "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "quantization_config" in json.load(open(os.path.join(stories, "config.json")))
    assert digest(kimi) == src_before and no_temporaries(models)


# ---- the mechanism, in-process ---------------------------------------------------------------------------


def test_an_interrupted_write_leaves_the_old_output(tmp_path):
    from eagle3_jax.checkpoint.atomic import atomic_output

    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.bin").write_bytes(b"old")
    for error in (KeyboardInterrupt, RuntimeError):
        with pytest.raises(error):
            with atomic_output(out, overwrite=True) as tmp:
                with open(os.path.join(tmp, "weights.bin"), "wb") as f:
                    f.write(b"half")
                raise error()
        assert (out / "weights.bin").read_bytes() == b"old"
        assert os.listdir(tmp_path) == ["out"]
    with atomic_output(out, overwrite=True) as tmp:
        with open(os.path.join(tmp, "weights.bin"), "wb") as f:
            f.write(b"new")
    assert (out / "weights.bin").read_bytes() == b"new" and os.listdir(tmp_path) == ["out"]


def test_leftovers_of_a_killed_run_are_cleaned_and_a_half_swap_undone(tmp_path):
    from eagle3_jax.checkpoint.atomic import atomic_output, clean_leftovers

    dead = 2**22 + 12345  # above pid_max's default: no such process
    out = tmp_path / "model"
    (tmp_path / f".model.tmp-{dead}-abc").mkdir()
    old = tmp_path / f".model.old-{dead}-xyz"
    old.mkdir()
    (old / "config.json").write_text("the old output")
    clean_leftovers(out)  # killed after moving the old output aside: it comes back
    assert sorted(os.listdir(tmp_path)) == ["model"] and (out / "config.json").read_text() == "the old output"
    (tmp_path / f".model.tmp-{dead}-def").mkdir()
    with atomic_output(out, overwrite=True) as tmp:
        open(os.path.join(tmp, "config.json"), "w").write("new")
    assert sorted(os.listdir(tmp_path)) == ["model"] and (out / "config.json").read_text() == "new"


def test_output_checks(tmp_path):
    from eagle3_jax.checkpoint.atomic import OutputError, check_output, write_text_output

    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty") == str(tmp_path / "empty")  # an empty folder is free to use
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x").write_text("x")
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path / "folder", overwrite=True, is_file=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_output(tmp_path / "file" / "out.json")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "folder")
    with pytest.raises(OutputError, match="is the input"):  # through a symlink too
        check_output(link, name="--out", overwrite=True, inputs={"--src": str(tmp_path / "folder")})
    path = write_text_output(tmp_path / "new" / "a.json", "{}")
    with pytest.raises(OutputError, match="already exists"):
        write_text_output(path, "[]")
    write_text_output(path, "[]", overwrite=True)
    assert open(path).read() == "[]" and os.listdir(tmp_path / "new") == ["a.json"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"


# ---- training resumes only the same run -------------------------------------------------------------------


TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=16,
                  intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)


def test_training_resumes_only_the_same_run(tmp_path):
    config, corpus, out = str(tmp_path / "config.json"), str(tmp_path / "corpus.npy"), str(tmp_path / "model")
    with open(config, "w") as f:
        json.dump(TINY_LLAMA, f)
    np.save(corpus, np.random.default_rng(0).integers(3, 64, (24, 8)).astype(np.int32))
    args = (f"--config={config}", f"--corpus={corpus}", f"--out={out}", "--batch_size=4", "--warmup_steps=1",
            "--learning_rate=0.003")
    r = run_script("train_target", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    trained = digest(out)
    # the same command again: finished, nothing retrained or rewritten
    r = run_script("train_target", *args)
    assert r.returncode == 0 and "already holds this run's model" in r.stdout, r.stderr[-3000:]
    assert digest(out) == trained
    # a record written before a flag existed (here --save_dtype, left at its default) is still this run's
    from eagle3_jax.train.run_record import RUN_FILE

    record_path = os.path.join(out + ".ckpt", RUN_FILE)
    with open(record_path) as f:
        record = json.load(f)
    del record["settings"]["--save_dtype"]
    with open(record_path, "w") as f:
        json.dump(record, f)
    for extra, says in (((), "already holds this run's model"), (("--save_dtype=float32",), "--save_dtype bfloat16 -> float32")):
        r = run_script("train_target", *args, *extra)
        assert says in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    # other settings or data: one line naming them and the ways on
    np.save(str(tmp_path / "other.npy"), np.random.default_rng(1).integers(3, 64, (24, 8)).astype(np.int32))
    cases = [
        ("train_target", (*args, "--learning_rate=0.001"), ("--learning_rate 0.003 -> 0.001", "--overwrite", "--out")),
        ("train_target", (*args, "--epochs=2"), ("--epochs 1 -> 2",)),
        ("train_target", (*args[:1], f"--corpus={tmp_path / 'other.npy'}", *args[2:]), ("the data",)),
    ]
    for (script, _, words), r in zip(cases, run_all([(c[0], c[1]) for c in cases])):
        assert_one_line_error(script, r, *words)
    assert digest(out) == trained and no_temporaries(str(tmp_path))


def test_train_target_continues_from_another_models_weights(tmp_path):
    """--init_from: a model trained further starts from that model's weights (at a learning rate too
    small to move them, the saved weights are the starting model's); weights of other sizes are
    refused in one line naming a tensor, and nothing is written."""
    from safetensors.numpy import load_file

    config, corpus = str(tmp_path / "config.json"), str(tmp_path / "corpus.npy")
    with open(config, "w") as f:
        json.dump(TINY_LLAMA, f)
    np.save(corpus, np.random.default_rng(0).integers(3, 64, (24, 8)).astype(np.int32))
    base = (f"--config={config}", f"--corpus={corpus}", "--batch_size=4", "--warmup_steps=1", "--save_dtype=float32")
    first = str(tmp_path / "first")
    assert run_script("train_target", *base, f"--out={first}").returncode == 0
    again = str(tmp_path / "again")
    r = run_script("train_target", *base, f"--init_from={first}", "--learning_rate=1e-12", f"--out={again}")
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = load_file(os.path.join(first, "model.safetensors")), load_file(os.path.join(again, "model.safetensors"))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, err_msg=name)
    wider = str(tmp_path / "wider.json")
    with open(wider, "w") as f:
        json.dump(dict(TINY_LLAMA, intermediate_size=48), f)
    other = str(tmp_path / "other")
    r = run_script("train_target", f"--config={wider}", *base[1:], f"--init_from={first}", f"--out={other}")
    assert_one_line_error("train_target", r, f"--init_from {first}", "gate_proj of shape (16, 48)", "--config's sizes")
    assert not os.path.exists(other) and not os.path.exists(other + ".ckpt")


def test_train_draft_checks_first(models, tmp_path):
    stories = os.path.join(models, "stories260K")
    binary = tmp_path / "prompts.txt"
    binary.write_bytes(b"Once upon a time\n\x89PNG\x00\x01")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"question": "caf\xe9"}\n')
    few = tmp_path / "few.txt"
    few.write_text("one\ntwo\nthree\n")
    ckpt = tmp_path / "other.ckpt"
    ckpt.mkdir()
    (ckpt / "run.json").write_text(json.dumps({"settings": {"--learning_rate": 0.5}, "data": "x", "finished": True}))
    out = str(tmp_path / "draft")
    base = (f"--target={stories}", f"--out={out}")
    cases = [
        ("train_draft", (*base, f"--prompts={few}", "--learning_rate=0"), ("--learning_rate must be > 0",)),
        ("train_draft", (*base, f"--prompts={few}", "--max_grad_norm=-1"), ("--max_grad_norm",)),
        ("train_draft", (*base, f"--prompts={binary}"), (str(binary), "offset 21")),
        ("train_draft", (*base, f"--prompts={latin}"), (str(latin), "byte 0xe9 at offset 17")),
        ("train_draft", (*base, f"--prompts={few}"), ("3 prompts", "--batch_size=16")),
        ("train_draft", (*base, f"--prompts={few}", "--draft_vocab_size=100000"), ("--draft_vocab_size=100000",)),
        ("train_draft", (*base, f"--prompts={few}", "--batch_size=1", f"--ckpt_dir={ckpt}"),
         ("another run", "--learning_rate 0.5 -> 0.001", "--overwrite")),
        ("train_draft", (f"--target={os.path.join(models, 'kimi-mini-eagle3')}", f"--out={out}", f"--prompts={few}"),
         ("is an EAGLE-3 draft",)),
        ("generate", (f"--model={stories}", f"--prompts_file={binary}"), (str(binary), "NUL byte at offset 21")),
    ]
    for (script, _, words), r in zip(cases, run_all([(c[0], c[1]) for c in cases])):
        assert_one_line_error(script, r, *words)
    assert not os.path.exists(out) and not os.path.exists(out + ".ckpt")


# ---- help, chat templates, one-liners ---------------------------------------------------------------------


def test_help_lists_the_shared_flags():
    shared = ("--spec", "--mesh", "--max_seq_len", "--kernels", "--w4a8", "--dequantize", "--batch_invariant",
              "--distributed", "--verbose")
    for script, r in zip(("generate", "serve"), run_all([("generate", ("--help",)), ("serve", ("--help",))])):
        assert r.returncode == 0
        missing = [f for f in shared if f"  {f}:" not in r.stdout and f"  {f}=" not in r.stdout
                   and f"  --[no]{f[2:]}:" not in r.stdout]
        assert not missing, (script, missing)
    assert "--chat_template" in r.stdout


def test_chat_needs_a_template(tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(STORIES, bare)
    cfg = json.load(open(bare / "tokenizer_config.json"))
    del cfg["chat_template"]
    json.dump(cfg, open(bare / "tokenizer_config.json", "w"))
    bad_template = tmp_path / "t.jinja"
    bad_template.write_text("{% for m in messages %}")
    cases = [
        ("eval_gsm8k", (f"--target={bare}", "--spec=none", "--limit=1"), ("has no chat template", "--chat_template=")),
        ("eval_gsm8k", (f"--target={bare}", "--spec=none", "--chat_template=/no/t.jinja"), ("--chat_template",)),
        ("serve", (f"--target={bare}", f"--chat_template={bad_template}", "--port=0"), ("not a valid jinja template",)),
    ]
    for (script, _, words), r in zip(cases, run_all([(c[0], c[1]) for c in cases])):
        assert_one_line_error(script, r, *words)


def test_chat_template_choices(tmp_path):
    from eagle3_jax.text.chat_template import ChatTemplate, ChatTemplateError

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for bundled in (KIMI, STORIES):  # base models: their template is the contents, one per line
        assert ChatTemplate.from_dir(bundled).render(messages) == "Be brief.\nHi"
    with pytest.raises(ChatTemplateError, match="--chat_template"):
        ChatTemplate.from_dir(tmp_path).render(messages)
    assert ChatTemplate.from_flag("join", tmp_path).render(messages) == "Be brief.\nHi"
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    assert ChatTemplate.from_flag(str(tpl), KIMI).render(messages) == "<system>Be brief.<user>Hi<assistant>"


def test_one_liners_say_what_is_wrong(models):
    kimi, draft = os.path.join(models, "kimi-mini"), os.path.join(models, "kimi-mini-eagle3")
    cases = [
        ("generate", (f"--model={kimi}/config.json",), ("is a file", "the model folder")),
        ("generate", (f"--model={draft}",), ("is an EAGLE-3 draft; pass it as --draft",)),
        ("serve", (f"--target={draft}",), ("is an EAGLE-3 draft; pass it as --draft",)),
        ("generate", (f"--model={kimi}", f"--draft={kimi}"), ("is not an EAGLE-3 draft",)),
        ("generate", (f"--model={kimi}", f"--tokenizer={kimi}/config.json"), ("is not a tokenizer file",)),
        ("serve", (f"--target={kimi}", "--host=no-such-host.invalid"), ("--host=no-such-host.invalid",)),
        ("serve", (f"--target={kimi}", "--host=192.0.2.1"), ("not an address of this machine",)),
    ]
    for (script, _, words), r in zip(cases, run_all([(c[0], c[1]) for c in cases])):
        line = assert_one_line_error(script, r, *words)
        assert "stop what uses that port" not in line and "not a tokenizer.json" not in line


# ---- bench: cells too small to time ----------------------------------------------------------------------


def test_bench_marks_cells_with_too_few_requests():
    from eagle3_jax.bench import report as R

    assert R.too_few_requests(8, 8) == 40 and R.too_few_requests(640, 64) is None and R.too_few_requests(10, 1) is None and R.too_few_requests(6, 1) == 10

    def cell(conc, n):
        m = {"output_throughput": 100.0, "output_throughput_per_device": 100.0, "request_throughput": 1.0,
             "ttft_ms": {"mean": 1.0}, "tpot_ms": {"mean": 1.0}, "itl_ms": {"mean": 1.0},
             "e2e_latency_ms": {"mean": 1.0}, "num_requests": n}
        return {"setting": "none", "label": "no-spec", "concurrency": conc, "seed": 0, "metrics": m}

    rows = R.aggregate([cell(8, 8), cell(64, 640)])
    assert [r["too_few_requests"] for r in rows] == [40, None]
    notes = R.too_few_notes(rows)
    assert "concurrency 8: 8 requests" in notes[0] and "--num_prompts=40" in notes[0]
    r = run_script("bench", "--base_url=http://127.0.0.1:9", "--spec=none", "--concurrency=8", "--num_prompts=8")
    assert "too few requests to time (8 at concurrency 8" in r.stderr and "--num_prompts=40" in r.stderr


# ---- the planner explains itself --------------------------------------------------------------------------


def test_plan_names_the_mesh_axis_that_does_not_divide():
    r = run_script("plan", "--target=tests/data/kimi-k2.5.config.json", "--meshes=1,1,5", "--devices=H100")
    assert ("mesh 1,1,5: the expert axis (5) does not divide experts=384 (180 tensors" in r.stdout
            and "GiB more per device. Meshes that divide: 1,1,4; 1,1,6" in r.stdout), r.stdout
    assert_one_line_error("plan", r, "needs 5 devices")  # and nothing compiled before saying so


def test_plan_says_what_is_over():
    from eagle3_jax.planning import report as plan_script
    from eagle3_jax.planning.memory import DEVICES, MemoryPlan

    G = 2**30
    p = MemoryPlan(mesh_shape={"data": 1, "tensor": 1, "expert": 5}, batch=64, max_len=2304, spec=None,
                   argument_bytes=560 * G, temp_bytes=4 * G, output_bytes=0, alias_bytes=0, weight_bytes=553 * G,
                   kv_bytes=5 * G, kv_bytes_per_token=1000, step_read_bytes=G, programs={})
    note = plan_script.over_note(p, DEVICES["H100"], G, "GiB")
    assert note.startswith("mesh 1,1,5, batch 64, H100: NO, needs 564.0 GiB of 74.5, 489.5 over (")
    assert "weights 553.0, KV 5.00, other arguments 2.00, temps 4.0" in note
    small = dataclasses.replace(p, argument_bytes=G, weight_bytes=G // 2, kv_bytes=G // 4, temp_bytes=0)
    assert plan_script.over_note(small, DEVICES["H100"], G, "GiB") is None
    assert plan_script.dividing_sizes(5, [384]) == [4, 6] and plan_script.dividing_sizes(3, [7]) == [7]
