"""The training planner compiles what a run compiles: its figures from shapes alone equal the ones of a
real run's programs (the same arguments and temporaries), and they grow with the sequence as a run's do."""

import jax
import numpy as np
import pytest

import eagle3_jax as e3
from pallas_kernels import launch
from eagle3_jax.train import data as data_lib
from eagle3_jax.train import draft_run
from eagle3_jax.train.data import teacher_forward
from eagle3_jax.train.plan import plan_training
from eagle3_jax.train.trainer import TrainConfig, compiled_bytes

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                                "(make test sets it)")

KIMI = "checkpoints/kimi-mini"
SEQ = 96


@pytest.mark.parametrize("mesh_shape,recipe", [
    ((2, 1, 4), draft_run.DraftRecipe(vocab_size=200, intermediate_size=96, ttt_steps=3, batch_size=2)),
    ((4, 2, 1), draft_run.DraftRecipe(arch="mla", ttt_steps=2, batch_size=1, context_parallel=True, sliding_window=40)),
])
def test_the_plan_equals_a_real_runs_programs(mesh_shape, recipe):
    mesh = e3.make_mesh(*mesh_shape)
    target = e3.load_target(KIMI, dtype="bfloat16", mesh=mesh)
    rng = np.random.default_rng(0)
    examples = [data_lib.Example(tokens=rng.integers(3, 500, SEQ).astype(np.int32), loss_mask=np.ones(SEQ, bool))
                for _ in range(8)]
    data = draft_run.prepare_data(examples, target.config.vocab_size, recipe)
    training = draft_run.DraftTraining(target, data, recipe, TrainConfig(compute_dtype="bfloat16"), mesh=mesh)
    (batch,) = [b for _, b in zip(range(1), draft_run.train_batches(target, data, recipe)(0))]
    plan = plan_training(KIMI, mesh, SEQ, recipe, dtype="bfloat16")

    assert plan.train_step == training.trainer.planned_bytes(batch)
    rows = jax.device_put(np.zeros((recipe.batch_size, SEQ), np.int32),
                          jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data" if recipe.batch_size % mesh_shape[0] == 0 else None)))
    with jax.set_mesh(mesh), launch.scatters_in_place():  # KV writes in place, as the plan counts them (a GPU's)
        real_teacher = compiled_bytes(teacher_forward.lower(
            target.params, target.config, rows, target.dtype).compile())
    assert plan.teacher == real_teacher
    assert plan.peak_bytes >= plan.target_bytes + plan.state_bytes + plan.batch_bytes


def test_the_plan_grows_with_the_sequence():
    mesh = e3.make_mesh(8, 1, 1)
    recipe = draft_run.DraftRecipe(vocab_size=256, intermediate_size=128, ttt_steps=3, batch_size=8)
    short, long = (plan_training(KIMI, mesh, n, recipe) for n in (512, 2048))
    assert long.batch_bytes == 4 * short.batch_bytes and long.state_bytes == short.state_bytes
    assert short.peak_bytes < long.peak_bytes <= 5 * short.peak_bytes
