"""The grouped expert kernels in Triton (pallas_kernels/triton_moe.py), run by Triton's interpreter
on CPU, against the XLA references at held-out shapes: every weight format (float, int4, MXFP4,
block and per-channel FP8 in e4m3fn and e4m3fnuz, W4A8), the fused gate/up + SiLU, K steps of
several scale groups, split-K (partials summed in XLA, SwiGLU after), empty experts, padding rows
past the groups, the decode form; the in-kernel element decoders over every bit pattern; and
compiled to gfx942 / sm_90 at Kimi-K2.5's per-device expert shapes (CI's newest-JAX leg)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from moe_cases import FORMATS, SIZES, case, close, make_weight

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from eagle3_jax.weights.quant import E2M1_VALUES, QArray, QFormat  # noqa: E402
from pallas_kernels import isa, launch, triton_call  # noqa: E402
from pallas_kernels.launch import MoeLaunch  # noqa: E402
from pallas_kernels.moe import grouped_matmul_reference, grouped_swiglu_reference, tile_plan  # noqa: E402
from pallas_kernels.triton_moe import (  # noqa: E402
    _e2m1,
    _e4m3,
    _e8m0,
    choose_splits,
    grouped_matmul,
    grouped_swiglu,
)

try:
    import torch  # the interpreter's tensors
except ImportError:
    torch = None
interpreted = pytest.mark.skipif(torch is None, reason="Triton's interpreter runs on torch CPU tensors; no torch here")

# small steps, so the held-out K below walks several steps of several scale groups each
SMALL = MoeLaunch(block_m=16, max_block_n=32, max_block_k=32, num_warps=4, num_stages=2, max_packed_k=64)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_matmul_equals_reference(fmt):
    """float32 activations (bfloat16 ones below), the launch table's entry for this host."""
    _, x, w, sizes = case(fmt, jnp.float32)
    got = grouped_matmul(x, w, sizes, interpret=True)
    close(got, grouped_matmul_reference(x, w, sizes), jnp.float32)
    assert got.dtype == jnp.float32 and not np.asarray(got)[sum(SIZES):].any()


@interpreted
@pytest.mark.parametrize("fmt", ["float", "int4", "mxfp4", "fp8_channel", "fp8_block_fnuz", "w4a8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_several_groups_a_step_and_split_k_equal_the_reference(fmt, splits):
    """K = 256 (384 for 128-blocks) in steps of 64: two int4 / MXFP4 / W4A8 groups a step, four or
    more steps, shared among 3 splits (the last one shorter) or walked by one program."""
    rng = np.random.default_rng(11)
    k = 384 if fmt.startswith("fp8_block") else 256
    sizes = [3, 0, 21, 2]
    x = jnp.asarray(rng.standard_normal((sum(sizes) + 2, k)), jnp.bfloat16)
    w, w_up = (make_weight(rng, fmt, len(sizes), k, 128 if fmt.startswith("fp8_block") else 64) for _ in range(2))
    if fmt == "float":
        w, w_up = w.astype(jnp.bfloat16), w_up.astype(jnp.bfloat16)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, sizes, interpret=True, launch=SMALL, splits=splits)
    close(got, grouped_matmul_reference(x, w, sizes), jnp.bfloat16)
    fused = grouped_swiglu(x, w, w_up, sizes, interpret=True, launch=SMALL, splits=splits)
    assert fused.dtype == jnp.bfloat16
    close(fused, grouped_swiglu_reference(x, w, w_up, sizes), jnp.bfloat16)
    assert not np.asarray(fused, np.float32)[int(sizes.sum()):].any()


@interpreted
@pytest.mark.parametrize("fmt", ["int4", "fp8_block_fnuz"])
def test_grouped_swiglu_equals_reference(fmt):
    rng, x, w_gate, sizes = case(fmt, jnp.bfloat16)
    w_up = make_weight(rng, fmt, len(SIZES), *w_gate.shape[1:])
    got = grouped_swiglu(x, w_gate, w_up, sizes, interpret=True)
    close(got, grouped_swiglu_reference(x, w_gate, w_up, sizes), jnp.bfloat16)


@interpreted
def test_decode_form_reads_only_the_routed_experts():
    """384 experts, 3 routed rows: 4 row tiles (one spare), each of the others reading one routed expert."""
    sizes = np.zeros(384, np.int32)
    sizes[[7, 200, 383]] = 1
    _, x, w, sizes = case("int4", jnp.bfloat16, sizes=list(sizes), pad_rows=1)
    expert, _, _, count = tile_plan(sizes, x.shape[0], 16)
    assert count == 4 and list(np.asarray(expert)) == [7, 200, 383, 384]
    close(grouped_matmul(x, w, sizes, interpret=True), grouped_matmul_reference(x, w, sizes), jnp.bfloat16)


def test_splits_fill_the_device_only_where_tiles_are_few():
    gpu = dataclasses.replace(SMALL, target_programs=512, min_split_steps=4)
    assert choose_splits(4 * 32, 28, gpu) == 4  # a decode step over a few experts: 128 programs -> 512
    assert choose_splits(1, 28, gpu) == 7  # at most 28 // 4 splits of 4 steps
    assert choose_splits(600, 28, gpu) == 1  # plenty of tiles
    assert choose_splits(1, 28, SMALL) == 1  # target 0: never split (the interpreter's default)


def test_kernels_stand_in_where_nothing_can_launch_them():
    """The memory planner's shape-only programs and deviceless traces for a GPU this host lacks get
    an opaque op of the kernel's outputs; a plain CPU trace calls the interpreter."""
    _, x, w, sizes = case("int4", jnp.bfloat16)

    def lowered():
        return jax.jit(lambda x, w, s: grouped_matmul(x, w, s)).lower(x, w, sizes).as_text()

    assert "callback" in lowered()
    for context in (launch.shape_only, lambda: launch.for_arch("sm_90")):
        with context():
            text = lowered()
        assert "optimization_barrier" in text and "callback" not in text


@triton.jit
def _decode_all(bits_ptr, out_ptr, KIND: tl.constexpr):
    bits = tl.load(bits_ptr + tl.arange(0, 256))
    if KIND == 0:
        value = _e4m3(bits, False)
    elif KIND == 1:
        value = _e4m3(bits, True)
    elif KIND == 2:
        value = _e2m1(bits.to(tl.int32) & 15)
    else:
        value = _e8m0(bits)
    tl.store(out_ptr + tl.arange(0, 256), value)


@interpreted
def test_element_decoders_cover_every_bit_pattern():
    bits = jnp.arange(256, dtype=jnp.uint8)

    def decoded(kind):
        [out] = triton_call.call(_decode_all, [jax.ShapeDtypeStruct((256,), jnp.float32)], bits, grid=(1,),
                                 num_warps=4, num_stages=1, interpret=True, KIND=kind)
        return np.asarray(out)

    for kind, dt in ((0, ml_dtypes.float8_e4m3fn), (1, ml_dtypes.float8_e4m3fnuz)):
        want = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
        got = decoded(kind)
        np.testing.assert_array_equal(got, want)
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # -0.0 where the format has it
    np.testing.assert_array_equal(decoded(2)[:16], E2M1_VALUES)
    got = decoded(3)
    np.testing.assert_array_equal(got[1:255], (2.0 ** (np.arange(1, 255) - 127)).astype(np.float32))
    assert got[0] == np.float32(2.0 ** -127) and np.isnan(got[255])


def kimi_experts(fmt: str):
    """Kimi-K2.5's routed experts on one device of eight (48 local experts, 7168 -> 2048 -> 7168)
    in `fmt`: "float" (bfloat16), "int4", "w4a8", "mxfp4" or "fp8_block_fnuz"."""
    sds = jax.ShapeDtypeStruct
    e, k, i = 48, 7168, 2048

    def weight(kk, n):
        if fmt == "float":
            return sds((e, kk, n), jnp.bfloat16)
        if fmt == "fp8_block_fnuz":
            return QArray(sds((e, kk, n), jnp.float8_e4m3fnuz), sds((e, kk // 128, n // 128), jnp.float32),
                          QFormat("fp8_block", (128, 128), fnuz=True))
        if fmt == "mxfp4":
            return QArray(sds((e, kk // 2, n), jnp.uint8), sds((e, kk // 32, n), jnp.uint8),
                          QFormat("mxfp4", (32, 1), "uint8"))
        return QArray(sds((e, kk // 2, n), jnp.uint8), sds((e, kk // 32, n), jnp.bfloat16),
                      QFormat("int4", (32, 1), "bfloat16", act="int8" if fmt == "w4a8" else "float"))

    return weight(k, i), weight(k, i), weight(i, k)


@pytest.mark.newest_jax  # CI's newest-JAX leg runs the compile-to-ISA tests
@pytest.mark.parametrize("arch", ["gfx942", "sm_90"])
def test_compiles_to_each_architecture_without_spills_on_matrix_units(arch):
    """Kimi-K2.5's experts at a decode step (64 assignments) in every format (bfloat16, int4, W4A8,
    MXFP4, FP8 block in e4m3fnuz), gate/up fused and down, and int4 at 8 assignments (K split, gate
    and up as partials), with the launch table's parameters: no spill, dots on the matrix units."""
    launches = []
    with launch.for_arch(arch), triton_call.capturing(launches):
        for fmt, rows in [(fmt, 64) for fmt in ("float", "int4", "w4a8", "mxfp4", "fp8_block_fnuz")] + [("int4", 8)]:
            gate, up, down = kimi_experts(fmt)
            x, sizes = jax.ShapeDtypeStruct((rows, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((48,), jnp.int32)
            jax.eval_shape(lambda x, g, u, d, s: grouped_matmul(grouped_swiglu(x, g, u, s), d, s),
                           x, gate, up, down, sizes)
    assert len(launches) == 12
    split = dict(launches[-2].constexprs)
    assert not split["FUSED_SWIGLU"] and split["steps_per_split"] < split["K_STEPS"]  # a few tiles: K split
    for captured in launches:
        report = isa.compile_launch(captured, arch)
        assert isa.check(report) == [], (captured.name, report)
        assert report.matrix_instructions, captured.name
