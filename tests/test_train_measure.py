"""Training measures its draft as serving does (the Engine, held-out prompts) and exports the best one."""

import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.train import data as data_lib
from eagle3_jax.train import draft_run
from eagle3_jax.train.measure import Measurement, measured_acceptance
from eagle3_jax.train.trainer import TrainConfig
from random_models import FAMILIES, random_target


@pytest.fixture(scope="module")
def run():
    target = random_target(dict(FAMILIES["llama"], num_hidden_layers=4))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 64, 4))) for _ in range(40)]
    examples = data_lib.regenerate(target, prompts, max_tokens=20, batch_size=40)
    recipe = draft_run.DraftRecipe(vocab_size=48, intermediate_size=64, ttt_steps=3, batch_size=4, eval_fraction=0.2)
    data = draft_run.prepare_data(examples, target.config.vocab_size, recipe)
    return target, data, recipe


def test_held_out_prompts_are_the_held_out_examples_prompts(run):
    _, data, _ = run
    assert len(data.eval_prompts) == 8
    # each held-out example, packed where it fits, starts with its prompt (not learned) and then its response
    starts = [(r, c) for r, c in zip(*np.nonzero(data.eval_positions == 0)) if data.eval_mask[r, c:c + 5].any()]
    rows = sorted(tuple(data.eval_tokens[r, c:c + 4]) for r, c in starts)
    assert rows == sorted(data.eval_prompts) and all(len(p) == 4 for p in data.eval_prompts)
    for r, c in starts:
        assert not data.eval_mask[r, c:c + 4].any() and data.eval_mask[r, c + 4]


def test_the_best_measured_draft_is_exported(run, tmp_path):
    target, data, recipe = run
    measurement = Measurement(prompts=data.eval_prompts, every=2, max_tokens=12)
    training = draft_run.DraftTraining(target, data, recipe, TrainConfig(epochs=3, learning_rate=3e-3, warmup_steps=2,
                                       compute_dtype="float32"), ckpt_dir=str(tmp_path / "ckpt"), measurement=measurement)
    said = []
    history = training.fit(draft_run.train_batches(target, data, recipe), progress=False, log=said.append)
    steps = training.steps_per_epoch * 3
    assert sorted(training.measured) == list(range(2, steps + 1, 2)) + ([steps] if steps % 2 else [])
    assert [h["measured_tau"] for h in history] == [training.measured[h["step"]]["tau"] for h in history]
    taus = {step: m["tau"] for step, m in training.measured.items()}
    best = max(taus.values())
    assert training.best["tau"] == best and training.best["step"] == max(s for s, t in taus.items() if t == best)
    assert any("measured tau" in line for line in said)
    # the export is the best step's draft: measured again through a loaded copy, the same tau
    out = training.export(str(tmp_path / "draft"), dtype="float32")
    draft = e3.load_draft(out, target=target, dtype="float32")
    assert measured_acceptance(target, draft, measurement)["tau"] == pytest.approx(best, abs=1e-9)
    # a resumed run knows its best: nothing left to train, and it exports the same draft
    again = draft_run.DraftTraining(target, data, recipe, TrainConfig(epochs=3, learning_rate=3e-3, warmup_steps=2,
                                    compute_dtype="float32"), ckpt_dir=str(tmp_path / "ckpt"), measurement=measurement)
    assert again.best == training.best
    again.trainer.restore_latest()
    params, step = again.exported_params()
    assert step == training.best["step"]
    first, _ = training.exported_params()
    np.testing.assert_array_equal(np.asarray(params["fc"]), np.asarray(first["fc"]))
