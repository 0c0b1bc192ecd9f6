"""Context-parallel rows (cache/spread.py): a row whose pages are dealt over the data shards, at
the same place in every shard's part of the batch, attends over each shard's pages and merges the
partials: the same logits as one device holding every page, beside rows of one shard each; a
tree's accepted path moved across shards reads back the same."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_target
from test_data_parallel import needs_8

import eagle3_jax as e3
from eagle3_jax.cache import kv_cache, spread
from eagle3_jax.models.target import forward
from eagle3_jax.runtime.sharding import mesh_context, shard_pages
from eagle3_jax.spec_decode.verify import commit_path


def spread_tables(batch: int, shards: int, per_shard: int, per_row: int, spread_pages: int) -> np.ndarray:
    """Block tables [batch, spread_pages]: the first row of every shard's part one spread row (its
    logical page j on shard j mod shards), the others `per_row` shuffled pages of their own shard;
    no page taken twice, never a shard's first."""
    rng = np.random.default_rng(0)
    rows = batch // shards
    table = np.zeros((batch, spread_pages), np.int32)
    for d in range(shards):
        own = d * per_shard + 1 + rng.permutation(rows * per_row)
        table[d * rows: (d + 1) * rows, :per_row] = own.reshape(rows, per_row)
    table[::rows] = [(j % shards) * per_shard + 1 + rows * per_row + j // shards for j in range(spread_pages)]
    return table


def test_spread_rows_are_those_alike_on_every_shard():
    table = np.array([[3, 4], [5, 0], [3, 4], [9, 0], [3, 4], [0, 0], [3, 4], [0, 0]])
    got = spread.spread_rows(jnp.asarray(table), 4)
    np.testing.assert_array_equal(got, [True, False] * 4)  # all-scratch padding rows are not spread
    np.testing.assert_array_equal(spread.spread_rows(jnp.asarray(table[1:7]), 2), [False] * 6)


@needs_8
@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m2"])
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_a_spread_row_attends_over_every_shard(family, mesh_shape):
    mesh = e3.make_mesh(*mesh_shape)
    shards, batch, page_size, per_row, spread_pages = mesh_shape[0], 8, 4, 4, 10
    rows = batch // shards
    per_shard = rows * per_row + spread_pages // shards + 2
    ref = random_target(FAMILIES[family])
    sharded = random_target(FAMILIES[family], mesh=mesh)
    table = spread_tables(batch, shards, per_shard, per_row, spread_pages)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 64, (batch, 12))
    prompt[::rows] = prompt[0]  # the spread row's replicas: the same inputs
    lengths = rng.integers(1, 13, batch)
    lengths[::rows] = 9  # its accepted node 3 (slot 12, page 3) moves to slot 11 (page 2): across shards
    draft = rng.integers(0, 64, (batch, 4))
    draft[::rows] = draft[0]
    tree = np.tril(np.ones((4, 4), bool))
    tree[3, 2] = False
    tree = jnp.asarray(np.broadcast_to(tree, (batch, 4, 4)))
    path = jnp.asarray(np.broadcast_to([0, 1, 3], (batch, 3)), jnp.int32)  # nodes 0, 1, 3 accepted
    step = jax.jit(forward, static_argnums=1)
    prompt, draft, lengths = (jnp.asarray(a, jnp.int32) for a in (prompt, draft, lengths))
    positions = jnp.broadcast_to(jnp.arange(12), (batch, 12))

    def run(target, data_shards):
        k, v = kv_cache.init_pages(target.config, shards * per_shard, page_size, jnp.float32)
        if target.mesh is not None:
            k, v = shard_pages(k, v, target.config, target.mesh)
        cache = kv_cache.paged_view(k, v, table, jnp.zeros(batch, jnp.int32), data_shards=data_shards)
        with mesh_context(target.mesh):
            prefill, _, cache = step(target.params, target.config, prompt, positions, cache)
            cache = cache.replace(lengths=lengths)
            verify, _, cache = step(target.params, target.config, draft, lengths[:, None] + jnp.arange(4)[None], cache,
                                    tree)
            cache = jax.jit(commit_path)(cache, path, jnp.full(batch, 3, jnp.int32))
            after, _, _ = step(target.params, target.config, draft[:, :1], cache.lengths[:, None], cache)
        return np.asarray(prefill), np.asarray(verify), np.asarray(after)

    want = run(ref, 1)
    got = run(sharded, shards)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=0)


@needs_8
@pytest.mark.parametrize("mesh_shape", [pytest.param((8, 1, 1), marks=pytest.mark.slow), (2, 1, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_scheduler_spreads_long_requests_as_one_device_runs_them(mesh_shape, caplog):
    """Mixed prompt lengths through the Scheduler on data shards, prefix caching on (a second run
    takes the cached pages): requests of context_parallel_len tokens or more are spread over every
    data shard (pages dealt over the shards, a replica row on each), the others hold their pages on
    one shard each, and the pool's pages are split over the shards. Plain, chain and tree give one
    device's tokens."""
    from random_models import random_draft

    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(1, 64, 20)]
    prompts = ([shared + [int(t) for t in rng.integers(1, 64, n)] for n in (1, 9, 3, 17, 5)] + [[7, 8], [9] * 11]
               + [[int(t) for t in rng.integers(1, 64, 41)]])
    sp = e3.SamplingParams(max_tokens=10)
    ref_target = random_target(FAMILIES["deepseek_v3"])
    mesh = e3.make_mesh(*mesh_shape)
    target = random_target(FAMILIES["deepseek_v3"], mesh=mesh)
    shards = mesh_shape[0]
    for spec in (None, e3.SpecConfig(3, 1, 4), e3.SpecConfig(3, 2, 6)):
        def run(t):
            sched = e3.Scheduler(t, None if spec is None else random_draft(t), spec, max_num_seqs=2 * shards,
                                 max_seq_len=64, page_size=4, prefix_caching=True, context_parallel_len=35)
            first = [o.token_ids for o in sched.generate(prompts, sp)]
            again = [o.token_ids for o in sched.generate(prompts, sp)]  # their prompts' pages cached now
            assert again == first
            return first, sched

        want, _ = run(ref_target)
        with caplog.at_level("INFO", logger="eagle3_jax"):
            got, sched = run(target)
        assert got == want, spec
        assert (sched._batch.table.shard == -1).sum() >= 1  # a slot held a spread request
        assert "requests of 35 tokens or more" in caplog.text and "is spread over the" in caplog.text  # said
        pools = jax.tree.leaves(sched._executor.state.tk)
        assert all(p.sharding.spec[1] == "data" for p in pools) and sched.stats()["prefix_cache_hits_total"] > 0


def test_context_parallel_len_is_checked():
    from eagle3_jax.scheduler.core import _spread_len

    assert _spread_len(None, 2 * (4 * 10 + 1), 8, 16) == 10 * 16 + 1  # a row's share of the pool: none spread
    assert _spread_len(4096, 100, 8, 16) == 4096
    with pytest.raises(ValueError, match="context_parallel_len must be an integer >= 1"):
        _spread_len(0, 100, 8, 16)


def test_spread_pages_are_dealt_over_the_shards_and_given_back():
    from eagle3_jax.scheduler.shard_pages import SPREAD, ShardPages

    pool = ShardPages(num_pages=4 * 6, shards=4, prefix_caching=False, spread_len=100)
    assert pool.spreads(100) and not pool.spreads(99) and pool.num_usable(100) == 4 * pool.num_usable(99) == 20
    pages = pool.allocate(SPREAD, 0, 6)
    assert [p // pool.share for p in pages] == [0, 1, 2, 3, 0, 1]  # logical page j on shard j mod 4
    pages += pool.allocate(SPREAD, 6, 3)
    assert [p // pool.share for p in pages[6:]] == [2, 3, 0]
    assert pool.per_shard([SPREAD, 1, 1]).tolist() == [1, 3, 1, 1]
    # free now: shard 0 2 of its 5 usable pages, shards 1-3 3; pages 9..20 would take 3 of shard 0's
    assert pool.short(SPREAD, len(pages), 12) == 0 and pool.short(SPREAD, len(pages), 11) is None
    assert pool.fits_spread(8, pool.per_shard([]))
    assert not pool.fits_spread(8, pool.per_shard([SPREAD]))
    pool.free(SPREAD, pages)
    assert pool.counts()["num_free_pages"] == 20
    assert not ShardPages(8, 1, False, 4).spreads(10**6)  # one shard: nothing to spread over
