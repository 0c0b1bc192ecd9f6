"""The GSM8K accuracy harness (eagle3_jax.bench.gsm8k, scripts/eval_gsm8k.py): lm-eval's answer
extraction on hand-made completions, the few-shot prompt, and greedy runs on the demo pair with and
without speculation, in-process and through the HTTP server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
from server_fixtures import ServerThread

from eagle3_jax.bench import gsm8k as G
from eagle3_jax.bench import gsm8k_run as R
from eagle3_jax.text.chat_template import ChatTemplate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIMI = os.path.join(ROOT, "checkpoints", "kimi-mini")
KIMI_DRAFT = os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
SCRIPT = os.path.join(ROOT, "scripts", "eval_gsm8k.py")

# The first two problems of the GSM8K train split, written out by hand.
NATALIA_Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?")
NATALIA_A = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
WENG_Q = ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
          "How much did she earn?")
WENG_A = ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
          "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10")


def problem(target: str) -> G.Problem:
    return G.Problem("q", f"Some reasoning 1 + 1 = 2.\n#### {target}")


# ---- extraction and scoring, as lm-eval's gsm8k filters and exact_match ----------------------------------


@pytest.mark.parametrize("completion, target, strict, flexible, strict_ok, flexible_ok", [
    # strict hit: the `#### N` line
    (" She sold 48 + 24 = 72 clips.\n#### 72", "72", "72", "72", True, True),
    # no `####`: strict misses, flexible takes the last number ("18." loses its final dot when compared)
    (" Janet sells 16 - 3 - 4 = 9 eggs at $2 each, so she makes 18.", "18", "[invalid]", "18.", False, True),
    # negative numbers keep their sign
    (" The temperature fell to -5 degrees.\n#### -5", "-5", "-5", "-5", True, True),
    (" The balance is -12 dollars", "12", "[invalid]", "-12", False, False),
    # `$`, thousands commas and a final period are ignored, on both sides
    (" It costs $1,000.", "1000", "[invalid]", "$1,000.", False, True),
    (" #### 1,000", "1,000", "1,000", "1,000", True, True),
    # strict's pattern needs a digit right after `#### `
    (" #### $1,000", "1000", "[invalid]", "$1,000", False, True),
    # no number at all
    (" I do not know.", "3", "[invalid]", "[invalid]", False, False),
    # several numbers: flexible takes the last; strict the first `####`
    (" First 12 apples, then 7 pears, 19 in all, or maybe 20", "19", "[invalid]", "20", False, False),
    (" #### 5\n#### 6", "5", "5", "6", True, False),
    # a single digit is found by flexible's second group
    (" so it is 7", "7", "[invalid]", "7", False, True),
])
def test_extraction_and_scoring(completion, target, strict, flexible, strict_ok, flexible_ok):
    assert G.extract(completion, G.STRICT) == strict
    assert G.extract(completion, G.FLEXIBLE) == flexible
    scores = G.score_completion(completion, problem(target))
    assert scores[G.STRICT] == {"answer": strict, "correct": strict_ok}
    assert scores[G.FLEXIBLE] == {"answer": flexible, "correct": flexible_ok}


def test_reference_normalisation():
    assert G.Problem(NATALIA_Q, NATALIA_A).target == "72"
    assert G.Problem("q", "It is $1,200 in all.\n#### 1,200").target == "1200"
    assert G.normalize("$3.50.") == "3.50" and G.normalize("ABC") == "abc"


def test_cut_at_stop_strings():
    assert G.cut_at_stop(" 6 + 1 = 7.\n#### 7\n\nQuestion: next one") == " 6 + 1 = 7.\n#### 7\n\n"
    assert G.cut_at_stop("a<|im_end|>b</s>c") == "a"  # the earliest stop string wins
    assert G.cut_at_stop("x</s>yQuestion:") == "x"
    assert G.cut_at_stop("no stop here") == "no stop here"


def test_mean_stderr_and_accuracy():
    mean, se = G.mean_stderr([1.0, 0.0, 1.0, 1.0])
    assert mean == pytest.approx(0.75) and se == pytest.approx(0.25)  # sample variance 0.25, / 4, sqrt
    assert G.mean_stderr([1.0]) == (1.0, None)
    acc = G.accuracy([G.score_completion(c, problem("4")) for c in ("#### 4", "4", "5")])
    assert acc[G.STRICT]["exact_match"] == pytest.approx(1 / 3)
    assert acc[G.FLEXIBLE]["exact_match"] == pytest.approx(2 / 3)  # "4", "4", "5"
    assert acc[G.STRICT]["n"] == 3 and acc[G.STRICT]["stderr"] == pytest.approx((1 / 3) ** 0.5 / 3 ** 0.5)


def test_agreement():
    base, other = ["#### 1", "a 2", "x"], ["#### 1", "a 2.", "y"]
    sb = [G.score_completion(c, problem("1")) for c in base]
    so = [G.score_completion(c, problem("1")) for c in other]
    a = G.agreement(base, other, sb, so)
    assert a["identical_completions"] == pytest.approx(1 / 3) and a["differing_questions"] == [1, 2]
    assert a[f"identical_{G.STRICT}_answers"] == pytest.approx(1.0)  # #### 1, invalid, invalid
    assert a[f"identical_{G.FLEXIBLE}_answers"] == pytest.approx(2 / 3)  # "2" vs "2." differ


# ---- data and prompts ---------------------------------------------------------------------------------------


def test_bundled_data():
    shots = G.load_problems(G.DEFAULT_FEWSHOT_FILE)
    assert len(shots) == 5
    assert shots[0] == G.Problem(NATALIA_Q, NATALIA_A) and shots[1] == G.Problem(WENG_Q, WENG_A)
    test = G.load_problems(G.DEFAULT_TEST_FILE)
    assert len(test) == 1319 and all(p.answer.rsplit("\n", 1)[-1].startswith("#### ") for p in test)
    assert G.load_problems(G.DEFAULT_TEST_FILE, 3) == test[:3]


def test_bad_data_files(tmp_path):
    with pytest.raises(G.DataError, match="does not exist"):
        G.load_problems(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(G.DataError, match=r"bad.jsonl:2 needs string fields"):
        G.load_problems(bad)
    bad.write_text("not json\n")
    with pytest.raises(G.DataError, match="is not JSON"):
        G.load_problems(bad)


QUESTION = "Tom has 2 apples and buys 3 more. How many apples does he have?"
TURN_1 = f"Question: {NATALIA_Q}\nAnswer:"
TURN_2 = f"Question: {WENG_Q}\nAnswer:"
TURN_Q = f"Question: {QUESTION}\nAnswer:"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_fewshot_prompt_multiturn_through_a_chat_template():
    shots = G.load_problems(G.DEFAULT_FEWSHOT_FILE, 2)
    text = G.render_prompts([G.Problem(QUESTION, "#### 5")], shots, multiturn=True,
                            render=ChatTemplate(CHATML).render)[0]
    expected = ("<|im_start|>user\n" + TURN_1 + "<|im_end|>\n"
                "<|im_start|>assistant\n" + NATALIA_A + "<|im_end|>\n"
                "<|im_start|>user\n" + TURN_2 + "<|im_end|>\n"
                "<|im_start|>assistant\n" + WENG_A + "<|im_end|>\n"
                "<|im_start|>user\n" + TURN_Q + "<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert text == expected


def test_fewshot_prompt_single_turn_and_without_template():
    shots = G.load_problems(G.DEFAULT_FEWSHOT_FILE, 2)
    single = G.fewshot_messages(QUESTION, shots, multiturn=False)
    assert single == [{"role": "user", "content":
                       f"{TURN_1} {NATALIA_A}\n\n{TURN_2} {WENG_A}\n\n{TURN_Q}"}]
    # kimi-mini, a base model, has the template of one: the turns' contents joined with newlines
    # (what --chat_template=join gives any model)
    for template in (ChatTemplate.from_dir(KIMI), ChatTemplate(join=True)):
        text = G.render_prompts([G.Problem(QUESTION, "#### 5")], shots, multiturn=True, render=template.render)[0]
        assert text == f"{TURN_1}\n{NATALIA_A}\n{TURN_2}\n{WENG_A}\n{TURN_Q}"
    assert G.fewshot_messages(QUESTION, []) == [{"role": "user", "content": TURN_Q}]


# ---- the script's runs (eagle3_jax.bench.gsm8k_run) ---------------------------------------------------------


def test_sources_and_their_flags():
    from eagle3_jax.bench.flag_checks import check_gsm8k_sources

    server = dict(base_url=["http://a", "http://b"], labels=["x", "y"], spec_given=False, mesh=None,
                  distributed=False, target=None, draft=None, chat_template=None)
    check_gsm8k_sources(**server)
    local = {**server, "base_url": [], "labels": [], "spec_given": True, "mesh": "1,1,8", "target": "t", "draft": "d",
             "chat_template": "c.jinja"}
    check_gsm8k_sources(**local)
    for change, words in (({"spec_given": True}, "drop --spec and name the runs with --labels"),
                          ({"mesh": "1,1,2"}, "--mesh and --distributed are for the in-process model"),
                          ({"distributed": True}, "--mesh and --distributed are for the in-process model"),
                          ({"labels": ["x"]}, "--labels names 1 runs but --base_url lists 2"),
                          ({"base_url": ["http://a", "http://a"]}, "--base_url lists a server more than once"),
                          ({"draft": "d"}, "--target and --draft are for in-process runs"),
                          ({"chat_template": "c"}, "--chat_template is for in-process runs")):
        with pytest.raises(ValueError, match=words):
            check_gsm8k_sources(**{**server, **change})
    with pytest.raises(ValueError, match="give --target .* or --base_url"):
        check_gsm8k_sources(**{**local, "target": None})
    with pytest.raises(ValueError, match="--labels names --base_url runs"):
        check_gsm8k_sources(**{**local, "labels": ["x"]})


def test_load_inputs_names_the_flag_at_fault(tmp_path):
    problems, shots = R.load_inputs(None, None, 2, 5)
    assert len(problems) == 2 and shots[0] == G.Problem(NATALIA_Q, NATALIA_A) and len(shots) == 5
    assert R.load_inputs(None, None, None, 0)[1] == []
    with pytest.raises(G.DataError, match=r"^--data: GSM8K file .*missing.jsonl does not exist"):
        R.load_inputs(str(tmp_path / "missing.jsonl"), None, 2, 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(G.DataError, match=r"^--fewshot_file: .*is not JSON"):
        R.load_inputs(None, str(bad), 2, 1)
    with pytest.raises(G.DataError, match=r"^--num_fewshot=9 but the few-shot file has only 5 examples"):
        R.load_inputs(None, None, 2, 9)


def test_prompts_and_the_sequence_length():
    class Tok:
        def encode(self, text, add_bos):
            return [1] * add_bos + [ord(c) for c in text]

    problems = [G.Problem("Q1", "#### 1"), G.Problem("Q22", "#### 2")]
    shots = [G.Problem("S", "#### 3")]
    prompts = R.encode_prompts(problems, shots, Tok(), lambda messages: "|".join(m["content"] for m in messages),
                               multiturn=True)
    assert prompts == [[1, *map(ord, f"Question: S\nAnswer:|#### 3|Question: {q}\nAnswer:")] for q in ("Q1", "Q22")]
    assert R.fit_max_seq_len([10, 20], 8, None, 512) == (28, None)  # the longest prompt plus the answer budget
    assert R.fit_max_seq_len([10, 20], 8, None, 25) == (25, "note: 1 of 2 prompts leave fewer than --max_tokens=8 "
                                                           "tokens within max_seq_len=25; their answers end there")
    assert R.fit_max_seq_len([10, 20], 8, 100, 25) == (100, None)  # as given (the script checked it)
    with pytest.raises(ValueError, match=r"^1 of 2 prompts have >= max_seq_len=20 tokens \(longest 20\); lower "
                                         "--num_fewshot"):
        R.fit_max_seq_len([10, 20], 8, 20, 512)
    R.check_prompt_lengths([10, 19], 20)


def test_run_servers_warm_up_label_and_refuse(monkeypatch):
    calls, said = [], []

    def generate_http(url, conversations, *, max_tokens, concurrency, model, progress=False, desc=""):
        calls.append((url, len(conversations), desc))
        if "down" in url:
            raise ConnectionError(f"no server answers at {url}")
        if "refuses" in url:
            raise RuntimeError("HTTP 400: too long")
        return G.RunOutput([G.Generation("#### 1", 3, "stop")] * len(conversations), 1.0)

    monkeypatch.setattr(R, "generate_http", generate_http)
    problems = [G.Problem(f"Q{i}", "#### 1") for i in range(5)]
    runs, config = R.run_servers(problems, [], ["http://a", "http://b"], [], multiturn=True, max_tokens=8,
                                 concurrency=2, model=None, warmup=True, progress=False, echo=said.append)
    assert [label for label, _ in runs] == ["http://a", "http://b"] and config == {"mode": "HTTP http://a, http://b"}
    assert calls == [("http://a", 2, ""), ("http://a", 5, "http://a"), ("http://b", 2, ""), ("http://b", 5, "http://b")]
    assert said == ["http://a: 5 questions to http://a ...", "http://b: 5 questions to http://b ..."]
    runs, _ = R.run_servers(problems, [], ["http://a"], ["base"], multiturn=True, max_tokens=8, concurrency=2,
                            model=None, warmup=False, progress=False, echo=said.append)
    assert runs[0][0] == "base" and calls[-1] == ("http://a", 5, "base") and len(calls) == 5
    with pytest.raises(R.RunError, match="^no server answers at http://down$"):
        R.run_servers(problems, [], ["http://down"], ["x"], multiturn=True, max_tokens=8, concurrency=2, model=None,
                      warmup=True, progress=False, echo=said.append)
    with pytest.raises(R.RunError, match="^x: HTTP 400: too long$"):
        R.run_servers(problems, [], ["http://refuses"], ["x"], multiturn=True, max_tokens=8, concurrency=2,
                      model=None, warmup=False, progress=False, echo=said.append)


def test_run_settings_one_scheduler_each(monkeypatch):
    from eagle3_jax.bench import parse_specs

    made, runs_of = [], []

    def make_scheduler(target, draft, setting, *, max_num_seqs, max_seq_len, page_size, prefill_chunk):
        made.append((setting.name, draft, max_num_seqs, max_seq_len, page_size, prefill_chunk))
        return setting.name

    def generate_in_process(sched, tok, prompts, *, max_tokens, stop_token_ids, concurrency, progress=False, desc=""):
        runs_of.append((sched, len(prompts), stop_token_ids, desc))
        return G.RunOutput([G.Generation("#### 1", 2, "stop")] * len(prompts), 1.0)

    monkeypatch.setattr(R, "make_scheduler", make_scheduler)
    monkeypatch.setattr(R, "generate_in_process", generate_in_process)
    target = types.SimpleNamespace(config=types.SimpleNamespace(eos_token_ids=(2, 7)))
    tok, said = types.SimpleNamespace(eos_ids=(7, 9)), []
    runs = R.run_settings(target, "draft", tok, parse_specs(["none", "chain:3:1:4"]), [[1]] * 5, max_seq_len=64,
                          max_tokens=8, concurrency=2, page_size=None, prefill_chunk=32, warmup=True, progress=False,
                          echo=said.append)
    assert made == [("none", "draft", 2, 64, None, 32), ("chain:3:1:4", "draft", 2, 64, None, 32)]
    assert runs_of == [("none", 2, (2, 7, 9), ""), ("none", 5, (2, 7, 9), "no-spec"),
                       ("chain:3:1:4", 2, (2, 7, 9), ""), ("chain:3:1:4", 5, (2, 7, 9), "EAGLE-3 chain:3:1:4")]
    assert [label for label, _ in runs] == ["no-spec", "EAGLE-3 chain:3:1:4"]
    assert runs[1][1].info == {"setting": "chain:3:1:4", "compiles": 0, "compile_s": 0.0}
    assert said == ["no-spec: 5 questions ...", "EAGLE-3 chain:3:1:4: 5 questions ..."]


def test_report_config_and_compile_notes():
    fake = types.SimpleNamespace(config=types.SimpleNamespace(kernels="xla", batch_invariant=False))
    config = R.in_process_config(fake, None, target_path="t", draft_path=None, dtype="float32", max_seq_len=300,
                                 prompt_tokens_max=250)
    assert config == {"mode": "in-process", "target": "t", "draft": None, "dtype": "float32", "max_seq_len": 300,
                      "prompt_tokens_max": 250, "mesh": None, "kernels": "xla", "batch_invariant": False}
    problems, shots = [G.Problem("Q", "#### 1")] * 3, [G.Problem("S", "#### 2")]
    full = R.report_config(config, problems, shots, multiturn=False, max_tokens=16, concurrency=4, data=None,
                           fewshot_file="f.jsonl", argv=["eval_gsm8k.py", "--limit=3"])
    assert list(full)[:9] == list(config) and full["argv"] == ["eval_gsm8k.py", "--limit=3"]
    assert (full["num_questions"], full["num_fewshot"], full["fewshot_as_multiturn"]) == (3, 1, False)
    assert full["stop_strings"] == list(G.STOP_STRINGS) and full["fewshot_file"] == "f.jsonl"
    assert full["data"] == os.path.relpath(G.DEFAULT_TEST_FILE)
    report = {"runs": [{"label": "no-spec"}, {"label": "chain", "compiles": 3, "compile_s": 2.0, "wall_s": 6.0,
                                              "num_output_tokens": 100}, {"label": "x", "compiles": 1, "compile_s": 5.0,
                                                                          "wall_s": 5.0, "num_output_tokens": 9}]}
    assert R.compile_notes(report) == ["chain: 3 XLA compilations took 2.0 s of its 6.0 s (25.0 tok/s without them)",
                                       "x: 1 XLA compilations took 5.0 s of its 5.0 s"]


# ---- the demo pair: greedy answers with and without speculation ------------------------------------------------

LIMIT, MAX_TOKENS, CONCURRENCY = 4, 24, 4


@pytest.fixture(scope="module")
def demo():
    """The demo pair's prompts (0-shot: its context is 512 tokens), one Scheduler per setting, and
    each setting's in-process run over the first LIMIT questions."""
    import eagle3_jax as e3
    from eagle3_jax.bench import parse_specs
    from eagle3_jax.bench.runner import make_scheduler
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(KIMI)
    problems = G.load_problems(G.DEFAULT_TEST_FILE, LIMIT)
    texts = G.render_prompts(problems, [], multiturn=True, render=ChatTemplate.from_dir(KIMI).render)
    prompts = [tok.encode(t, add_bos=True) for t in texts]
    target = e3.load_target(KIMI, dtype="float32")
    draft = e3.load_draft(KIMI_DRAFT, target=target, dtype="float32")
    scheds, runs = {}, {}
    for s in parse_specs(["none", "chain:3:1:4"]):
        # One prefill step takes all four prompts (464 tokens): fewer programs to compile, here and
        # when the server test sends the same prompts at once.
        scheds[s.name] = make_scheduler(target, draft, s, max_num_seqs=CONCURRENCY, max_seq_len=256,
                                        prefill_chunk=512)
        runs[s.name] = G.generate_in_process(scheds[s.name], tok, prompts, max_tokens=MAX_TOKENS,
                                             stop_token_ids=tok.eos_ids, concurrency=CONCURRENCY)
    return {"tok": tok, "problems": problems, "prompts": prompts, "scheds": scheds, "runs": runs}


def test_in_process_identical_with_and_without_speculation(demo):
    none, chain = demo["runs"]["none"], demo["runs"]["chain:3:1:4"]
    assert len(none.generations) == LIMIT
    assert [g.text for g in chain.generations] == [g.text for g in none.generations]
    assert all(g.text and 1 <= g.num_tokens <= MAX_TOKENS for g in none.generations)
    assert none.tau == pytest.approx(1.0) and 1.0 < chain.tau <= 4.0
    report = G.build_report(demo["problems"], [("no-spec", none), ("chain", chain)], config={
        "num_questions": LIMIT, "num_fewshot": 0, "fewshot_as_multiturn": True, "max_tokens": MAX_TOKENS,
        "mode": "in-process"})
    agree = report["runs"][1]["agreement"]
    assert agree["identical_completions"] == 1.0 and agree["differing_questions"] == []
    assert agree[f"identical_{G.STRICT}_answers"] == agree[f"identical_{G.FLEXIBLE}_answers"] == 1.0
    assert report["runs"][0]["scores"] == report["runs"][1]["scores"]
    assert len(report["samples"]) == LIMIT and report["samples"][0]["target"] == "18"
    table = G.format_report(report)
    assert "| no-spec | strict-match | 0 |" in table and "chain vs no-spec: identical completions 1.000" in table


def test_in_process_stop_string_ends_a_request_early(demo):
    """A stop string the tiny model does write (" was") aborts the request in the step that completes
    it, which under speculation may hold more tokens; the text is the full completion cut there."""
    full = [g.text for g in demo["runs"]["none"].generations]
    assert any(" was" in t for t in full)
    out = G.generate_in_process(demo["scheds"]["chain:3:1:4"], demo["tok"], demo["prompts"], max_tokens=MAX_TOKENS,
                                stop_token_ids=demo["tok"].eos_ids, stops=(" was",), concurrency=CONCURRENCY)
    assert [g.text for g in out.generations] == [G.cut_at_stop(t, (" was",)) for t in full]
    for g, t in zip(out.generations, full):
        if " was" in t:
            assert g.finish_reason == "stop" and g.num_tokens < MAX_TOKENS


def test_through_the_server_same_answers(demo):
    """The chain scheduler behind scripts/serve.py's app: the HTTP run renders the same prompts (the
    server's chat template), sends the stop strings as lm-eval does, and answers what the in-process
    run answered; the server ends each answer at its stop (the in-process run aborts a step later,
    so it generated at least as many tokens); tau comes from /metrics."""
    from eagle3_jax.serving import AsyncEngine, make_app

    engine = AsyncEngine(demo["scheds"]["chain:3:1:4"], tokenizer=demo["tok"]).start()
    server = ServerThread(make_app(engine, "kimi-mini", tokenizer_dir=KIMI))
    try:
        conversations = [G.fewshot_messages(p.question, []) for p in demo["problems"]]
        out = G.generate_http(server.base_url, conversations, max_tokens=MAX_TOKENS, concurrency=CONCURRENCY)
        five_shot = G.fewshot_messages(demo["problems"][0].question, G.load_problems(G.DEFAULT_FEWSHOT_FILE))
        with pytest.raises(RuntimeError, match="HTTP 400.*max_seq_len is 256"):  # ~1,300 tokens: refused
            G.generate_http(server.base_url, [five_shot], max_tokens=MAX_TOKENS, concurrency=1)
    finally:
        server.stop()
        engine.shutdown(timeout=30)
    assert [g.text for g in out.generations] == [g.text for g in demo["runs"]["chain:3:1:4"].generations]
    assert out.info["stop_strings_sent"] is True and out.info["model"] == "kimi-mini"
    assert out.tau is not None and 1.0 < out.tau <= 4.0
    assert 0 < out.num_output_tokens <= demo["runs"]["chain:3:1:4"].num_output_tokens


# ---- the script -------------------------------------------------------------------------------------------


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env)


def assert_usage_error(r: subprocess.CompletedProcess, needle: str) -> None:
    """Exit status 2 and one line on stderr that names the problem, no traceback."""
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_script_help_and_usage_errors():
    """--help exits 0; mistakes found before JAX loads answer at once (the others: the slow test)."""
    r = run_script("--help")
    assert r.returncode == 0 and "--num_fewshot" in r.stdout
    assert_usage_error(run_script("--limit=0"), "--limit=0")
    assert_usage_error(run_script(), "give --target")
    assert_usage_error(run_script("--base_url=http://127.0.0.1:1", "--spec=none"), "drop --spec")
    assert_usage_error(run_script("--base_url=http://127.0.0.1:1", f"--target={KIMI}"), "the servers hold the models")


@pytest.mark.slow
def test_script_end_to_end_on_the_demo_pair(tmp_path):
    out = tmp_path / "gsm8k.json"
    r = run_script(f"--target={KIMI}", f"--draft={KIMI_DRAFT}", "--spec=none,chain:3:1:4", "--num_fewshot=0",
                   "--limit=3", "--max_tokens=16", "--concurrency=2", "--noprogress", f"--output={out}")
    assert r.returncode == 0, r.stderr
    assert "EAGLE-3 chain:3:1:4 vs no-spec: identical completions 1.000" in r.stdout
    report = json.loads(out.read_text())
    assert [row["label"] for row in report["runs"]] == ["no-spec", "EAGLE-3 chain:3:1:4"]
    assert report["config"]["num_questions"] == 3 and len(report["samples"]) == 3
    assert_usage_error(run_script("--base_url=http://127.0.0.1:1", "--limit=1"),  # nothing listens on port 1
                       "no server answers at http://127.0.0.1:1")
    assert_usage_error(run_script(f"--target={KIMI}", "--spec=chain:3:2:4", "--draft=x"), "--spec: a chain has topk=1")
    assert_usage_error(run_script(f"--target={KIMI}", "--spec=none", "--data=/no/such.jsonl"), "--data: GSM8K file")
    assert_usage_error(run_script("--target=/no/such/model", "--spec=none"), "no config.json at /no/such/model")
    assert_usage_error(run_script(f"--target={KIMI}", "--spec=none", "--limit=2"),  # 5 shots: ~1,300 tokens
                       "lower --num_fewshot or raise --max_seq_len")
