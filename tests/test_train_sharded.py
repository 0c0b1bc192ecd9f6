"""A draft trained with its target sharded over the mesh (as serving shards it) and its own state split
over the devices: the same losses and the same exported draft as on one device."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import eagle3_jax as e3
from eagle3_jax.train import data as data_lib
from eagle3_jax.train import draft_run
from eagle3_jax.train.placement import bytes_per_device, sharded_spec
from eagle3_jax.train.trainer import TrainConfig

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                                "(make test sets it)")

KIMI = "checkpoints/kimi-mini"


@pytest.fixture(scope="module")
def examples():
    target = e3.load_target(KIMI, dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, 500, 6))) for _ in range(20)]
    return data_lib.regenerate(target, prompts, max_tokens=26, batch_size=20)


def train(examples, mesh, tmp_path, name, steps=48):
    """Trains the bundled pair's kind of draft for `steps` steps with the target on `mesh`; its
    losses, its exported weights and the draft state's bytes on the fullest device."""
    target = e3.load_target(KIMI, dtype="float32", mesh=mesh)
    recipe = draft_run.DraftRecipe(vocab_size=256, intermediate_size=128, ttt_steps=3, batch_size=4, eval_fraction=0.1)
    data = draft_run.prepare_data(examples, target.config.vocab_size, recipe)
    steps_per_epoch = len(data.train_tokens) // recipe.batch_size
    tc = TrainConfig(epochs=-(-steps // steps_per_epoch), learning_rate=3e-3, warmup_steps=4, compute_dtype="float32")
    training = draft_run.DraftTraining(target, data, recipe, tc, mesh=mesh)
    losses = []
    training.trainer.fit(draft_run.train_batches(target, data, recipe), steps_per_epoch, progress=False,
                         log=lambda s: None, on_step=lambda s, m: losses.append(m["loss"]))
    folder = training.export(str(tmp_path / name), dtype="float32")
    return losses, load_file(f"{folder}/model.safetensors"), bytes_per_device(training.trainer.state)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8), (2, 1, 4)])
def test_training_on_the_targets_mesh_equals_one_device(examples, tmp_path, mesh_shape):
    single, single_weights, single_bytes = train(examples, None, tmp_path, "single")
    sharded, sharded_weights, sharded_bytes = train(examples, e3.make_mesh(*mesh_shape), tmp_path, "sharded")
    assert len(single) >= 48
    np.testing.assert_allclose(sharded, single, rtol=1e-5)
    assert sharded_weights.keys() == single_weights.keys()
    for key, value in single_weights.items():
        np.testing.assert_allclose(sharded_weights[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
    assert sharded_bytes < single_bytes / 4  # the draft's weights and moments split, not copied per device


def test_state_split_over_the_most_devices_that_divide():
    mesh = e3.make_mesh(2, 1, 4)
    assert sharded_spec((512, 96), mesh) == jax.sharding.PartitionSpec(("data", "expert"), None)
    assert sharded_spec((6, 12), mesh) == jax.sharding.PartitionSpec(None, "expert")  # 8 divides neither: 4 does
    assert sharded_spec((3,), mesh) == jax.sharding.PartitionSpec()
    assert sharded_spec((), mesh) == jax.sharding.PartitionSpec()


def test_a_mesh_that_leaves_the_target_whole_is_refused(tmp_path):
    """kimi-mini's 8 experts over an expert axis of 3: refused in one line naming the meshes that
    divide, before the target loads; nothing written."""
    out = tmp_path / "d"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    r = subprocess.run([sys.executable, "scripts/train_draft.py", f"--target={KIMI}", "--prompts=checkpoints/demo_prompts.txt",
                        "--mesh=1,1,3", "--batch_size=1", f"--out={out}"], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "--mesh" in last and "expert axis (3) does not divide experts=8" in last and "1,1,2; 1,1,4" in last, last
    assert not out.exists() and not (tmp_path / "d.ckpt").exists()
