"""KV page writes and moves: the values land where the float scatter puts them, for every pool dtype,
and XLA:CPU compiles them without widening a narrow float pool to float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.cache import kv_cache

LAYERS, PAGES, PAGE, DIM = 3, 6, 4, 8


def _cache(dtype) -> kv_cache.KVCache:
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(LAYERS, PAGES, PAGE, DIM)), dtype)
    # Row 0 owns pages 1, 2 and has 3 slots; row 1 owns pages 3, 4 and has 7 (its second token
    # of a write lands past its table and is dropped).
    return kv_cache.paged_view(k, k[..., :2], [[1, 2], [3, 4]], [3, 7])


def _bits(x: jax.Array) -> np.ndarray:
    """Exact comparison, NaNs and signed zeros included."""
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float32])
def test_write_puts_each_token_in_its_page_slot_and_drops_past_the_table(dtype):
    cache = _cache(dtype)
    new = jnp.asarray(np.random.default_rng(1).normal(size=(2, 2, DIM)), jnp.float32)
    out = jax.jit(lambda c, k, v: kv_cache.write(c, 1, k, v))(cache, new, new[..., :2])
    # Row 0: slots 3, 4 -> (page 1, offset 3), (page 2, offset 0); row 1: slot 7 -> (page 4, 3), slot 8 dropped.
    pages, offsets, rows, tokens = [1, 2, 4], [3, 0, 3], [0, 0, 1], [0, 1, 0]
    expected = cache.k.at[1, pages, offsets].set(new[rows, tokens].astype(dtype))
    np.testing.assert_array_equal(_bits(out.k), _bits(expected))
    np.testing.assert_array_equal(_bits(out.v), _bits(expected[..., :2]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_move_copies_slots_in_every_layer(dtype):
    cache = _cache(dtype)
    out = jax.jit(kv_cache.move)(cache, jnp.asarray([[1], [6]]), jnp.asarray([[2], [4]]))
    # Row 0: slot 1 (page 1, 1) -> slot 2 (page 1, 2); row 1: slot 6 (page 4, 2) -> slot 4 (page 4, 0).
    expected = cache.k.at[:, [1, 4], [2, 0]].set(cache.k[:, [1, 4], [1, 2]])
    np.testing.assert_array_equal(_bits(out.k), _bits(expected))


def test_narrow_float_pools_are_not_widened_to_float32_on_cpu():
    """XLA:CPU cannot scatter bfloat16: a float scatter widened the whole pool (every layer's pages)
    to float32 and back at each write, which the bit-level writes avoid."""
    cache = _cache(jnp.bfloat16)
    new = jnp.zeros((2, 2, DIM), jnp.float32)
    write = jax.jit(lambda c, k, v: kv_cache.write(c, 1, k, v), donate_argnums=(0,))
    text = write.lower(cache, new, new[..., :2]).compile().as_text()
    assert f"f32[{LAYERS},{PAGES},{PAGE},{DIM}]" not in text
