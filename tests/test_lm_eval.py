"""lm-eval's `local-completions` model, unmodified, against the server on the kimi-mini pair: GSM8K
generate_until (stop strings on every request) and a loglikelihood task (rolling perplexity of the
reference answers: echo + logprobs requests) over the
repository's GSM8K copy (data/lm_eval/*.yaml, nothing fetched from a hub). The plain and the
speculative server give the same answers and the same loglikelihoods (float32: greedy speculation
is exact)."""

from __future__ import annotations

import os

import pytest
from server_fixtures import ServerThread

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")  # local-completions counts context lengths with a Hugging Face tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "kimi-mini")
DRAFT = os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
TASKS = ["gsm8k_local", "gsm8k_answer_perplexity"]
LIMIT = 2


def evaluate(base_url: str, task_manager) -> dict:
    model_args = (f"base_url={base_url}/v1/completions,model=kimi-mini,tokenizer={TARGET},"
                  "tokenizer_backend=huggingface,max_length=512,num_concurrent=1,max_retries=1")
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=TASKS, limit=LIMIT,
                                   task_manager=task_manager,
                                   gen_kwargs="max_gen_toks=64", log_samples=True)


def served(speculate: bool) -> tuple[ServerThread, object]:
    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.serving import AsyncEngine, make_app
    from eagle3_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    target = e3.load_target(TARGET, dtype="float32")
    draft = e3.load_draft(DRAFT, target=target, dtype="float32") if speculate else None
    # pages of 128 and chunks of 16 tokens: every request of the run (at most 512 tokens) steps at
    # one block-table width and one chunk bucket, so each server compiles four programs only
    sched = Scheduler(target, draft, e3.SpecConfig(3, 1, 4) if speculate else None, max_num_seqs=4, max_seq_len=512,
                      prefix_caching=True, page_size=128, prefill_chunk=16)
    engine = AsyncEngine(sched, tokenizer=tok).start()
    return ServerThread(make_app(engine, "kimi-mini", tokenizer_dir=TARGET)), engine


def test_lm_eval_runs_unmodified_and_speculation_changes_nothing(monkeypatch):
    monkeypatch.chdir(ROOT)  # the task files name the data by paths relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    # only the repository's task files (lm-eval's own hundreds are not indexed)
    task_manager = TaskManager(include_path=os.path.join(ROOT, "data", "lm_eval"), include_defaults=False)
    runs = {}
    for speculate in (False, True):
        server, engine = served(speculate)
        try:
            runs[speculate] = evaluate(server.base_url, task_manager)
        finally:
            server.stop()
            engine.shutdown(timeout=30)
    plain, spec = runs[False], runs[True]
    for task in TASKS:
        a, b = plain["samples"][task], spec["samples"][task]
        assert len(a) == len(b) and {s["doc_id"] for s in a} == set(range(LIMIT))  # a sample per filter
        assert [s["resps"] for s in a] == [s["resps"] for s in b], task  # answers, loglikelihoods
        assert plain["results"][task] == spec["results"][task]
    gens = [s["resps"][0][0] for s in plain["samples"]["gsm8k_local"]]
    assert all(isinstance(g, str) and "Question:" not in g for g in gens)  # cut at the stop string
    lls = [s["resps"][0][0] for s in plain["samples"]["gsm8k_answer_perplexity"]]
    assert all(ll < 0 for ll in lls)  # each answer's loglikelihood: the sum of its tokens' logprobs
    assert plain["results"]["gsm8k_answer_perplexity"]["bits_per_byte,none"] > 0
