"""Constrained output, host side: constraints compiled once per vocabulary (Kimi's tiktoken one and a
tokenizer.json one), the next-token bitmask, advancing, rolling back, EOS only where the grammar
may end, and clear errors for constraints that cannot be compiled."""

from __future__ import annotations

import json

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.structured import Constraint, ConstraintError, GrammarCache
from model_folders import kimi_folder, llama_folder

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}


def _bit(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


@pytest.fixture(scope="module", params=["kimi", "llama"])
def grammars(request, tmp_path_factory):
    folder = (kimi_folder if request.param == "kimi" else llama_folder)(tmp_path_factory.mktemp(request.param))
    tok = e3.load_tokenizer(folder)
    return tok, GrammarCache(tok, tok.vocab_size + 40)  # a model's vocabulary is often padded past the tokenizer's


@pytest.mark.parametrize("constraint,good,bad", [
    (Constraint.json_schema(SCHEMA), '{"city": "Paris", "days": 3}', '{"city": "Paris", "days": "3"}'),
    (Constraint.json_object(), '{"a": [1, 2, {"b": null}]}', '[1, 2]'),
    (Constraint.regex(r"\d{3}-[A-Z]{2}"), "123-AB", "12-AB"),
    (Constraint.choice(["yes", "no", "maybe"]), "maybe", "perhaps"),
    (Constraint.grammar('start: "(" item ("," item)* ")"\nitem: /[0-9]+/'), "(1,22,333)", "(1,,2)"),
])
def test_the_mask_allows_exactly_the_grammar(grammars, constraint, good, bad):
    tok, cache = grammars
    eos = tok.eos_ids[0]
    matcher = cache.matcher(constraint)
    ids = tok.encode(good, add_bos=False)
    for i, token in enumerate(ids):  # each next token of a valid answer is allowed, EOS only at the end
        mask = matcher.allowed()
        assert _bit(mask, token), (good, i)
        assert not _bit(mask, eos) and not matcher.accepting
        assert not any(_bit(mask, t) for t in range(tok.vocab_size, cache.vocab_size))  # padding never
        assert matcher.advance([token])
    assert matcher.accepting and _bit(matcher.allowed(), eos)
    wrong = tok.encode(bad, add_bos=False)
    assert cache.matcher(constraint).valid_prefix(wrong) < len(wrong)


def test_rollback_returns_to_an_earlier_state(grammars):
    tok, cache = grammars
    matcher = cache.matcher(Constraint.json_schema(SCHEMA))
    start = matcher.allowed().copy()
    ids = tok.encode('{"city": "Rome"', add_bos=False)
    assert matcher.advance(ids)
    middle = matcher.allowed().copy()
    assert matcher.advance(tok.encode(', "days": 2}', add_bos=False)) and matcher.accepting
    matcher.rollback(len(tok.encode(', "days": 2}', add_bos=False)))
    np.testing.assert_array_equal(matcher.allowed(), middle)
    matcher.rollback(len(ids))
    np.testing.assert_array_equal(matcher.allowed(), start)
    assert not matcher.advance(tok.encode("[", add_bos=False))  # forbidden: the matcher says so
    assert matcher.error


def test_each_constraint_compiles_once_within_the_bound(grammars):
    tok, _ = grammars
    cache = GrammarCache(tok, tok.vocab_size, max_entries=2)
    a, b = cache.matcher(Constraint.json_schema(SCHEMA)), cache.matcher(Constraint.json_schema(json.dumps(SCHEMA)))
    assert len(cache) == 1  # the same schema, as a mapping or as text: one grammar
    assert a.advance(tok.encode("{", add_bos=False)) and not b.accepting  # each request its own state
    cache.matcher(Constraint.regex("a+"))
    cache.matcher(Constraint.choice(["x"]))
    assert len(cache) == 2  # least recently used out


@pytest.mark.parametrize("make,message", [
    (lambda: Constraint.regex("(unclosed"), "regex"),
    (lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "json schema"),
    (lambda: Constraint.grammar("start: missing_rule"), "grammar"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.choice([]), "non-empty list"),
])
def test_constraints_that_cannot_compile_say_why(grammars, make, message):
    _, cache = grammars
    with pytest.raises(ConstraintError, match=message):
        cache.matcher(make())


def test_a_slow_compile_is_refused(grammars):
    tok, _ = grammars
    with pytest.raises(ConstraintError, match="took .* to compile"):
        GrammarCache(tok, tok.vocab_size, compile_seconds=0.0).matcher(Constraint.json_schema(SCHEMA))
