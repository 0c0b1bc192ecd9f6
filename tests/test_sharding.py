"""The same programs on 1 device and on an 8-device mesh give equal results."""

import jax
import numpy as np
import pytest
from random_models import FAMILIES, random_target

import eagle3_jax as e3
from eagle3_jax.runtime.sharding import partition_spec

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (make test sets it)")

MESHES = [(2, 2, 2), (1, 8, 1), (1, 2, 4), (8, 1, 1), (2, 1, 4)]


@needs_8
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_logits_equal_unsharded(family, mesh_shape):
    ids = np.random.default_rng(0).integers(0, 64, (4, 10))
    ref = random_target(FAMILIES[family]).logits(ids)
    sharded = random_target(FAMILIES[family], mesh=e3.make_mesh(*mesh_shape))
    leaves = jax.tree.leaves(sharded.params)
    assert any(len(leaf.sharding.device_set) == 8 for leaf in leaves)
    dense_on_data = mesh_shape[1] == 1 and family == "llama"  # no tensor axis: a dense model is whole everywhere
    assert any(not leaf.sharding.is_fully_replicated for leaf in leaves) != dense_on_data
    np.testing.assert_allclose(sharded.logits(ids), ref, atol=1e-5 * np.abs(ref).max())


@needs_8
@pytest.mark.slow  # the default run shards the scheduler and speculation below
@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
def test_sharded_generation_equals_unsharded(family):
    prompts = [[1, 5, 9], [3, 4, 5, 6, 7, 8, 9]]
    sp = e3.SamplingParams(max_tokens=8)
    ref = e3.Engine(random_target(FAMILIES[family]), max_batch_size=2, max_seq_len=64).generate(prompts, sp)
    mesh = e3.make_mesh(2, 2, 2)
    out = e3.Engine(random_target(FAMILIES[family], mesh=mesh), max_batch_size=2, max_seq_len=64).generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


@needs_8
def test_sharded_speculative_generation_equals_unsharded():
    from random_models import random_draft

    prompts = [[1, 2, 3], [4, 5]]
    sp = e3.SamplingParams(max_tokens=8)
    ref = e3.Engine(random_target(FAMILIES["deepseek_v3"]), max_batch_size=2, max_seq_len=64).generate(prompts, sp)
    target = random_target(FAMILIES["deepseek_v3"], mesh=e3.make_mesh(2, 2, 2))
    eng = e3.Engine(target, draft=random_draft(target), spec=e3.SpecConfig(3, 2, 6), max_batch_size=2, max_seq_len=64)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in ref]


def test_experts_and_heads_follow_the_rules():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "tensor", "expert"))
    assert partition_spec(("experts", "embed", "expert_mlp"), (8, 32, 16), mesh) == jax.sharding.PartitionSpec("expert", None, "tensor")


@needs_8
def test_experts_split_over_data_and_expert():
    """Data-parallel attention: the routed experts over every device of data x expert, dense
    weights whole on each data shard; experts that data x expert does not divide over expert alone."""
    P = jax.sharding.PartitionSpec
    mesh = e3.make_mesh(2, 1, 4)
    assert partition_spec(("experts", "embed", "expert_mlp"), (8, 32, 16), mesh) == P(("data", "expert"), None, "tensor")
    assert partition_spec(("experts", "embed", "expert_mlp"), (12, 32, 16), mesh) == P("expert", None, "tensor")
    assert partition_spec(("experts", "embed", "expert_mlp"), (8, 32, 16), e3.make_mesh(8, 1, 1)) == P("data", None, "tensor")
    assert partition_spec(("embed", "mlp"), (32, 48), mesh) == P(None, "tensor")
    target = random_target(FAMILIES["deepseek_v3"], mesh=e3.make_mesh(8, 1, 1))
    experts = target.params["segments"][1]["experts_gate"]
    assert experts.addressable_shards[0].data.shape[1] == 1  # [L, E/8, H, I]: one expert per device


@needs_8
def test_indivisible_dims_are_replicated():
    mesh = e3.make_mesh(1, 8, 1)
    # 12 heads' columns over 8 devices do not divide: replicate rather than fail.
    assert partition_spec(("embed", "q_heads"), (32, 12), mesh) == jax.sharding.PartitionSpec(None, None)
    assert partition_spec(("embed", "q_heads"), (32, 16), mesh) == jax.sharding.PartitionSpec(None, "tensor")


def test_bad_mesh_size_is_rejected():
    with pytest.raises(ValueError, match="devices"):
        e3.make_mesh(3, 5, 7)


@needs_8
def test_sharded_scheduler_equals_unsharded():
    """Paged pools on a mesh (latent pages split like a dense cache), with speculation."""
    from random_models import random_draft

    prompts = [[1, 2, 3], [4, 5], [6] * 9]
    sp = e3.SamplingParams(max_tokens=8)
    ref = e3.Engine(random_target(FAMILIES["deepseek_v3"]), max_batch_size=4, max_seq_len=64).generate(prompts, sp)
    target = random_target(FAMILIES["deepseek_v3"], mesh=e3.make_mesh(2, 2, 2))
    sched = e3.Scheduler(target, random_draft(target), e3.SpecConfig(3, 2, 6), max_num_seqs=2, max_seq_len=64)
    assert [o.token_ids for o in sched.generate(prompts, sp)] == [o.token_ids for o in ref]


@needs_8
@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("minimax_m2", marks=pytest.mark.slow),
                                    pytest.param("llama", marks=pytest.mark.slow)])
def test_sharded_sampled_speculation_equals_unsharded(family):
    """Sampled (lossless) tree speculation: the same per-request keys give the same tokens on a
    mesh whose expert axis splits the routed experts (expert-parallel MoE) as on one device."""
    from random_models import random_draft

    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    sp = [e3.SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, seed=s) for s in (11, 12)]
    spec = e3.SpecConfig(3, 2, 6)

    def run(mesh):
        target = random_target(FAMILIES[family], mesh=mesh)
        engine = e3.Engine(target, draft=random_draft(target), spec=spec, max_batch_size=2, max_seq_len=64)
        return [o.token_ids for o in engine.generate(prompts, sp)]

    assert run(e3.make_mesh(1, 2, 4)) == run(None)


@needs_8
@pytest.mark.parametrize("mesh_shape", [(2, 1, 4), (1, 1, 8)], ids=["data2-expert4", "expert8"])
def test_kernels_on_a_mesh(mesh_shape, kernel_calls):
    """kernels="triton" on a mesh: the routed experts run the grouped kernels inside each
    expert-parallel shard and attention its kernel on each data shard's rows (expert-only meshes
    replicate it); decode / verify logits of a dense cache equal one device's XLA path
    (paged caches on data and tensor meshes: test_kernel_mesh.py)."""
    import dataclasses

    import jax.numpy as jnp

    from eagle3_jax.cache import kv_cache
    from eagle3_jax.models.target import forward

    ref = random_target(FAMILIES["deepseek_v3"])
    mesh = e3.make_mesh(*mesh_shape)
    sharded = random_target(FAMILIES["deepseek_v3"], mesh=mesh)
    sharded = dataclasses.replace(sharded, config=dataclasses.replace(sharded.config, kernels="triton"))
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 64, (2, 10)), jnp.int32)
    cache = ref.init_cache(2, 32)
    _, _, cache = forward(ref.params, ref.config, prompt, jnp.broadcast_to(jnp.arange(10), (2, 10)), cache)
    cache = kv_cache.advance(cache, jnp.asarray([10, 6], jnp.int32))
    toks = jnp.asarray(rng.integers(0, 64, (2, 4)), jnp.int32)
    pos = cache.lengths[:, None] + jnp.arange(4)[None]
    tree = jnp.asarray(np.broadcast_to(np.tril(np.ones((4, 4), bool)), (2, 4, 4)))
    step = jax.jit(forward, static_argnums=1)
    want = step(ref.params, ref.config, toks, pos, cache, tree)[0]
    with jax.set_mesh(mesh):
        got = step(sharded.params, sharded.config, toks, pos, cache, tree)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(np.abs(want).max()))
    assert set(kernel_calls) == {"grouped_swiglu", "paged_prefix_attention"}
