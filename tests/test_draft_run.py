"""The draft run after regeneration (eagle3_jax/train/draft_run.py, what scripts/train_draft.py runs):
the held-out split, the vocabulary from the training responses only, the feature store reused,
refused or rewritten, and a short run that trains, resumes and exports a loadable draft."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.models import draft as draft_lib
from eagle3_jax.train import draft_run
from eagle3_jax.train.draft_model import assembled_params
from eagle3_jax.train.data import Example
from eagle3_jax.train.feature_store import FeatureStore
from eagle3_jax.train.trainer import TrainConfig
from random_models import FAMILIES, random_target

RECIPE = draft_run.DraftRecipe(vocab_size=40, intermediate_size=64, ttt_steps=2, batch_size=4, eval_fraction=0.25)


def _examples(n: int, seed: int = 0) -> list[Example]:
    """Prompt [1, 2, 3] + a response of ids in [4, 60), lengths 6 to 12."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        response = rng.integers(4, 60, int(rng.integers(3, 10)))
        tokens = np.concatenate([[1, 2, 3], response]).astype(np.int32)
        out.append(Example(tokens, np.arange(len(tokens)) >= 3))
    return out


def test_held_out_is_the_share_and_at_least_one_batch():
    assert draft_run.held_out_count(100, 0.05, 16) == 16
    assert draft_run.held_out_count(1000, 0.05, 16) == 50
    assert draft_run.held_out_count(10, 0.0, 4) == 4


def test_split_is_a_seeded_permutation_with_the_held_out_first():
    examples = _examples(20)
    train, held_out = draft_run.split_examples(examples, 0.25, 4, seed=3)
    order = np.random.default_rng(3).permutation(20)
    assert [id(e) for e in held_out] == [id(examples[i]) for i in order[:5]]
    assert [id(e) for e in train] == [id(examples[i]) for i in order[5:]]
    again, _ = draft_run.split_examples(examples, 0.25, 4, seed=3)
    assert [id(e) for e in again] == [id(e) for e in train]


def test_prepare_data_counts_only_training_responses_and_packs_in_rows_of_the_longest():
    examples = _examples(20)
    _, held_out = draft_run.split_examples(examples, RECIPE.eval_fraction, RECIPE.batch_size, RECIPE.seed)
    for e in held_out:  # a token only the held-out responses use: not worth a draft id
        e.tokens[-1] = 63
    data = draft_run.prepare_data(examples, 64, RECIPE)
    longest = max(len(e.tokens) for e in examples)
    assert data.train_tokens.shape[1] == data.eval_tokens.shape[1] == longest
    # packed: every example whole (its positions from 0), in fewer rows, at least a batch of them
    assert RECIPE.batch_size <= len(data.train_tokens) < 15 and RECIPE.batch_size <= len(data.eval_tokens) <= 5
    assert ((data.train_positions == 0) & (data.train_tokens == 1)).sum() == 15  # each starts with the prompt 1, 2, 3
    assert data.train_mask.shape == data.train_positions.shape == data.train_tokens.shape
    assert data.eval_mask.sum() == sum(e.loss_mask.sum() for e in held_out)
    assert data.train_mask.sum() == sum(e.loss_mask.sum() for e in examples) - data.eval_mask.sum()
    assert data.vocab.draft_vocab_size == 40 and 63 not in set(data.vocab.draft_ids.tolist())
    full = draft_run.prepare_data(examples, 64, draft_run.DraftRecipe(batch_size=4, eval_fraction=0.25))
    assert full.vocab.draft_vocab_size == 64  # vocab_size 0: the target's vocabulary


@pytest.fixture(scope="module")
def target():
    return random_target(dict(FAMILIES["llama"], num_hidden_layers=4))


def test_feature_store_is_reused_refused_or_rewritten(target, tmp_path):
    data = draft_run.prepare_data(_examples(20), 64, RECIPE)
    path = str(tmp_path / "features")
    store = draft_run.offline_store(path, target, data)
    assert draft_run.store_matches(store, data, target) and len(store) == len(data.train_tokens)
    written = os.path.getmtime(path)
    assert draft_run.store_matches(draft_run.offline_store(path, target, data), data, target)
    assert os.path.getmtime(path) == written  # a matching store is read, not written again
    # another draft vocabulary: the same store (it keeps the hidden state the logits are made from)
    revocab = draft_run.prepare_data(_examples(20), 64, draft_run.DraftRecipe(vocab_size=30, batch_size=4,
                                                                              eval_fraction=0.25))
    assert revocab.vocab.draft_vocab_size != data.vocab.draft_vocab_size
    assert draft_run.store_matches(draft_run.offline_store(path, target, revocab), revocab, target)
    assert os.path.getmtime(path) == written
    other = draft_run.prepare_data(_examples(20, seed=1), 64, RECIPE)
    with pytest.raises(draft_run.StaleFeatureStore, match="written for other data or another target"):
        draft_run.offline_store(path, target, other)
    assert draft_run.store_matches(draft_run.offline_store(path, target, other, overwrite=True), other, target)
    batches = list(draft_run.train_batches(target, other, RECIPE, FeatureStore(path))(0))
    assert len(batches) == len(other.train_tokens) // 4 and all(len(b["tokens"]) == 4 for b in batches)
    # a store in another version of the format (one written before packing): refused by name, or rewritten
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump(dict(meta, version=1), f)
    with pytest.raises(draft_run.StaleFeatureStore, match="cannot be read .*store version 1"):
        draft_run.offline_store(path, target, other)
    assert draft_run.store_matches(draft_run.offline_store(path, target, other, overwrite=True), other, target)


def test_a_feature_store_of_another_target_is_not_reused(tmp_path):
    """The store records the target folder it came from: the same rows under another target are
    refused by name (and rewritten with overwrite)."""
    kimi, stories = (e3.load_target(f"checkpoints/{name}", dtype="float32") for name in ("kimi-mini", "stories260K"))
    data = draft_run.prepare_data(_examples(12), 512, RECIPE)
    path = str(tmp_path / "features")
    draft_run.offline_store(path, kimi, data)
    with pytest.raises(draft_run.StaleFeatureStore, match="another target"):
        draft_run.offline_store(path, stories, data)
    assert draft_run.store_matches(draft_run.offline_store(path, stories, data, overwrite=True), data, stories)


def test_a_short_run_trains_resumes_and_exports_a_loadable_draft(target, tmp_path):
    data = draft_run.prepare_data(_examples(24), 64, RECIPE)
    tc = TrainConfig(epochs=1, learning_rate=3e-3, warmup_steps=1, compute_dtype="float32")
    ckpt = str(tmp_path / "ckpt")
    training = draft_run.DraftTraining(target, data, RECIPE, tc, ckpt_dir=ckpt)
    assert training.steps_per_epoch == 18 // 4 and training.config.has_draft_vocab
    online = list(draft_run.train_batches(target, data, RECIPE)(0))
    assert len(online) == 4 and online[0]["tokens"].shape[0] == 4
    logs: list[str] = []
    history = training.fit(draft_run.train_batches(target, data, RECIPE), progress=False, log=logs.append)
    assert len(history) == 1 and history[0]["step"] == 4 and "eval_loss" in history[0]
    out = training.export(str(tmp_path / "draft"), dtype="float32", extra_files={"training_log.json": "{}"})
    assert os.path.isfile(os.path.join(out, "training_log.json"))
    draft = e3.load_draft(out, target=target, dtype="float32")
    assert draft.config.draft_vocab_size == 40
    again = draft_run.DraftTraining(target, data, RECIPE, tc, ckpt_dir=ckpt)
    logs.clear()
    assert again.fit(draft_run.train_batches(target, data, RECIPE), progress=False, log=logs.append) == []
    assert logs == ["all 4 steps were trained before; nothing left to train"]


def test_an_eagle31_draft_trains_exports_and_reloads_as_it_trained(target, tmp_path):
    """fc_norm, norm_output and norm_before_fc on, and a sliding window: the trained draft's export
    carries the switches, the window and their weights, and the reloaded draft gives the logits the
    trained parameters give."""
    recipe = dataclasses.replace(RECIPE, fc_norm=True, norm_output=True, norm_before_fc=True, sliding_window=4)
    data = draft_run.prepare_data(_examples(12), 64, recipe)
    tc = TrainConfig(epochs=1, learning_rate=3e-3, warmup_steps=1, compute_dtype="float32")
    training = draft_run.DraftTraining(target, data, recipe, tc)
    training.fit(draft_run.train_batches(target, data, recipe), progress=False, log=lambda _: None)
    out = training.export(str(tmp_path / "draft"), dtype="float32")
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    assert raw["fc_norm"] is raw["norm_output"] is raw["norm_before_fc"] is True
    assert raw["layer_types"] == ["sliding_attention"] and raw["sliding_window"] == 4
    draft = e3.load_draft(out, target=target, dtype="float32")
    assert draft.config.fc_norm and draft.config.norm_output and draft.config.norm_before_fc
    assert draft.config.layer_windows == (4,)
    assert not np.allclose(np.asarray(draft.params["fc_norm.0"]), 1.0)  # trained, not left at its init
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (1, 9))  # longer than the window
    aux = rng.standard_normal((1, 9, 3 * target.config.hidden_size)).astype(np.float32)
    trained = assembled_params(training.trainer.state.params, training.frozen)
    want = draft_lib.Draft(training.config, trained, np.dtype(np.float32), target).logits(ids, aux)
    np.testing.assert_allclose(draft.logits(ids, aux), want, rtol=1e-5, atol=1e-5)
