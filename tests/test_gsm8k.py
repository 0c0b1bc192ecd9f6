"""The GSM8K accuracy harness (eagle3_jax.bench.gsm8k, scripts/eval_gsm8k.py): lm-eval's answer
extraction on hand-made completions, the few-shot prompt, and greedy runs on the demo pair with and
without speculation, in-process and through the HTTP server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_fixtures import ServerThread

from eagle3_jax.bench import gsm8k as G
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
