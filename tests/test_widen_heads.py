"""Widening a Llama-family pair's heads (checkpoint/widen_heads.py) computes what the narrow pair did:
logits here and in transformers, greedy speculative outputs and acceptance; so does a draft whose
repeated feature layers are made distinct (checkpoint/distinct_aux.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.checkpoint.distinct_aux import distinct_aux_layers
from eagle3_jax.checkpoint.widen_heads import head_lanes, rewrite_hf_folder, widen_head_dim, widen_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES, STORIES_DRAFT = (os.path.join(ROOT, "checkpoints", n) for n in ("stories260K", "stories260K-eagle3"))
PROMPT = [1, 403, 258, 300, 50, 99, 12, 7, 410, 33]


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    folder = tmp_path_factory.mktemp("widened")
    return widen_head_dim(STORIES, folder / "target", 32), widen_head_dim(STORIES_DRAFT, folder / "draft", 32)


def speculate(target_dir: str, draft_dir: str) -> list[tuple[list[int], float]]:
    target = e3.load_target(target_dir, dtype="float32")
    engine = e3.Engine(target, draft=e3.load_draft(draft_dir, target), spec=e3.SpecConfig.parse("chain:3:1:4"),
                       max_seq_len=128)
    out = engine.generate([PROMPT, PROMPT[:4]], e3.SamplingParams(max_tokens=40))
    return [(o.token_ids, o.metrics["mean_accept_length"]) for o in out]


def test_rotary_lanes_keep_their_frequency():
    d, D, base = 8, 32, 10000.0
    freq = lambda width: base ** (-np.arange(0, width, 2) / width)  # noqa: E731  (rotate-half: lane i and i + width/2)
    lanes = head_lanes(d, D, rotary=True)
    np.testing.assert_array_equal(freq(D)[lanes[: d // 2]], freq(d))
    np.testing.assert_array_equal(lanes[d // 2:] - D // 2, lanes[: d // 2])
    np.testing.assert_array_equal(head_lanes(d, D, rotary=False), np.arange(d))


def test_widths_that_cannot_keep_the_frequencies_are_refused():
    with open(os.path.join(STORIES, "config.json")) as f:
        config = json.load(f)
    for head_dim in (8, 12, 24):
        with pytest.raises(ValueError, match="power-of-two multiple"):
            widen_tensors({}, config, head_dim)


def test_widened_target_logits_equal_the_narrow_ones(widened):
    target, _ = widened
    with open(os.path.join(target, "config.json")) as f:
        assert json.load(f)["head_dim"] == 32
    narrow = e3.load_target(STORIES, dtype="float32").logits(np.asarray([PROMPT]))
    wide = e3.load_target(target, dtype="float32").logits(np.asarray([PROMPT]))
    np.testing.assert_allclose(np.asarray(wide), np.asarray(narrow), atol=2e-5, rtol=0)


def test_transformers_reads_the_widened_target_as_the_narrow_one(widened):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    logits = []
    for folder in (STORIES, widened[0]):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(torch.tensor([PROMPT])).logits.numpy())
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-5, rtol=0)


def test_widened_pair_speculates_as_the_narrow_pair(widened):
    narrow, wide = speculate(STORIES, STORIES_DRAFT), speculate(*widened)
    assert narrow == wide
    assert max(accept for _, accept in narrow) > 1.0  # the draft is accepted at all: the comparison means something


def test_a_draft_reading_one_layer_thrice_reads_three_and_speculates_alike(tmp_path):
    with open(os.path.join(STORIES, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    folder = rewrite_hf_folder(STORIES_DRAFT, tmp_path / "draft", lambda t, c: distinct_aux_layers(t, c, layers))
    with open(os.path.join(folder, "config.json")) as f:
        ids = json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 3, 4]  # the repeated hidden_states[2] first, fillers after, ascending
    narrow, distinct = speculate(STORIES, STORIES_DRAFT), speculate(STORIES, folder)
    assert [tokens for tokens, _ in distinct] == [tokens for tokens, _ in narrow]
    np.testing.assert_allclose([a for _, a in distinct], [a for _, a in narrow], atol=0.05)
    tensors = {"fc.weight": np.ones((2, 6), np.float32)}
    with pytest.raises(ValueError, match="cannot be folded"):
        distinct_aux_layers(tensors, {"fc_norm": True, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 2, 2]}}, 5)
    same = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    assert distinct_aux_layers(tensors, same, 5) == (tensors, same)
