"""The bundled demo checkpoints: what they are, and that EAGLE-3 on them is lossless and accepts long."""

import os

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.text.tokenizer import load_tokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..", "checkpoints")
PROMPTS = ["Once upon a time", "Tom had a big red ball", "The sun was shining and", "Max wanted to play with his friend"]


def folder_mb(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20


@pytest.fixture(scope="module")
def kimi_mini():
    target = e3.load_target(os.path.join(ROOT, "kimi-mini"), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "kimi-mini-eagle3"), target=target, dtype="float32")
    return target, draft


def test_kimi_mini_is_a_small_deepseek_v3(kimi_mini):
    cfg = kimi_mini[0].config
    assert cfg.family == "deepseek_v3" and cfg.attention == "mla" and cfg.rope.rope_type == "yarn"
    assert cfg.rope.interleaved and cfg.scoring_func == "sigmoid" and cfg.use_routing_bias
    assert cfg.shared_intermediate_size > 0 and cfg.first_k_dense_replace == 1 and cfg.num_experts > 1
    assert folder_mb(os.path.join(ROOT, "kimi-mini")) + folder_mb(os.path.join(ROOT, "kimi-mini-eagle3")) < 20


def run(target, draft, spec, prompts, max_tokens=48):
    tok = load_tokenizer(target.path, bos_id=target.config.bos_token_id)
    ids = [tok.encode(p, add_bos=True) for p in prompts]
    sp = e3.SamplingParams(max_tokens=max_tokens)
    base = e3.Engine(target, max_batch_size=4, max_seq_len=128).generate(ids, sp)
    outs = e3.Engine(target, draft=draft, spec=spec, max_batch_size=4, max_seq_len=128).generate(ids, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    return float(np.mean([a for o in outs for a in o.metrics["accept_lengths"]]))


# chain is slow-marked: test_scheduler runs the kimi-mini pair's chain speculation against plain decoding
@pytest.mark.parametrize("spec, min_tau", [pytest.param(e3.SpecConfig(3, 1, 4), 2.5, marks=pytest.mark.slow),
                                           (e3.SpecConfig(5, 4, 16), 3.0)], ids=["chain", "tree"])
def test_kimi_mini_pair_is_lossless_and_accepts_long_paths(kimi_mini, spec, min_tau):
    assert run(*kimi_mini, spec, PROMPTS) >= min_tau


def test_stories260k_pair_is_lossless_and_accepts_long_paths():
    target = e3.load_target(os.path.join(ROOT, "stories260K"), dtype="float32")
    draft = e3.load_draft(os.path.join(ROOT, "stories260K-eagle3"), target=target, dtype="float32")
    assert draft.config.has_draft_vocab
    assert run(target, draft, e3.SpecConfig(3, 1, 4), PROMPTS) >= 2.0
