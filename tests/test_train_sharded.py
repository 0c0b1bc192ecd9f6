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
from eagle3_jax.train.placement import sharded_spec
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


def bytes_per_device(tree) -> int:
    """Bytes the arrays of `tree` hold on their most loaded device (their shards' sizes)."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def train(examples, mesh, tmp_path, name, steps=50):
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
    assert len(single) >= 50
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


def run_train_draft(args: list[str], num_processes: int, devices_each: int, timeout: int = 900) -> list[str]:
    """scripts/train_draft.py in `num_processes` processes of `devices_each` fake CPU devices joined as
    one job (EAGLE3_COORDINATOR on 127.0.0.1 with --distributed when more than one); their outputs."""
    from test_multihost import child_xla_flags, free_port

    port, procs = free_port(), []
    for i in range(num_processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(devices_each))
        if num_processes > 1:
            env.update(EAGLE3_COORDINATOR=f"127.0.0.1:{port}", EAGLE3_NUM_PROCESSES=str(num_processes),
                       EAGLE3_PROCESS_ID=str(i))
        extra = ["--distributed"] if num_processes > 1 else []
        procs.append(subprocess.Popen([sys.executable, "scripts/train_draft.py", *args, *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.newest_jax
def test_two_processes_train_like_one_and_resume_in_one(tmp_path):
    """Two processes x 4 devices (mesh 2,1,4: the data axis across them) train and export the same
    draft as one process x 8, with the teacher online or from one offline store that each process
    writes and reads its own rows of; the files are written once; a one-process run restores the
    two processes' checkpoint and exports the same draft again."""
    common = [f"--target={KIMI}", "--prompts=checkpoints/demo_prompts.txt", "--max_tokens=24", "--batch_size=2",
              "--epochs=2", "--ttt_steps=2", "--compute_dtype=float32", "--save_dtype=float32", "--mesh=2,1,4"]
    run_train_draft([*common, f"--out={tmp_path / 'one'}"], 1, 8)
    outs = run_train_draft([*common, f"--out={tmp_path / 'two'}"], 2, 4)
    assert all("exported" in out for out in outs)
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys()
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    outs = run_train_draft([*common, "--mode=offline", f"--out={tmp_path / 'offline'}"], 2, 4)
    assert all("bytes per token" in out for out in outs)
    offline = load_file(tmp_path / "offline" / "model.safetensors")
    for key in one:
        np.testing.assert_allclose(offline[key], one[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # the finished two-process run, its output removed and its record reopened: one process restores its last step
    record = tmp_path / "two.ckpt" / "run.json"
    record.write_text(record.read_text().replace('"finished": true', '"finished": false'))
    for f in (tmp_path / "two").iterdir():
        f.unlink()
    (tmp_path / "two").rmdir()
    (out,) = run_train_draft([*common, f"--out={tmp_path / 'two'}"], 1, 8)
    assert "nothing left to train" in out and "regenerated before" in out
    again = load_file(tmp_path / "two" / "model.safetensors")
    for key in one:
        np.testing.assert_array_equal(again[key], two[key], err_msg=key)
