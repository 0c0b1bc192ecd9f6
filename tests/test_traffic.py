"""The load counter (pallas_kernels/traffic.py) under Triton's interpreter: a tiny kernel's loads
counted exactly, nothing left hooked; the attention minimum met where the kernel reads each byte
once; and the MoE kernels reading at most 1.15x their minimum at held-out decode shapes with every
launch-table entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from eagle3_jax.bench import traffic as bench  # noqa: E402
from pallas_kernels import traffic, triton_call  # noqa: E402
from pallas_kernels.attention import Fp8Scales  # noqa: E402
from pallas_kernels.launch import AttentionLaunch  # noqa: E402
from pallas_kernels.triton_attention import paged_prefix_attention  # noqa: E402


@triton.jit
def _masked_sum(x_ptr, y_ptr, n, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)  # the vector once, masked past n
    y = tl.load(y_ptr + tl.program_id(0))  # a scalar, unmasked
    tl.store(out_ptr + i, x + y.to(tl.float32), mask=i < n)


def _launch(x, y):
    [out] = triton_call.call(_masked_sum, [jax.ShapeDtypeStruct((48,), jnp.float32)], x, y, 37, grid=(3,),
                             num_warps=4, num_stages=1, interpret=True, name="masked_sum", BLOCK=16)
    return jax.block_until_ready(out)


def test_counts_a_masked_load_exactly_and_unhooks():
    from triton.runtime import interpreter

    x, y = jnp.arange(37, dtype=jnp.float32), jnp.arange(3, dtype=jnp.bfloat16)
    with traffic.counting(distinct=True) as launches:
        out = _launch(x, y)
    np.testing.assert_array_equal(np.asarray(out)[:37], np.arange(37) + np.arange(48)[:37] // 16)
    [counted] = launches
    assert (counted.kernel, counted.grid, counted.loads) == ("masked_sum", (3,), 6)
    assert counted.bytes_loaded == 37 * 4 + 3 * 2  # the mask-true elements only, times their size
    assert counted.by_argument == {"x_ptr": 37 * 4, "y_ptr": 3 * 2}
    assert counted.distinct_by_argument == {"x_ptr": 37 * 4, "y_ptr": 3 * 2, "out_ptr": 0}
    assert "create_masked_load" not in vars(interpreter.interpreter_builder)  # put back
    _launch(x, y)
    assert len(launches) == 1  # outside the block nothing is counted


def _pages(rng, shape, fp8):
    if not fp8:
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), None
    bits = rng.integers(0, 0x7E, shape).astype(np.uint8)
    return jnp.asarray(bits), jnp.asarray(rng.uniform(0.5, 1.5, shape[:-1] + (max(shape[-1] // 128, 1),)), jnp.float32)


@pytest.mark.parametrize("kind", ["gqa", "mla_fp8"])
def test_attention_minimum_is_what_a_tile_reading_each_slot_once_loads(kind):
    """One row tile per KV head (16 rows), whole pages below every length: each visible slot, each
    query, table entry and length read once; the only excess is the layer index, once a program."""
    rng = np.random.default_rng(0)
    batch, pages, ps = 2, 4, 16
    table = jnp.asarray(1 + rng.permutation(batch * pages).reshape(batch, pages), jnp.int32)
    lengths = jnp.asarray([64, 32], jnp.int32)  # the second row reads half its table
    one = AttentionLaunch(block_rows=16, num_warps=4, num_stages=1)
    if kind == "gqa":
        heads = 2
        q = jnp.asarray(rng.standard_normal((batch, heads, 16, 64)), jnp.bfloat16)
        k, _ = _pages(rng, (1, batch * pages + 1, ps, heads, 64), False)
        v, _ = _pages(rng, (1, batch * pages + 1, ps, heads, 64), False)
        args = dict(q=q, k_pool=k, v_pool=v, block_table=table, lengths=lengths)
    else:
        heads = 1
        q = jnp.asarray(rng.standard_normal((batch, 1, 16, 256)), jnp.bfloat16)
        q2 = jnp.asarray(rng.standard_normal((batch, 1, 16, 64)), jnp.bfloat16)
        k, ks = _pages(rng, (1, batch * pages + 1, ps, 1, 256), True)
        k2, k2s = _pages(rng, (1, batch * pages + 1, ps, 1, 64), True)
        args = dict(q=q, k_pool=k, v_pool=None, block_table=table, lengths=lengths, q2=q2, k2_pool=k2,
                    scales=Fp8Scales(ks, k2=k2s))
    with traffic.counting() as launches:
        jax.block_until_ready(paged_prefix_attention(layer=0, scale=0.1, num_splits=1, interpret=True, launch=one,
                                                     **args))
    [counted] = launches
    minimum = traffic.attention_minimum(**args)
    programs = batch * heads
    assert counted.bytes_loaded - minimum == (programs - 1) * 4 + (heads - 1) * batch * 4 + (heads - 1) * 6 * 4
    if kind == "mla_fp8":  # 96 slots x (256 + 64 bytes + 2 + 1 float32 scales)
        assert counted.by_argument["k_ptr"] == 96 * 256 and counted.by_argument["ks_ptr"] == 96 * 2 * 4
        assert counted.by_argument["k2_ptr"] == 96 * 64 and counted.by_argument["k2s_ptr"] == 96 * 4


@pytest.mark.parametrize("tokens", [48, 160])
def test_moe_reads_each_byte_about_once_at_held_out_decode_shapes(tokens):
    """24 of 192 experts, top-6, int4 1024 -> 512 -> 1024: every distinct MoE launch of the launch
    table (fused gate/up and down) loads at most 1.15x what its contract must read."""
    shapes = bench.MoeShapes(hidden=1024, inter=512, experts=192, local_experts=24, topk=6, fmt="int4",
                             tokens=(tokens,))
    rows = bench.moe_rows(shapes, bench.ARCHS, seed=7)
    assert {arch for row in rows for arch in row["archs"]} == set(bench.ARCHS)
    for row in rows:
        assert 1.0 <= row["ratio"] <= 1.15, (row["part"], row["archs"], row["ratio"], row["by_argument"])
