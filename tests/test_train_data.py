"""Draft-training data: vocabulary selection, HF export round trip, prompts, regeneration by the
target, packing, and the teacher batches of the online and offline (feature store) modes."""

from __future__ import annotations

import collections
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, LLAMA, draft_config_dict, random_draft, random_target

import eagle3_jax as e3
from eagle3_jax.models.draft import parse_draft_config
from eagle3_jax.train.data import teacher_forward
from eagle3_jax.train import (
    DraftVocab,
    Example,
    FeatureStore,
    batch_order,
    count_tokens,
    export_hf_draft,
    load_prompts,
    online_batches,
    pack,
    regenerate,
    select_draft_vocab,
    teacher_batch,
    teacher_head,
    write_feature_store,
)

V = LLAMA["vocab_size"]


# ---- vocab --------------------------------------------------------------------------------------------


def test_count_tokens_matches_counter():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, V, size=int(n)) for n in rng.integers(0, 40, size=12)]
    masks = [rng.random(len(s)) < 0.6 for s in seqs]
    ref = collections.Counter(int(t) for s, m in zip(seqs, masks) for t, keep in zip(s, m) if keep)
    got = count_tokens(seqs, masks, vocab_size=V)
    assert got.dtype == np.int64 and got.shape == (V,)
    assert {i: int(c) for i, c in enumerate(got) if c} == dict(ref)
    # unmasked, and a 2-D array input
    arr = rng.integers(0, V, size=(3, 7))
    ref2 = collections.Counter(arr.reshape(-1).tolist())
    assert {i: int(c) for i, c in enumerate(count_tokens(arr, vocab_size=V)) if c} == dict(ref2)
    with pytest.raises(ValueError, match="outside"):
        count_tokens([[0, V]], vocab_size=V)
    with pytest.raises(ValueError, match="masks"):
        count_tokens([[1, 2]], [[True], [False]], vocab_size=V)


def _check_vocab(dv: DraftVocab, vd: int):
    assert dv.draft_ids.dtype == np.int64 and dv.d2t.dtype == np.int64 and dv.t2d.dtype == np.bool_
    assert dv.draft_ids.shape == (vd,) and dv.t2d.shape == (V,)
    assert np.all(np.diff(dv.draft_ids) > 0)
    np.testing.assert_array_equal(np.arange(vd) + dv.d2t, dv.draft_ids)  # target = draft + d2t[draft]
    np.testing.assert_array_equal(np.flatnonzero(dv.t2d), dv.draft_ids)


def test_select_draft_vocab_ties_and_mass():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 5, size=V)  # many ties
    for vd in (1, 7, 20, V):
        dv = select_draft_vocab(counts, vd)
        ref = sorted(sorted(range(V), key=lambda i: (-counts[i], i))[:vd])
        np.testing.assert_array_equal(dv.draft_ids, ref)
        _check_vocab(dv, vd)
        assert dv.covered_mass == pytest.approx(sum(counts[i] for i in ref) / counts.sum())
    assert select_draft_vocab(counts, V).covered_mass == pytest.approx(1.0)


def test_select_draft_vocab_fills_with_lowest_unused_ids():
    counts = np.zeros(V, np.int64)
    counts[[40, 9, 33]] = [5, 5, 1]
    dv = select_draft_vocab(counts, 6)
    np.testing.assert_array_equal(dv.draft_ids, [0, 1, 2, 9, 33, 40])
    _check_vocab(dv, 6)
    assert dv.covered_mass == pytest.approx(1.0)
    assert select_draft_vocab(np.zeros(V), 3).covered_mass == 0.0
    for bad in (0, V + 1):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            select_draft_vocab(counts, bad)


# ---- export round trip -----------------------------------------------------------------------------------

EXPORT_CASES = {
    "single": dict(num_layers=1),
    "two_layers_embed": dict(num_layers=2, include_embed=True),
    "reduced": dict(num_layers=1, reduced=True),
    "aux_ids_embed_nbr": dict(num_layers=1, aux=True, include_embed=True, norm_before_residual=True),
    "two_layers_reduced_aux": dict(num_layers=2, reduced=True, aux=True),
}


def _export_case(num_layers, reduced=False, aux=False, include_embed=False, norm_before_residual=False):
    target = random_target(dict(LLAMA, num_hidden_layers=4))
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}} if aux else {}
    if norm_before_residual:
        extra["norm_before_residual"] = True
    raw = draft_config_dict(target.config, draft_vocab_size=24 if reduced else None, num_layers=num_layers,
                            rope_theta=5000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                            **extra)
    vocab = select_draft_vocab(np.random.default_rng(2).integers(0, 9, size=V), 24) if reduced else None
    draft = random_draft(target, raw, with_embed=include_embed, d2t=vocab.d2t if reduced else None)
    return target, draft, vocab


def loaded_aux_ids(path, target):
    return e3.load_draft(path, target=target, dtype="float32").aux_layer_ids


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_round_trip(case, tmp_path):
    opts = dict(EXPORT_CASES[case])
    include_embed = opts.pop("include_embed", False)
    target, draft, vocab = _export_case(**opts, include_embed=include_embed)
    out = export_hf_draft(tmp_path / "draft", draft.config, draft.params, vocab, dtype="float32",
                          include_embed=include_embed)
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["torch_dtype"] == "float32"
    assert parse_draft_config(raw) == draft.config
    if opts.get("aux"):
        assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
        assert loaded_aux_ids(out, target) == (0, 1, 2)  # a list not starting at 1: id k = hidden_states[k]
    assert raw.get("norm_before_residual", False) == draft.config.norm_before_residual
    loaded = e3.load_draft(out, target=target, dtype="float32")
    rng = np.random.default_rng(3)
    ids = rng.integers(0, V, size=(2, 9))
    aux = rng.standard_normal((2, 9, 3 * target.config.hidden_size)).astype(np.float32)
    np.testing.assert_array_equal(loaded.logits(ids, aux), draft.logits(ids, aux))
    assert ("d2t" in loaded.params) == bool(opts.get("reduced"))
    if opts.get("reduced"):
        np.testing.assert_array_equal(np.asarray(loaded.params["d2t"]), vocab.d2t)
    assert [p for p in os.listdir(tmp_path) if p != "draft"] == []  # no temp folders left behind


def _vllm_names(keys):
    """vLLM Eagle3LlamaForCausalLM.load_weights renames: t2d skipped, d2t -> draft_id_to_target_id,
    "midlayer." -> "layers.0.", everything but lm_head under "model."."""
    out = set()
    for name in keys:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add(name.replace("d2t", "draft_id_to_target_id"))
            continue
        if "lm_head" not in name:
            name = "model." + name
        out.add(name.replace("midlayer.", "layers.0."))
    return out


def _vllm_params(num_layers, reduced, embed):
    layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    names = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.hidden_norm.weight"}
    names |= {f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in layer}
    if reduced:
        names.add("draft_id_to_target_id")
    if embed:
        names.add("model.embed_tokens.weight")
    return names


@pytest.mark.parametrize("case", ["single", "two_layers_reduced_aux", "aux_ids_embed_nbr"])
def test_export_keys_follow_vllm_and_sglang_rules(case, tmp_path):
    from safetensors import safe_open

    torch = pytest.importorskip("torch")
    opts = dict(EXPORT_CASES[case])
    include_embed = opts.pop("include_embed", False)
    target, draft, vocab = _export_case(**opts, include_embed=include_embed)
    out = export_hf_draft(tmp_path / "d", draft.config, draft.params, vocab, include_embed=include_embed)  # bfloat16
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:  # the reference reader
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    keys = set(tensors)
    single = opts["num_layers"] == 1
    assert any(k.startswith("midlayer.") for k in keys) == single
    assert not any(k.startswith("layers.1.hidden_norm") for k in keys)
    assert _vllm_names(keys) == _vllm_params(opts["num_layers"], opts.get("reduced", False), include_embed)
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tuple(tensors["fc.weight"].shape) == (draft.config.hidden_size, 3 * draft.config.target_hidden_size)
    assert tuple(tensors["lm_head.weight"].shape) == (draft.config.draft_vocab_size, draft.config.hidden_size)
    if opts.get("reduced"):
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert tensors["t2d"].shape == (V,) and int(tensors["t2d"].sum()) == draft.config.draft_vocab_size
        # vLLM / SGLang: target ids = d2t + arange(draft_vocab)
        np.testing.assert_array_equal((tensors["d2t"] + torch.arange(24)).numpy(), vocab.draft_ids)
    # the bf16 export loads and runs close to the float32 draft
    loaded = e3.load_draft(out, target=target, dtype="float32")
    rng = np.random.default_rng(4)
    ids, aux = rng.integers(0, V, size=(1, 6)), rng.standard_normal((1, 6, 3 * 32)).astype(np.float32)
    np.testing.assert_allclose(loaded.logits(ids, aux), draft.logits(ids, aux), atol=0.15, rtol=0.05)


def test_export_errors_and_replacement(tmp_path):
    target, draft, vocab = _export_case(num_layers=1, reduced=True)
    out = tmp_path / "d"
    export_hf_draft(out, draft.config, draft.params, None, dtype="float32")  # d2t taken from params
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        export_hf_draft(out, draft.config, draft.params, vocab, dtype="float32")
    export_hf_draft(out, draft.config, draft.params, vocab, dtype="float32", overwrite=True)  # replaces it
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists"):
        export_hf_draft(foreign, draft.config, draft.params, vocab)
    assert (foreign / "notes.txt").read_text() == "mine"
    other = select_draft_vocab(np.arange(V), 24)
    with pytest.raises(ValueError, match="disagrees"):
        export_hf_draft(tmp_path / "x", draft.config, draft.params, other)
    with pytest.raises(ValueError, match="DraftVocab"):
        export_hf_draft(tmp_path / "x", draft.config, draft.params, select_draft_vocab(np.arange(V), 10))
    with pytest.raises(ValueError, match="dtype"):
        export_hf_draft(tmp_path / "x", draft.config, draft.params, vocab, dtype="int8")
    bad = dict(draft.params, layers=[dict(draft.params["layers"][0], q_proj=jnp.zeros((3, 3)))])
    with pytest.raises(ValueError, match="q_proj"):
        export_hf_draft(tmp_path / "x", draft.config, bad, vocab)
    assert sorted(os.listdir(tmp_path)) == ["d", "foreign"]


# ---- prompts ------------------------------------------------------------------------------------------------


def test_load_prompts_formats(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "What is 2+2?", "answer": "4"}\n\n{"question": "And 3+3?", "answer": "6"}\n')
    assert load_prompts(gsm) == ["What is 2+2?", "And 3+3?"]
    assert load_prompts(gsm, limit=1) == ["What is 2+2?"]
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}) + "\n")
    assert load_prompts(mt) == ["Write a poem."]
    share = tmp_path / "sharegpt.json"
    share.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Tell a joke."},
                                      {"from": "gpt", "value": "..."}]},
        {"id": "b", "conversations": []},  # skipped
        {"id": "c", "conversations": [{"from": "human", "value": "Summarize X."}]},
    ]))
    assert load_prompts(share) == ["Tell a joke.", "Summarize X."]
    txt = tmp_path / "p.txt"
    txt.write_text("Once upon a time\n\n   \nThe cat\n")
    assert load_prompts(txt) == ["Once upon a time", "The cat"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="extension"):
        load_prompts(tmp_path / "p.csv")
    (tmp_path / "odd.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="unknown record format"):
        load_prompts(tmp_path / "odd.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"question": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:1"):
        load_prompts(tmp_path / "broken.jsonl")


# ---- regeneration and packing --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return random_target(LLAMA)


def test_regenerate_greedy_matches_engine_and_masks_responses(target):
    # every engine call here runs waves of 2 rows in a 32-token cache: one prefill + one decode compile
    prompts = [[1, 5, 9], [7, 8, 9, 10, 11]]
    kw = dict(max_tokens=6, batch_size=2, max_seq_len=32)
    exs = regenerate(target, prompts, temperatures=(0.0, 1.0), seed=3, **kw)
    assert len(exs) == 4
    ref = e3.Engine(target, max_batch_size=2, max_seq_len=32).generate(prompts, e3.SamplingParams(max_tokens=6))
    for i, p in enumerate(prompts):
        for j in range(2):
            ex = exs[2 * i + j]
            assert ex.tokens.dtype == np.int32 and ex.loss_mask.dtype == np.bool_
            assert list(ex.tokens[: len(p)]) == p and len(ex.tokens) == len(p) + 6
            np.testing.assert_array_equal(ex.loss_mask, np.arange(len(ex.tokens)) >= len(p))
        assert list(exs[2 * i].tokens[len(p):]) == ref[i].token_ids
    # teacher-forced check: every greedy response token is the target's argmax after its prefix
    greedy = [exs[0].tokens, exs[2].tokens]
    padded = np.zeros((2, max(map(len, greedy))), np.int32)
    for i, g in enumerate(greedy):
        padded[i, : len(g)] = g
    logits = target.logits(padded)
    for i, (p, g) in enumerate(zip(prompts, greedy)):
        np.testing.assert_array_equal(logits[i, len(p) - 1: len(g) - 1].argmax(-1), g[len(p):])
    # sampled responses are reproducible from the seed
    again = regenerate(target, prompts[:1], temperatures=(0.0, 1.0), seed=3, **kw)
    np.testing.assert_array_equal(again[1].tokens, exs[1].tokens)
    # a stop token ends the response and stays in it
    stop = int(exs[0].tokens[len(prompts[0]) + 1])
    first = regenerate(target, prompts, stop_token_ids=(stop,), **kw)[0]
    resp = list(first.tokens[3:])
    assert resp[-1] == stop and stop not in resp[:-1] and len(resp) <= 2


def test_regeneration_speculating_with_a_draft_gives_the_targets_own_responses(target):
    """train_draft.py --regen_draft: the target regenerates with a draft speculating (chain), and the
    greedy responses are the plain ones token for token."""
    draft = random_draft(target, draft_config_dict(target.config))
    prompts = [[1, 5, 9], [7, 8, 9, 10, 11], [3, 4]]
    kw = dict(max_tokens=8, batch_size=3, max_seq_len=32)
    plain, speculated = regenerate(target, prompts, **kw), regenerate(target, prompts, draft=draft, **kw)
    for a, b in zip(plain, speculated):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_regenerated_examples_are_kept_and_read_back_only_for_their_key(tmp_path):
    """save_examples / load_examples: the same examples back for the same key; nothing for a missing
    file; the settings that differ named for another key."""
    from eagle3_jax.train.data import Example, StaleExamples, load_examples, save_examples

    rng = np.random.default_rng(0)
    examples = [Example(tokens=rng.integers(0, 64, n).astype(np.int32), loss_mask=np.arange(n) >= 2) for n in (5, 9, 3)]
    path = tmp_path / "regenerated.npz"
    key = {"--max_tokens": 6, "--temperatures": ["0"], "data": "abc"}
    assert load_examples(path, key) is None
    save_examples(path, examples, key)
    back = load_examples(path, dict(reversed(list(key.items()))))  # the key's order does not matter
    assert len(back) == 3
    for got, want in zip(back, examples):
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
    with pytest.raises(StaleExamples, match="--max_tokens 6 -> 7"):
        load_examples(path, dict(key, **{"--max_tokens": 7}))
    # a flag added since the responses were kept: they ran as its default, and match only that
    added, defaults = dict(key, **{"--conversations": None}), {"--conversations": None}
    assert len(load_examples(path, added, defaults)) == 3
    with pytest.raises(StaleExamples, match="--conversations None -> chats.jsonl"):
        load_examples(path, dict(added, **{"--conversations": "chats.jsonl"}), defaults)
    with pytest.raises(StaleExamples, match="--conversations unset -> None"):
        load_examples(path, added)
    save_examples(path, [], key)
    assert load_examples(path, key) == [] and os.listdir(tmp_path) == ["regenerated.npz"]


def test_pack_lays_whole_examples_in_few_rows_each_counting_from_zero():
    lengths = (6, 10, 3, 4, 12)
    exs = [Example(np.arange(100 * i + 1, 100 * i + 1 + n, dtype=np.int32), np.arange(n) >= 2)
           for i, n in enumerate(lengths)]
    tokens, mask, positions = pack(exs, 10)
    assert tokens.dtype == positions.dtype == np.int32 and mask.dtype == np.bool_ and tokens.shape == (4, 10)
    # longest first, each into the roomiest row that holds it: [10], [12 cut to 10], [6, 4], [3, padding]
    np.testing.assert_array_equal(tokens[0], np.arange(101, 111))
    np.testing.assert_array_equal(tokens[1], np.arange(401, 411))
    np.testing.assert_array_equal(tokens[2], np.concatenate([np.arange(1, 7), np.arange(301, 305)]))
    np.testing.assert_array_equal(positions[2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    np.testing.assert_array_equal(mask[2], [0, 0, 1, 1, 1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(tokens[3], [201, 202, 203] + [0] * 7)
    np.testing.assert_array_equal(positions[3], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6])  # the padding: a sequence of its own
    assert not mask[3, 3:].any()
    # at least a batch of rows while there are examples for them: the short ones spread out
    tokens, _, positions = pack(exs[:1] + exs[2:4], 20, min_rows=2)
    assert tokens.shape == (2, 20) and [list(np.flatnonzero(p[:(t != 0).sum()] == 0)) for p, t in zip(positions, tokens)] \
        == [[0], [0, 4]]
    assert pack(exs[:1], 20, min_rows=4)[0].shape == (1, 20)


def test_teacher_sees_each_packed_sequence_alone():
    """Three sequences packed in rows of 32 and run in passes of 8 (sequences straddle the passes):
    each one's features, logits and argmax equal its teacher alone, for MLA + MoE, GQA + MoE and a
    dense GQA target; positions that do not count from 0 through each sequence are refused."""
    rng = np.random.default_rng(2)
    exs = [Example(rng.integers(1, 64, n).astype(np.int32), np.ones(n, bool)) for n in (13, 11, 8)]
    tokens, _, positions = pack(exs, 32)
    assert tokens.shape == (1, 32)
    starts = list(np.flatnonzero(positions[0] == 0))[:3]
    for family in ("deepseek_v3", "minimax_m2", "llama"):
        target = random_target(FAMILIES[family])
        packed = teacher_forward(target.params, target.config, jnp.asarray(tokens), target.dtype, chunk=8,
                                 positions=jnp.asarray(positions))
        for ex, at in zip(exs, starts):
            n = len(ex.tokens)
            alone = teacher_forward(target.params, target.config, jnp.asarray(ex.tokens[None]), target.dtype)
            for key, value in alone.items():
                np.testing.assert_allclose(np.asarray(packed[key][0, at:at + n], np.float32),
                                           np.asarray(value[0], np.float32), rtol=1e-5, atol=1e-5,
                                           err_msg=f"{family} {key} at {at}")
    with pytest.raises(ValueError, match="count 0, 1"):
        teacher_batch(target, tokens, positions=positions + 1)


# ---- teacher batches: online vs offline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, V, size=(10, 12)).astype(np.int32)
    mask = rng.random((10, 12)) < 0.5
    draft_ids = select_draft_vocab(count_tokens(tokens, mask, vocab_size=V), 20).draft_ids
    return tokens, mask, draft_ids


def test_teacher_batch_matches_target_logits(target, rows):
    """The teacher's hidden state times the head at the draft ids is the target's logits there (as
    the loss makes them); its argmax and features are the target's."""
    tokens, _, draft_ids = rows
    tb = teacher_batch(target, tokens[:4])
    logits, aux = target.logits(tokens[:4], return_aux=True)
    assert tb["teacher_hidden"].dtype == target.dtype and tb["teacher_hidden"].shape == (4, 12, 32)
    assert tb["teacher_argmax"].dtype == jnp.int32
    assert tb["aux"].dtype == target.dtype and tb["aux"].shape == (4, 12, 3 * 32)
    head = teacher_head(target, draft_ids)
    assert head.shape == (32, len(draft_ids))
    remade = jnp.dot(tb["teacher_hidden"], head, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(remade), logits[..., draft_ids], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(tb["teacher_argmax"]), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(tb["aux"]), aux)
    with pytest.raises(ValueError, match="draft_ids"):
        teacher_head(target, [V])


def test_batch_order():
    a = batch_order(10, 4, seed=1, epoch=0)
    assert [len(b) for b in a] == [4, 4]
    full = batch_order(10, 4, seed=1, epoch=0, drop_last=False)
    assert [len(b) for b in full] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(full), np.random.default_rng(1 * 1000003).permutation(10))
    assert not np.array_equal(np.concatenate(full), np.concatenate(batch_order(10, 4, seed=1, epoch=1, drop_last=False)))


def test_online_and_feature_store_batches_are_identical(target, rows, tmp_path):
    tokens, mask, draft_ids = rows
    positions = np.tile(np.arange(12, dtype=np.int32), (10, 1))
    positions[::2, 5:] -= 5  # the even rows hold two sequences
    path = write_feature_store(tmp_path / "store", target, tokens, mask, batch_size=3, progress=False,
                               shard_size=3, positions=positions)
    store = FeatureStore(path)
    assert len(store) == 10 and store.seq_len == 12
    # per token: 3 feature layers and the hidden state (float32, hidden 32), argmax, token, position, mask
    assert store.bytes_per_token == (3 + 1) * 32 * 4 + 4 + 4 + 4 + 1
    assert store.aux_layer_ids == tuple(target.config.aux_layer_ids)
    for drop_last in (True, False):
        off = list(store.batches(4, seed=7, epoch=2, drop_last=drop_last))
        on = list(online_batches(target, tokens, mask, 4, seed=7, epoch=2, drop_last=drop_last,
                                 positions=positions))
        assert len(off) == len(on) == (2 if drop_last else 3)
        for a, b, idx in zip(off, on, batch_order(10, 4, seed=7, epoch=2, drop_last=drop_last)):
            assert set(a) == set(b) == {"tokens", "loss_mask", "positions", "aux", "teacher_hidden", "teacher_argmax"}
            for k in a:
                assert a[k].dtype == np.asarray(b[k]).dtype, k
                np.testing.assert_array_equal(a[k], np.asarray(b[k]), err_msg=k)  # bitwise (float32 target)
            np.testing.assert_array_equal(a["tokens"], tokens[idx])
            np.testing.assert_array_equal(a["loss_mask"], mask[idx])
            np.testing.assert_array_equal(a["positions"], positions[idx])
    # read lazily (as training lays a batch on the mesh, each process its own rows): the same values
    for a, b in zip(store.batches(4, seed=7, epoch=2, lazy=True), store.batches(4, seed=7, epoch=2)):
        for k in a:
            assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
            np.testing.assert_array_equal(np.asarray(a[k]), b[k], err_msg=k)
            np.testing.assert_array_equal(a[k][1:3], b[k][1:3], err_msg=k)
    e2 = np.concatenate([b["tokens"] for b in store.batches(4, seed=7, epoch=2)])
    e3_ = np.concatenate([b["tokens"] for b in store.batches(4, seed=7, epoch=3)])
    assert not np.array_equal(e2, e3_)
    ref = teacher_batch(target, tokens[[9, 0]], positions=positions[[9, 0]])
    got = store.rows([9, 0])
    np.testing.assert_array_equal(got["teacher_hidden"], np.asarray(ref["teacher_hidden"]))


def test_feature_store_bfloat16_and_validation(rows, tmp_path):
    tokens, mask, _ = rows
    bf = random_target(LLAMA, dtype=jnp.bfloat16)
    path = write_feature_store(tmp_path / "s", bf, tokens[:5], mask[:5], batch_size=8, progress=False)
    store = FeatureStore(path)
    (batch,) = store.batches(5, seed=0, epoch=0)
    (online,) = online_batches(bf, tokens[:5], mask[:5], 5, seed=0, epoch=0)
    assert batch["aux"].dtype == jnp.bfloat16
    np.testing.assert_allclose(batch["aux"].astype(np.float32), np.asarray(online["aux"], np.float32), rtol=0.02, atol=0.02)
    assert batch["teacher_hidden"].dtype == jnp.bfloat16 and FeatureStore(path).bytes_per_token == 4 * 32 * 2 + 13
    np.testing.assert_array_equal(batch["teacher_hidden"].astype(np.float32), np.asarray(online["teacher_hidden"], np.float32))
    # a store is replaced only when asked
    with pytest.raises(ValueError, match="already exists"):
        write_feature_store(path, bf, tokens[:2], mask[:2], batch_size=8, progress=False)
    write_feature_store(path, bf, tokens[:2], mask[:2], batch_size=8, progress=False, overwrite=True)
    assert len(FeatureStore(path)) == 2
    os.remove(os.path.join(path, "shard00000.aux.npy"))
    with pytest.raises(FileNotFoundError, match="shard00000.aux.npy"):
        FeatureStore(path)
    with pytest.raises(FileNotFoundError, match="meta.json"):
        FeatureStore(tmp_path)
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        write_feature_store(tmp_path / "y", bf, tokens, mask[:2], progress=False)


def test_the_teacher_in_passes_equals_one_pass():
    """A sequence longer than the teacher's chunk runs as passes over a KV cache (the last one
    padded): the same features, logits and argmax as one pass, for an MLA + MoE and a GQA target."""
    for family in ("deepseek_v3", "llama"):
        target = random_target(FAMILIES[family])
        ids = jnp.asarray(np.random.default_rng(1).integers(1, 64, (2, 37)), jnp.int32)
        whole = teacher_forward(target.params, target.config, ids, target.dtype, chunk=64)
        passes = teacher_forward(target.params, target.config, ids, target.dtype, chunk=8)
        for key, value in whole.items():
            assert passes[key].shape == value.shape
            np.testing.assert_allclose(np.asarray(passes[key], np.float32), np.asarray(value, np.float32),
                                       rtol=1e-5, atol=1e-5, err_msg=f"{family} {key}")
