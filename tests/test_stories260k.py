"""The bundled real checkpoint (stories260K, llama2.c TinyStories, MIT) reproduces its published
greedy continuation: through the engine, and teacher-forced through `Target.logits`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest


e3 = pytest.importorskip("eagle3_jax")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(REPO_ROOT, "checkpoints", "stories260K")


@pytest.fixture(scope="module")
def golden():
    path = os.path.join(CKPT, "golden.json")
    if not os.path.exists(path):
        pytest.skip(f"{path} not present")
    with open(path) as f:
        g = json.load(f)
    assert g["prompt_ids"] == [1] and len(g["output_ids"]) == 200
    return g


@pytest.fixture(scope="module")
def stories(golden):
    return e3.load_target(CKPT, dtype="float32")


def test_config(stories):
    cfg = stories.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 5, 64, 512)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 8)
    assert cfg.tie_word_embeddings


def test_teacher_forced_argmax(stories, golden):
    seq = golden["prompt_ids"] + golden["output_ids"]
    logits = stories.logits(np.asarray([seq[:-1]], np.int32))
    pred = logits[0].argmax(-1)[len(golden["prompt_ids"]) - 1:]
    mism = np.nonzero(pred != np.asarray(golden["output_ids"]))[0]
    assert mism.size == 0, f"teacher-forced argmax differs from golden at output positions {mism[:10].tolist()}"


def test_engine_greedy_generate(stories, golden):
    engine = e3.Engine(stories, draft=None, max_batch_size=8, max_seq_len=512)
    outs = engine.generate([golden["prompt_ids"]], e3.SamplingParams(temperature=0.0, max_tokens=200))
    assert len(outs) == 1
    got = list(outs[0].token_ids)
    want = golden["output_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"greedy output differs from golden (len {len(got)} vs {len(want)}; first mismatch at {first})"


def test_engine_greedy_ragged_batch(stories, golden):
    """Two prompts of different lengths in one batch: each row continues the golden text."""
    want = golden["output_ids"]
    k = 5
    engine = e3.Engine(stories, draft=None, max_batch_size=8, max_seq_len=512)
    outs = engine.generate(
        [golden["prompt_ids"] + want[:k], golden["prompt_ids"]],
        [e3.SamplingParams(temperature=0.0, max_tokens=len(want) - k), e3.SamplingParams(temperature=0.0, max_tokens=len(want))],
    )
    assert list(outs[0].token_ids) == want[k:]
    assert list(outs[1].token_ids) == want
