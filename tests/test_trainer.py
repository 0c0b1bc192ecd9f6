"""Draft training end to end (tiny): loss falls, acceptance rises, resume continues the same curve."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import eagle3_jax as e3
from eagle3_jax.train import data as data_lib
from eagle3_jax.train.draft_model import assembled_params, init_draft_params, make_ttt_loss, new_draft_config
from eagle3_jax.train.export import export_hf_draft
from eagle3_jax.train.trainer import Trainer, TrainConfig
from eagle3_jax.train.vocab import count_tokens, select_draft_vocab
from random_models import FAMILIES, random_target

BATCH = 8


@pytest.fixture(scope="module")
def setup():
    target = random_target(dict(FAMILIES["llama"], num_hidden_layers=4))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 64, 4))) for _ in range(48)]
    examples = data_lib.regenerate(target, prompts, max_tokens=20, temperatures=(0.0,), batch_size=48)
    vocab = select_draft_vocab(count_tokens([e.tokens for e in examples], [e.loss_mask for e in examples],
                                            vocab_size=64), 48)
    tokens, mask, positions = data_lib.pack(examples, 24)
    cfg = new_draft_config(target.config, vocab, intermediate_size=64)
    return target, prompts, vocab, tokens, mask, cfg, positions


def make_trainer(setup, ckpt_dir=None, epochs=1, lr=3e-3):
    target, _, vocab, tokens, mask, cfg, positions = setup
    params, frozen = init_draft_params(cfg, target, vocab, seed=0)
    steps = len(tokens) // BATCH
    tc = TrainConfig(epochs=epochs, learning_rate=lr, warmup_steps=2, checkpoint_every=2, compute_dtype="float32")
    trainer = Trainer(make_ttt_loss(cfg, vocab, num_steps=3), params, frozen, tc, total_steps=steps * epochs,
                      ckpt_dir=ckpt_dir)

    def batches(epoch):
        return data_lib.online_batches(target, tokens, mask, BATCH, seed=0, epoch=epoch,
                                       positions=positions)

    return trainer, batches, steps, frozen


def engine_tau(target, draft, prompts):
    outs = e3.Engine(target, draft=draft, spec=e3.SpecConfig(3, 1, 4), max_batch_size=16, max_seq_len=64).generate(
        prompts[:16], e3.SamplingParams(max_tokens=16))
    return float(np.mean([a for o in outs for a in o.metrics["accept_lengths"]]))


def test_training_lowers_loss_and_raises_acceptance(setup, tmp_path):
    target, prompts, vocab, tokens, mask, cfg, _ = setup
    trainer, batches, steps, frozen = make_trainer(setup, epochs=8)
    evaluate = lambda p: trainer.evaluate(batches(0))  # noqa: E731
    before = evaluate(None)
    d0 = export_hf_draft(tmp_path / "d0", cfg, assembled_params(trainer.state.params, frozen), vocab, dtype="float32")
    history = trainer.fit(batches, steps, evaluate=evaluate, progress=False, log=lambda s: None)
    after = history[-1]
    assert after["eval_loss"] < 0.9 * before["eval_loss"]  # soft CE: the target entropy is a floor
    assert after["eval_acc_0"] > before["eval_acc_0"] + 0.2
    assert after["eval_sim_tau"] > before["eval_sim_tau"] + 0.5
    d1 = export_hf_draft(tmp_path / "d1", cfg, assembled_params(trainer.state.params, frozen), vocab, dtype="float32")
    tau0 = engine_tau(target, e3.load_draft(d0, target=target, dtype="float32"), prompts)
    tau1 = engine_tau(target, e3.load_draft(d1, target=target, dtype="float32"), prompts)
    assert tau1 > tau0 + 0.3, (tau0, tau1)


def test_resume_continues_the_same_loss_curve(setup, tmp_path):
    ref_losses = {}
    trainer, batches, steps, _ = make_trainer(setup)
    trainer.fit(batches, steps, progress=False, log=lambda s: None, on_step=lambda s, m: ref_losses.__setitem__(s, m["loss"]))
    ref_params = jax.device_get(trainer.state.params)

    class Interrupted(Exception):
        pass

    def interrupted(epoch):
        for i, b in enumerate(batches(epoch)):
            if i == 4:
                raise Interrupted  # the process dies after step 4 (checkpointed at step 4)
            yield b

    first, _, _, _ = make_trainer(setup, ckpt_dir=tmp_path / "ckpt")
    with pytest.raises(Interrupted):
        first.fit(interrupted, steps, progress=False, log=lambda s: None)
    resumed_losses, said = {}, []
    second, _, _, _ = make_trainer(setup, ckpt_dir=tmp_path / "ckpt")
    second.fit(batches, steps, progress=False, log=said.append,
               on_step=lambda s, m: resumed_losses.__setitem__(s, m["loss"]))
    assert said[0] == f"resuming from step 4 of {steps}"
    assert min(resumed_losses) == 5 and max(resumed_losses) == steps
    np.testing.assert_allclose([resumed_losses[s] for s in range(5, steps + 1)],
                               [ref_losses[s] for s in range(5, steps + 1)], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
                 jax.device_get(second.state.params), ref_params)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (make test sets it)")
def test_data_parallel_training_equals_single_device(setup):
    """Rows over 8 devices, or each sequence over 4 (context parallelism): the one-device losses."""
    target, _, vocab, tokens, mask, cfg, positions = setup
    losses = {}
    for name, mesh in [("single", None), ("data8", e3.make_mesh(data=8)), ("context4", e3.make_mesh(data=4, tensor=2))]:
        params, frozen = init_draft_params(cfg, target, vocab, seed=0)
        tc = TrainConfig(epochs=1, learning_rate=3e-3, warmup_steps=1, compute_dtype="float32")
        split = name.startswith("context")  # each sequence over the data axis, not the batch's rows
        trainer = Trainer(make_ttt_loss(cfg, vocab, num_steps=3, context=(mesh, "data") if split else None), params,
                          frozen, tc, total_steps=3, mesh=mesh,
                          batch_spec=PartitionSpec(None, "data") if split else PartitionSpec("data"))
        batches = lambda epoch: data_lib.online_batches(  # noqa: E731
            target, tokens, mask, BATCH, seed=0, epoch=epoch, positions=positions)
        got = []
        trainer.fit(batches, 3, progress=False, log=lambda s: None, on_step=lambda s, m: got.append(m["loss"]))
        losses[name] = got
        if mesh is not None:
            assert trainer.state.params["fc"].sharding.is_fully_replicated
    np.testing.assert_allclose(losses["data8"], losses["single"], rtol=2e-5)
    np.testing.assert_allclose(losses["context4"], losses["single"], rtol=2e-5)


def test_bench_train_records_memory_and_speed_against_the_length(tmp_path):
    """scripts/bench_train.py: a row per length and form (bounded, and the whole form up to
    --baseline_max_len), each with XLA's plan, the process's peak, tokens/s and the ratio to half
    the length; the command and machine recorded."""
    out = tmp_path / "train-memory.json"
    r = subprocess.run([sys.executable, "scripts/bench_train.py", "--target=checkpoints/stories260K", "--seq_lens=64,128",
                        "--baseline_max_len=64", "--ttt_steps=2", "--steps=1", f"--json_out={out}"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert "bench_train.py" in record["command"] and record["machine"]["cpu_count"] >= 1
    rows = record["rows"]
    assert [(row["bounded"], row["length"]) for row in rows] == [(True, 64), (True, 128), (False, 64)]
    for row in rows:
        assert row["plan_peak_bytes"] > 0 and row["peak_resident_bytes"] > 0 and row["tokens_per_s"] > 0
    assert "plan_peak_vs_half" in rows[1] and "plan_peak_vs_half" not in rows[0]
    assert "| bounded T=128 |" in r.stdout


def test_train_draft_regenerates_once(tmp_path):
    """A second draft trained on the same target, prompts and generation flags reads the first run's
    regenerated responses (the target generates nothing) and trains on the same examples."""
    common = ["--target=checkpoints/stories260K", "--prompts=checkpoints/demo_prompts.txt", "--max_tokens=12",
              "--batch_size=2", "--epochs=1", "--ttt_steps=2", "--eval_fraction=0"]
    first = subprocess.run([sys.executable, "scripts/train_draft.py", *common, f"--out={tmp_path / 'a'}"],
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    kept = tmp_path / "a.ckpt" / "regenerated.npz"
    assert f"(kept in {kept})" in first.stdout
    second = subprocess.run([sys.executable, "scripts/train_draft.py", *common, "--fc_norm", f"--regenerated={kept}",
                             f"--out={tmp_path / 'b'}"], capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"regenerated before, read from {kept}" in second.stdout and "regenerated 8" not in second.stdout
    stale = subprocess.run([sys.executable, "scripts/train_draft.py", *common, "--max_tokens=13",
                            f"--regenerated={kept}", f"--out={tmp_path / 'c'}"], capture_output=True, text=True,
                           timeout=900)
    assert stale.returncode != 0 and "--max_tokens" in stale.stderr.strip().splitlines()[-1]
