"""Data-parallel attention: on a mesh with a `data` axis each device holds the KV pages of its own
rows and attends over them alone (kv_cache.on_data_shards), while the routed experts are split over
data x expert. The same forward passes give the same logits as one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_target

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache
from eagle3_jax.models.target import forward
from eagle3_jax.runtime.sharding import mesh_context, shard_pages

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def shard_tables(batch: int, shards: int, pages_per_shard: int, pages_per_row: int, seed: int = 0) -> np.ndarray:
    """Block tables [batch, pages_per_row] whose rows take pages of their own data shard only
    (row r on shard r // (batch / shards)), shuffled, never a shard's first page."""
    rng = np.random.default_rng(seed)
    rows = batch // shards
    table = np.zeros((batch, pages_per_row), np.int32)
    for d in range(shards):
        pages = d * pages_per_shard + 1 + rng.permutation(pages_per_shard - 1)[: rows * pages_per_row]
        table[d * rows: (d + 1) * rows] = pages.reshape(rows, pages_per_row)
    return table


@needs_8
@pytest.mark.parametrize("family", ["deepseek_v3", pytest.param("minimax_m2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 1, 4), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_rows_attend_their_own_pages(family, mesh_shape):
    mesh = e3.make_mesh(*mesh_shape)
    shards, batch, page_size, per_row = mesh_shape[0], 8, 4, 6
    per_shard = batch // shards * per_row + 1
    ref = random_target(FAMILIES[family])
    sharded = random_target(FAMILIES[family], mesh=mesh)
    table = shard_tables(batch, shards, per_shard, per_row)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, 64, (batch, 12)), jnp.int32)
    draft = jnp.asarray(rng.integers(0, 64, (batch, 4)), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, 13, batch), jnp.int32)
    tree = np.tril(np.ones((4, 4), bool))
    tree[3, 2] = False
    tree = jnp.asarray(np.broadcast_to(tree, (batch, 4, 4)))
    step = jax.jit(forward, static_argnums=1)

    def run(target, data_shards):
        k, v = kv_cache.init_pages(target.config, shards * per_shard, page_size, jnp.float32)
        if target.mesh is not None:
            k, v = shard_pages(k, v, target.config, target.mesh)
        cache = kv_cache.paged_view(k, v, table, jnp.zeros(batch, jnp.int32), data_shards=data_shards)
        with mesh_context(target.mesh):
            prefill, _, cache = step(target.params, target.config, prompt, jnp.broadcast_to(jnp.arange(12), (batch, 12)),
                                     cache)
            cache = cache.replace(lengths=lengths)
            verify, _, _ = step(target.params, target.config, draft, lengths[:, None] + jnp.arange(4)[None], cache, tree)
        return np.asarray(prefill), np.asarray(verify)

    want = run(ref, 1)
    got = run(sharded, shards)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=0)


@needs_8
@pytest.mark.slow  # its 2,1,4 case runs in test_context_parallel's scheduler test, beside spread requests
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_scheduler_on_data_shards_equals_one_device(mesh_shape):
    """Mixed prompt lengths through the Scheduler, prefix caching on (a second run takes the cached
    pages), plain, chain and tree: the tokens of one device. Each request's pages
    are on its own data shard, and the pool's pages are split over the shards."""
    from random_models import random_draft

    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(1, 64, 20)]
    prompts = [shared + [int(t) for t in rng.integers(1, 64, n)] for n in (1, 9, 3, 17, 5)] + [[7, 8], [9] * 11]
    sp = e3.SamplingParams(max_tokens=10)
    ref_target = random_target(FAMILIES["deepseek_v3"])
    mesh = e3.make_mesh(*mesh_shape)
    target = random_target(FAMILIES["deepseek_v3"], mesh=mesh)
    shards = mesh_shape[0]
    for spec in (None, e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)):
        def run(t):
            draft = None if spec is None else random_draft(t)
            sched = e3.Scheduler(t, draft, spec, max_num_seqs=shards, max_seq_len=64, page_size=4,
                                 prefix_caching=True)
            first = [o.token_ids for o in sched.generate(prompts, sp)]
            again = [o.token_ids for o in sched.generate(prompts, sp)]  # their prompts' pages cached now
            assert again == first
            return first, sched

        want, _ = run(ref_target)
        got, sched = run(target)
        assert got == want, spec
        pools = jax.tree.leaves(sched._executor.state.tk)
        assert all(p.sharding.spec[1] == "data" for p in pools) and sched.stats()["prefix_cache_hits_total"] > 0
        assert {r for r in range(shards)} >= set(sched._batch.table.shard[:shards].tolist())


@needs_8
def test_fp8_pages_on_data_shards():
    """FP8 pages (values and their scales) split over data shards: a GQA + MoE model's chain
    speculation gives the tokens of one device's FP8 cache."""
    from random_models import random_draft

    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 64, n)] for n in (5, 19, 3, 11)]
    sp = e3.SamplingParams(max_tokens=8)

    def run(mesh):
        target = random_target(FAMILIES["minimax_m2"], mesh=mesh)
        sched = e3.Scheduler(target, random_draft(target), e3.SpecConfig(3, 1, 4), max_num_seqs=4, max_seq_len=64,
                             page_size=4, kv_cache_dtype="fp8")
        return [o.token_ids for o in sched.generate(prompts, sp)]

    assert run(e3.make_mesh(4, 1, 2)) == run(None)


def test_a_batch_the_data_axis_does_not_divide_is_refused():
    from eagle3_jax.scheduler.core import _pool_pages

    assert _pool_pages(None, 6, 10, 2) == 2 * (3 * 10 + 1)
    with pytest.raises(ValueError, match="max_num_seqs=6 must be a multiple of the mesh's data axis \\(4\\)"):
        _pool_pages(None, 6, 10, 4)
    assert _pool_pages(9, 4, 10, 2) == 10  # rounded up to equal shares, with a warning
    with pytest.raises(ValueError, match="each of the 4 data shards reserves a page"):
        _pool_pages(7, 4, 10, 4)
