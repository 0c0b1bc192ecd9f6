"""The paged prefix attention as a `triton.jit` kernel (pallas_kernels/triton_attention.py), run by
Triton's interpreter through `jax.pure_callback` on this CPU host: equal to the XLA reference at
shapes the engine does not use (GQA with values wider than keys, MLA with its rope term, FP8 pages
of both float8 flavours, several KV splits, row tiles), and compiled by the `triton` package to
gfx942 and sm_90 ISA at Kimi-K2.5's MLA shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_cases as cases
import pytest
from paged_attention_cases import close

pytest.importorskip("triton")

from pallas_kernels import isa, launch, triton_call  # noqa: E402
from pallas_kernels.attention import Fp8Scales, paged_prefix_attention_reference  # noqa: E402
from pallas_kernels.launch import AttentionLaunch  # noqa: E402
from pallas_kernels.triton_attention import paged_prefix_attention  # noqa: E402

try:
    import torch  # the interpreter's tensors
except ImportError:
    torch = None
interpreted = pytest.mark.skipif(torch is None, reason="Triton's interpreter runs on torch CPU tensors; no torch here")

PAGE = 16
LENGTHS = [0, 1, 17, 32, 45]  # empty, one slot, a partial page, whole pages, several pages and a partial one


def pools_and_table(rng, heads: int, dims: list[int], num_pages: int = 24, layers: int = 2, width: int = 3):
    return cases.pools_and_table(rng, heads, dims, page=PAGE, lengths=LENGTHS, num_pages=num_pages, layers=layers,
                                 width=width)


@interpreted
@pytest.mark.parametrize("group,t,num_splits", [(1, 1, 1), (4, 3, 2)])
def test_gqa_equals_reference(group, t, num_splits):
    rng = np.random.default_rng(group * 10 + t)
    heads, d, dv = 2, 16, 32  # values wider than keys
    (k, v), table, lengths = pools_and_table(rng, heads, [d, dv])
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), heads, group * t, d)), jnp.float32)
    kw = dict(scale=d ** -0.5)
    got = paged_prefix_attention(q, jnp.asarray(k), jnp.asarray(v), 1, table, lengths, num_splits=num_splits,
                                 interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, k, v, 1, table, lengths, **kw), jnp.float32)


@interpreted
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mla_latent_plus_rope_equals_reference(dtype):
    rng = np.random.default_rng(3)
    nh, t, r, dr = 4, 4, 64, 16
    (lat, rope), table, lengths = pools_and_table(rng, 1, [r, dr])
    q = rng.standard_normal((len(LENGTHS), 1, nh * t, r))
    q2 = rng.standard_normal((len(LENGTHS), 1, nh * t, dr))
    q, q2, lat, rope = (jnp.asarray(x, dtype) for x in (q, q2, lat, rope))
    kw = dict(scale=0.1, q2=q2, k2_pool=rope)
    got = paged_prefix_attention(q, lat, None, 0, table, lengths, num_splits=2, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, lat, None, 0, table, lengths, **kw), dtype)


def fp8_pool(x: np.ndarray, fnuz: bool) -> tuple[jax.Array, jax.Array]:
    """A float32 pool as float8 bits and its float32 scales (as the KV cache stores them)."""
    from eagle3_jax.cache.kv_cache import quantize

    slots = quantize(jnp.asarray(x), jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(slots.values, jnp.uint8), slots.scales


@interpreted
@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_pages_equal_the_reference_over_their_dequantized_values(fnuz):
    """GQA heads 256 wide (two scale groups) and MLA's 512-wide latent (four) with its rope key (one),
    decoded in registers, each group's scale applied to its part of the scores and values."""
    rng = np.random.default_rng(5)
    (k, v), table, lengths = pools_and_table(rng, 1, [256, 256], num_pages=18)
    (kb, ks), (vb, vs) = fp8_pool(k, fnuz), fp8_pool(v, fnuz)
    assert ks.shape[-1] == 2
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 2, 256)), jnp.float32)
    kw = dict(scale=256 ** -0.5, scales=Fp8Scales(ks, vs, fnuz=fnuz))
    got = paged_prefix_attention(q, kb, vb, 1, table, lengths, num_splits=1, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, kb, vb, 1, table, lengths, **kw), jnp.float32)
    (lat, rope), table, lengths = pools_and_table(rng, 1, [512, 64], num_pages=18)
    (lb, ls), (rb, rs) = fp8_pool(lat, fnuz), fp8_pool(rope, fnuz)
    assert ls.shape[-1] == 4
    q, q2 = (jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 16, w)), jnp.float32) for w in (512, 64))
    kw = dict(scale=0.05, q2=q2, k2_pool=rb, scales=Fp8Scales(ls, k2=rs, fnuz=fnuz))
    got = paged_prefix_attention(q, lb, None, 0, table, lengths, num_splits=2, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, lb, None, 0, table, lengths, **kw), jnp.float32)


@interpreted
def test_row_tiles_do_not_change_the_result():
    """48 rows of one head in tiles of 16 or in one tile of 64 (the padding rows dropped): the same numbers."""
    rng = np.random.default_rng(7)
    (lat,), table, lengths = pools_and_table(rng, 1, [16])
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 48, 16)), jnp.float32)
    results = [paged_prefix_attention(q, jnp.asarray(lat), None, 0, table, lengths, scale=0.25, num_splits=1,
                                      interpret=True, launch=AttentionLaunch(block_rows=rows, num_warps=4,
                                                                             num_stages=2))
               for rows in (16, 2048)]  # float32 16 lanes wide: 16 rows a tile, then all 48 (padded to 64)
    np.testing.assert_allclose(np.asarray(results[1][0]), np.asarray(results[0][0]), atol=1e-6)
    close(results[0], paged_prefix_attention_reference(q, lat, None, 0, table, lengths, scale=0.25), jnp.float32)


@interpreted
@pytest.mark.parametrize("page", [4, 24])
def test_any_lane_width_and_page_size_is_masked_within_its_block(page):
    """Keys 12 lanes wide, values 20, rope 4, pages of 4 or 24 slots: padded to blocks of 16 / 32
    and masked, equal to the reference (GQA, and MLA with its rope term)."""
    rng = np.random.default_rng(page)
    lengths = [0, 1, 5, 30, 47]
    pools, table, lengths = cases.pools_and_table(rng, 2, [12, 20], page=page, lengths=lengths, num_pages=64,
                                                  width=-(-47 // page))
    k, v = (jnp.asarray(x) for x in pools)
    q = jnp.asarray(rng.standard_normal((len(lengths), 2, 3, 12)), jnp.float32)
    got = paged_prefix_attention(q, k, v, 1, table, lengths, scale=0.3, num_splits=2, interpret=True)
    close(got, paged_prefix_attention_reference(q, k, v, 1, table, lengths, scale=0.3), jnp.float32)
    (lat, rope), table, lengths = cases.pools_and_table(rng, 1, [20, 4], page=page, lengths=lengths, num_pages=64,
                                                        width=-(-47 // page))
    q, q2 = (jnp.asarray(rng.standard_normal((len(lengths), 1, 6, w)), jnp.float32) for w in (20, 4))
    kw = dict(scale=0.2, q2=q2, k2_pool=jnp.asarray(rope))
    got = paged_prefix_attention(q, jnp.asarray(lat), None, 0, table, lengths, num_splits=1, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, lat, None, 0, table, lengths, **kw), jnp.float32)


def kimi_mla(heads: int, tokens: int):
    """Kimi-K2.5's absorbed MLA prefix attention per device: latent 512 + rope 64, pages of 16, 8K context."""
    sds = jax.ShapeDtypeStruct
    batch, pages = 4, 512
    return (sds((batch, 1, heads * tokens, 512), jnp.bfloat16), sds((batch, 1, heads * tokens, 64), jnp.bfloat16),
            sds((2, batch * pages, 16, 1, 512), jnp.bfloat16), sds((2, batch * pages, 16, 1, 64), jnp.bfloat16),
            sds((batch, pages), jnp.int32), sds((batch,), jnp.int32))


@pytest.mark.newest_jax  # CI's newest-JAX leg runs the compile-to-ISA tests
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm_90"])
def test_compiles_to_each_architecture_without_spills_on_matrix_units(arch):
    """Decode (T = 1) and verify (T = 4) of Kimi-K2.5's 8 heads per device, with the launch table's
    parameters: captured from the traced call, compiled from the kernel's source, no spill, the
    dots on the matrix units (MFMA / MMA: not the float32 fallback the interpreter's path takes)."""
    with launch.for_arch(arch):
        launches = []
        with triton_call.capturing(launches):
            for tokens in (1, 4):
                jax.eval_shape(lambda q, q2, lat, rope, table, lengths: paged_prefix_attention(
                    q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope), *kimi_mla(8, tokens))
    assert len(launches) == 2 and all(not dict(l.constexprs)["INTERPRETED"] for l in launches)
    for captured in launches:
        report = isa.compile_launch(captured, arch)
        assert not isa.check(report), (arch, dict(captured.constexprs), isa.check(report))
        assert report.matrix_instructions, (arch, "dots not on the matrix units")


@pytest.mark.newest_jax
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm_90"])
def test_the_gate_fails_a_kernel_that_spills(arch):
    """Kimi-K2.5's MLA with 16 heads x 4 verify tokens in one row tile of 64 rows at 8 warps (a
    float32 [64, 512] accumulator beside the queries) is past the register file on every
    architecture: the gate says so (a spill on sm_90, AGPRs or scratch on AMD); the table's row
    tiles at the same shape pass."""
    def captured(launch_params):
        launches = []
        with launch.for_arch(arch), triton_call.capturing(launches):
            jax.eval_shape(lambda q, q2, lat, rope, table, lengths: paged_prefix_attention(
                q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope, launch=launch_params),
                *kimi_mla(16, 4))
        [one] = launches
        return one

    problems = isa.check(isa.compile_launch(captured(AttentionLaunch(block_rows=64, num_warps=8, num_stages=2)),
                                            arch))
    assert problems and any("spill" in p or "AGPR" in p or "scratch" in p for p in problems), problems
    assert isa.check(isa.compile_launch(captured(None), arch)) == []
