"""Structured output in decoding: every output of held-out schemas, regexes and choices is valid,
greedy constrained speculation (chain, tree, auto) equals greedy constrained plain decoding token
for token on the demo pair, sampled constrained outputs follow the masked target distribution,
tree masks are the grammar's state on each node's path, and a mixed batch with cancellations
leaks neither pages nor grammars."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.structured import Constraint, ConstraintError, GrammarCache, RequestGrammar, mask_words
from eagle3_jax.structured.guide import allows
from test_lossless_sampling import PROMPT, P_OK, V, chisquare, exact_continuations, random_pair_and_conditionals

jsonschema = pytest.importorskip("jsonschema")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "checkpoints")

# Held out from the implementation: shapes a schema, regex or choice request takes.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
]
REGEXES = [r"(yes|no), [a-z ]{3,20}\.", r"[0-9]{3}-[0-9]{4}", r"The (cat|dog) (ran|sat)( [a-z]+){0,3}\."]
CHOICES = [["red", "green", "blue"], ["Once upon a time", "The end"]]
CONSTRAINTS = ([Constraint.json_schema(s) for s in SCHEMAS] + [Constraint.regex(r) for r in REGEXES]
               + [Constraint.choice(c) for c in CHOICES])


def check_valid(constraint: Constraint, text: str) -> None:
    """The output `text` is what `constraint` asks for (jsonschema / re / membership)."""
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.text, text), (constraint.text, text)
    else:
        assert text in json.loads(constraint.text), text


@pytest.fixture(scope="module")
def demo():
    tok = e3.load_tokenizer(os.path.join(DEMO, "kimi-mini"))
    target = e3.load_target(os.path.join(DEMO, "kimi-mini"), dtype="float32")
    draft = e3.load_draft(os.path.join(DEMO, "kimi-mini-eagle3"), target=target, dtype="float32")
    with open(os.path.join(DEMO, "demo_prompts.txt")) as f:
        prompts = [tok.encode(line.strip()) for line in f if line.strip()]
    return tok, target, draft, prompts


# Pages of 32 slots: every sequence here fits a block table of 4 pages, so each program compiles
# for one width only (the tests' time is mostly compiling).
PAGE = 32


def _constrained(engine, prompts, constraints, max_tokens=48):
    n = len(constraints)
    sps = [e3.SamplingParams(max_tokens=max_tokens, constraint=c) for c in constraints]
    return engine.generate([prompts[i % len(prompts)] for i in range(n)], sps)


@pytest.fixture(scope="module")
def plain_outputs(demo):
    """Greedy constrained plain decoding of the held-out constraints: the reference."""
    tok, target, _, prompts = demo
    engine = e3.Scheduler(target, max_num_seqs=16, max_seq_len=256, page_size=PAGE, tokenizer=tok)
    return _constrained(engine, prompts, CONSTRAINTS)


def _speculative(demo, spec) -> list:
    tok, target, draft, prompts = demo
    engine = e3.Scheduler(target, draft, spec, max_num_seqs=16, max_seq_len=256, page_size=PAGE, tokenizer=tok)
    outputs = _constrained(engine, prompts, CONSTRAINTS)
    assert engine.stats()["num_compiled_grammars"] == len(CONSTRAINTS)
    return outputs


def test_greedy_constrained_speculation_equals_plain_and_every_output_is_valid(demo, plain_outputs):
    for constraint, out in zip(CONSTRAINTS, plain_outputs):
        assert out.finish_reason == "stop", (constraint, out.text)
        check_valid(constraint, out.text)
    for spec in (e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)):
        outputs = _speculative(demo, spec)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs], spec
        # The draft keeps being accepted under the grammar (its first level proposed under it).
        accepted = np.mean([o.metrics["mean_accept_length"] for o in outputs])
        assert accepted > 1.5, (spec, accepted)


@pytest.mark.slow
def test_greedy_constrained_auto_equals_plain(demo, plain_outputs):
    outputs = _speculative(demo, e3.SpecConfig.auto(3, trees=(e3.SpecConfig(3, 2, 6),)))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]


def test_a_constraint_that_cannot_finish_ends_at_length(demo):
    tok, target, draft, prompts = demo
    engine = e3.Scheduler(target, draft, e3.SpecConfig(3, 1, 4), max_num_seqs=2, max_seq_len=256, page_size=PAGE,
                          tokenizer=tok)
    out, = engine.generate([prompts[0]], e3.SamplingParams(max_tokens=12, constraint=Constraint.regex("[a-z ]{40,}")))
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert re.fullmatch("[a-z ]*", out.text)


def test_bad_constraints_are_refused_before_anything_is_queued(demo):
    tok, target, _, prompts = demo
    engine = e3.Engine(target, max_batch_size=2, max_seq_len=256, tokenizer=tok)
    for bad in (Constraint.regex("(unclosed"), Constraint.grammar("start: nothing_defined"),
                Constraint.json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}})):
        with pytest.raises(ConstraintError):
            engine.generate([prompts[0], prompts[1]], [e3.SamplingParams(), e3.SamplingParams(constraint=bad)])
        assert not engine.scheduler.has_unfinished()
    with pytest.raises(ValueError, match="tokenizer"):
        e3.Engine(target, max_batch_size=2, max_seq_len=256).generate(
            [prompts[0]], e3.SamplingParams(constraint=Constraint.json_object()))
    with pytest.raises(ValueError, match="synthetic_acceptance"):
        e3.SamplingParams(constraint=Constraint.json_object(), synthetic_acceptance=(0.5,))


def _fresh_mask(cache, constraint, path, words):
    m = cache.matcher(constraint)
    assert m.advance(path)
    return m.allowed()


def test_tree_masks_are_the_grammars_state_on_each_path(demo):
    tok, target, _, _ = demo
    vocab = target.config.vocab_size
    words = mask_words(vocab)
    cache = GrammarCache(tok, vocab)
    constraint = Constraint.json_schema(SCHEMAS[0])
    valid = tok.encode('{"name": "Tim", "age": 3}', add_bos=False)
    valid = valid[1:] if tok.decode(valid[:1]) == "" else valid  # the tokenizer's leading space piece
    assert cache.matcher(constraint).valid_prefix(valid) == len(valid)
    rng = np.random.default_rng(0)
    for trial in range(20):
        # A tree of 12 nodes whose paths mix the valid text's tokens with random ones.
        n = 12
        parents = np.zeros(n, np.int32)
        tokens = np.zeros(n, np.int32)
        depth = np.zeros(n, np.int32)
        for i in range(1, n):
            parents[i] = rng.integers(0, i)
            depth[i] = depth[parents[i]] + 1
            tokens[i] = valid[depth[i] - 1] if rng.random() < 0.7 else rng.integers(0, vocab)
        grammar = RequestGrammar(cache.matcher(constraint))
        out = np.zeros((n, words), np.int32)
        grammar.tree_masks(tokens, parents, out)
        for i in range(n):
            path, node = [], i
            while node:
                path.append(int(tokens[node]))
                node = parents[node]
            path.reverse()
            m = cache.matcher(constraint)
            reachable = all(allows(m.allowed(), t) and m.advance([t]) for t in path)
            if reachable:
                np.testing.assert_array_equal(out[i], m.allowed(), err_msg=f"trial {trial} node {i}")
            else:
                assert (out[i] == -1).all()
        assert grammar.matcher.valid_prefix(valid) == len(valid)  # the walk left the matcher where it was


def test_grammar_starts_after_the_answer_token(demo):
    tok, target, _, _ = demo
    cache = GrammarCache(tok, target.config.vocab_size)
    end = 2 * 0 + 5  # any token id stands for the end of the reasoning here
    grammar = RequestGrammar(cache.matcher(Constraint.choice(["red"])), after_token=end)
    free = np.zeros(mask_words(target.config.vocab_size), np.int32)
    grammar.next_mask(free)
    assert (free == -1).all()
    assert not grammar.accept(9) and not grammar.accept(end) and grammar.live
    tokens = np.asarray([3, end] + tok.encode("red", add_bos=False)[:1], np.int32)
    out = np.zeros((3, free.size), np.int32)
    grammar.tree_masks(tokens, np.asarray([0, 0, 1]), out)
    assert not (out[0] == -1).all()  # live already: node 0's mask is the grammar's


# ---- the masked distribution, sampled ---------------------------------------------------------------

REGEX = "[ab][cde][a-g]*"  # tokens a..g are ids 0..6, </s> (EOS) is 7
N_SAMPLES = 6144


def _char_tokenizer(folder) -> e3.Tokenizer:
    vocab = {c: i for i, c in enumerate("abcdefg")} | {"</s>": 7}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None,
                 "added_tokens": [{"id": 7, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True}],
                 "normalizer": None, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."},
                                                       "behavior": "Isolated", "invert": False},
                 "post_processor": None,
                 "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "</s>"}}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "add_bos_token": False}, f)
    return e3.load_tokenizer(folder)


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    return _char_tokenizer(tmp_path_factory.mktemp("chars")), *random_pair_and_conditionals()


def _masked(z, allowed):
    z = np.array(z, np.float64)
    z[..., [t for t in range(V) if t not in allowed]] = -np.inf
    return z


@pytest.mark.parametrize("spec", ["tree", pytest.param("chain", marks=pytest.mark.slow)])
def test_sampled_constrained_speculation_follows_the_masked_distribution(char_models, spec):
    """The first three tokens under the regex: drawn from the target's distribution with the tokens
    the grammar forbids removed (before temperature and filters, as vLLM), under speculation."""
    tok, target, draft, cond = char_models
    temperature, top_k, top_p = 1.0, 5, 0.9
    shape = {"chain": e3.SpecConfig(2, 1, 3), "tree": e3.SpecConfig(2, 3, 6)}[spec]
    engine = e3.Engine(target, draft, shape, max_batch_size=2048, max_seq_len=32, tokenizer=tok)
    constraint = Constraint.regex(REGEX)
    sps = [e3.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, seed=77_000_000 + i,
                             constraint=constraint) for i in range(N_SAMPLES)]
    outs = engine.generate([PROMPT] * N_SAMPLES, sps)
    toks = np.asarray([o.token_ids for o in outs])
    assert toks.shape == (N_SAMPLES, 3)
    for o in outs:
        assert re.fullmatch(REGEX, tok.decode(o.token_ids)), o.token_ids
    counts = np.bincount((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2], minlength=V ** 3).reshape(V, V, V)
    exact = exact_continuations((_masked(cond[0], {0, 1}), _masked(cond[1], {2, 3, 4}), cond[2]),
                                temperature, top_k, top_p)
    stat, df, p = chisquare(counts, exact)
    accepted = np.bincount([a for o in outs for a in o.metrics["accept_lengths"]], minlength=4)
    print(f"\nconstrained {spec}: chi2={stat:.1f} df={df} p={p:.4g} accept lengths {accepted[1:].tolist()}")
    assert p > P_OK, (stat, df, p)
    assert accepted[2:].sum() > 0.05 * accepted.sum(), accepted  # drafts are accepted under the grammar


# ---- a mixed batch -----------------------------------------------------------------------------------

def test_mixed_batch_with_cancellations_leaks_nothing(demo):
    tok, target, draft, prompts = demo
    scheduler = e3.Scheduler(target, draft, e3.SpecConfig(3, 1, 4), max_num_seqs=32, max_seq_len=256, page_size=PAGE,
                             tokenizer=tok)
    wanted = {}
    for i in range(32):
        constraint = CONSTRAINTS[i % len(CONSTRAINTS)] if i % 3 != 2 else None
        sampling = e3.SamplingParams(max_tokens=48, constraint=constraint, logprobs=1 if i % 5 == 0 else None)
        rid = scheduler.add_request(prompts[i % len(prompts)], sampling)
        wanted[rid] = constraint
    cancel = [rid for i, rid in enumerate(wanted) if i % 4 == 1]
    done, steps = {}, 0
    while scheduler.has_unfinished():
        for delta in scheduler.step():
            if delta.finished:
                done[delta.request_id] = delta.output
        steps += 1
        if steps == 3:
            assert all(scheduler.abort(rid) for rid in cancel if rid not in done)
    assert len(done) == 32
    for rid, constraint in wanted.items():
        out = done[rid]
        if rid in cancel and out.finish_reason == "abort":
            continue
        if constraint is not None:
            assert out.finish_reason == "stop", (constraint, out)
            check_valid(constraint, tok.decode(out.token_ids))
        if out.logprobs is not None:  # the programs' logprob variants ran too
            assert len(out.logprobs) == len(out.token_ids)
    stats = scheduler.stats()
    assert stats["num_free_pages"] == stats["num_pages"] and stats["num_running"] == 0
    assert stats["num_constrained_requests"] == 0


# ---- through the server ------------------------------------------------------------------------------

def _request_field(constraint: Constraint) -> dict:
    """The constraint as vLLM clients send it (structured_outputs)."""
    value = json.loads(constraint.text) if constraint.kind in ("json_schema", "choice") else constraint.text
    return {"structured_outputs": {{"json_schema": "json"}.get(constraint.kind, constraint.kind): value}}


def test_served_outputs_are_valid_streamed_and_whole(demo):
    """The held-out constraints through /v1/completions with a speculating server: each reply
    valid, streamed == whole == the Engine's greedy output."""
    openai = pytest.importorskip("openai")
    from eagle3_jax.serving import AsyncEngine, make_app
    from server_fixtures import ServerThread

    tok, target, draft, prompts = demo
    scheduler = e3.Scheduler(target, draft, e3.SpecConfig(3, 2, 6), max_num_seqs=4, max_seq_len=256, page_size=PAGE,
                             tokenizer=tok)
    engine = AsyncEngine(scheduler, tokenizer=tok).start()
    server = ServerThread(make_app(engine, "demo"))
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    try:
        for i, constraint in enumerate(CONSTRAINTS):
            common = dict(model="demo", prompt=prompts[i % len(prompts)], temperature=0, max_tokens=48,
                          extra_body=_request_field(constraint))
            whole = client.completions.create(**common)
            streamed = "".join(c.choices[0].text for c in client.completions.create(**common, stream=True)
                               if c.choices)
            assert whole.choices[0].finish_reason == "stop", (constraint, whole.choices[0].text)
            assert whole.choices[0].text == streamed
            check_valid(constraint, streamed)
    finally:
        server.stop()
        engine.shutdown(timeout=10)


@pytest.mark.newest_jax  # CI's newest-JAX leg runs it
def test_a_multihost_leader_runs_the_single_program_forms(demo):
    """A leader (here alone: its broadcasts reach no follower) runs a constrained step's parts as
    one program each ("verify", masked "plain_decode" / "store_decode"): the same tokens."""
    tok, target, draft, prompts = demo
    constraints = [CONSTRAINTS[0], CONSTRAINTS[4], CONSTRAINTS[-1]]
    for spec in (e3.SpecConfig(3, 2, 6), None):
        outputs = []
        for lead in (False, True):
            scheduler = e3.Scheduler(target, draft if spec else None, spec, max_num_seqs=4, max_seq_len=256,
                                     page_size=PAGE, tokenizer=tok)
            if lead:
                scheduler.lead()
            outputs.append([o.token_ids for o in scheduler.generate(
                prompts[:3], [e3.SamplingParams(max_tokens=24, constraint=c) for c in constraints])])
            scheduler.release_followers()
        assert outputs[0] == outputs[1], spec


def test_chain_masks_filled_in_one_call_equal_the_walk(demo):
    """Chains are filled by llguidance for the whole batch at once: the same masks as the walk,
    nodes past a forbidden token included (every token: never reached)."""
    from eagle3_jax.structured import batch_tree_masks

    tok, target, _, _ = demo
    vocab = target.config.vocab_size
    cache = GrammarCache(tok, vocab)
    constraint = Constraint.json_schema(SCHEMAS[0])
    valid = tok.encode('{"name": "Tim", "age": 3}', add_bos=False)[1:]
    rng = np.random.default_rng(1)
    n, batch = 5, 6
    tokens = np.asarray([[0] + [valid[j] if rng.random() < 0.8 else int(rng.integers(0, vocab)) for j in range(n - 1)]
                         for _ in range(batch)], np.int32)
    parents = np.tile(np.maximum(np.arange(n) - 1, 0), (batch, 1)).astype(np.int32)
    grammars = [RequestGrammar(cache.matcher(constraint)) if row != 2 else None for row in range(batch)]
    masks = batch_tree_masks(grammars, tokens, parents, mask_words(vocab))
    for row, grammar in enumerate(grammars):
        expected = np.full((n, mask_words(vocab)), -1, np.int32)
        if grammar is not None:
            RequestGrammar(cache.matcher(constraint)).tree_masks(tokens[row], parents[row], expected)
        np.testing.assert_array_equal(masks[row], expected, err_msg=f"row {row}")
