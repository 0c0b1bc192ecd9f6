"""The compile gate: the Triton kernels compiled to AMDGCN (gfx942, gfx950) and PTX + cubin (sm_90)
with the `triton` package on this CPU host, at the shapes the engine launches; and the launch table.

The representative subset runs here (each configuration's largest launched shape, in each of its
weight formats, plus the float8 per-channel extras); `scripts/compile_gate.py --scope=full` is the
whole sweep (its table is in benchmarks/)."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from eagle3_jax.planning import compile_gate as gate  # noqa: E402
from pallas_kernels import isa, launch, triton_call  # noqa: E402
from pallas_kernels.launch import AttentionLaunch  # noqa: E402
from pallas_kernels.triton_attention import paged_prefix_attention  # noqa: E402

ARCHS = ("gfx942", "gfx950", "sm_90")
needs_8_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def kimi_mla(nh: int, t: int, launch_params: AttentionLaunch | None = None):
    """Kimi-K2.5's absorbed MLA prefix attention (latent 512 + rope 64, pages of 16, 8K context)."""
    sds = jax.ShapeDtypeStruct
    batch, pages = 4, 512
    args = (sds((batch, 1, nh * t, 512), jnp.bfloat16), sds((batch, 1, nh * t, 64), jnp.bfloat16),
            sds((2, batch * pages, 16, 1, 512), jnp.bfloat16), sds((2, batch * pages, 16, 1, 64), jnp.bfloat16),
            sds((batch, pages), jnp.int32), sds((batch,), jnp.int32))

    def attend(q, q2, lat, rope, table, lengths):
        return paged_prefix_attention(q, lat, None, 1, table, lengths, scale=0.1, q2=q2, k2_pool=rope,
                                      launch=launch_params)

    return attend, args


def captured(fn, args, arch: str) -> list[triton_call.JitLaunch]:
    """The kernel launches tracing `fn(*args)` for `arch` makes."""
    launches: list[triton_call.JitLaunch] = []
    with launch.for_arch(arch), triton_call.capturing(launches):
        jax.eval_shape(fn, *args)
    return launches


@pytest.mark.newest_jax  # CI's newest-JAX leg runs it (minutes of Triton compiles)
@needs_8_devices
def test_every_kernel_form_compiles_without_spills_on_every_architecture():
    items = list(gate.representative_cases()) + list(gate.EXTRA)
    rows = gate.run_gate(items, ARCHS)
    failed = [f"{r.arch} {r.kernel} {r.shape}: {r.problems} ({r.launches[0]})" for r in rows if r.problems]
    assert not failed, "\n".join(failed)
    names = {r.kernel for r in rows}
    for form in ("paged_prefix_attention_mla", "paged_prefix_attention_gqa", "grouped_swiglu_int4",
                 "grouped_matmul_int4", "grouped_swiglu_w4a8", "grouped_swiglu_mxfp4", "grouped_swiglu_float",
                 "grouped_matmul_fp8_block", "grouped_swiglu_fp8_block_fnuz", "grouped_matmul_fp8_channel",
                 "grouped_matmul_fp8_channel_fnuz"):
        assert any(form in n for n in names), form
    for r in rows:  # what the gate read is there: registers, shared memory, occupancy, matrix instructions
        assert r.report.registers and r.report.shared_bytes is not None and r.report.occupancy
        assert r.report.matrix_instructions, (r.arch, r.kernel)
    # each architecture's kernels carry that architecture's launch parameters
    mla = [r for r in rows if "attention_mla" in r.kernel]
    assert {r.arch for r in mla} == set(ARCHS)
    for r in mla:  # bfloat16 pages and FP8 pages have a launch form each
        form = "mla_attention_fp8" if r.kernel.endswith("_fp8") else "mla_attention"
        entry = launch.launch(form, r.arch)
        assert (r.report.num_warps, r.report.num_stages) == (entry.num_warps, entry.num_stages), (r.arch, form)


@triton.jit
def _broken(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)) @ 2)  # no such operator on a 1-D block


def test_compile_errors_and_oversized_shared_memory_fail_the_gate():
    broken = triton_call.JitLaunch(_broken, "broken", (("x_ptr", "*fp32"), ("BLOCK", "constexpr")), (("BLOCK", 16),),
                                   4, 2, (1,))
    report = isa.compile_launch(broken, "gfx950")
    assert report.error and isa.check(report)[0].startswith("does not compile")
    [one] = captured(*kimi_mla(8, 1), "gfx942")
    report = isa.compile_launch(one, "gfx942")
    assert isa.check(report) == []
    too_big = dataclasses.replace(report, shared_bytes=launch.ARCHS["gfx942"].shared_bytes + 1)
    assert any("shared memory" in p for p in isa.check(too_big))


@triton.jit
def _strided_copy(x_ptr, n, stride, o_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(o_ptr + i * stride, tl.load(x_ptr + i * stride, mask=i < n, other=0.0), mask=i < n)


@pytest.mark.parametrize("arch", ARCHS)
def test_launches_compile_as_jax_triton_specialises_them(arch, monkeypatch):
    """compile_launch compiles what jax_triton would (isa's docstring): every array argument, input
    or output, 16-byte aligned (tt.divisibility 16), a scalar equal to 1 folded as the constexpr 1,
    no attribute on other scalars, even multiples of 16. The source it hands Triton is read, not
    compiled."""
    sds = jax.ShapeDtypeStruct

    def copy(x, stride):
        return triton_call.call(_strided_copy, [sds((64,), jnp.float32)], x, 32, stride, grid=(1,), num_warps=4,
                                num_stages=1, BLOCK=64)[0]

    [unit] = captured(lambda x: copy(x, 1), (sds((64,), jnp.float32),), arch)
    [wide] = captured(lambda x: copy(x, 2), (sds((64,), jnp.float32),), arch)
    assert unit.scalars == (("n", 32), ("stride", 1)) and wide.scalars == (("n", 32), ("stride", 2))
    sources = []

    def compile_(source, **_):
        sources.append(source)
        raise RuntimeError("read, not compiled")

    monkeypatch.setattr(triton, "compile", compile_)
    for one in (unit, wide):
        assert isa.compile_launch(one, arch).error == "RuntimeError: read, not compiled"
    folded, kept = sources
    aligned = [["tt.divisibility", 16]]
    assert folded.attrs[(0,)] == folded.attrs[(3,)] == aligned and folded.attrs[(1,)] == []  # x, out; n = 32
    assert folded.signature["stride"] == "constexpr" and folded.constants[(2,)] == 1
    assert kept.signature["stride"] == "i32" and (2,) not in kept.constants and kept.attrs[(2,)] == []
    assert kept.constants[(4,)] == folded.constants[(4,)] == 64  # BLOCK
    # the gate compiles the two apart (the code differs), and a second stride > 1 with the first
    assert gate._launch_key(unit) != gate._launch_key(wide)
    assert gate._launch_key(wide) == gate._launch_key(dataclasses.replace(wide, scalars=(("n", 32), ("stride", 3))))


def test_parts_merge_into_one_record(tmp_path):
    """`--json_in`: records of separate `--archs` runs become one, their rows and commands kept; a
    failing row still fails the merged record."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = isa.CompileReport("k", "gfx942", 4, 2, registers=40, shared_bytes=1024, occupancy=8,
                               matrix_instructions=("v_mfma",)).as_row()
    parts = []
    for arch, problems in (("gfx942", []), ("sm_90", ["spills 8 B"])):
        row = {**report, "arch": arch, "constexprs": {"BLOCK": 16}, "grid": [1], "problems": problems,
               "passes": not problems, "launches": [f"case {arch}"]}
        parts.append(tmp_path / f"{arch}.json")
        parts[-1].write_text(json.dumps({"date": "2026-12-02", "machine": "m", "jax": "j", "triton": "t", "scope": "full",
                                         "archs": [arch], "command": f"gate --archs={arch}", "seconds": 1.0,
                                         "rows": [row]}))
    out = tmp_path / "merged.json"
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_gate.py"),
                        f"--json_in={parts[0]},{parts[1]}", f"--json_out={out}",
                        f"--markdown_out={tmp_path / 'merged.md'}"], capture_output=True, text=True, cwd=root,
                       env=dict(os.environ, PYTHONPATH=root), timeout=300)
    assert r.returncode == 1 and "FAIL sm_90 k BLOCK=16: spills 8 B" in r.stderr, r.stderr[-2000:]
    merged = json.loads(out.read_text())
    assert merged["archs"] == ["gfx942", "sm_90"] and merged["date"] == "2026-12-02"
    assert merged["command"] == ["gate --archs=gfx942", "gate --archs=sm_90"] and merged["seconds"] == [1.0, 1.0]
    assert [row["arch"] for row in merged["rows"]] == ["gfx942", "sm_90"]
    assert "| k | sm_90 | 1 | 8 | 40 | 1024 | NO |" in (tmp_path / "merged.md").read_text()


def test_launch_table_covers_every_form_and_architecture():
    for form in launch.FORMS:
        for arch in (*launch.ARCHS, launch.DEFAULT):
            assert (form, arch) in launch.TABLE, (form, arch)
    with pytest.raises(ValueError, match="unknown GPU architecture"):
        with launch.for_arch("gfx9000"):
            pass
    with launch.for_arch("gfx950"):
        assert launch.current_arch() == "gfx950"
        assert launch.launch("mla_attention") == launch.TABLE[("mla_attention", "gfx950")]
    assert launch.current_arch() == launch.DEFAULT  # a CPU host


def test_architecture_read_from_the_device(monkeypatch, caplog):
    class Device:
        def __init__(self, capability, kind=""):
            self.compute_capability, self.device_kind = capability, kind

    assert launch.arch_of_device(Device("gfx942:sramecc+:xnack-")) == "gfx942"
    assert launch.arch_of_device(Device("9.0")) == "sm_90"
    assert launch.arch_of_device(Device("10.0")) == "sm_100"
    assert launch.arch_of_device(Device(None, "AMD Instinct MI355X")) == "gfx950"  # no capability reported
    assert launch.arch_of_device(Device(None, "Some GPU")) == "Some GPU"
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: [Device("gfx1100")])
    launch._local_gpu_arch.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="eagle3_jax"):
            assert launch._local_gpu_arch() == launch.DEFAULT
        assert "gfx1100" in caplog.text and "conservative defaults" in caplog.text
    finally:
        launch._local_gpu_arch.cache_clear()


@pytest.mark.parametrize("arch", ["gfx942", "sm_90"])
def test_float32_kernel_dots_stay_float32(arch):
    """A float32 dot at default precision becomes TF32 (sm_90) / xf32 (gfx942) matrix instructions;
    the kernels ask for IEEE float32, so their float32 runs compute in float32 on a GPU."""
    from pallas_kernels.triton_moe import grouped_matmul

    sds = jax.ShapeDtypeStruct
    attention_args = (sds((2, 2, 16, 32), jnp.float32), sds((1, 8, 16, 2, 32), jnp.float32),
                      sds((1, 8, 16, 2, 32), jnp.float32), sds((2, 4), jnp.int32), sds((2,), jnp.int32))
    moe_args = (sds((64, 128), jnp.float32), sds((4, 128, 64), jnp.float32), sds((4,), jnp.int32))
    for fn, args in ((lambda q, k, v, t, n: paged_prefix_attention(q, k, v, 0, t, n, scale=0.1), attention_args),
                     (grouped_matmul, moe_args)):
        [one] = captured(fn, args, arch)
        report = isa.compile_launch(one, arch)
        assert isa.check(report) == [] and report.matrix_instructions is not None
        assert not any("tf32" in m or "xf32" in m for m in report.matrix_instructions), report.matrix_instructions


@pytest.mark.slow  # minutes of Triton compiles for the entries of GPUs the table does not know; scripts/compile_gate.py
@needs_8_devices
def test_default_launch_entries_compile_on_every_architecture(monkeypatch):
    """An unknown GPU gets the table's default entries: they compile clean on every known one too
    (each attention form, bf16 / int4 / MXFP4 / FP8 block and per-channel experts)."""
    for form, arch in list(launch.TABLE):
        monkeypatch.setitem(launch.TABLE, (form, arch), launch.TABLE[(form, launch.DEFAULT)])
    wanted = {("kimi-k2.5-int4", "dequantize"), ("kimi-k2.5-mxfp4", None), ("minimax-m2.5-fp8", None)}
    items = [c for c in gate.representative_cases() if (c.config.name, c.quant) in wanted] + list(gate.EXTRA)
    rows = gate.run_gate(items, ARCHS)
    failed = [f"{r.arch} {r.kernel} {r.shape}: {r.problems}" for r in rows if r.problems]
    assert not failed, "\n".join(failed)


def test_float32_attention_keeps_xla_on_gpus(caplog):
    """float32 attention spills in the Triton kernel (MLA on every architecture, GQA on sm_90): the
    engine keeps the XLA path there and says so; bfloat16 runs the kernel, and interpreted (a CPU
    host) any dtype does."""
    from eagle3_jax.models.kernel_attention import kernel_takes as _kernel_takes
    from eagle3_jax.runtime.kernels import warn_once

    warn_once.cache_clear()  # said once per process: this test's lines, whatever ran before
    for arch in ("gfx942", "sm_90"):
        with launch.for_arch(arch), caplog.at_level(logging.WARNING, logger="eagle3_jax"):
            assert not _kernel_takes(jnp.float32)
            assert _kernel_takes(jnp.bfloat16)
        assert f"keeps its XLA path for float32 caches on {arch}" in caplog.text
    assert _kernel_takes(jnp.float32)  # CPU: interpreted
