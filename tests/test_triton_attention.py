"""The paged prefix attention as a `triton.jit` kernel (pallas_kernels/triton_attention.py), run by
Triton's interpreter through `jax.pure_callback` on this CPU host: equal to the XLA reference at
shapes the engine does not use (GQA with values wider than keys, MLA with its rope term, FP8 pages
of both float8 flavours, several KV splits, row tiles, pages walked in tiles of slots), its FP8
decoding exact for every bit pattern, compiled by the `triton` package to gfx942, gfx950 and sm_90
ISA at Kimi-K2.5's MLA shapes; and the pieces around it (splits, tiles, merges, the benchmark)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import paged_attention_cases as cases
import pytest
from paged_attention_cases import close

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pallas_kernels import isa, launch, triton_call  # noqa: E402
from pallas_kernels.attention import Fp8Scales, merge_partials, paged_prefix_attention_reference  # noqa: E402
from pallas_kernels.launch import AttentionLaunch  # noqa: E402
from pallas_kernels.triton_attention import _fp8_decode, paged_prefix_attention  # noqa: E402

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


@interpreted
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_sliding_window_rows_read_only_their_window(kind):
    """starts [B, T] (a sliding-window draft layer): row m is token m % T's and sees no slot below
    its start; equal to the reference, and the pages wholly below every row's window are never
    loaded: counted in the interpreter, the keys read are those of the tiles from the lowest start
    on, not the whole prefix."""
    from pallas_kernels import traffic

    rng = np.random.default_rng(7)
    t, group, d = 3, 2, 16
    lengths = [45, 80, 17, 96, 33]
    (k, v), table, lengths = cases.pools_and_table(rng, 1, [d, d], page=PAGE, lengths=lengths, num_pages=32, width=6)
    k, v = jnp.asarray(k), jnp.asarray(v)
    starts = jnp.asarray(np.maximum(np.asarray(lengths)[:, None] + np.arange(t)[None, :] - 9, 0), jnp.int32)  # 10-slot windows
    q = jnp.asarray(rng.standard_normal((len(lengths), 1, group * t, d)), jnp.float32)
    kw = dict(scale=d ** -0.5, starts=starts)
    values = None if kind == "mla" else v
    if kind == "mla":
        kw.update(q2=jnp.asarray(rng.standard_normal((len(lengths), 1, group * t, 8)), jnp.float32),
                  k2_pool=jnp.asarray(rng.standard_normal(k.shape[:-1] + (8,)), jnp.float32))
    with traffic.counting() as launches:
        got = paged_prefix_attention(q, k, values, 1, table, lengths, interpret=True, num_splits=1, **kw)
    close(got, paged_prefix_attention_reference(q, k, values, 1, table, lengths, **kw), jnp.float32)
    key_bytes = launches[-1].by_argument["k_ptr"]
    first_tile = np.asarray(starts).min(axis=1) // PAGE
    tiles = np.maximum(-(-np.asarray(lengths) // PAGE) - first_tile, 0)
    assert key_bytes <= tiles.sum() * PAGE * d * 4  # the window's tiles only (lanes and slots masked within)
    assert key_bytes < (-(-np.asarray(lengths) // PAGE)).sum() * PAGE * d * 4 / 2  # less than half the prefix


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
def test_fp8_pages_in_three_scale_groups():
    """GQA heads 384 wide over FP8 pages: three scale groups, padded to four in the kernel's batched
    dots and masked; equal to the reference."""
    rng = np.random.default_rng(13)
    (k, v), table, lengths = pools_and_table(rng, 1, [384, 384], num_pages=18)
    (kb, ks), (vb, vs) = fp8_pool(k, False), fp8_pool(v, False)
    assert ks.shape[-1] == 3
    q = jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 2, 384)), jnp.float32)
    kw = dict(scale=384 ** -0.5, scales=Fp8Scales(ks, vs))
    got = paged_prefix_attention(q, kb, vb, 1, table, lengths, num_splits=2, interpret=True, **kw)
    close(got, paged_prefix_attention_reference(q, kb, vb, 1, table, lengths, **kw), jnp.float32)


def test_fp8_rope_key_in_several_scale_groups_is_refused():
    """The kernel scales MLA's rope key as one group (64 lanes in every model it serves): a wider one
    with several scale groups is refused, not misread."""
    bits = jnp.zeros((1, 4, 16, 1, 256), jnp.uint8)
    kw = dict(scale=0.1, q2=jnp.zeros((1, 1, 16, 256)), k2_pool=bits, interpret=True,
              scales=Fp8Scales(jnp.ones((1, 4, 16, 1, 1)), k2=jnp.ones((1, 4, 16, 1, 2))))
    with pytest.raises(ValueError, match="rope key of 256 lanes as one group; its pool has 2 scale groups"):
        paged_prefix_attention(jnp.zeros((1, 1, 16, 64)), bits[..., :64], None, 0, jnp.zeros((1, 4), jnp.int32),
                               jnp.ones((1,), jnp.int32), **kw)


@interpreted
def test_fp8_row_parts_do_not_change_the_result():
    """MLA over FP8 pages (four scale groups) with a tile's rows in 1, 2 or 4 parts of the batched
    dots (`AttentionLaunch.row_parts`, as AMD's entries run them): the same numbers, the reference's."""
    rng = np.random.default_rng(9)
    (lat, rope), table, lengths = pools_and_table(rng, 1, [512, 64], num_pages=18)
    (lb, ls), (rb, rs) = fp8_pool(lat, False), fp8_pool(rope, False)
    q, q2 = (jnp.asarray(rng.standard_normal((len(LENGTHS), 1, 40, w)), jnp.float32) for w in (512, 64))
    kw = dict(scale=0.05, q2=q2, k2_pool=rb, scales=Fp8Scales(ls, k2=rs))
    results = []
    for parts in (1, 2, 4):  # float32 queries: 64-row tiles (40 rows padded), parts of 64, 32 and 16 rows
        attend = functools.partial(paged_prefix_attention, q, lb, None, 0, table, lengths, num_splits=1, interpret=True,
                                   launch=AttentionLaunch(block_rows=128, num_warps=8, num_stages=1, row_parts=parts),
                                   **kw)
        with triton_call.capturing([]) as launches:
            attend()
        assert [dict(one.constexprs)["PARTS"] for one in launches] == [parts]
        results.append(attend())
    for got in results[1:]:
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(results[0][0]), atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(results[0][1]), atol=1e-6)
    close(results[2], paged_prefix_attention_reference(q, lb, None, 0, table, lengths, **kw), jnp.float32)


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


@interpreted
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pages_walked_in_tiles_of_slots(num_splits):
    """Pages of 32 slots walked 16 (or 8) slots a step, as the launch table has it for large
    pages: lengths ending inside a page's first or second tile, empty rows, KV splits."""
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


@triton.jit
def _decode_every_byte(bits_ptr, out_ptr, FNUZ: tl.constexpr):
    offsets = tl.arange(0, 256)
    tl.store(out_ptr + offsets, _fp8_decode(tl.load(bits_ptr + offsets), FNUZ))


@interpreted
@pytest.mark.parametrize("fnuz", [False, True], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_bits_decode_as_the_format_defines_them(fnuz):
    """Every byte but the NaN codes (never written) decodes to its float8 value, signed zeros and
    subnormals included."""
    dtype = ml_dtypes.float8_e4m3fnuz if fnuz else ml_dtypes.float8_e4m3fn
    bits = np.arange(256, dtype=np.uint8)
    [got] = triton_call.call(_decode_every_byte, [jax.ShapeDtypeStruct((256,), jnp.float32)], jnp.asarray(bits),
                             grid=(1,), num_warps=4, num_stages=1, interpret=True, FNUZ=fnuz)
    want = bits.view(dtype).astype(np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(np.asarray(got)[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(np.asarray(got)[finite]), np.signbit(want[finite]))


@interpreted
def test_interpreting_leaves_the_language_as_it_was():
    """A kernel that calls a device function, interpreted, leaves triton.language's builtins as they
    were (Triton's interpreter leaves a device call's patches behind), so the process still
    compiles kernels after it (the compile gate beside the interpreter tests)."""
    before = {name: vars(tl.core)[name] for name in ("load", "store", "where", "range")}
    tensor_before = {k: v for k, v in vars(tl.core.tensor).items() if k != "__annotations__"}
    triton_call.call(_decode_every_byte, [jax.ShapeDtypeStruct((256,), jnp.float32)], jnp.zeros((256,), jnp.uint8),
                     grid=(1,), num_warps=4, num_stages=1, interpret=True, FNUZ=False)
    assert {name: vars(tl.core)[name] for name in before} == before
    assert {k: v for k, v in vars(tl.core.tensor).items() if k != "__annotations__"} == tensor_before


def test_wide_pools_walk_fewer_slots_per_step():
    """The launch's slots a step are set for 2-byte pools: a float32 pool walks at most 16 (a
    32-slot float32 MLA tile spills on sm_90); a page no tile divides is walked whole when it is a
    power of two >= 16, else the compiled kernel does not take it (the engine keeps XLA)."""
    wide, narrow = (AttentionLaunch(block_rows=16, num_warps=4, num_stages=2, block_slots=s) for s in (64, 16))
    assert [wide.tile(64, 2), wide.tile(64, 4), wide.tile(128, 4), wide.tile(16, 2), wide.tile(32, 2),
            wide.tile(48, 2), wide.tile(96, 2)] == [64, 16, 16, 16, 32, 16, 32]
    assert [narrow.tile(64, 2), narrow.tile(64, 4), narrow.tile(32, 4)] == [16, 16, 16]
    assert [wide.walks(p) for p in (16, 48, 128, 256, 8, 24, 72)] == [True] * 4 + [False] * 3


def test_splits_the_kernel_takes():
    """KV splits give a launch about TARGET_PROGRAMS programs (an H200 walked Kimi-K2.5's 8K prefix
    at batch 1 latency-bound with 16), within one page per split and MAX_SPLITS."""
    from pallas_kernels.attention import MAX_SPLITS, TARGET_PROGRAMS, default_splits

    with launch.for_arch("sm_90"):
        assert default_splits(1, 1, 64, 512, 512, 2) == MAX_SPLITS  # MLA decode, batch 1: one row tile
        assert default_splits(16, 1, 64, 512, 512, 2) == TARGET_PROGRAMS // 16  # 64-row tiles on sm_90
        assert default_splits(16, 1, 256, 512, 512, 2) == TARGET_PROGRAMS // (16 * 4)  # verify: 4 row tiles
        assert default_splits(64, 1, 256, 512, 512, 2) == 1  # verify at batch 64: programs enough
        assert default_splits(1, 1, 16, 3, 512, 2, page_size=64) == 3  # a short table: one page per split
        # a split reads 4x its queries' bytes: a 64-row tile over 1K bfloat16 slots takes 4 splits, FP8 2
        assert default_splits(1, 1, 64, 64, 512, 2) == 4 and default_splits(1, 1, 64, 64, 512, 2, kv_itemsize=1) == 2


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


@interpreted
def test_kernel_benchmark_runs_on_cpu(tmp_path):
    """scripts/bench_kernels.py works on a CPU host (Triton's interpreter), so it runs the day a GPU does."""
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
    assert "interpret" in r.stdout
    record = json.loads(out.read_text())
    rows = record["rows"]
    attention = [x for x in rows if x["op"] == "attention"]
    assert [(x["tokens"], x["context"], x["launch"]) for x in attention] == [
        (1, 40, "table"), (1, 40, "32:8:1:16"), (4, 40, "table"), (4, 40, "32:8:1:16")]  # the table's, then the swept
    assert all(x["max_abs_err"] < 5e-2 and x["equal"] for x in attention)
    assert all(x["launcher"] == "triton_interpreter" for x in rows)
    moe = [x for x in rows if x["op"] == "moe"]
    assert [x["tokens"] for x in moe] == [1, 32] and all(x["max_rel_err"] < 5e-2 for x in moe)


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
    """Kimi-K2.5's MLA with 32 heads x 4 verify tokens in one row tile of 128 rows at 8 warps (a
    float32 [128, 512] accumulator, 256 KB) is past the register file on every architecture: the
    gate says so (a spill on sm_90, AGPRs or scratch on AMD); the table's row tiles at the same
    shape pass."""
    def captured(launch_params):
        launches = []
        with launch.for_arch(arch), triton_call.capturing(launches):
            jax.eval_shape(lambda q, q2, lat, rope, table, lengths: paged_prefix_attention(
                q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope, launch=launch_params),
                *kimi_mla(32, 4))
        [one] = launches
        return one

    problems = isa.check(isa.compile_launch(captured(AttentionLaunch(block_rows=128, num_warps=8, num_stages=2)),
                                            arch))
    assert problems and any("spill" in p or "AGPR" in p or "scratch" in p for p in problems), problems
    assert isa.check(isa.compile_launch(captured(None), arch)) == []
