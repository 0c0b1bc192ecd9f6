"""The paged prefix-attention kernel (Pallas, interpret mode on CPU) against its jnp reference:
GQA group sizes 1/4/8, T = 1 and a 16-node tree, MLA's latent + rope form, lengths that are not a
multiple of the page size, empty rows, KV split over several programs, float32 and bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_cases as cases
import pytest
from paged_attention_cases import close

from pallas_kernels import launch
from pallas_kernels.attention import (
    Fp8Scales,
    fp8_decode,
    merge_partials,
    paged_prefix_attention,
    paged_prefix_attention_reference,
)

PAGE = 4
LENGTHS = [0, 1, 7, 8, 13]  # empty, one slot, partial page, whole pages, several pages + partial


def pools_and_table(rng, heads: int, dims: list[int], num_pages: int = 40, layers: int = 2, width: int = 6):
    return cases.pools_and_table(rng, heads, dims, page=PAGE, lengths=LENGTHS, num_pages=num_pages, layers=layers,
                                 width=width)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group,t", [(1, 1), (4, 1), (8, 1), (4, 16), (3, 16)], ids=lambda x: str(x))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gqa_equals_reference(group, t, num_splits, dtype):
    rng = np.random.default_rng(group * 100 + t)
    heads, d = 2, 16
    (k, v), table, lengths = pools_and_table(rng, heads, [d, d])
    q = rng.standard_normal((len(LENGTHS), heads, group * t, d)).astype(np.float32)
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    kw = dict(scale=d ** -0.5)
    got = paged_prefix_attention(args[0], args[1], args[2], 1, table, lengths, num_splits=num_splits, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(*args, 1, table, lengths, **kw), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 16])
def test_mla_latent_plus_rope_equals_reference(t, dtype):
    rng = np.random.default_rng(t)
    nh, r, dr = 4, 32, 16
    (lat, rope), table, lengths = pools_and_table(rng, 1, [r, dr])
    q = rng.standard_normal((len(LENGTHS), 1, nh * t, r)).astype(np.float32)
    q2 = rng.standard_normal((len(LENGTHS), 1, nh * t, dr)).astype(np.float32)
    q, q2, lat, rope = (jnp.asarray(x, dtype) for x in (q, q2, lat, rope))
    kw = dict(scale=0.1, q2=q2, k2_pool=rope)
    got = paged_prefix_attention(q, lat, None, 0, table, lengths, num_splits=2, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, lat, None, 0, table, lengths, **kw), dtype)


@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_bits_decode_as_jax_converts_them(fnuz):
    dtype = jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn
    bits = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(jax.lax.bitcast_convert_type(bits, dtype).astype(jnp.float32))
    got = np.asarray(fp8_decode(bits, fnuz))
    finite = np.isfinite(want)
    assert finite.sum() >= 253  # the NaN codes are never written
    np.testing.assert_array_equal(got[finite], want[finite])


def fp8_pool(x: np.ndarray, groups: int, fnuz: bool) -> tuple[jax.Array, jax.Array]:
    """A float32 pool [..., D] as float8 bits and float32 scales [..., groups] (as the KV cache stores it)."""
    from eagle3_jax.cache.kv_cache import quantize

    slots = quantize(jnp.asarray(x), jnp.float8_e4m3fnuz if fnuz else jnp.float8_e4m3fn)
    assert slots.scales.shape[-1] == groups
    return jax.lax.bitcast_convert_type(slots.values, jnp.uint8), slots.scales


@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_pages_equal_the_reference_over_their_dequantized_values(fnuz, dtype):
    """GQA (128-wide heads: a scale per slot per head; 256-wide: two) and MLA (a 512-wide latent:
    4 groups, its rope key 1) over float8 pages decoded in the kernel: the reference attention over
    the pages' dequantized values."""
    rng = np.random.default_rng(7)
    for d in (128, 256):
        (k, v), table, lengths = pools_and_table(rng, 2, [d, d], num_pages=34)
        (kb, ks), (vb, vs) = fp8_pool(k, d // 128, fnuz), fp8_pool(v, d // 128, fnuz)
        q = jnp.asarray(rng.standard_normal((len(LENGTHS), 2, 4 * 3, d)), dtype)
        kw = dict(scale=d ** -0.5, scales=Fp8Scales(ks, vs, fnuz=fnuz))
        got = paged_prefix_attention(q, kb, vb, 1, table, lengths, num_splits=2, interpret=True, **kw)
        close(got, paged_prefix_attention_reference(q, kb, vb, 1, table, lengths, **kw), dtype)
    (lat, rope), table, lengths = pools_and_table(rng, 1, [512, 64], num_pages=34)
    (lb, ls), (rb, rs) = fp8_pool(lat, 4, fnuz), fp8_pool(rope, 1, fnuz)
    q, q2 = (jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 4 * 2, w)), dtype) for w in (512, 64))
    kw = dict(scale=0.05, q2=q2, k2_pool=rb, scales=Fp8Scales(ls, k2=rs, fnuz=fnuz))
    got = paged_prefix_attention(q, lb, None, 0, table, lengths, num_splits=3, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, lb, None, 0, table, lengths, **kw), dtype)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_row_blocks_do_not_change_the_result(kind):
    """The rows of a head cut into programs of 16, 32 or all 48 (padded to 64) rows (a launch-table choice):
    the same numbers, the padding rows dropped."""
    from pallas_kernels.launch import AttentionLaunch

    rng = np.random.default_rng(7)
    d = 16
    (k, v), table, lengths = pools_and_table(rng, 1, [d, d])
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 48, d)), jnp.float32)
    k, v = jnp.asarray(k), None if kind == "mla" else jnp.asarray(v)
    results = [paged_prefix_attention(q, k, v, 0, table, lengths, scale=0.25, interpret=True,
                                      launch=AttentionLaunch(block_rows=rows, num_warps=4, num_stages=2))
               for rows in (16, 64, 512)]  # float32: 16, 32 and 64 rows per program
    for out, lse in results[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(results[0][0]), atol=1e-6)
        np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(results[0][1]))
    close(results[0], paged_prefix_attention_reference(q, k, v, 0, table, lengths, scale=0.25), jnp.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_pages_walked_in_tiles_of_slots(num_splits):
    """Pages of 32 slots walked 16 (or 8) slots per step, as the launch table has it for large
    pages: lengths ending inside a page's first or second tile, empty rows, KV splits."""
    from pallas_kernels.launch import AttentionLaunch

    rng = np.random.default_rng(11)
    page, width, d = 32, 4, 16
    lengths = np.asarray([0, 5, 16, 17, 70, 128], np.int32)
    k, v = (jnp.asarray(rng.standard_normal((1, 30, page, 2, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, 30))[: len(lengths) * width].reshape(len(lengths), width), jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lengths), 2, 8, d)), jnp.float32)
    want = paged_prefix_attention_reference(q, k, v, 0, table, lengths, scale=0.25)
    for slots in (16, 8):
        got = paged_prefix_attention(q, k, v, 0, table, lengths, scale=0.25, num_splits=num_splits, interpret=True,
                                     launch=AttentionLaunch(block_rows=16, num_warps=4, num_stages=2, block_slots=slots))
        close(got, want, jnp.float32)


def test_wide_pools_walk_fewer_slots_per_step():
    """The launch's slots per step are set for 2-byte pools: a float32 pool walks at most 16 (a
    32-slot float32 MLA tile spills on sm_90); pages that are no multiple of them are walked a
    page per step."""
    from pallas_kernels.attention import _tile
    from pallas_kernels.launch import AttentionLaunch

    wide, narrow = (AttentionLaunch(block_rows=16, num_warps=4, num_stages=2, block_slots=s) for s in (64, 16))
    assert [_tile(64, wide, 2), _tile(64, wide, 4), _tile(128, wide, 4), _tile(16, wide, 2), _tile(32, wide, 2),
            _tile(48, wide, 2), _tile(96, wide, 2)] == [64, 16, 16, 16, 32, 16, 32]
    assert [_tile(64, narrow, 2), _tile(64, narrow, 4), _tile(32, narrow, 4)] == [16, 16, 16]
    assert [wide.walks(p) for p in (16, 48, 128, 256, 8, 24, 72)] == [True] * 4 + [False] * 3


def test_merging_with_the_new_tokens_equals_one_softmax():
    """Prefix partial + the new tokens' partial = softmax over both key sets at once."""
    rng = np.random.default_rng(0)
    s = rng.standard_normal((3, 5, 11)).astype(np.float32)
    v = rng.standard_normal((3, 11, 8)).astype(np.float32)

    def partial(cols):
        lse = jax.nn.logsumexp(s[..., cols], axis=-1)
        return jnp.einsum("bms,bsd->bmd", jnp.exp(s[..., cols] - lse[..., None]), v[:, cols]), lse

    want = jnp.einsum("bms,bsd->bmd", jax.nn.softmax(s, axis=-1), v)
    got = merge_partials(*partial(slice(0, 7)), *partial(slice(7, 11)))
    np.testing.assert_allclose(got, want, atol=1e-6)
    empty = (jnp.zeros((3, 5, 8)), jnp.full((3, 5), -jnp.inf))  # a row with no prefix yet
    np.testing.assert_allclose(merge_partials(*empty, *partial(slice(0, 11))), want, atol=1e-6)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowers_to_a_triton_kernel_for_gpus(platform):
    """Deviceless lowering at Kimi-K2.5's MLA shapes (latent 512 + rope 64, 16 heads x 4 verify
    tokens, pages of 16): the module holds the Triton kernel, not an XLA fallback."""
    sds = jax.ShapeDtypeStruct
    nh, t, r, dr, batch = 16, 4, 512, 64, 4
    args = (sds((batch, 1, nh * t, r), jnp.bfloat16), sds((batch, 1, nh * t, dr), jnp.bfloat16),
            sds((2, 64, 16, 1, r), jnp.bfloat16), sds((2, 64, 16, 1, dr), jnp.bfloat16),
            sds((batch, 16), jnp.int32), sds((batch,), jnp.int32))

    def attend(q, q2, lat, rope, table, lengths):
        return paged_prefix_attention(q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope, num_splits=2)

    with launch.deviceless(launch.PLATFORM_ARCH[platform]):
        text = jax.jit(attend).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "triton" in text and "eagle3_paged_prefix_attention" in text


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_fp8_pages_lower_to_a_triton_kernel_for_gpus(platform):
    """The same at FP8 pages (bits and scales, decoded in the kernel: no float8 cast for Pallas'
    Triton lowering to refuse)."""
    sds = jax.ShapeDtypeStruct
    nh, t, r, dr, batch = 16, 4, 512, 64, 4
    args = (sds((batch, 1, nh * t, r), jnp.bfloat16), sds((batch, 1, nh * t, dr), jnp.bfloat16),
            sds((2, 64, 16, 1, r), jnp.uint8), sds((2, 64, 16, 1, dr), jnp.uint8),
            sds((2, 64, 16, 1, 4), jnp.float32), sds((2, 64, 16, 1, 1), jnp.float32),
            sds((batch, 16), jnp.int32), sds((batch,), jnp.int32))

    def attend(q, q2, lat, rope, lat_scales, rope_scales, table, lengths):
        scales = Fp8Scales(lat_scales, k2=rope_scales, fnuz=platform == "rocm")
        return paged_prefix_attention(q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope, num_splits=2,
                                      scales=scales)

    with launch.deviceless(launch.PLATFORM_ARCH[platform]):
        text = jax.jit(attend).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "triton" in text and "eagle3_paged_prefix_attention" in text


def test_kernel_benchmark_runs_on_cpu(tmp_path):
    """scripts/bench_kernels.py works on a CPU host (interpret mode), so it runs the day a GPU does."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "k.json"
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_kernels.py"), "--batches=2", "--tokens=1,4",
                        "--contexts=40", "--heads=4", "--latent=32", "--rope=16", "--repeats=1", "--hidden=64",
                        "--moe_inter=64", "--experts=16", "--local_experts=4", "--topk=2", "--moe_tokens=1,32",
                        "--moe_format=mxfp4", "--attention_launches=32:8:1:16", f"--json_out={out}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "interpret mode" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    attention = [x for x in rows if x["op"] == "attention"]
    assert [(x["tokens"], x["context"], x["launch"]) for x in attention] == [
        (1, 40, "table"), (1, 40, "32:8:1:16"), (4, 40, "table"), (4, 40, "32:8:1:16")]  # the table's, then the swept
    assert all(x["max_abs_err"] < 5e-2 and x["equal"] for x in attention)
    moe = [x for x in rows if x["op"] == "moe"]
    assert [x["tokens"] for x in moe] == [1, 32] and all(x["max_rel_err"] < 5e-2 for x in moe)


def test_splits_and_pages_the_kernel_takes():
    """KV splits give a launch about TARGET_PROGRAMS programs (an H200 walked Kimi-K2.5's 8K prefix
    at batch 1 latency-bound with 16), within one page per split and MAX_SPLITS; on a GPU pages
    are a whole number of 16-slot tiles or one power-of-two tile, interpreted any size runs."""
    from pallas_kernels.attention import MAX_SPLITS, TARGET_PROGRAMS, default_splits, pages_fit

    with launch.for_arch("sm_90"):
        assert default_splits(1, 1, 64, 512, 512, 2) == MAX_SPLITS  # MLA decode, batch 1: 2 row blocks
        assert default_splits(16, 1, 64, 512, 512, 2) == TARGET_PROGRAMS // (16 * 4)  # 16-row blocks on sm_90
        assert default_splits(64, 1, 256, 512, 512, 2) == 1  # verify at batch 64: programs enough
        assert default_splits(1, 1, 64, 3, 512, 2) == 3  # a short table: one page per split
        assert [pages_fit(p) for p in (16, 32, 48, 64, 8, 72, 8200)] == [True] * 4 + [False] * 3
    assert pages_fit(8, interpret=True) and pages_fit(8200, interpret=True)
