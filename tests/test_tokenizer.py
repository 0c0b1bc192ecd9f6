"""eagle3_jax.text.tokenizer against the bundled stories260K tokenizer.json and its published goldens."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from eagle3_jax.text.tokenizer import TokenizerError, load_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(REPO_ROOT, "checkpoints", "stories260K")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(STORIES)


def test_special_ids(tok):
    assert tok.bos_id == 1
    assert tok.eos_ids == (2,)
    assert tok.vocab_size == 512


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time",
        "There was a big",
        " hello",
        "Tom said: \"Héllo, wörld! 😀\"\n\tThe end. 12345",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids) == text


def test_known_encodings(tok):
    # GOLDEN.md: BOS + llama2.c encode(); " hello" keeps SentencePiece's dummy prefix.
    assert tok.encode("There was a big") == [1, 291, 276, 286, 261, 370]
    assert tok.encode(" hello") == [1, 410, 281, 306, 414]
    assert tok.encode("") == [1]
    assert tok.encode("There was a big", add_bos=False) == [291, 276, 286, 261, 370]
    assert tok.encode("", add_bos=False) == []


def test_golden_text(tok):
    with open(os.path.join(STORIES, "golden.json")) as f:
        golden = json.load(f)
    with open(os.path.join(STORIES, "GOLDEN.md")) as f:
        md = f.read()
    text = tok.decode(golden["output_ids"])
    assert len(text) == 464 and text.startswith("Once upon a time, there was a little girl named Lily.")
    assert text in md
    assert tok.decode(golden["prompt_ids"] + golden["output_ids"]) == text


def test_decode_continuation_keeps_spacing(tok):
    prompt = tok.encode("There was a big")
    # 432 = ",", 352 = "▁r": alone, the decoder strips the leading space of "▁r".
    assert tok.decode([352]) == "r"
    assert tok.decode_continuation(prompt, [432, 352]) == ", r"
    assert tok.decode_continuation([1], [403, 407]) == "Once upon"


def test_rendered_template_text_keeps_a_single_bos(tok):
    """A chat template writes the BOS text itself; encoding must not add a second BOS."""
    plain = tok.encode("Once upon a time")
    assert tok.encode("<s>Once upon a time") == plain and plain.count(tok.bos_id) == 1


def test_bos_prepended_when_tokenizer_does_not(tmp_path):
    with open(os.path.join(STORIES, "tokenizer.json")) as f:
        raw = json.load(f)
    raw["post_processor"] = None  # a tokenizer.json that adds no special tokens
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    t = load_tokenizer(tmp_path)
    assert t.encode("There was a big") == [1, 291, 276, 286, 261, 370]
    assert t.eos_ids == (2, 5)
    assert load_tokenizer(tmp_path / "tokenizer.json", bos_id=7, eos_ids=[9]).encode("a")[0] == 7


def test_special_ids_from_tokenizer_config(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(STORIES, name), tmp_path / name)
    t = load_tokenizer(tmp_path)
    assert (t.bos_id, t.eos_ids) == (1, (2,))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json .* nor tiktoken.model"):
        load_tokenizer(tmp_path)


def test_malformed_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="could not be read"):
        load_tokenizer(tmp_path)
