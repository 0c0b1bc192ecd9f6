"""Attention over a long cache in blocks of slots (models/blockwise.py) equals one pass over it:
dense and paged caches, prefill (expanded MLA), decode and tree verify (absorbed), rows of
different lengths, and a padding row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_models import FAMILIES, random_target

from eagle3_jax.cache import kv_cache
from eagle3_jax.models import blockwise
from eagle3_jax.models.target import forward


def _paged(cache: kv_cache.KVCache, page_size: int, seed: int) -> kv_cache.KVCache:
    """The dense cache's slots laid out on shuffled pages (page 0 kept as scratch)."""
    layers, b, s = cache.k.shape[:3]
    per_row = s // page_size
    order = np.random.default_rng(seed).permutation(b * per_row) + 1
    table = order.reshape(b, per_row)

    def pool(buf):
        pages = np.zeros((layers, b * per_row + 1, page_size) + buf.shape[3:], buf.dtype)
        pages[:, table.reshape(-1)] = np.asarray(buf).reshape((layers, b * per_row, page_size) + buf.shape[3:])
        return jnp.asarray(pages)

    return kv_cache.paged_view(pool(cache.k), pool(cache.v), table, cache.lengths)


def _run(target, cache, tokens, tree=None):
    b, t = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(t)[None]
    logits, _, cache = jax.jit(forward, static_argnums=1)(target.params, target.config, tokens, positions, cache, tree)
    return np.asarray(logits), cache


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_blocks_equal_one_pass(family, paged, monkeypatch):
    target = random_target(FAMILIES[family])
    rng = np.random.default_rng(0)
    lengths = jnp.asarray([40, 7, 0], jnp.int32)  # the last row a padding row: nothing before its tokens
    prompt = jnp.asarray(rng.integers(0, 64, (3, 40)), jnp.int32)
    tree = np.tril(np.ones((4, 4), bool))
    tree[2, 1] = False  # a tree: node 2 is a sibling of node 1
    tree = jnp.asarray(np.broadcast_to(tree, (3, 4, 4)))
    draft = jnp.asarray(rng.integers(0, 64, (3, 4)), jnp.int32)

    def steps():
        cache = target.init_cache(3, 128)
        if paged:
            cache = _paged(cache, 16, seed=1)
        prefill, cache = _run(target, cache, prompt)  # 40 tokens: the expanded MLA form
        cache = kv_cache.advance(cache, lengths)
        verify, _ = _run(target, cache, draft, tree)  # absorbed, a tree window
        return prefill, verify

    want = steps()
    monkeypatch.setattr(blockwise, "MAX_BLOCK_SLOTS", 16)
    jax.clear_caches()  # trace again with the smaller blocks
    assert blockwise.block_slots(target.init_cache(3, 128), 4, 4) == 16
    got = steps()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5 * np.abs(w).max(), rtol=0)


def test_block_size_bounds_the_temporaries():
    """Slots per block shrink as the batch, heads and queries grow, within one page and the cap."""
    cfg = random_target(FAMILIES["deepseek_v3"]).config
    small = kv_cache.init_cache(cfg, 1, 8192, jnp.bfloat16)
    assert blockwise.block_slots(small, 1, 4) == blockwise.MAX_BLOCK_SLOTS
    shapes = jax.eval_shape(lambda: kv_cache.init_cache(cfg, 64, 8192, jnp.bfloat16))
    big = kv_cache.KVCache(k=shapes.k, v=shapes.v, lengths=shapes.lengths)
    size = blockwise.block_slots(big, 256, 64)
    assert 16 <= size < blockwise.MAX_BLOCK_SLOTS and size & (size - 1) == 0
    assert 64 * size * (4 * 64 * 256) <= blockwise.BLOCK_BYTES < 2 * 64 * size * (4 * 64 * 256 + 40)
